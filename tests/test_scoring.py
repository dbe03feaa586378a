"""Tests of what the scorers share: the Hendrycks MATH normaliser, gold answers as strings, the batch length check,
the scorer table, and the refusal to grade without a wall-clock bound where there are no POSIX pipes."""

import os

import pytest

from trl_bandpo.evaluation.scorers import DEFAULT_TIMEOUTS, SCORERS, score
from trl_bandpo.scoring.answers import MAX_GOLD_CHARS, gold_alternatives, paired
from trl_bandpo.scoring.math_reward import is_equivalent
from trl_bandpo.scoring.strict_grader import grade_answer
from trl_bandpo.scoring.strict_grader._normalize import mathd_normalize
from trl_bandpo.scoring.strict_grader.hendrycks import normalize
from trl_bandpo.scoring.verifier import verify_pairs


@pytest.mark.parametrize("text", [r"\sqrt", r"3\sqrt", r"\frac", r"1\frac", r"5\text{ cm}\text{ m}"])
def test_the_normaliser_raises_and_each_caller_keeps_its_fallback(text):
    with pytest.raises(ValueError):
        normalize(text)
    assert mathd_normalize(f"  {text} ") == text  # prime_math: the stripped answer
    assert is_equivalent(text, text) and not is_equivalent(text, text + " ")  # math_reward: the raw strings


def test_gold_alternatives_options():
    assert gold_alternatives([r"$\boxed{7}$ ", 12.0, 2**70, None, True]) == ["7", "12", str(2**70)]
    assert gold_alternatives([r"$\boxed{7}$ ", 12.0], as_written=True) == [r"$\boxed{7}$ ", "12"]
    long = "1" * (MAX_GOLD_CHARS + 1)
    assert gold_alternatives(long, as_written=True) == []
    assert gold_alternatives(long, as_written=True, max_chars=None) == [long]
    assert gold_alternatives("", as_written=True) == [""] and gold_alternatives("$ $") == []


def test_paired_checks_the_lengths():
    assert list(paired(["a", "b"], [1, 2])) == [("a", 1), ("b", 2)]
    with pytest.raises(ValueError, match="same length, got 1 and 0"):
        paired(["a"], [])


def test_one_scorer_table():
    assert list(SCORERS) == ["math_verify", "dapo", "strict", "math_reward"]
    assert DEFAULT_TIMEOUTS == {"math_verify": 2.0, "dapo": None, "strict": 10.0, "math_reward": None}
    assert all(scorer.help for scorer in SCORERS.values())
    for name in SCORERS:
        with pytest.raises(ValueError, match="same length"):
            score(name, ["a"], [])


def test_graders_refuse_to_run_without_posix_pipes(monkeypatch):
    monkeypatch.setattr(os, "name", "nt")
    with pytest.raises(RuntimeError, match="POSIX pipes.*'dapo' and 'math_reward' scorers need no workers"):
        verify_pairs([("x^2 - 1", "(x-1)(x+1) + 0*os_name_test")], 2.0, 1)
    with pytest.raises(RuntimeError, match="strict-grader worker processes need POSIX pipes"):
        grade_answer("2x", "x+x")
    assert grade_answer("1/2", r"\frac{1}{2}")  # settled by the string stages, in-process
    assert score("dapo", ["Answer: 4"], ["4"]) == [True] and score("math_reward", [r"\boxed{4}"], ["4"]) == [True]

"""Tests of the math_verify boxed-answer rewards: real answer formats, hostile answers and the time bound."""

import pickle
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from trl_bandpo.scoring.answers import MAX_GOLD_CHARS, gold_alternatives
from trl_bandpo.scoring.rewards import (
    MAX_ANSWER_CHARS,
    MAX_BRACE_DEPTH,
    MathVerifyReward,
    boxed_accuracy_reward,
    boxed_signed_reward,
    completion_text,
    extract_boxed_answer,
    is_equivalent,
    score_completions,
)

HOSTILE_TIMEOUT_S = 1.0
# A hostile answer costs at most its timeout, plus waiting for a replacement worker to start (about 1 s here).
TIME_BOUND_S = HOSTILE_TIMEOUT_S + 8.0


# ---------------------------------------------------------------------------------------------------------------
# Extraction
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so the answer is \boxed{42}.", "42"),
        (r"\boxed{1} then, correcting myself, \boxed{2}", "2"),  # the LAST box counts
        (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{\sqrt{2}}{2}"),  # nested braces
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces do not close the box
        (r"$\boxed 7$", "7"),  # brace-less form
        (r"\boxed {12}", "12"),
        (r"\fbox{3}", "3"),
        (r"\boxed{}", ""),
        (r"\boxed{3", None),  # truncated: no answer
        (r"\boxed{1} and then \boxed{", None),  # truncated last box: earlier boxes are not used
        ("no box here: 42", None),
        (r"\boxedx{3}", None),
        ("", None),
        (None, None),
        (17, None),
    ],
)
def test_extract_boxed_answer(text, expected):
    assert extract_boxed_answer(text) == expected


def test_completion_text_accepts_strings_and_conversations():
    assert completion_text("plain") == "plain"
    assert completion_text([{"role": "assistant", "content": "hi"}]) == "hi"
    assert completion_text([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]) == "a"
    assert completion_text([{"role": "assistant", "content": [{"type": "text", "text": "x"}, "y"]}]) == "xy"
    assert completion_text([{"role": "assistant", "content": None}]) == ""
    assert completion_text([]) == ""
    assert completion_text(None) == ""


# ---------------------------------------------------------------------------------------------------------------
# Real answer formats
# ---------------------------------------------------------------------------------------------------------------

EQUIVALENT = [
    ("7", "007"),  # AIME answers with leading zeros
    ("7", "7"),
    (7, "7"),  # integer ground truth
    (27.0, "27"),  # float ground truth from a float64 column
    ("0.5", r"\frac{1}{2}"),
    ("0.5", r"\dfrac{1}{2}"),
    (r"\frac{1}{2}", "1/2"),
    (r"\frac{\sqrt{2}}{2}", r"\sqrt{2}/2"),
    ("5", r"5\text{ cm}"),  # units
    ("5", r"5 \text{cm}"),
    (r"\text{Monday}", "Monday"),  # plain-text answers
    ("Monday", r"\text{Monday}"),
    (r"\text{(B)}", "B"),
    ("1000", "1,000"),
    ("18", "18.0"),
    (r"x^2+1", "1+x^2"),
    (r"2\pi", r"2 \pi"),
    ("(1,2)", "(1, 2)"),
    ("3", "x = 3"),
    ("$\\frac{1}{3}$", r"\frac13"),  # gold with dollar signs
    (r"The answer is \boxed{12}", "12"),  # gold given as a worked solution
    (["4", "-4"], "-4"),  # a list of acceptable answers
]

NOT_EQUIVALENT = [
    ("7", "8"),
    ("0.5", r"\frac{1}{3}"),
    (r"\frac{\sqrt{2}}{2}", r"\sqrt{2}"),
    ("Monday", "Tuesday"),
    ("70", "7"),
    ("1", ""),
    ("", "1"),
    (None, "1"),
]


@pytest.mark.parametrize("gold, answer", EQUIVALENT)
def test_equivalent_answers(gold, answer):
    assert is_equivalent(gold, answer)


@pytest.mark.parametrize("gold, answer", NOT_EQUIVALENT)
def test_different_answers(gold, answer):
    assert not is_equivalent(gold, answer)


def test_reward_scores_and_names():
    conversation = [{"role": "assistant", "content": r"\boxed{7}"}]
    completions = [r"... so \boxed{007}", r"\boxed{8}", "I do not know", conversation]
    solution = ["7", "7", "7", 7]
    assert boxed_accuracy_reward(completions, solution) == [1.0, 0.0, 0.0, 1.0]
    assert boxed_signed_reward(completions, solution) == [1.0, -1.0, -1.0, 1.0]
    assert boxed_accuracy_reward.__name__ == "boxed_accuracy_reward"
    assert boxed_signed_reward.__name__ == "boxed_signed_reward"
    custom = MathVerifyReward(correct=2.0, wrong=-0.5, name="my_math")
    assert custom.__name__ == "my_math"
    trl_kwargs = {"prompts": ["p"] * 4, "trainer_state": None, "log_metric": print}
    assert custom(completions, solution, **trl_kwargs) == [2.0, -0.5, -0.5, 2.0]
    default = MathVerifyReward()
    assert default.__name__ == "math_verify_reward"
    assert default([r"\boxed{1}", r"\boxed{2}"], ["1", "1"]) == [1.0, -1.0]


def test_rewards_accept_other_spellings_of_a_right_answer():
    """Issue 27, item 10: full-width digits, a zero-width space, ``½``, ``1 000`` and a gold's final period were
    refused; the wrong answers next to them stay wrong (tests/test_rewards_normal_form.py has the evidence)."""
    completions = [
        "\\boxed{\uff11\uff12}",  # full-width 12
        "\\boxed{1\u200b2}",  # a zero-width space inside
        "\\boxed{\u00bd}",
        r"\boxed{1 000}",
        r"\boxed{3}",
        "\\boxed{\uff11\uff13}",  # full-width 13: wrong
        r"\boxed{1 000}",  # math_verify read it as 1*000 = 0: wrong
        r"\boxed{1e3}",  # E-notation stays refused
    ]
    solution = ["12", "12", "0.5", 1000, "3.", "12", "0", "1000"]
    assert boxed_signed_reward(completions, solution) == [1.0] * 5 + [-1.0] * 3
    assert boxed_accuracy_reward(completions, solution) == [1.0] * 5 + [0.0] * 3
    assert MathVerifyReward(correct=2.0, wrong=0.5)(completions, solution) == [2.0] * 5 + [0.5] * 3


def test_reward_is_picklable_and_matches_trl_naming():
    from trl.trainer.utils import get_callable_name, is_async_callable

    restored = pickle.loads(pickle.dumps(boxed_signed_reward))
    assert restored([r"\boxed{3}"], ["3"]) == [1.0]
    assert get_callable_name(boxed_signed_reward) == "boxed_signed_reward"
    assert not is_async_callable(boxed_signed_reward)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": float("inf")}, "timeout_s"),
        ({"correct": float("nan")}, "correct"),
        ({"wrong": "0"}, "wrong"),
        ({"name": "has space"}, "name"),
        ({"num_workers": 0}, "num_workers"),
    ],
)
def test_factory_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MathVerifyReward(**kwargs)


def test_reward_rejects_missing_or_mismatched_solutions():
    with pytest.raises(ValueError, match="solution"):
        boxed_accuracy_reward([r"\boxed{1}"])
    with pytest.raises(ValueError, match="same length"):
        boxed_accuracy_reward([r"\boxed{1}"], ["1", "2"])
    with pytest.raises(ValueError, match="single string"):
        boxed_accuracy_reward([r"\boxed{1}"], "1")


# ---------------------------------------------------------------------------------------------------------------
# Hostile answers: always wrong, never raise, bounded time
# ---------------------------------------------------------------------------------------------------------------

HOSTILE = {
    "power tower": r"\boxed{9^{9^{9^{9}}}}",
    "huge power": r"\boxed{10^{10^{10^{10}}}}",
    "100k characters in a box": r"\boxed{" + "1+" * 50_000 + "1}",
    "100k characters, no box": "x" * 100_000,
    "1000-deep nesting": r"\boxed{" + "{" * 1000 + "1" + "}" * 1000 + "}",
    "1000-deep fractions": r"\boxed{" + r"\frac{1}{" * 1000 + "2" + "}" * 1000 + "}",
    "unclosed box of braces": r"\boxed{" + "{" * 100_000,
    "many boxes": r"\boxed{1}" * 20_000 + r"\boxed{\frac{1}{0}}",
    "garbage latex": r"\boxed{\begin{matrix} & \\ \end{pmatrix} \left( ^^^ __ \frac{}{}}",
    "python code": r"\boxed{__import__('os').system('echo pwned')}",
    "nul and control characters": "\\boxed{\x00\x01\x1b[2J}",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_answer_is_wrong_within_time_bound(name):
    reward = MathVerifyReward(correct=1.0, wrong=-1.0, timeout_s=HOSTILE_TIMEOUT_S)
    started = time.monotonic()
    scores = reward([HOSTILE[name]], ["7"])
    elapsed = time.monotonic() - started
    assert scores == [-1.0]
    assert elapsed < TIME_BOUND_S, f"{name} took {elapsed:.1f} s"


def test_answers_over_the_caps_score_wrong_at_once():
    long_but_right = "0" * MAX_ANSWER_CHARS + "7"  # equals 7, but longer than the cap
    deep_but_right = "{" * (MAX_BRACE_DEPTH + 1) + "7" + "}" * (MAX_BRACE_DEPTH + 1)
    started = time.monotonic()
    assert score_completions([rf"\boxed{{{long_but_right}}}", rf"\boxed{{{deep_but_right}}}"], ["7", "7"]) == [
        False,
        False,
    ]
    assert time.monotonic() - started < 1.0


def test_hostile_answer_does_not_spoil_the_batch():
    # Golds unused elsewhere, so that no cached verdict short-cuts the timeouts.
    completions = [HOSTILE["power tower"], r"\boxed{\frac{22}{2}}", r"\boxed{8}", HOSTILE["huge power"], r"\boxed{11}"]
    started = time.monotonic()
    # The default 2 s budget leaves the honest answers ample time even on a loaded machine.
    flags = score_completions(completions, ["11"] * 5, timeout_s=2.0, num_workers=2)
    assert flags == [False, True, False, False, True]
    assert time.monotonic() - started < 2 * (2.0 + TIME_BOUND_S)


def test_time_bound_holds_in_worker_threads_and_leaves_signals_alone():
    handler_before = signal.getsignal(signal.SIGALRM)
    reward = MathVerifyReward(timeout_s=2.0, num_workers=1)
    batches = [
        ([r"\boxed{7^{7^{7^{7}}}}", r"\boxed{\dfrac{1}{2}}"], ["13", "0.5"]),
        ([r"\boxed{6^{6^{6^{6}}}}", r"\boxed{\sqrt{2}/2}"], ["13", r"\frac{\sqrt2}{2}"]),
    ]
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda batch: reward(*batch), batches))
    elapsed = time.monotonic() - started
    assert results == [[-1.0, 1.0], [-1.0, 1.0]]
    assert elapsed < 2 * (2.0 + TIME_BOUND_S)
    assert signal.getsignal(signal.SIGALRM) is handler_before
    assert threading.current_thread() is threading.main_thread()


def test_same_pair_is_verified_once():
    completions = [r"\boxed{\sqrt{8}}"] * 64
    started = time.monotonic()
    assert boxed_accuracy_reward(completions, [r"2\sqrt{2}"] * 64) == [1.0] * 64
    assert time.monotonic() - started < 10.0
    started = time.monotonic()  # now cached: no worker round trip
    assert boxed_accuracy_reward(completions, [r"2\sqrt{2}"] * 64) == [1.0] * 64
    assert time.monotonic() - started < 0.5


def test_waiting_for_a_slow_answer_does_not_spin():
    """While one worker grinds on a hostile answer and the other sits idle, the caller sleeps in select()."""
    score_completions([r"\boxed{1}", r"\boxed{2}"], ["1", "2"], num_workers=2)  # two ready workers
    cpu_before, wall_before = time.process_time(), time.monotonic()
    slow = r"\boxed{8^{8^{8^{8}}}}"  # not used elsewhere: verdicts are cached per (gold, answer)
    flags = score_completions([slow, r"\boxed{\sqrt{4}}"], ["5", "2"], timeout_s=1.5, num_workers=2)
    assert flags == [False, True]
    assert time.monotonic() - wall_before >= 1.0  # it did wait for the hostile answer's deadline
    assert time.process_time() - cpu_before < 0.5


# ---------------------------------------------------------------------------------------------------------------
# Wrong answers never score right (issue 18): nested boxes, false equations, oversized ground truths
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so \boxed{\boxed{2}+1}", r"\boxed{2}+1"),  # the outer box is the last one, not the inner
        (r"\boxed{1}, then \fbox{\boxed{2}+1}.", r"\boxed{2}+1"),
        (r"\boxed{\boxed{2}+1} and finally \boxed{5}", "5"),
        (r"\boxed{\boxed{7}}", r"\boxed{7}"),
        (r"\boxed{5} \boxed{\boxed{2}", None),  # the last outer box never closes: no answer (not the inner 2)
    ],
)
def test_nested_boxes_are_read_from_the_outermost_last_box(text, expected):
    assert extract_boxed_answer(text) == expected


def test_a_box_inside_the_answer_is_unwrapped_before_comparing():
    completions = [r"\boxed{\boxed{2}+1}", r"\boxed{\boxed{2}+1}", r"\boxed{\boxed{7}}", r"\boxed{\boxed{7}}"]
    assert score_completions(completions, ["3", "2", "7", "8"]) == [True, False, True, False]
    assert gold_alternatives(r"so the answer is $\boxed{\boxed{2}+1}$") == ["{2}+1"]


@pytest.mark.parametrize(
    "gold, answer, expected",
    [
        ("3", "2=3", False),  # math_verify alone reads the right-hand side, 3
        ("3", "2 = 3", False),
        ("3", "x = 2 = 3", False),
        ("3", r"\frac{1}{0} = 3", False),
        ("3", r"\pi = 3", False),
        ("3", "x = 3", True),  # a variable on the left: the value is the right-hand side
        ("3", "a_n = 3", True),
        ("3", "f(2) = 3", True),  # an unknown function is not a number
        ("3", "1+2=3", True),  # both sides equal
        ("3", r"\frac{6}{2} = 3", True),
    ],
)
def test_an_equation_between_different_numbers_is_wrong(gold, answer, expected):
    assert is_equivalent(gold, answer) is expected


def test_an_oversized_ground_truth_scores_wrong_without_work():
    assert gold_alternatives(" " * 100 + "7") == ["7"]
    assert gold_alternatives(" " * MAX_GOLD_CHARS + "7") == []  # over the cap: no gold answer at all
    assert gold_alternatives([" " * MAX_GOLD_CHARS + "7", "8"]) == ["8"]
    huge = "1" * 10_000_000
    started = time.monotonic()
    assert score_completions([r"\boxed{7}", r"\boxed{1}", r"\boxed{8}"], [huge, huge, [huge, "8"]]) == [
        False,
        False,
        True,
    ]
    assert time.monotonic() - started < 5.0  # 22 s when the 10 MB gold was normalised


def test_the_call_budget_counts_the_time_spent_reading_answers(monkeypatch, caplog):
    import trl_bandpo.scoring.rewards as rewards

    budgets = []

    def fake_verify_pairs(pairs, timeout_s, num_workers, call_timeout_s):
        budgets.append(call_timeout_s)
        return [False] * len(pairs)

    def slow_gold_alternatives(solution):
        time.sleep(0.3)
        return gold_alternatives(solution)

    monkeypatch.setattr(rewards, "verify_pairs", fake_verify_pairs)
    monkeypatch.setattr(rewards, "gold_alternatives", slow_gold_alternatives)
    assert score_completions([r"\boxed{x}"], ["y"], call_timeout_s=10.0) == [False]
    assert len(budgets) == 1 and budgets[0] <= 10.0 - 0.3  # what is left of the budget, not all of it
    budgets.clear()
    with caplog.at_level("WARNING", logger="trl_bandpo.scoring.rewards"):
        assert score_completions([r"\boxed{x}"], ["y"], call_timeout_s=0.1) == [False]
    assert budgets == []  # spent before any verification: nothing is verified
    assert any("1 of 1 answers were not verified" in record.getMessage() for record in caplog.records)

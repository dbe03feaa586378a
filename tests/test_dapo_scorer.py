r"""The DAPO / Minerva scorer (verl's ``math_dapo`` rule): each normalisation rule, the window, and the reward."""

import logging
import pickle
import time

import pytest

from trl_bandpo.scoring.dapo import (
    MAX_GOLD_CHARS,
    REMOVED_EXPRESSIONS,
    SUBSTITUTIONS,
    WINDOW_CHARS,
    dapo_correct,
    extract_dapo_answer,
    normalize_final_answer,
    score_dapo_completions,
)
from trl_bandpo.scoring.rewards import DAPOReward, dapo_reward

# ---------------------------------------------------------------------------------------------------------------
# normalize_final_answer: one group of hand-written cases per rule
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("x = 5", "5"),  # the text after the last "="
        ("a = b = 7", "7"),
        ("f(x)=x^2", "x^2"),
        ("5", "5"),
        ("=", ""),
    ],
)
def test_keeps_text_after_last_equals_sign(raw, expected):
    assert normalize_final_answer(raw) == expected


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("an apple", "apple"),  # "an " goes
        ("a triangle", "triangle"),  # "a " goes
        ("pizza pie", "pizzpie"),  # ... anywhere, also at the end of a word
        ("5.$", "5"),  # ".$" -> "$", then "$" goes
        ("\\$5", "5"),  # "\$" goes
        ("1\\ 000", "1000"),  # "\ " goes
        ("1 2 3", "123"),  # every space goes
        ("\\mbox{cm}", ""),  # mbox -> text, "cm" is a removed unit, then "\text{}" goes
        ("x,\\text{and}y", "x,y"),
        ("x\\text{and}y", "x,y"),
        ("3\\text{and}4", "34"),  # "3,4" is then all digits: the comma goes
        ("5\\text{m}", "5"),  # \text{m} -> \text{} -> removed
    ],
)
def test_substitutions(raw, expected):
    assert normalize_final_answer(raw) == expected


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("5 square units", "5"),
        ("12 ways", "12"),
        ("30 dollars", "30"),
        ("60 mph", "60"),
        ("4 inches", "4"),
        ("3 hours", "3"),
        ("9 km", "9"),
        ("2 feet", "2"),
        ("10 minutes", "10"),
        ("7 cents", "7"),
        ("90 degrees", "90"),
        ("5 cm", "5"),
        ("8 pounds", "8"),
        ("100 meters", "100"),
        ("6 students", "6"),
        ("x,y,\\ldots", "x,y,"),
        ("x,y,\\dots", "x,y,"),
        ("5\\text{s}", "5"),
        ("5\\text{.}", "5"),
        ("5\\text{}^2", "5"),
        ("5\\text{}^3", "5"),
        ("21\\mathrm{th}", "21"),
        ("90^\\circ", "90"),
        ("90^{\\circ}", "90"),
        ("1\\;000", "1000"),
        ("1,\\!000", "1000"),
        ("1{,}000", "1000"),
        ('"yes"', "yes"),
        ("skmy", "sy"),  # removal happens inside words too
    ],
)
def test_removed_expressions(raw, expected):
    assert normalize_final_answer(raw) == expected


def test_lists_are_the_minerva_lists():
    assert SUBSTITUTIONS[0] == ("an ", "") and SUBSTITUTIONS[-1] == ("\\text{m}", "\\text{}")
    assert len(SUBSTITUTIONS) == 10
    assert REMOVED_EXPRESSIONS[0] == "square" and REMOVED_EXPRESSIONS[-1] == "\\dots"
    assert len(REMOVED_EXPRESSIONS) == 41


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("The value is $5$ here", "5"),  # only the first $...$ span survives
        ("$1$ and $2$", "1"),
        ("$x+1$", "x+1"),
        ("5$", "5"),  # a single $ is simply deleted
    ],
)
def test_dollar_spans(raw, expected):
    assert normalize_final_answer(raw) == expected


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("\\text{east}", "east"),
        ("\\textbf{B}", "B"),
        ("\\overline{12}", "12"),
        ("\\boxed{5}", "5"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # \boxed: up to the last brace
        ("\\text{(A)}\\text{B}", "(A)B"),  # \text: up to the first brace, every occurrence
    ],
)
def test_unwrapping(raw, expected):
    assert normalize_final_answer(raw) == expected


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("\\frac12", "\\frac{1}{2}"),
        ("\\frac 1 2", "\\frac{1}{2}"),  # spaces are removed first
        ("\\frac1{2}", "\\frac{1}{{}2}"),  # two characters, whatever they are
        ("\\frac{1}{2}", "\\frac{1}{2}"),
        ("\\dfrac12", "\\dfrac{1}{2}"),  # fires inside \dfrac, which itself stays
        ("fraction", "frac{t}{i}on"),  # and inside words
        ("\\sqrt2", "\\sqrt{2}"),
        ("\\sqrt 3", "\\sqrt{3}"),
        ("\\sqrt{3}", "\\sqrt{3}"),
        ("2\\sqrt2", "2\\sqrt{2}"),
        ("\\sqrt[3]{8}", "\\sqrt{[}3]{8}"),
    ],
)
def test_shorthand_tex(raw, expected):
    assert normalize_final_answer(raw) == expected


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("1,000", "1000"),  # thousands separators go in pure numbers
        ("1,000,000", "1000000"),
        ("1,000.5", "1,000.5"),  # not all digits: kept
        ("(1,2)", "(1,2)"),
        ("-1,000", "-1,000"),  # a sign is not a digit
        ("1,²", "1²"),  # str.isdigit accepts Unicode digits, as in math_dapo
    ],
)
def test_thousands_separators(raw, expected):
    assert normalize_final_answer(raw) == expected


@pytest.mark.parametrize(
    "raw, expected",
    [("42.", "42."), ("  7\t", "7"), ("7\n", "7"), ("\n\\text{\n}5", "5"), ("", "")],
)
def test_strip_and_trailing_period(raw, expected):
    assert normalize_final_answer(raw) == expected


# ---------------------------------------------------------------------------------------------------------------
# Extraction: window, last match, case, newlines
# ---------------------------------------------------------------------------------------------------------------


def test_last_match_wins():
    assert extract_dapo_answer("Answer: 3\nwait, no.\nAnswer: 5") == "5"


@pytest.mark.parametrize("text", ["answer: 5", "ANSWER : 5", "Final Answer:5", "The answer:  5"])
def test_case_insensitive(text):
    assert extract_dapo_answer(text).strip() == "5"


def test_answer_may_start_on_the_next_line():
    assert extract_dapo_answer("Answer:\n42") == "42"  # \s* crosses the newline, as in math_dapo


def test_answer_is_the_rest_of_the_line():
    assert extract_dapo_answer("Answer: 12 apples\nbye") == "12 apples"


@pytest.mark.parametrize("text", ["The result is 5.", "\\boxed{5}", "Answer 5", "Answer:", "", None, 17])
def test_missing_answer(text):
    assert extract_dapo_answer(text) is None
    assert not dapo_correct(text, "5")


def test_window_of_300_characters():
    assert WINDOW_CHARS == 300
    early = "Answer: 5\n" + "x" * WINDOW_CHARS  # the Answer line lies before the last 300 characters
    assert extract_dapo_answer(early) is None
    assert not dapo_correct(early, "5")
    inside = "Answer: 5\n" + "x" * (WINDOW_CHARS - len("Answer: 5\n"))  # exactly 300 characters
    assert extract_dapo_answer(inside) == "5"
    cut = "Answer: 5\n" + "x" * (WINDOW_CHARS - len("Answer: 5\n") + 2)  # the window starts at "swer: 5"
    assert extract_dapo_answer(cut) is None
    earlier_ignored = "Answer: 5\n" + "y" * 400 + "\nAnswer: 6"
    assert dapo_correct(earlier_ignored, "6") and not dapo_correct(earlier_ignored, "5")


# ---------------------------------------------------------------------------------------------------------------
# Correctness against gold answers
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, gold, expected",
    [
        ("... so\nAnswer: 34", "34", True),
        ("Answer: $34$", "34", True),
        ("Answer: x = 34", "34", True),
        ("Answer: 1,000", "1000", True),
        ("Answer: 1000", "1,000", True),  # gold normalised alike
        ("Answer: \\frac12", "\\frac{1}{2}", True),
        ("Answer: \\boxed{34}", "$34$", True),
        ("Answer: 34 degrees", "34^\\circ", True),
        ("Answer: 42.", "42", False),  # the trailing period stays
        ("Answer: \\dfrac{1}{2}", "\\frac{1}{2}", False),  # no \dfrac rewrite
        ("Answer: 0.5", "\\frac{1}{2}", False),  # no numeric equivalence
        ("Answer: 34", "35", False),
        ("Answer: 34", "", False),
    ],
)
def test_dapo_correct(completion, gold, expected):
    assert dapo_correct(completion, gold) is expected


def test_gold_variants():
    assert dapo_correct("Answer: 34", 34)  # numbers are written out
    assert dapo_correct("Answer: 0.5", 0.5)
    assert dapo_correct("Answer: 34", ["33", "34"])  # any alternative
    assert not dapo_correct("Answer: 34", ["33", "35"])
    for bad in (None, True, float("nan"), {"a": 1}, []):
        assert not dapo_correct("Answer: 34", bad)


def test_missing_answer_is_wrong_even_for_invalid_gold():
    assert not dapo_correct("no answer line", "[INVALID]")  # math_dapo would score this correct


# ---------------------------------------------------------------------------------------------------------------
# Time: linear normalisation, a cap on the gold answer (issue 18)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("1" * 60_000, "1" * 60_000),  # no $: the first-$-span rule tried every start position (25 s)
        ("1$" + "1" * 60_000, "1" * 60_001),  # one $ on the line: no span, the $ is deleted
        ("\\text{" * 5_000, "\\text{" * 5_000),  # never closed: nothing to unwrap
        ("\\boxed{" * 5_000, "\\boxed{" * 5_000),
        ("\\overline{" * 5_000 + "\nx}", "\\overline{" * 5_000 + "\nx}"),  # the } is on another line
        ("a$b$c\nd$e$f", "b\ne"),  # the first span of each line
    ],
)
def test_normalisation_takes_linear_time(raw, expected):
    started = time.monotonic()
    assert normalize_final_answer(raw) == expected
    assert time.monotonic() - started < 5.0


def test_a_gold_answer_over_the_cap_scores_wrong_without_work(caplog):
    started = time.monotonic()
    assert not dapo_correct("Answer: 4", "1" * 60_000)
    assert time.monotonic() - started < 5.0
    assert dapo_correct("Answer: 4", " " * 100 + "4")
    assert not dapo_correct("Answer: 4", " " * MAX_GOLD_CHARS + "4")  # would normalise to "4", but is not read
    assert dapo_correct("Answer: 4", [" " * MAX_GOLD_CHARS + "4", "4"])
    with caplog.at_level(logging.WARNING, logger="trl_bandpo.scoring.dapo"):
        flags = score_dapo_completions(["Answer: 4", "Answer: 4"], ["4", "1" * 10_000_000])
    assert flags == [True, False]
    assert any("1 of 2 rows have a gold answer longer" in record.getMessage() for record in caplog.records)


def test_score_dapo_completions_checks_lengths():
    assert score_dapo_completions(["Answer: 1", "Answer: 2"], ["1", "1"]) == [True, False]
    with pytest.raises(ValueError):
        score_dapo_completions(["Answer: 1"], [])


# ---------------------------------------------------------------------------------------------------------------
# The TRL reward function
# ---------------------------------------------------------------------------------------------------------------


def test_dapo_reward_on_strings():
    completions = ["work...\nAnswer: 7", "Answer: 8", "I don't know"]
    assert dapo_reward(completions, solution=["7", "7", "7"], prompts=["p"] * 3) == [1.0, -1.0, -1.0]


def test_dapo_reward_on_conversations():
    completions = [
        [{"role": "assistant", "content": "Answer: 12"}],
        [{"role": "assistant", "content": [{"type": "text", "text": "Answer: 1"}, {"type": "text", "text": "3"}]}],
        [{"role": "assistant", "content": "Answer: 11"}],
    ]
    assert dapo_reward(completions, ["12", "13", "12"], trainer_state=None) == [1.0, 1.0, -1.0]


def test_dapo_reward_metadata_and_pickling():
    assert dapo_reward.__name__ == "dapo_reward"
    clone = pickle.loads(pickle.dumps(dapo_reward))
    assert clone(["Answer: 2"], ["2"]) == [1.0]
    accuracy = DAPOReward(correct=1.0, wrong=0.0, name="dapo_accuracy")
    assert accuracy(["Answer: 2", "Answer: 3"], ["2", "2"]) == [1.0, 0.0]
    assert accuracy.__name__ == "dapo_accuracy"


def test_dapo_reward_rejects_bad_arguments():
    with pytest.raises(ValueError):
        dapo_reward(["Answer: 2"])  # no solution column
    with pytest.raises(ValueError):
        dapo_reward(["Answer: 2"], "2")  # a single string, not one gold per completion
    with pytest.raises(ValueError):
        DAPOReward(correct=float("inf"))
    with pytest.raises(ValueError):
        DAPOReward(name="not a name")

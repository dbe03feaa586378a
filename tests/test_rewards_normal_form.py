r"""The pure-string shortcut of the rewards never accepts what `math_verify` rejects.

`score_completions` accepts an answer without `math_verify` when its `canonical_text` equals the gold's. A false
positive there is the worst error a reward can make (the policy learns to produce it), so every rewrite of the
normal form is checked here against `math_verify` itself, in-process (`verifier._math_verify_equal`, the comparison
the worker processes run): whenever the shortcut says "equal", `math_verify` must say so too.
"""

import pytest

from trl_bandpo.scoring.answers import canonical_text
from trl_bandpo.scoring.rewards import is_equivalent, score_completions
from trl_bandpo.scoring.verifier import _math_verify_equal

VERIFY_TIMEOUT_S = 5

# Answers `math_verify` rejects that an earlier, more aggressive normal form (lowercasing, deleting all spacing)
# accepted: each must score wrong end to end.
KNOWN_FALSE_POSITIVES = [
    ("12", "1 2"),
    ("12", r"1\;2"),
    (r"\rightarrow", r"\Rightarrow"),
    (r"\alpha", r"\Alpha"),
    (r"\sin x", r"\Sin x"),
]

# Pairs the normal form must identify: one or more per rewrite it performs.
SHORTCUT_EQUAL = [
    # integers: leading zeros, sign of zero, "+" sign, surrounding whitespace, dollars
    ("7", "007"),
    ("-7", "-007"),
    ("100", "0100"),
    ("0", "-0"),
    ("0", "+0"),
    ("0", "000"),
    ("7", "+7"),
    ("-5", "- 5"),
    ("12", " 12 "),
    ("42", "$42$"),
    # fractions
    (r"\frac{1}{2}", r"\dfrac{1}{2}"),
    (r"\frac{1}{2}", r"\tfrac{1}{2}"),
    (r"-\frac{3}{4}", r"-\dfrac{3}{4}"),
    (r"\frac{\sqrt{2}}{2}", r"\dfrac{\sqrt{2}}{2}"),
    (r"\frac {1} {2}", r"\frac{1}{2}"),
    (r"\frac12", r"\dfrac12"),
    (r"\frac{1}{2}", r"$\dfrac{1}{2}$"),
    # \left / \right before brackets and bars
    (r"\left(1,2\right)", "(1,2)"),
    (r"\left[0, 1\right)", "[0, 1)"),
    (r"\left\{1, 2\right\}", r"\{1, 2\}"),
    (r"\left|x\right|", "|x|"),
    (r"\left( \frac{1}{2} \right)", r"(\frac{1}{2})"),
    # whitespace next to operators and brackets
    ("x + 1", "x+1"),
    ("x - 1", "x-1"),
    ("x = 3", "x=3"),
    ("x ^ 2", "x^2"),
    ("a _ 1", "a_1"),
    ("3 / 4", "3/4"),
    ("2 * 3", "2*3"),
    ("x < 1", "x<1"),
    ("( 1 , 2 )", "(1 , 2)"),
    ("(1, -2)", "(1,-2)"),
    (r"\{ 1, 2, 3 \}", r"\{1, 2, 3\}"),
    (r"\sqrt {2}", r"\sqrt{2}"),
    # whitespace before a command, runs of whitespace
    (r"2 \sqrt{2}", r"2\sqrt{2}"),
    (r"x \cdot y", r"x\cdot y"),
    (r"x \le 1", r"x\le 1"),
    (r"3 \pi", r"3\pi"),
    (r"\pi  r", r"\pi r"),
    (r"50 \%", r"50\%"),
    # units and text: the insides of \text{..} are kept, the space before the command is not
    (r"5 \text{ cm}", r"5\text{ cm}"),
    (r"5 \,\text{cm}", r"5\,\text{cm}"),
    (r"\text{Monday}", r" \text{Monday} "),
    ("$x+1$", "x + 1"),
]

# Pairs the normal form must keep apart: `math_verify` reads them differently (or a rewrite would be unproven).
SHORTCUT_APART = KNOWN_FALSE_POSITIVES + [
    ("12", r"1\,2"),
    ("12", r"1\quad 2"),
    ("12", r"1\ 2"),
    ("10", "1 0"),
    ("1,000", "1, 000"),
    ("7", "7."),
    ("2.5", "2.5."),
    ("a", "a."),
    (r"\text{pi}", "pi"),
    (r"\text{x+1}", "x+1"),
    (r"\text{no solution}", r"\text{nosolution}"),
    (r"\operatorname{lcm}", "lcm"),
    ("i", "I"),
    (r"\Gamma", r"\gamma"),
    (r"\Delta x", r"\delta x"),
    (r"\pi r", r"\pir"),
    (r"\left.x\right|", ".x|"),
    (r"\frac{1}{2}", r"\frac12"),
    ("-0.5", "+0.5"),
]


def shortcut_equal(gold, answer):
    return canonical_text(gold) == canonical_text(answer)


@pytest.mark.parametrize("gold, answer", SHORTCUT_EQUAL)
def test_shortcut_identifies_only_what_math_verify_identifies(gold, answer):
    assert shortcut_equal(gold, answer), (canonical_text(gold), canonical_text(answer))
    assert _math_verify_equal(gold, answer, VERIFY_TIMEOUT_S)


@pytest.mark.parametrize("gold, answer", SHORTCUT_APART)
def test_shortcut_keeps_apart_what_math_verify_may_tell_apart(gold, answer):
    assert not shortcut_equal(gold, answer), canonical_text(answer)


def test_shortcut_is_sound_on_the_whole_corpus():
    """The property itself: shortcut-equal implies `math_verify`-equal, for every pair in either list."""
    assert len(SHORTCUT_EQUAL) + len(SHORTCUT_APART) >= 45
    unsound = [
        (gold, answer)
        for gold, answer in SHORTCUT_EQUAL + SHORTCUT_APART
        if shortcut_equal(gold, answer) and not _math_verify_equal(gold, answer, VERIFY_TIMEOUT_S)
    ]
    assert not unsound


SPACING_BASES = ["12", "-7", "1,000", "(1,2)", "x+1", r"\frac{1}{2}", r"\pi r", r"2\sqrt{2}", "3.5", r"\sin x"]


@pytest.mark.parametrize("base", SPACING_BASES)
def test_spaces_anywhere_never_make_the_shortcut_unsound(base):
    """A space inserted at any position: whenever the normal form still equals the base's, math_verify agrees."""
    variants = {base[:k] + " " + base[k:] for k in range(len(base) + 1)} | {base.replace(",", ", ")}
    merged = [v for v in sorted(variants) if v != base and shortcut_equal(base, v)]
    assert [v for v in merged if not _math_verify_equal(base, v, VERIFY_TIMEOUT_S)] == []


@pytest.mark.parametrize("gold, answer", KNOWN_FALSE_POSITIVES)
def test_known_false_positives_score_wrong(gold, answer):
    assert not _math_verify_equal(gold, answer, VERIFY_TIMEOUT_S)  # math_verify itself says no
    assert not is_equivalent(gold, answer)
    assert score_completions([rf"so \boxed{{{answer}}}"], [gold]) == [False]


def test_true_positives_of_the_shortcut_still_score_right():
    completions = [r"\boxed{007}", r"\boxed{\dfrac{1}{2}}", r"$\boxed{\left(1,2\right)}$", r"\boxed{x + 1}"]
    assert score_completions(completions, [7, r"\frac{1}{2}", "(1,2)", "$x+1$"]) == [True] * 4

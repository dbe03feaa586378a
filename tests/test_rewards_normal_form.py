r"""The pure-string shortcut of the rewards never accepts what `math_verify` rejects.

`score_completions` accepts an answer without `math_verify` when its `canonical_text` equals the gold's. A false
positive there is the worst error a reward can make (the policy learns to produce it), so every rewrite of the
normal form is checked here against `math_verify` itself, in-process (`verifier._math_verify_equal`, the comparison
the worker processes run): whenever the shortcut says "equal", `math_verify` must say so too.
"""

import math
import re
import string
import sys
import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_bandpo.scoring.answers import answer_form, canonical_text, gold_forms, plain_text
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


# ---------------------------------------------------------------------------------------------------------------
# Unicode spellings, digit groups and a gold's final period (issue 27, item 10): `plain_text`, `answer_form` and
# `gold_forms` rewrite answers and golds before the shortcut and `math_verify` see them.
# ---------------------------------------------------------------------------------------------------------------

# Right answers `math_verify` refused as written, each accepted now (end to end, real verifier processes).
OTHER_SPELLINGS = [
    ("1000", "1 000"),  # digit groups: math_verify read 1 000 as 1*000 = 0
    ("1000", r"1\,000"),
    ("1000", "1\u202f000"),  # narrow no-break space (NFKC: a space), then digit groups
    ("12345.5", "12 345.5"),
    ("-1000", "- 1 000"),
    ("12", "\uff11\uff12"),  # full-width digits
    ("12", "1\u200b2"),  # a zero-width space inside
    ("12", "\ufeff12\u200d"),  # byte-order mark, zero-width joiner
    (r"\frac{1}{2}", "\u00bd"),  # vulgar fraction
    ("0.5", "\u00bd"),
    (r"\frac{7}{2}", "3\u00bd"),  # a mixed number: math_verify reads 3\frac{1}{2} as 7/2
    (r"\sqrt{2}", "2^\u00bd"),  # braced after ^: 2^{\frac{1}{2}}, not 2^\frac{1}{2} (which math_verify reads as 1/2)
    ("3.", "3"),  # the gold's final period
    ("3.", "3."),  # ... still right as written
    ("x = 2.", "2"),
]

# What stays refused, and why (docs/evaluation.md, "Right answers the math_verify reward refuses").
STILL_REFUSED = [
    ("1000", "1e3"),  # math_verify reads 1e3 as 1*e*3 (Euler's number); see test_e_notation_keeps_math_verifys_reading
    ("8", "2\u00b3"),  # superscripts stay as written (NFKC would write 2³ as 23) and math_verify does not read them
    ("23", "2\u00b3"),
    ("x^2", "x\u00b2"),
    (r"\frac{1}{2}", "1\u20442"),  # the fraction slash: 3 1⁄2 would read 3*1/2
    ("12", "\u216b"),  # Roman numeral twelve: NFKC would write the letters XII
    ("3", "3."),  # an answer's own final period is kept: math_verify reads 7. apart from 7
    ("6", "2\u20623"),  # invisible times is kept (dropping it would read 23), and math_verify does not read it
    ("23", "2\u20623"),
    ("1.5", "1,5"),  # a decimal comma: math_verify reads 1,5 as the pair {1, 5}
    ("1000", "1, 000"),  # a pair, not a thousand
    ("12", "1 2"),  # one-digit groups are not digit groups
]


@pytest.mark.parametrize("gold, answer", OTHER_SPELLINGS)
def test_right_answers_in_other_spellings_score_right(gold, answer):
    assert score_completions([rf"so \boxed{{{answer}}}."], [gold]) == [True]


@pytest.mark.parametrize("gold, answer", STILL_REFUSED)
def test_what_stays_refused(gold, answer):
    assert score_completions([rf"\boxed{{{answer}}}"], [gold]) == [False]


def test_e_notation_keeps_math_verifys_reading():
    """``1e3`` is not rewritten: `math_verify` reads it as 1*e*3, which is right for the gold ``3e``."""
    assert _math_verify_equal("3e", "1e3", VERIFY_TIMEOUT_S)
    assert score_completions([r"\boxed{1e3}", r"\boxed{1e3}"], ["3e", "1000"]) == [True, False]


def test_the_forms_of_answers_and_golds():
    assert (
        plain_text("\uff11\uff12") == "12" and plain_text("1\u200b2") == "12" and plain_text("1\u00a0000") == "1 000"
    )
    assert plain_text("\U0001d465+1") == "x+1"  # math italic x
    assert plain_text("\u00bd") == r"\frac{1}{2}" and plain_text("x^ \u00bd") == r"x^ {\frac{1}{2}}"
    assert plain_text("\\sqrt\u00bd") == r"\sqrt{\frac{1}{2}}"
    assert plain_text("2\u00b3") == "2\u00b3" and plain_text("\u215f") == "\u215f"  # kept: superscript, ⅟
    assert plain_text("2\u2062x") == "2\u2062x"  # invisible times kept
    assert (
        answer_form(r" \boxed{2}+1 000 ") == "{2}+1 000"
        and answer_form(" 1 000 ") == "1000"
        and answer_form(" 1~000~000.25 ") == "1000000.25"
    )
    assert answer_form("x = 1 000") == "x = 1 000" and answer_form("1 000,5") == "1 000,5"
    assert (
        answer_form("1 00") == "1 00"
        and answer_form("1 0000") == "1 0000"
        and answer_form(r"1 000\,000") == r"1 000\,000"
    )
    assert (
        gold_forms("3.") == ["3.", "3"] and gold_forms("1, 2, ...") == ["1, 2, ..."] and gold_forms(r"x\.") == [r"x\."]
    )
    assert gold_forms("\uff13\uff0e") == ["3.", "3"] and gold_forms(".") == ["."] and gold_forms("\u200b") == []
    assert gold_forms("1 000.") == ["1 000.", "1000"]


ASCII_TEXT = st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=127), max_size=60)
MATH_TEXT = st.text(alphabet=string.digits + string.ascii_letters + " .,+-*/^_=()[]{}|\\~:;!'<>$", max_size=60)
INVISIBLE = [
    "\u200b",
    "\u200c",
    "\u200d",
    "\u2060",
    "\ufeff",
    "\u00ad",
    "\u200e",
    "\u200f",
    "\u2066",
    "\u2069",
    "\ufe0f",
]
SPACES = ["\u00a0", "\u202f", "\u2009", "\u2002", "\u2003", "\u3000", "\u205f"]


def full_width(text):
    return "".join("\u3000" if c == " " else chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in text)


def with_invisible(text, marks):
    """`text` with invisible characters after each character (not right after a backslash: ``\\`` and the character it
    escapes stay together, as box extraction reads them)."""
    out = []
    for i, char in enumerate(text):
        out.append(char)
        if char != "\\":
            out.append(marks[i % len(marks)])
    return "".join(out)


def with_spaces(text, spaces):
    return "".join(spaces[i % len(spaces)] if c == " " else c for i, c in enumerate(text))


@settings(max_examples=400, deadline=None)
@given(ASCII_TEXT)
def test_ascii_text_is_left_as_it_is(text):
    """No ASCII answer or gold is rewritten by `plain_text`: every ASCII verdict before the digit-group and
    final-period rules is the verdict of before (those two rules are pinned by `EXPECTED_CHANGES`)."""
    assert plain_text(text) == text


@settings(max_examples=400, deadline=None)
@given(
    MATH_TEXT,
    st.lists(st.sampled_from(INVISIBLE), min_size=1, max_size=4),
    st.lists(st.sampled_from(SPACES), min_size=1),
)
def test_unicode_disguises_give_back_the_ascii_text(text, marks, spaces):
    """Full-width forms, invisible characters and other spaces are undone exactly: the disguised answer is given to
    `math_verify` as the ASCII answer is, so it gets the same verdict (right or wrong)."""
    for disguised in (full_width(text), with_invisible(text, marks), with_spaces(text, spaces)):
        assert plain_text(disguised) == text
        assert answer_form(disguised) == answer_form(text)
        assert gold_forms(disguised) == gold_forms(text)


def _changed_characters():
    for code in range(0x80, sys.maxunicode + 1):
        char = chr(code)
        if unicodedata.normalize("NFKC", char) != char or unicodedata.category(char) == "Cf":
            yield char, plain_text(char)


def test_every_character_keeps_its_meaning():
    """Over every Unicode character NFKC changes (and every format character), by an independent reference, the
    character's Unicode name and numeric value: raised, lowered and Roman-numeral characters are kept as written; a
    vulgar fraction becomes ``\\frac`` of its value; every other character written with ASCII digits is written with
    the digits of its numeric value (``①`` -> ``1``, ``⒒`` -> ``11.``; telegraph symbols carry the number of their
    name: ``㏠`` -> ``1日``); only invisible format characters are dropped, never the invisible operators."""
    checked = 0
    for char, plain in _changed_characters():
        checked += 1
        name, nfkc = unicodedata.name(char, ""), unicodedata.normalize("NFKC", char)
        raised = ("SUPERSCRIPT" in name or "SUBSCRIPT" in name) and re.search(
            r"[\w+=()-]", nfkc.encode("ascii", "ignore").decode()
        )
        if raised or "ROMAN NUMERAL" in name or "FRACTION NUMERATOR" in name:  # 2³ (not 23), x₁ (not x1), Ⅻ (not XII)
            assert plain == char, name
        elif name.startswith("VULGAR FRACTION"):
            numerator, denominator = re.fullmatch(r"\\frac\{(\d+)\}\{(\d+)\}", plain).groups()
            assert int(numerator) / int(denominator) == unicodedata.numeric(char), name
        elif plain == "":
            assert unicodedata.category(char) in ("Cf", "Mn") and name.split()[0] != "INVISIBLE", name
        elif re.search("[0-9]", plain) and not name.startswith("IDEOGRAPHIC TELEGRAPH SYMBOL"):
            assert float(re.sub("[^0-9]", "", plain)) == unicodedata.numeric(char), name
    assert checked > 5000
    assert [plain_text(c) for c in "\u2061\u2062\u2063\u2064"] == list("\u2061\u2062\u2063\u2064")


# The verdict property over a corpus: every (gold, answer) pair of CORPUS x CORPUS (2304 pairs), scored end to end by
# `score_completions` (with `math_verify` run in-process instead of in worker processes), against the verdict of the
# code before these rewrites (`canonical_text` shortcut, else `math_verify` on the strings as written). Every
# difference is listed here with the verdict it now gets, checked by hand: each is a right answer now accepted, or an
# answer `math_verify` misread (``1 000`` as 0) now refused. A verdict not listed must not change.
CORPUS = [
    *("0", "1", "3", "6", "7", "8", "12", "23", "357", "1000", "12345", "-1000", "2", "0.5", "1.5", "3.0"),
    *("1,000", "1, 000", "1 000", r"1\,000", "1~000", "12 345", "- 1 000"),  # separators
    *("1.", "3.", "1.5.", "x=2.", "a.", "a", "x=3"),  # final periods
    *("10^{3}", "2^{3}", "1:2", "1 2", "1e3", "3e", r"\frac{1}{2}", r"3\frac{1}{2}", r"\frac{7}{2}"),
    *("\u22121", "\u03c0", "\u00bd", "3\u00bd", "\uff11\uff12", "1\u200b2", "2\u00b3", "\u22121 000", "2\u20623"),
]
EXPECTED_CHANGES = {
    # digit groups joined: a thousand (and 12345) now equals its other spellings ...
    **dict.fromkeys(
        [
            *[(g, a) for g in ("1000", "1,000", "10^{3}") for a in ("1 000", r"1\,000", "1~000")],
            *[(g, a) for g in ("1 000", r"1\,000", "1~000") for a in ("1000", "1,000", "10^{3}")],
            *[(g, "1~000") for g in ("1 000", r"1\,000")],  # (1 000 and 1\, 000 were equal before: both read 0)
            *[("1~000", a) for a in ("1 000", r"1\,000")],
            ("12345", "12 345"),
            ("12 345", "12345"),
            ("-1000", "- 1 000"),
            ("- 1 000", "-1000"),
            ("-1000", "\u22121 000"),
            ("\u22121 000", "-1000"),
        ],
        True,
    ),
    # ... and no longer equals what math_verify misread it as (1 000 as 1*000 = 0, 12 345 as 12+345 = 357)
    **dict.fromkeys(
        [
            *[(g, a) for g in ("0",) for a in ("1 000", r"1\,000", "- 1 000", "\u22121 000")],
            *[(g, a) for g in ("1 000", r"1\,000", "- 1 000", "\u22121 000") for a in ("0",)],
            *[(g, a) for g in ("1 000", r"1\,000") for a in ("- 1 000", "\u22121 000")],
            *[(g, a) for g in ("- 1 000", "\u22121 000") for a in ("1 000", r"1\,000")],
            ("357", "12 345"),
            ("12 345", "357"),
        ],
        False,
    ),
    # the gold's final period: what equals the gold without it is right (1 2 as in math_verify's reading: 1 + 2)
    ("1.", "1"): True,
    ("3.", "3"): True,
    ("3.", "3.0"): True,
    ("3.", "x=3"): True,
    ("3.", "1 2"): True,
    ("1.5.", "1.5"): True,
    ("x=2.", "2"): True,
    ("a.", "a"): True,
    # full-width digits, a zero-width space, a vulgar fraction: the ASCII spelling's verdict
    ("12", "\uff11\uff12"): True,
    ("12", "1\u200b2"): True,
    ("\uff11\uff12", "12"): True,
    ("1\u200b2", "12"): True,
    ("\uff11\uff12", "1\u200b2"): True,
    ("1\u200b2", "\uff11\uff12"): True,
    **dict.fromkeys([(g, "\u00bd") for g in ("0.5", "1:2", r"\frac{1}{2}")], True),
    **dict.fromkeys([("\u00bd", a) for a in ("0.5", "1:2", r"\frac{1}{2}")], True),
    **dict.fromkeys([(g, "3\u00bd") for g in (r"3\frac{1}{2}", r"\frac{7}{2}")], True),
    **dict.fromkeys([("3\u00bd", a) for a in (r"3\frac{1}{2}", r"\frac{7}{2}")], True),
}


@pytest.fixture
def in_process_verifier(monkeypatch):
    """`math_verify` run in this process (the workers' comparison, `_math_verify_equal`), verdicts cached per pair."""
    import trl_bandpo.scoring.rewards as rewards

    cache = {}

    def verify(gold, answer):
        if (gold, answer) not in cache:
            cache[gold, answer] = _math_verify_equal(gold, answer, VERIFY_TIMEOUT_S)
        return cache[gold, answer]

    monkeypatch.setattr(rewards, "verify_pairs", lambda pairs, *args: [verify(g, a) for g, a in pairs])
    return verify


def test_no_verdict_changes_but_the_listed_ones(in_process_verifier):
    verify = in_process_verifier
    pairs = [(gold, answer) for gold in CORPUS for answer in CORPUS]
    assert len(pairs) == 48 * 48
    now = score_completions(
        [rf"\boxed{{{answer}}}" for _, answer in pairs], [g for g, _ in pairs], call_timeout_s=math.inf
    )
    before = [shortcut_equal(gold, answer) or verify(gold, answer) for gold, answer in pairs]
    changed = {pair: verdict for pair, verdict, old in zip(pairs, now, before) if verdict != old}
    assert changed == EXPECTED_CHANGES
    # the verdict is math_verify's verdict on the rewritten strings (the shortcut agrees with it on every pair)
    assert now == [any(verify(form, answer_form(a)) for form in gold_forms(g)) for g, a in pairs]


@pytest.mark.parametrize("disguise", ["full width", "invisible", "spaces"])
def test_disguised_answers_and_golds_get_the_ascii_verdict(in_process_verifier, disguise):
    """Each ASCII string of the corpus, disguised: every verdict equals the ASCII spelling's, right or wrong."""
    ascii_corpus = [text for text in CORPUS if text.isascii()]
    disguised = {
        "full width": full_width,
        "invisible": lambda text: with_invisible(text, INVISIBLE),
        "spaces": lambda text: with_spaces(text, SPACES),
    }[disguise]
    pairs = [(gold, answer) for gold in ascii_corpus for answer in ascii_corpus]
    boxed_answers = [rf"\boxed{{{answer}}}" for _, answer in pairs]
    golds = [gold for gold, _ in pairs]
    plain = score_completions(boxed_answers, golds, call_timeout_s=math.inf)
    assert sum(plain) > 100
    assert score_completions([rf"\boxed{{{disguised(a)}}}" for _, a in pairs], golds, call_timeout_s=math.inf) == plain
    assert score_completions(boxed_answers, [disguised(g) for g in golds], call_timeout_s=math.inf) == plain

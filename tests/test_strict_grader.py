r"""The conservative evaluation checker (verl's ``prime_math`` rules): normalisations, verdicts per rule, time bound.

Every expected verdict below is written by hand from the rules of ``prime_math`` (PRM800K's ``grade_answer``, then
ToRA's ``math_equal``); the module docstring of `trl_bandpo.scoring.strict_grader` lists them.
"""

import ast
import threading
import time
from pathlib import Path

import pytest
import sympy

from trl_bandpo.scoring.strict_grader import extract_answer, grade_answer, strict_score, strict_scores
from trl_bandpo.scoring.strict_grader._expressions import python_value, read_expression
from trl_bandpo.scoring.strict_grader._grade import grade, should_allow_eval, split_tuple
from trl_bandpo.scoring.strict_grader._normalize import latex_to_text, mathd_normalize, prm_normalize

REPO = Path(__file__).resolve().parents[1]
x, y = sympy.symbols("x y")


# ---------------------------------------------------------------------------------------------------------------
# Normalisations
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, expected",
    [
        (r"\dfrac{1}{2}", r"\frac{1}{2}"),
        (r"\left( 1, 2 \right)", "(1,2)"),
        (r"30^\circ", "30"),
        (r"\$5", "5"),
        (r"5\text{ cm}", "5"),
        (r"50\%", "50"),
        (".5", r"\frac{1}{2}"),  # "0.5", then the 0.5 rule
        ("k = 3", "3"),
        (r"\sqrt3", r"\sqrt{3}"),
        (r"\frac12", r"\frac{1}{2}"),
        ("3/4", r"\frac{3}{4}"),
        ("3/x", "3/x"),
        (r"\text{Monday}", "Monday"),
        (r"\sqrt", r"\sqrt"),  # an error inside: the answer as it was
    ],
)
def test_mathd_normalize(raw, expected):
    assert mathd_normalize(raw) == expected


@pytest.mark.parametrize(
    "raw, expected",
    [
        (r"\text{Monday}", "mon"),  # "day" is a unit word, removed anywhere
        (r"\$12", "12"),
        ("50%", "50"),
        ("2 or 3", "2 , 3"),
        ("2 and 3", "2 , 3"),
        ("3 million", "3 *10^6"),
        ("5 meters", "5"),  # "5 ", then an integer is written as an integer
        ("12 hours", "12"),
        ("90^\\circ", "90"),
        ("{5}", "5"),
        ("1,\\!000", "1000"),
        ("3.0", "3"),
        ("1,000", "1000"),
        (r"\frac{1}{2}", "1/2"),
        (r"3\frac{1}{2}", "3+1/2"),  # a mixed number
        (r"\sqrt{2}", "sqrt(2)"),
        (r"2\pi", "2pi"),
        (r"(-\infty, 3) \cup (4, \infty)", "(-inf, 3) u(4, inf)"),
        (r"2 \cdot 3", "2 *3"),
        ("- 3", "-3"),
        ("ABC", "abc"),
    ],
)
def test_prm_normalize(raw, expected):
    assert prm_normalize(raw) == expected


@pytest.mark.parametrize(
    "latex, expected",
    [
        (r"\frac{1+x}{2}", "1+x/2"),  # no parentheses, as pylatexenc writes it
        (r"\frac12", "1/2"),
        (r"\sqrt[3]{2}", "√(2)"),  # the degree is dropped
        (r"\sqrt2x", "√(2)x"),
        (r"\pi r", "πr"),  # a macro takes the spaces after it
        (r"\alpha+\Omega", "α+Ω"),
        (r"\left[0,1\right)", "[0,1)"),
        (r"\text{ or } x", " or  x"),
        (r"\mathbb{R}", "ℝ"),
        (r"\hat{x}", "x\u0302"),
        (r"\mbox{ab}c", "c"),
        (r"\foo{3}", "3"),  # an unknown macro vanishes, its group stays
        (r"\{1,2\}", "{1,2}"),
        (r"1\,000", "1 000"),
        (r"a\\b", "a\nb"),
        (r"\le\ge\neq\in\infty\cup\cdot\times", "≤≥≠∈∞∪·×"),
    ],
)
def test_latex_to_text(latex, expected):
    assert latex_to_text(latex) == expected


def test_latex_to_text_fails_like_pylatexenc():
    with pytest.raises(ValueError):
        latex_to_text(r"\sqrt")
    assert latex_to_text(r"\frac") == "%s/%s"  # pylatexenc writes its format string


@pytest.mark.parametrize(
    "text, expected",
    [("(1,2)", ["1", "2"]), ("[a, b)", ["a", "b"]), ("1,000", ["1000"]), ("((1,2))", ["((1,2))"]), ("", [])],
)
def test_split_tuple(text, expected):
    assert split_tuple(text) == expected


def test_should_allow_eval():
    assert should_allow_eval("(x^2)-(y)")
    assert not should_allow_eval("(a)-(b+c)")  # three letters
    assert should_allow_eval("(sqrt(2))-(frac)")  # sqrt and frac are not counted
    assert not should_allow_eval("(2^{3})-(8)") and not should_allow_eval("(2^(3))-(8)")
    assert not should_allow_eval("(2^10)-(1024)") and not should_allow_eval("(2^3^2)-(1)")


# ---------------------------------------------------------------------------------------------------------------
# Reading expressions without executing them
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("2x", 2 * x),
        ("x(2)", 2 * x),
        ("(1)(2)", sympy.Integer(2)),
        ("xy", x * y),
        ("ab2", 2 * sympy.Symbol("a") * sympy.Symbol("b")),
        ("ln2", 2 * sympy.Symbol("l") * sympy.Symbol("n")),  # one unknown name, split into letters
        ("ln(2)", sympy.log(2)),
        ("sqrt 2", sympy.sqrt(2)),
        ("2sqrt(3)", 2 * sympy.sqrt(3)),
        ("5!", sympy.Integer(120)),
        ("2x!", 2 * sympy.factorial(x)),
        ("1/2x", x / 2),
        ("-2**2", sympy.Integer(-4)),
        ("2**3**2", sympy.Integer(512)),
        ("0.5", sympy.Float("0.5")),
        ("1e3", sympy.Float(1000)),
        ("2pi", 2 * sympy.pi),
        ("mu", sympy.Symbol("mu")),  # Greek names are not split
        ("x_1", sympy.Symbol("x_1")),
    ],
)
def test_read_expression_implicit(text, expected):
    assert read_expression(text, implicit=True) == expected


def test_read_expression_standard():
    assert read_expression("2^3", implicit=False) == 1  # ^ is Python's XOR without the implicit rules
    assert read_expression("[[1], [2]]", implicit=False) == [[1], [2]]
    assert read_expression("E + I", implicit=False) == sympy.E + sympy.I
    with pytest.raises(SyntaxError):
        read_expression("2x", implicit=False)


@pytest.mark.parametrize(
    "text",
    ["__import__('os')", "open('f')", "x.__class__", "lambda: 1", "gamma(2)", "S(1)", "eval('1')", "sqrt -1", "'a'"],
)
def test_read_expression_refuses_code(text):
    with pytest.raises((ValueError, SyntaxError)):
        read_expression(text, implicit=True)


def test_python_value():
    assert python_value("1*3.14/2") == pytest.approx(1.57)
    assert python_value("(2, 3)") == (2, 3) and python_value("[1, [2]]") == [1, [2]]
    assert python_value("7 ^ 2") == 5
    for text in ["__import__('os').getcwd()", "x", "'a'", "1/0", "2**10**9", "{1}", "\\frac{1}{2}"]:
        with pytest.raises(ValueError):
            python_value(text)


# ---------------------------------------------------------------------------------------------------------------
# Verdicts, rule by rule (gold answers second)
# ---------------------------------------------------------------------------------------------------------------

RULES = {
    "equal numbers in other forms": [
        ("1,000", "1000", True), ("1{,}000", "1000", True), ("1000.0", "1000", True), ("1e3", "1000", True),
        ("-3", "- 3", True), ("03", "3", True), ("10^3", "1000", False), ("2 \\cdot 3", "6", False),
        ("5!", "120", False), ("x=3", "3", True), ("\\text{3}", "3", True),
    ],
    "tolerance": [
        ("3.0001", "3", True), ("3.001", "3", False), ("1000.1", "1000", True), ("1000.2", "1000", False),
        ("3.14", "\\pi", True), ("6.28", "2\\pi", True), ("3.14159", "\\pi", True), ("3.2", "\\pi", False),
    ],
    "fractions and decimals": [
        ("0.5", "\\frac{1}{2}", True), ("\\frac12", "\\frac{1}{2}", True), ("\\dfrac{1}{2}", "\\frac{1}{2}", True),
        ("0.75", "\\frac{3}{4}", True), ("-1.5", "-\\frac{3}{2}", True), ("\\frac{-3}{2}", "-\\frac{3}{2}", True),
        ("7.75", "7 3/4", True), ("7\\frac{3}{4}", "7.75", True), ("0.333", "\\frac{1}{3}", False),
        ("2/4", "1/2", False), ("\\frac{2}{4}", "\\frac{1}{2}", False),
    ],
    "intervals and tuples": [
        ("(0, 1)", "(0,1)", True), ("[0,1)", "[0, 1)", True), ("[0,1)", "(0,1)", False), ("(0,1)", "[0,1)", False),
        ("(-\\infty, 3) \\cup (4, \\infty)", "(-\\infty,3)\\cup(4,\\infty)", True), ("(1,2)", "(2,1)", False),
        ("Interval.Ropen(0, 1)", "[0, 1)", True), ("x \\in [1,2]", "[1,2]", False),
        # different brackets are different intervals, also where dropping the brackets makes the texts equal
        ("[1,2]", "[1,2)", False), ("[1,2)", "[1,2]", False), ("(1,2)", "(1,2]", False), ("(1,2]", "[1,2]", False),
        ("(-\\infty,2)", "(-\\infty,2]", False), ("(-\\infty,2]", "(-\\infty,2)", False), ("[1,2]", "1,2", True),
    ],
    "multiple answers": [
        ("2, 3", "2,3", True), ("2, 3", "3, 2", False), ("\\{1,2\\}", "\\{2,1\\}", False), ("2 and 3", "2, 3", False),
        ("2 or 3", "2 or 3", True),
    ],
    "units and percent": [
        ("5 cm", "5", True), ("5\\text{ cm}", "5", True), ("5", "5 \\text{ cm}", True), ("5 meters", "5", True),
        ("30^\\circ", "30", True), ("\\$ 12", "12", True), ("12 dollars", "12", False), ("50\\%", "50", True),
        ("0.5", "50\\%", True), ("50%", "0.5", True), ("5000", "50", True), ("3 million", "3000000", False),
    ],
    "text answers": [
        ("Monday", "\\text{Monday}", True), ("monday", "Monday", True), ("\\text{(B)}", "B", True),
        ("A", "(A)", True), ("B", "(A)", False), ("yes", "no", False),
    ],
    "symbolic (sympy)": [
        ("2\\sqrt{2}", "\\sqrt{8}", True), ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}", True),
        ("(x+1)^2", "x^2+2x+1", True), ("x^2+1", "1+x^2", True), ("1/2x", "x/2", True), ("ab", "ba", True),
        ("\\sqrt{2}", "1.4142", False), ("e^2", "7.389", False), ("\\ln 2", "0.693", False),
    ],
    "bases, matrices": [
        ("1010_2", "1010", True), ("1010_2", "10", False), ("x_1", "3", False),
        ("Matrix([[1], [2]])", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", True),
        ("[1, 2]", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", False),
        # a bmatrix is the same matrix as a pmatrix
        ("\\begin{bmatrix} 1 \\\\ 2 \\end{bmatrix}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", True),
        ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{bmatrix} 1 \\\\ 2 \\end{bmatrix}", True),
        ("\\begin{bmatrix} 1 \\\\ 3 \\end{bmatrix}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", False),
        ("Matrix([[1], [2]])", "\\begin{bmatrix} 1 \\\\ 2 \\end{bmatrix}", True),
        ("\\begin{vmatrix} 1 \\end{vmatrix}", "\\begin{pmatrix} 1 \\end{pmatrix}", False),  # a determinant
    ],
    # Integers compare exactly, at any size (as floats, different ones beyond 1e308 or 2**53 looked equal).
    "large integers": [
        ("1" * 400, "1" * 399 + "2", False), ("1" * 400, "1" * 400, True), ("1" * 400 + ".0", "1" * 400, True),
        ("1" + "0" * 4999 + "1", "1" + "0" * 5000, False),  # 10**5000 + 1 and 10**5000
        ("1" * 300, "1" * 299 + "2", False), ("12345678901234567", "12345678901234568", False),
        ("123457", "123456", False), ("1000000001", "1000000000", False), ("5000", "50", True),
        ("1" * 300 + "_2", "1" * 299 + "2_2", False),  # base subscripts: the digits compared exactly
        ("1e9999999999999999999", "2e9999999999999999999", False),  # beyond any float or Decimal: not both "inf"
        ("inf", "inf", True),
    ],
    # A lenient checker (math_verify, a CAS) accepts these; prime_math does not.
    "lenient checkers accept, prime_math rejects": [
        ("\\sin^2 x + \\cos^2 x", "1", False),  # an integer gold needs an integer answer
        ("a+b+c", "c+b+a", False),  # three letters: sympy is not tried
        ("x^{2}+1", "1+x^{2}", False),  # "^{": sympy is not tried
        ("9", "3^2", False), ("\\frac{2}{4}", "\\frac{1}{2}", False), ("1.41421", "\\sqrt{2}", False),
    ],
}  # fmt: skip


def _short(text: str) -> str:
    return text if len(text) <= 40 else f"{text[:16]}...{text[-8:]} ({len(text)} chars)"


@pytest.mark.parametrize(
    "given, gold, expected",
    [
        pytest.param(*case, id=f"{rule}: {_short(case[0])} vs {_short(case[1])}")
        for rule, cases in RULES.items()
        for case in cases
    ],
)
def test_grade_answer_rules(given, gold, expected):
    assert grade_answer(given, gold) is expected


def test_worker_and_in_process_verdicts_agree():
    for cases in RULES.values():
        for given, gold, expected in cases:
            assert grade(given, gold) is expected, (given, gold)


# ---------------------------------------------------------------------------------------------------------------
# Extraction and strict_score
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, expected",
    [
        (r"so \boxed{5}.", "5"),
        (r"\boxed{1} no, \boxed{2}", "2"),
        (r"so \boxed{x = 5}", "5"),
        (r"\boxed{f(x) = x^2}", "x^2"),
        (r"\boxed{\text{this is } 7}", "} 7"),  # after the last "is ", braces or not
        (r"\boxed{a. b}", "a"),  # the text before the last ". "
        (r"\boxed{ \frac{1}{2} }", r"\frac{1}{2}"),
        (r"\boxed{}", None),  # an empty box: no answer
        (r"so x = \boxed{3", None),  # a box that never closes (a cut-off completion): no answer
        (None, None),
        ("", None),
        ([{"role": "assistant", "content": r"\boxed{3}"}], "3"),
        # nested boxes: the outermost last box, its inner box commands dropped
        (r"\boxed{\boxed{2}+1}", "{2}+1"),
        (r"\boxed{\boxed{7}}", "{7}"),
        # without a box: the text after the last "answer:"/"answer is"/"answers are", cut as a box's content is
        ("no box: 5", "5"),
        ("The answer is 12.", "12."),
        ("The final answer is $\\frac{1}{2}$.", "$\\frac{1}{2}$."),
        ("It is 5", "5"),
        ("The answer is", None),
        # the cuts come before the box: a box only counts after the last "answer is", before "is the answer"
        (r"\boxed{3}. So the answer is 4.", "4."),
        (r"The answer is \boxed{5}.", "5"),
        (r"I think \boxed{3} is the answer, not \boxed{4}", "3"),
    ],
)
def test_extract_answer(completion, expected):
    assert extract_answer(completion) == expected


def test_strict_score():
    assert strict_score(r"Thus $\boxed{\dfrac{1}{2}}$.", "0.5")
    assert not strict_score(r"Thus $\boxed{\dfrac{2}{4}}$.", r"\frac{1}{2}")
    assert strict_score([{"role": "assistant", "content": r"\boxed{12}"}], 12)  # numbers as gold
    assert strict_score(r"\boxed{12}", ["11", "12"])  # alternatives
    assert strict_score("The answer is 12.", "12")  # no box: the text after "answer is", "12." reads as 12
    assert strict_score("The final answer is $12$.", "12")
    assert not strict_score(r"The final answer is $\frac{1}{2}$.", r"\frac{1}{2}")  # "1/2." is not 1/2
    assert strict_score(r"\boxed{3}. So the answer is 4.", "4") and not strict_score(
        r"\boxed{3}. So the answer is 4.", "3"
    )
    assert not strict_score("I do not know", "5")
    assert not strict_score(r"\boxed{\boxed{2}+1}", "2")  # the inner box is not the answer
    assert strict_score(r"\boxed{\boxed{2}+1}", "2+1")
    assert strict_score(r"\boxed{\boxed{\frac{1}{2}}}", "0.5")
    assert not strict_score(r"\boxed{12}", None)
    assert strict_scores([r"\boxed{1}", r"\boxed{2}"], ["1", "1"]) == [True, False]
    with pytest.raises(ValueError):
        strict_scores([r"\boxed{1}"], [])


def test_bad_timeouts_are_refused():
    for bad in (0, -1, float("inf"), True, "1"):
        with pytest.raises(ValueError):
            grade_answer("1", "1", timeout_s=bad)


# ---------------------------------------------------------------------------------------------------------------
# Time bound, safety, garbage
# ---------------------------------------------------------------------------------------------------------------


def test_slow_answer_times_out_and_the_pool_recovers():
    assert grade_answer("2x", "x+x", timeout_s=5)  # a warm worker
    start = time.monotonic()
    assert not grade_answer("9**9**9*x", "x", timeout_s=0.5)  # sympy builds a 370-million-digit integer
    assert time.monotonic() - start < 5.0
    assert grade_answer("2x", "x+x", timeout_s=5)  # a fresh worker takes over


def test_concurrent_calls():
    results = [None] * 4

    def work(i):
        results[i] = grade_answer(f"{i}x", f"{i - 1}x+x", timeout_s=10)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(results))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [True] * len(results)


def test_model_output_is_never_executed(tmp_path):
    marker = tmp_path / "executed"
    payloads = [
        f"__import__('os').system('touch {marker}')",
        f"Matrix(__import__('os').system('touch {marker}'))",
        f"[__import__('os').system('touch {marker}')]",
        f"2\\pi + __import__('os').system('touch {marker}')",
    ]
    for payload in payloads:
        assert not grade_answer(payload, r"\begin{pmatrix} 1 \end{pmatrix}")
        assert not grade_answer(payload, "x")
    assert not marker.exists()


GARBAGE = ["", " ", "}}}{{{", "\\", "\\frac", "\\sqrt", "\\boxed{", "$$$", "\x00", "é" * 50, "(" * 2000, "1" * 5000,
           "[[[[]]]]", "(,)", "Point(", "Matrix(", "1_", "_", "\\pi\\pi\\pi", "%", "nan", "inf", "-inf", "1e999",
           "0x10", "\n\n", "\\text{", "Interval(", "9**9**9", "&&&", "\\begin{pmatrix}"]  # fmt: skip


def test_garbage_never_raises():
    for given in GARBAGE:
        for gold in ("1", "x", "(1,2)", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", given):
            assert grade_answer(given, gold, timeout_s=0.5) in (True, False)
    assert not grade_answer(None, "1") and not grade_answer("1", None)
    assert not grade_answer("1" * 20_000, "1")  # over MAX_CHARS
    for completion in (None, 17, {"content": 3}, [], [{"role": "assistant"}], b"\\boxed{1}"):
        assert strict_score(completion, "1") is False


def test_module_level_imports_are_light():
    """sympy is imported on first use only (in the worker processes), never when the package is imported."""
    for path in [
        *(REPO / "trl_bandpo" / "scoring" / "strict_grader").glob("*.py"),
        REPO / "trl_bandpo" / "scoring" / "dapo.py",
    ]:
        for node in ast.parse(path.read_text()).body:  # module level only
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [alias.name for alias in node.names] + [getattr(node, "module", None) or ""]
                assert not any(n.split(".")[0] in ("sympy", "math_verify", "torch") for n in names), path

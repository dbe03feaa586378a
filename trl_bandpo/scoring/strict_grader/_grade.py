r"""The comparison rules of verl's ``prime_math`` grader, and the worker process that applies them.

`grade` is ``prime_math.compute_score``'s verdict on an extracted answer: the PRM800K check (`prm_grade`) or, when
it fails, ToRA's ``math_equal`` (`tora_equal`, tried with pi = 3.14159... and pi = 3.14 when either side has
``\pi``). Model output is never handed to ``eval``, ``sympify`` or ``parse_expr``: `read_expression` and
`python_value` (in `_expressions`) parse it with Python's `ast` and build values from a whitelist. This file
imports only the standard library at import time (sympy on first use): `trl_bandpo.scoring.strict_grader` runs it in
worker processes (`worker_handler`), loaded with its sibling modules as a stand-alone package, and kills a
worker that exceeds the time limit.
"""

from __future__ import annotations

import contextlib
import math
import re
from decimal import Decimal, localcontext

from ._expressions import python_value, read_expression
from ._normalize import (
    EXACT,
    MAX_INTEGER_DIGITS,
    exact_number,
    is_frac,
    mathd_normalize,
    prm_normalize,
    str_is_int,
    strip_formatted_commas,
)

# --- PRM800K's check (prime_math.grade_answer) ---


def should_allow_eval(expr: str) -> bool:
    """PRM800K's guard before sympy: at most two distinct letters (``sqrt``/``frac`` aside), no large powers."""
    letters = {c for c in expr.replace("sqrt", "").replace("frac", "") if c.isalpha()}
    if len(letters) > 2 or "^{" in expr or "^(" in expr:
        return False
    return re.search(r"\^[0-9]+\^", expr) is None and re.search(r"\^[0-9][0-9]+", expr) is None


def sympy_equal(gold: str, given: str) -> bool:
    """Whether sympy simplifies ``(gold) - (given)`` to 0 (PRM800K's ``are_equal_under_sympy``); False on any error."""
    expr = f"({gold})-({given})"
    if not should_allow_eval(expr):
        return False
    try:
        import sympy

        return bool(sympy.simplify(read_expression(expr.replace("^", "**"), implicit=True)) == 0)
    except Exception:  # noqa: BLE001 - unreadable or not comparable: not equal
        return False


def split_tuple(expr: str) -> list[str]:
    """The elements of a tuple or interval (``(1,2)``, ``[a,b)``); thousands separators are not element commas."""
    expr = strip_formatted_commas(expr)
    if not expr:
        return []
    brackets = "()[]"
    if len(expr) > 2 and expr[0] in brackets and expr[-1] in brackets and not any(c in expr[1:-1] for c in brackets):
        return [item.strip() for item in expr[1:-1].split(",")]
    return [expr]


def same_matrix_brackets(answer: str) -> str:
    r"""``\begin{bmatrix}..\end{bmatrix}`` written as ``\begin{pmatrix}..\end{pmatrix}``: the same matrix in other
    brackets, compared as one (``prime_math`` compares their text, and its matrix rules know only ``pmatrix``)."""
    return answer.replace("\\begin{bmatrix}", "\\begin{pmatrix}").replace("\\end{bmatrix}", "\\end{pmatrix}")


def quick_match(given: str, gold: str) -> bool:
    """The string stages of PRM800K's check (no sympy): equal MATH normal forms, or equal PRM800K normal forms."""
    given, gold = same_matrix_brackets(given), same_matrix_brackets(gold)
    if mathd_normalize(gold) == mathd_normalize(given):
        return True
    gold_normal, given_normal = prm_normalize(gold), prm_normalize(given)
    return gold_normal is not None and gold_normal == given_normal


def prm_grade(given: str, gold: str) -> bool:
    """``prime_math.grade_answer``: string stages, then element-wise comparison of tuples with sympy."""
    if quick_match(given, gold):
        return True
    gold_normal, given_normal = prm_normalize(gold), prm_normalize(given)
    if not given_normal:
        return False
    gold_items, given_items = split_tuple(gold_normal), split_tuple(given_normal)
    if len(gold_items) != len(given_items) or (
        len(gold_items) > 1 and (gold_normal[0] != given_normal[0] or gold_normal[-1] != given_normal[-1])
    ):
        return False  # a different number of elements, or different brackets
    for gold_item, given_item in zip(gold_items, given_items):
        if is_frac(gold_item) and is_frac(given_item):
            equal = gold_item == given_item  # fractions must be written the same (reduced) way
        elif str_is_int(gold_item) != str_is_int(given_item):
            equal = False  # an integer must be matched by an integer
        else:
            equal = sympy_equal(gold_item, given_item)
        if not equal:
            return False
    return True


# --- ToRA's math_equal (prime_math.grader), as it runs in verl ---


_TORA_MAX_CHARS = 1000  # ToRA reads no more of a string prediction
_CLOSER = {"(": ")", "[": "]"}
_OTHER_OPENER = {"(": "[", "[": "("}


def _same_text(prediction: str, reference: str) -> bool:
    """ToRA's string tests: equal up to case and surrounding whitespace, or equal once all spaces are removed."""
    if prediction.strip().lower() == reference.strip().lower():
        return True
    return "".join(prediction.split(" ")) == "".join(reference.split(" "))


def _same_parts(pred_parts: list, ref_parts: list) -> bool:
    """As many parts on both sides, equal in pairs (`_all_equal`, not evaluated for different lengths)."""
    return len(pred_parts) == len(ref_parts) and _all_equal(pred_parts, ref_parts)


def _tora_normalize(answer: object, pi: float) -> object:
    if not isinstance(answer, str):
        return answer
    if re.match(r"\$\d+(\.\d+)?", answer):
        return answer[1:]
    if re.match(r"\d+(\.\d+)?\\?%$", answer):  # a percentage ("%" or "\%"): the number alone
        return re.sub(r"\\?%", "", answer)
    if "_" in answer:  # a base subscript: "1010_2" -> 1010 (ValueError when the part before "_" is no number)
        digits = answer.split("_")[0]
        number = exact_number(digits)  # int(float(..)) would give long numbers a neighbour's digits
        if number is not None and number.adjusted() < MAX_INTEGER_DIGITS:
            return int(number)  # truncated, as int(float(..)) does
        return int(float(digits))
    if "\\pi" in answer:
        index = answer.find("\\pi")
        while index != -1:
            product = f"*{pi}" if index > 0 and answer[index - 1].isdigit() else f"1*{pi}"
            answer = answer[:index] + product + answer[index + 3 :]
            index = answer.find("\\pi", index + 1)
        with contextlib.suppress(ValueError):
            answer = python_value(answer)
    return answer


def _as_number(value: object) -> float | None:
    try:
        text = str(value)  # ValueError for an int beyond Python's digit limit, inside the test as in ToRA
        return float(text.replace("{,}", "")) if "{,}" in text else float(text.replace(",", ""))
    except ValueError:
        return None


def _exact_as_number(value: object) -> Decimal | None:
    """`_as_number` without its float: the exact value of the same text (None for floats, ``inf``, ``nan``)."""
    if isinstance(value, str):
        value = value.replace("{,}", "") if "{,}" in value else value.replace(",", "")
    return exact_number(value)


def _is_infinity(value: object) -> bool:
    """Whether `value` spells an infinity (``inf``, ``-Infinity``, a float inf), not a number too large for floats."""
    if isinstance(value, float):
        return math.isinf(value)
    return isinstance(value, str) and value.strip().lower().lstrip("+-") in ("inf", "infinity")


def _numbers_match(predicted: Decimal, reference: Decimal, tolerance: float) -> bool:
    """ToRA's numeric test, computed exactly: two integers must be equal (or one 100 times the other, the percent
    forms); otherwise the prediction must lie within a relative `tolerance` of the reference, of the reference / 100
    or of the reference * 100 (``math.isclose``)."""
    with localcontext(EXACT):
        candidates = (reference.scaleb(-2), reference, reference.scaleb(2))
        if predicted == predicted.to_integral_value() and reference == reference.to_integral_value():
            return predicted in candidates
        bound = Decimal(repr(tolerance))
        return any(abs(c - predicted) <= bound * max(abs(c), abs(predicted)) for c in candidates)


def tora_equal(prediction: object, reference: object, pi: float = math.pi, tolerance: float = 1e-4) -> bool:
    """ToRA's ``math_equal`` as verl runs it; raises where it raises (the caller then scores the answer wrong)."""
    prediction = _tora_normalize(prediction, pi)
    reference = _tora_normalize(reference, pi)
    if isinstance(prediction, str):
        prediction = prediction[:_TORA_MAX_CHARS]
        if isinstance(reference, str) and _same_text(prediction, reference):
            return True
    predicted_number, reference_number = _as_number(prediction), _as_number(reference)
    if predicted_number is not None and reference_number is not None:  # percentages: x, x/100 and 100x all match
        exact = _exact_as_number(prediction), _exact_as_number(reference)
        if None not in exact:
            return _numbers_match(*exact, tolerance)
        if not math.isfinite(predicted_number) or not math.isfinite(reference_number):
            # only a written infinity equals an infinity: a number beyond Decimal's range is no inf
            return _is_infinity(prediction) and _is_infinity(reference) and predicted_number == reference_number
        candidates = (reference_number / 100, reference_number, reference_number * 100)
        return any(math.isclose(c, predicted_number, rel_tol=tolerance) for c in candidates)
    if not prediction and prediction != 0:  # nothing to compare (None, "", []), unless it is the number 0
        return False
    reference = str(reference).strip()
    prediction = _format_interval(str(prediction).strip())
    pred_text, ref_text = prediction, reference
    head = prediction[:1]
    if head in _CLOSER and prediction.endswith(_CLOSER[head]) and not reference.startswith(_OTHER_OPENER[head]):
        pred_text, ref_text = pred_text.strip("[]()"), ref_text.strip("[]()")  # one bracketed side: brackets dropped
    if not _different_intervals(prediction, reference) and re.sub(r"[{}()]", "", pred_text) == re.sub(
        r"[{}()]", "", ref_text
    ):
        return True
    ends = prediction[:1] + prediction[-1:]
    if len(ends) == 2 and ends[0] in _CLOSER and ends[1] in ")]" and ends == reference[:1] + reference[-1:]:
        if _same_parts(prediction[1:-1].split(","), reference[1:-1].split(",")):  # a tuple or interval
            return True
    if "," in prediction and "," in reference:  # comma-separated lists, in order
        pred_parts, ref_parts = (list(map(str.strip, text.split(","))) for text in (prediction, reference))
        if len(pred_parts) == len(ref_parts):
            return _all_equal(pred_parts, ref_parts)
    if prediction.startswith("Point") and reference[0] + reference[-1] == "()":  # sympy's printed Point(x, y)
        inside = prediction[:-1][prediction.find("(") + 1 :]
        if _same_parts(inside.split(","), reference[1:-1].split(",")):
            return True
    if r"\begin{pmatrix}" in reference:
        return _matrix_equal(prediction, reference)
    return False  # ToRA's symbolic step never accepts in verl (see trl_bandpo.scoring.strict_grader)


def _different_intervals(prediction: str, reference: str) -> bool:
    """Whether both are bracketed (``(`` or ``[`` ... ``)`` or ``]``) with different brackets: ``[1,2]`` and ``[1,2)``
    are different intervals, although ToRA's test without brackets finds them equal (we do not take that step)."""
    bracketed = all(len(t) > 1 and t[0] in "([" and t[-1] in ")]" for t in (prediction, reference))
    return bracketed and (prediction[0], prediction[-1]) != (reference[0], reference[-1])


def _all_equal(predictions: list, references: list) -> bool:
    """Whether the parts are equal in pairs; every pair is compared first, so that an error in any part propagates
    (ToRA compares them in a list comprehension)."""
    verdicts = [tora_equal(p, r) for p, r in zip(predictions, references)]
    return all(verdicts)


def _format_interval(prediction: str) -> str:
    """sympy's printed intervals as brackets: ``Interval.Ropen(a, b)`` -> ``[a, b)``."""
    for name, left, right in (("Interval", "[", "]"), ("Interval.Ropen", "[", ")"), ("Interval.Lopen", "(", "]"),
                              ("Interval.open", "(", ")")):  # fmt: skip
        match = re.match(rf"^{re.escape(name)}\((.*)\)$", prediction)
        if match:
            return f"{left}{match.group(1)}{right}"
    return prediction


def _matrix_equal(prediction: str, reference: str) -> bool:
    """ToRA's matrix cases: a printed sympy ``Matrix(...)`` or a Python list against a ``pmatrix`` reference."""
    if prediction.startswith("Matrix"):
        try:
            rows = read_expression(prediction.removeprefix("Matrix"), implicit=False)
            nested = [row for row in rows if isinstance(row, list)] if isinstance(rows, list) else None
            if nested is None or (nested and (len(nested) != len(rows) or len({len(r) for r in nested}) != 1)):
                return False  # not a matrix
            items = [x for row in rows for x in (row if isinstance(row, list) else [row])]
            ref_items = reference.split()[1:-1:2]
            return len(items) == len(ref_items) and _all_equal(items, ref_items)
        except Exception:  # noqa: BLE001 - not a matrix
            return False
    if prediction.startswith("[") and prediction.endswith("]"):
        value = python_value(prediction)  # ValueError where prime_math's eval raises: the answer is wrong
        if isinstance(value, list):
            rows = reference.removeprefix(r"\\begin{pmatrix}").removeprefix(r"\begin{pmatrix}")
            rows = rows.removesuffix(r"\\end{pmatrix}").removesuffix(r"\end{pmatrix}").split("\\")
            rows = [row.split("&") if "&" in row else row for row in rows]
            try:
                return len(value) == len(rows) and _all_equal(value, rows)
            except Exception:  # noqa: BLE001 - as in ToRA: an error here means not equal
                return False
    return False


# --- The whole verdict, and the worker process ---


def grade(given: str, gold: str) -> bool:
    """``prime_math.compute_score``'s verdict for an extracted answer: PRM800K's check, else ToRA's ``math_equal``."""
    given, gold = same_matrix_brackets(given), same_matrix_brackets(gold)
    try:
        if prm_grade(given, gold):
            return True
    except Exception:  # noqa: BLE001 - prime_math would raise here; we score the answer wrong
        return False
    try:
        if "\\pi" in given or "\\pi" in gold:
            verdicts = [tora_equal(given, gold, pi=pi) for pi in (math.pi, 3.14)]  # an error in either: wrong
            return any(verdicts)
        return tora_equal(given, gold)
    except Exception:  # noqa: BLE001 - as prime_math: an error in math_equal means wrong
        return False


def worker_handler():
    """A worker's entry point (`trl_bandpo.scoring.worker_pool`): import sympy, then grade ``(given, gold)`` pairs."""
    grade("x", "2x")
    return lambda given, gold: grade(str(given), str(gold))

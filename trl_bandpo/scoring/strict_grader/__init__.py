r"""A conservative answer checker for evaluation, to the rules of verl's ``prime_math`` grader.

The DGPO paper (§5.1) reports accuracy with verl's ``prime_math`` checker
(``verl.utils.reward_score.prime_math``), not with the training reward. This package applies the same rules,
written anew: `strict_score` grades a completion (its last ``\boxed{}``, or without a box the text after its last
``answer is``), `grade_answer` an extracted answer.

**Extraction** (`extract_answer`), as ``prime_math.match_answer`` does: the completion is cut after its last
``answer:``, then after its last ``answer is``, then after its last ``answers are``, then before its last ``is
answer``, ``is the answer``, ``are answers``, ``are the answers`` (each case-insensitive, each on what the previous
cut left, stripped). When the rest has a box, the answer is the argument of its last outermost ``\boxed{..}`` /
``\fbox{..}`` (`trl_bandpo.scoring.answers.extract_boxed_answer`), stripped, with the box commands inside it dropped
(``\boxed{\boxed{2}+1}`` -> ``{2}+1``, never ``2``); without a box, the answer is the rest itself (``The answer is
12.`` -> ``12.``). Then the text before its last ``". "`` is kept, and for each marker ``"be "``, ``"is "``,
``"are "``, ``"="``, ``": "``, ``"get "`` (and their forms with a newline), in that order, the text after its last
(case-insensitive) occurrence (``\boxed{x = 5}`` -> ``5``, ``It is 5`` -> ``5``). An empty result is no answer:
wrong.

**Verdict** (`grade_answer`), as ``prime_math.compute_score`` decides after extraction:

1. PRM800K's check (``prime_math.grade_answer``): the two answers are equal when their Hendrycks MATH normal forms
   are equal (``\dfrac``, ``\left``/``\right``, degrees, ``\$``, ``\%``, a unit after ``\text{ ``, ``.5`` ->
   ``0.5``, a short ``k =`` prefix, ``\sqrt3``, ``\frac12``, spaces, ``0.5`` -> ``\frac{1}{2}``, ``3/4`` ->
   ``\frac{3}{4}``), or their PRM800K normal forms are equal (``\text{..}``, ``$``, ``%``, ``or``/``and`` as commas,
   ``million`` -> ``*10^6``, unit words such as ``cm``/``hours``/``feet``, degrees, one pair of outer braces, an
   integer-valued number written as an integer (exactly, at any size), LaTeX as plain text, mixed numbers ``7 3/4``
   -> ``7+3/4``, lower case, thousands separators of integers). Otherwise both are split into elements when they
   are a tuple or interval (same brackets and number of elements required), and each pair of elements must be: two
   fractions written identically (unreduced fractions are not accepted), or both integers or both not, and then
   equal for sympy (``simplify((gold) - (given)) == 0``), which is only tried when the expression has at most two
   distinct letters and no ``^{``, ``^(`` or exponent of two digits or more.
2. Otherwise, ToRA's ``math_equal`` (``prime_math.grader``), tried with pi = 3.14159... and with pi = 3.14 when
   either side contains ``\pi``: ``$5`` -> ``5``, ``50%`` -> ``50``, a base subscript dropped (``1010_2`` ->
   ``1010``, not converted; an answer whose text before ``_`` is no number is wrong), ``\pi`` replaced by the
   number and the result evaluated when it is plain arithmetic; then equal strings (ignoring case, or ignoring
   spaces); numbers equal within a relative tolerance of 1e-4 to the reference, the reference divided by 100 or
   the reference times 100 (so ``0.5`` matches ``50``, and ``6.28`` matches ``2\pi`` with pi = 3.14), where two
   integers must be equal exactly (or one 100 times the other), at any size; equal strings once brackets, braces
   and parentheses are dropped (``[1,2]`` and ``1,2``), a step not taken when both are bracketed with different
   brackets (``[1,2]`` and ``[1,2)``, ``(-\infty,2)`` and ``(-\infty,2]`` are different intervals); tuples and
   intervals with the same brackets compared element by element; comma-separated lists compared element by element
   (in order); a printed sympy ``Point(..)`` or ``Matrix(..)`` against a tuple or a ``pmatrix``.

A ``bmatrix`` is read as a ``pmatrix`` (the same matrix in other brackets) on both sides, before any rule.
Numbers are read exactly (`decimal.Decimal` from the same text ``float`` reads, `_normalize.integer_text`), never
through a float: two different integers are never equal, however long, and a number too large even for a
`decimal.Decimal` (``1e9999999999999999999``) is not the float ``inf`` that equals every other one.

Rules of ``prime_math`` that never accept anything in verl, which we therefore leave out: ToRA's last step,
``symbolic_equal`` (sympy equality of the two answers), enters verl's ``timeout_limit`` as a context manager;
``timeout_limit`` is a decorator factory, so each of those ``with`` statements raises TypeError, which the step
catches, and the step returns False. (Its LaTeX parser, sympy's ``parse_latex``, would also need antlr4 4.11; the
BandPO authors' environment pins 4.9.3.) A Python list against a ``pmatrix``, which ``prime_math`` hands to
``eval``, is evaluated here only when it is plain arithmetic; anything else is wrong, as when ``eval`` fails.

**Safety and time.** Model output is never executed: where ``prime_math`` calls sympy's ``parse_expr`` or Python's
``eval``, we parse with Python's `ast` and build the value from a whitelist (`_expressions`). The string stages run
in the calling process; the rest runs in a worker process (`trl_bandpo.scoring.worker_pool`) that is killed when the
answer takes longer than ``timeout_s``, and the answer is then wrong. Without POSIX pipes there are no workers:
`grade_answer` then raises RuntimeError for an answer that the string stages do not settle.

**Where we may differ from ``prime_math``:**

* Extraction: ``prime_math`` finds the box by searching for the last ``\boxed`` command (``\fbox`` only when
  there is none), which lands inside a nested box (``\boxed{\boxed{2}+1}`` would be graded as ``2``); we take the
  last outermost box, drop the box commands inside it, and take a later ``\fbox`` over an earlier ``\boxed``. We
  take ``\boxed 5`` (no braces) as ``5``. A last box that is empty or never closes (a cut-off completion) is no
  answer here; ``prime_math`` then grades the text around it as if there were no box.
* Numbers: ``prime_math`` reads them as floats, so integers of 17 digits or more can equal a neighbour, integers
  beyond 1e308 all equal each other (``inf``), and two integers within the relative tolerance (``123457`` and
  ``123456``) are equal; we compare two integers exactly. Intervals: ``prime_math``'s test with brackets dropped
  finds ``[1,2]`` equal to ``[1,2)``; we do not take it when both are bracketed with different brackets. Matrices:
  we read ``bmatrix`` as ``pmatrix``; ``prime_math`` compares their text.
* LaTeX to text: ``prime_math`` uses ``pylatexenc`` 2.10; we reproduce its output for the commands answers use
  (`_normalize.latex_to_text`) but not for malformed LaTeX (a ``\frac`` or ``\sqrt`` that is itself an argument,
  unbalanced braces, ``\\[``), where either text may fail to parse or compare differently.
* sympy parsing: our reader follows sympy's ``parse_expr`` with ``implicit_multiplication_application`` on what
  answers contain (``2x``, ``x(1)``, ``sqrt 2``, ``xy``, ``ln2`` -> ``l*n*2``, ``5!``), but names sympy knows other
  than the whitelist (``gamma``, ``S``, ``li``, ...) make the comparison fail instead of being used, and unusual
  inputs (``sqrt 2x``, hexadecimal, ``0.[3]``) may be read differently. Results may also differ with the sympy
  version (``simplify`` changes between releases; the BandPO authors used sympy 1.13.1).
* Time: ``prime_math`` gives each sympy comparison 10 s; we give the whole answer ``timeout_s`` (10 s by default).
  Both bounds only matter for answers that make sympy slow.
* Version: we follow verl's ``prime_math``. The BandPO authors' copy writes the ``pmatrix`` test with ``"\b"`` (a
  backspace character), so the matrix cases never fire there; elsewhere the two copies agree.
* Errors: where ``prime_math`` would raise (an exception in PRM800K's check propagates out of ``compute_score``),
  the answer is wrong here. Answers or gold answers longer than `MAX_CHARS` characters are wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...core.checks import Number
from ..answers import completion_text, contains_box, extract_boxed_answer, gold_alternatives, paired, unwrap_boxes
from ..worker_pool import WorkerPool
from . import _grade
from ._grade import quick_match

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "MAX_CHARS",
    "extract_answer",
    "grade_answer",
    "strict_score",
    "strict_scores",
]

DEFAULT_TIMEOUT_S = 10.0  # prime_math's limit for one sympy comparison
MAX_CHARS = 10_000  # longer answers (or gold answers) are wrong without any work
_ANSWER_MARKERS = ("answer:", "answer is", "answers are")  # case-insensitive, as all markers
_ANSWER_BEFORE_MARKERS = ("is answer", "is the answer", "are answers", "are the answers")
_MARKERS = ("be ", "is ", "are ", "=", ": ", "get ", "be\n", "is\n", "are\n", ":\n", "get\n")
# Workers run `_grade.worker_handler` (with `_grade`'s sibling modules, not trl_bandpo); idle ones stop at exit.
_POOL = WorkerPool(_grade.__file__, "worker_handler", name="strict-grader", max_idle=8)
_TIMEOUT = Number(low=0, low_open=True)


def extract_answer(completion: Any) -> str | None:
    r"""The answer ``prime_math`` grades in a completion (see the module), or None when there is none.

    Examples: ``extract_answer(r"... so \boxed{x = 5}.")`` is ``"5"``, ``extract_answer("The answer is 12.")`` is
    ``"12."``.
    """
    text = _cut(completion_text(completion), _ANSWER_MARKERS)  # after the last "answer:", then "answer is", ...
    for marker in _ANSWER_BEFORE_MARKERS:  # ... and before the last "is the answer"
        index = text.lower().rfind(marker)
        if index != -1:
            text = text[:index].strip()
    answer = text
    if contains_box(text):
        boxed = extract_boxed_answer(text)
        if boxed is None or not boxed.strip():  # an empty box, or one that never closes: no answer
            return None
        answer = unwrap_boxes(boxed.strip())
    if ". " in answer:
        answer = answer[: answer.lower().rfind(". ")].strip()
    return _cut(answer, _MARKERS) or None


def _cut(text: str, markers: Sequence[str]) -> str:
    """`text` after the last (case-insensitive) occurrence of each marker in turn, stripped."""
    for marker in markers:
        index = text.lower().rfind(marker)
        if index != -1:
            text = text[index + len(marker) :].strip()
    return text


def grade_answer(given: Any, gold: Any, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    r"""Whether the extracted answer `given` equals `gold` under ``prime_math``'s rules (see the module).

    Args:
        given: the model's answer, e.g. the inside of its box (``r"\frac{1}{2}"``); None is wrong.
        gold: the reference answer (converted with ``str`` when it is not a string, as ``prime_math`` does).
        timeout_s: wall-clock limit for the stages after the string comparison (default `DEFAULT_TIMEOUT_S`), run in
            a worker process; a slower answer is wrong.

    Returns:
        The verdict. Never raises on bad answers; raises ValueError for a bad `timeout_s`, and RuntimeError if no
        worker process can start (e.g. sympy is missing, or the system has no POSIX pipes).
    """
    timeout_s = _TIMEOUT(timeout_s, "timeout_s")
    if given is None or gold is None:
        return False
    given, gold = str(given), str(gold)
    if len(given) > MAX_CHARS or len(gold) > MAX_CHARS:
        return False
    try:
        if quick_match(given, gold):
            return True
    except Exception:  # noqa: BLE001 - a malformed answer is a wrong answer
        return False
    return _POOL.run([(given, gold)], timeout_s)[0] is True  # too slow, or crashed its worker: wrong


def strict_score(completion: Any, gold: Any, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    r"""Whether a completion's answer (`extract_answer`) is correct under ``prime_math``'s rules.

    Args:
        completion: the model's output, a string or a conversation (see `trl_bandpo.scoring.answers.completion_text`).
        gold: the reference answer: a string, a number, or a list of acceptable alternatives.
        timeout_s: wall-clock limit per comparison (see `grade_answer`).
    """
    timeout_s = _TIMEOUT(timeout_s, "timeout_s")
    answer = extract_answer(completion)
    if answer is None:
        return False
    return any(grade_answer(answer, text, timeout_s) for text in gold_alternatives(gold, as_written=True))


def strict_scores(
    completions: Sequence[Any], golds: Sequence[Any], timeout_s: float = DEFAULT_TIMEOUT_S
) -> list[bool]:
    """`strict_score` of each (completion, gold) pair; the two sequences must have the same length."""
    return [strict_score(completion, gold, timeout_s) for completion, gold in paired(completions, golds)]

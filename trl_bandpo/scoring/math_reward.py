r"""verl's ``math_reward`` rule (the ``"math_reward"`` scorer of `trl_bandpo.evaluation`; the BandPO authors' AMC 2023
validation, docs/evaluation.md): the last ``\boxed{}`` of a completion, compared with the gold answer as a string
after the Hendrycks MATH normalisation. No numeric or symbolic equivalence, only that normalisation's rewrites
(``0.5`` equals ``\frac{1}{2}``, ``0.25`` does not equal ``\frac{1}{4}``; ``12`` does not equal ``12.0``).

**The answer** (`last_boxed_answer`):

1. when the completion contains ``\boxed`` followed by a space anywhere, the answer is the text after the *last*
   ``\boxed `` up to the next ``$`` (or the end), whatever comes after it;
2. otherwise, from the last ``\boxed`` (or, when there is none, the last ``\fbox``), the text up to the ``}`` that
   brings the count of braces back to zero. No such ``}``: no answer. The span must read ``\boxed{...}``: an
   ``\fbox{..}`` (or ``\boxed`` not followed by ``{``) is found but then rejected, and scores wrong, as in verl;
3. no answer scores wrong.

**Equivalence** (`is_equivalent`): the two normal forms (`trl_bandpo.scoring.strict_grader.hendrycks.normalize`)
are equal strings; when either cannot be normalised (two ``\text{ ``, a ``\sqrt`` or ``\frac`` with nothing after
it), as in verl, the answer and the gold are compared exactly as written.

**Gold answers** are text: a number is written as `trl_bandpo.data` writes it (``27.0`` -> ``"27"``; verl scores
every answer to a float gold wrong, docs/evaluation.md), and a gold *string* that is an integer-valued decimal
(``"12.0"``, ``"-3.00"``) also accepts its integer form (``\boxed{12}``). The answer is not rewritten:
``\boxed{12.0}`` against the gold ``12`` scores wrong, as in verl. A list of golds is a list of alternatives.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from .answers import completion_text, gold_alternatives, paired
from .strict_grader.hendrycks import normalize as normalize_answer

_BOX = "\\boxed"
_SPACED_BOX = "\\boxed "
_INTEGRAL_DECIMAL = re.compile(r"(-?\d+)\.0+")


def last_boxed_answer(text: str) -> str | None:
    r"""The answer of a completion under verl's ``math_reward`` extraction (module docstring), or None."""
    if not isinstance(text, str):
        return None
    if _SPACED_BOX in text:
        return text.rsplit(_SPACED_BOX, 1)[1].split("$", 1)[0]
    start = text.rfind(_BOX)  # verl falls back on the last \fbox, whose span it then rejects: no answer either
    if start < 0 or not text.startswith(_BOX + "{", start):
        return None
    depth = 0
    for end in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth == 0 and text[end] == "}":
            return text[start + len(_BOX) + 1 : end]
    return None  # no brace brings the count back to zero


def is_equivalent(answer: str | None, gold: str | None) -> bool:
    """Whether `answer` and `gold` have the same normal form (`normalize_answer`); when either cannot be normalised,
    whether they are the same string. Two Nones are equivalent, one None is not (as in verl)."""
    if answer is None or gold is None:
        return answer is None and gold is None
    try:
        return normalize_answer(answer) == normalize_answer(gold)
    except ValueError:
        return answer == gold


def gold_strings(solution: Any) -> list[str]:
    """The gold strings a solution accepts (module docstring, "Gold answers")."""
    golds = []
    for gold in gold_alternatives(solution, as_written=True, max_chars=None):
        integral = _INTEGRAL_DECIMAL.fullmatch(gold.strip())
        golds += [gold] if integral is None else [gold, str(int(integral.group(1)))]
    return golds


def math_reward_correct(completion: Any, solution: Any) -> bool:
    """Whether a completion (string or conversation) answers `solution` under the rule. Never raises on bad input."""
    try:
        answer = last_boxed_answer(completion_text(completion))
        return answer is not None and any(is_equivalent(answer, gold) for gold in gold_strings(solution))
    except Exception:  # noqa: BLE001 - an unreadable completion or gold answer scores wrong
        return False


def score_math_reward_completions(completions: Sequence[Any], solutions: Sequence[Any]) -> list[bool]:
    """`math_reward_correct` of each (completion, solution) pair; the two sequences must have the same length."""
    return [math_reward_correct(c, s) for c, s in paired(completions, solutions)]

r"""verl's ``math_reward`` rule: the last ``\boxed{}`` of a completion, compared with the gold answer as a string after
the Hendrycks MATH normalisation. The BandPO authors' validation scored AMC 2023 with it (their AMC rows carry the
``data_source`` ``lighteval/MATH``, which verl scores with ``verl.utils.reward_score.math_reward``); the
``"math_reward"`` scorer of `trl_bandpo.evaluation` applies it. It is stricter than math-verify: no numeric or
symbolic equivalence, only the string rewrites below (``0.5`` equals ``\frac{1}{2}``, ``0.25`` does not equal
``\frac{1}{4}``; ``12`` does not equal ``12.0``).

**The answer** (`last_boxed_answer`):

1. when the completion contains ``\boxed`` followed by a space anywhere, the answer is the text after the *last*
   ``\boxed `` up to the next ``$`` (or the end), whatever comes after it;
2. otherwise, from the last ``\boxed`` (or, when there is none, the last ``\fbox``), the text up to the ``}`` that
   brings the count of braces back to zero. No such ``}``: no answer. The span must read ``\boxed{...}``: an
   ``\fbox{..}`` (or ``\boxed`` not followed by ``{``) is found but then rejected, and scores wrong, as in verl;
3. no answer scores wrong.

**The normal form** (`normalize_answer`: `trl_bandpo.scoring.strict_grader.hendrycks.normalize`, which lists its
steps), applied to the answer and the gold. Some strings cannot be normalised (two ``\text{ ``, a ``\sqrt`` or
``\frac`` with nothing after it): then, as in verl, the answer and the gold are compared exactly as written.

**Equivalence** (`is_equivalent`): the two normal forms are equal strings.

**Gold answers** are text (docs/evaluation.md, "Float gold answers and math_reward": verl, given a float gold such as
math-ai/amc23's ``27.0``, scores every answer wrong; we do not reproduce that). A number is written as
`trl_bandpo.data` writes it (``27.0`` -> ``"27"``), and a gold *string* that is an integer-valued decimal (``"12.0"``,
``"-3.00"``) also accepts its integer form (``\boxed{12}``). The answer is not rewritten: ``\boxed{12.0}`` against
the gold ``12`` scores wrong, as in verl. A list of golds is a list of alternatives.
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
    start = text.rfind(_BOX)
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    depth = 0
    for end in range(start, len(text)):
        if text[end] == "{":
            depth += 1
        elif text[end] == "}":
            depth -= 1
            if depth == 0:
                break
    else:  # no brace brings the count back to zero
        return None
    span = text[start : end + 1]
    if not span.startswith(_BOX + "{"):  # an \fbox, or \boxed not followed by its brace: verl rejects the span
        return None
    return span[len(_BOX) + 1 : -1]


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
    """The gold strings a solution accepts (module docstring, "Gold answers"): a string as written, plus the integer
    form of an integer-valued decimal; numbers written out; a list or tuple of alternatives; nothing for anything else
    (`trl_bandpo.scoring.answers.gold_alternatives`)."""
    golds = []
    for gold in gold_alternatives(solution, as_written=True, max_chars=None):
        integral = _INTEGRAL_DECIMAL.fullmatch(gold.strip())
        golds += [gold] if integral is None else [gold, str(int(integral.group(1)))]
    return golds


def math_reward_correct(completion: Any, solution: Any) -> bool:
    """Whether a completion (a string or a conversation, `trl_bandpo.scoring.answers.completion_text`) answers
    `solution` under verl's ``math_reward`` rule (module docstring). Never raises on bad input."""
    try:
        answer = last_boxed_answer(completion_text(completion))
        return answer is not None and any(is_equivalent(answer, gold) for gold in gold_strings(solution))
    except Exception:  # noqa: BLE001 - an unreadable completion or gold answer scores wrong
        return False


def score_math_reward_completions(completions: Sequence[Any], solutions: Sequence[Any]) -> list[bool]:
    """`math_reward_correct` of each (completion, solution) pair; the two sequences must have the same length."""
    return [math_reward_correct(c, s) for c, s in paired(completions, solutions)]

r"""Verifiable math rewards: `math_verify` on the last ``\boxed{...}`` answer of a completion.

The reward reads the *last* ``\boxed{...}`` (or ``\fbox{...}``, or ``\boxed 42``) of a completion (the outermost
one: ``\boxed{\boxed{2}+1}`` answers ``{2}+1``, i.e. 3), compares it with the dataset's ground-truth answer (column
``solution``) using `math_verify`, and returns one score per completion: +1/-1 for DGPO (`boxed_signed_reward`),
1/0 for accuracy (`boxed_accuracy_reward`), or any pair from `MathVerifyReward`.

`score_completions` settles what it can cheaply (`trl_bandpo.scoring.answers`) before anything reaches `math_verify`:
answers longer than `MAX_ANSWER_CHARS` or nested deeper than `MAX_BRACE_DEPTH` braces, and answers to a ground truth
longer than `MAX_GOLD_CHARS`, score wrong at once; answers and golds are written in plain characters (`answer_form`,
`gold_forms`: NFKC, vulgar fractions, digit groups, a gold's final period; docs/evaluation.md lists these rewrites
and what stays refused); a pure-string check (`canonical_text`) accepts identical answers without sympy, never what
`math_verify` would reject; the rest goes to `trl_bandpo.scoring.verifier` (worker processes, a wall-clock bound per
answer, verdicts cached per (gold, answer) pair). An equation between two different numbers (``\boxed{2=3}``) is
wrong whatever its right-hand side.

Time is bounded per answer (``timeout_s``) and per call (``call_timeout_s``, default `default_call_timeout`,
counted from the start of the call): once a call's budget is spent, the answers not yet verified score wrong (a
warning says how many). Nothing here executes model output.

`dapo_reward` (`DAPOReward`) is the other rule: the ``Answer: ...`` line compared as a normalised string, as verl's
``math_dapo`` reward that the BandPO authors trained with (`trl_bandpo.scoring.dapo`); pure Python, no boxes.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Sequence
from typing import Any

from ..core.checks import Integer, Number, is_number
from .answers import MAX_ANSWER_CHARS as MAX_ANSWER_CHARS  # re-exported: part of this module's interface
from .answers import MAX_BRACE_DEPTH as MAX_BRACE_DEPTH
from .answers import (
    MAX_GOLD_CHARS,
    answer_form,
    canonical_text,
    completion_text,
    extract_boxed_answer,
    gold_alternatives,
    gold_forms,
    is_admissible,
    is_oversized_gold,
    paired,
)
from .dapo import score_dapo_completions
from .verifier import DEFAULT_NUM_WORKERS, verify_pairs

_LOGGER = logging.getLogger(__name__)


_TIMEOUT = Number(low=0, low_open=True)
_NUM_WORKERS = Integer(low=1, optional=True)


def _check_call_timeout(call_timeout_s: Any) -> float | None:
    """None (the default budget), ``math.inf`` (no budget) or a finite number of seconds > 0."""
    if is_number(call_timeout_s) and call_timeout_s == math.inf:
        return math.inf
    return Number(low=0, low_open=True, optional=True)(call_timeout_s, "call_timeout_s")


def default_call_timeout(timeout_s: float, num_workers: int, num_pairs: int) -> float:
    """Default wall-time budget of one reward call: ``timeout_s * (4 + num_pairs / (8 * num_workers))``.

    Four per-answer timeouts, plus an eighth of one per (gold, answer) pair each worker has to verify. Honest answers
    take a few hundredths of a second each, so even a large evaluation batch is never cut off, while a batch of slow
    answers costs a bounded multiple of `timeout_s`: 64 of them with ``timeout_s=2`` on 2 workers cost 16 s, not
    their 64 timeouts in turn. Worker start-up (about a second, once) is not counted.
    """
    return timeout_s * (4 + num_pairs / (8 * num_workers))


def _set_scores(reward: Any, correct: Any, wrong: Any, name: Any) -> None:
    """Check and set a reward function's `correct` / `wrong` scores and its metric name (``__name__``)."""
    reward.correct, reward.wrong = Number()(correct, "correct"), Number()(wrong, "wrong")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ValueError(f"name must be a Python identifier (it names the logged metric), got {name!r}")
    reward.__name__ = reward.__qualname__ = name


def score_completions(
    completions: Sequence[Any],
    solutions: Sequence[Any],
    timeout_s: float = 2.0,
    num_workers: int | None = None,
    call_timeout_s: float | None = None,
) -> list[bool]:
    """Correctness of each completion's last boxed answer against its ground truth.

    Args:
        completions: N strings or conversations (see `completion_text`).
        solutions: N ground truths (string, number, or list of acceptable alternatives).
        timeout_s: wall-clock limit per verified answer; an answer that exceeds it is wrong, and it is not verified
            again in this call against another gold.
        num_workers: verifier processes used in parallel (default `DEFAULT_NUM_WORKERS`).
        call_timeout_s: wall-clock budget of the whole call (default `default_call_timeout` of the distinct (gold,
            answer) pairs the string check leaves to `math_verify`; ``math.inf`` for none). It counts from the start
            of the call, reading the answers and ground truths included; only the wait for a verifier process to
            start is not counted. When it runs out, every answer not yet verified is wrong, a warning says how many,
            and the call returns promptly.

    Returns:
        N booleans. Never raises on bad answers or ground truths: missing, malformed, oversized, unverifiable or too
        slow answers are False.
    """
    started = time.monotonic()
    timeout_s = _TIMEOUT(timeout_s, "timeout_s")
    num_workers = _NUM_WORKERS(num_workers, "num_workers") or DEFAULT_NUM_WORKERS
    call_timeout_s = _check_call_timeout(call_timeout_s)
    pairs = paired(completions, solutions)
    flags = [False] * len(completions)
    pending: list[tuple[int, list[tuple[str, str]]]] = []  # (row, [(gold, answer) for each gold alternative])
    golds_of: dict[str, list[tuple[str, str]]] = {}  # per string ground truth: [(gold, its canonical_text)]
    oversized = 0
    for row, (completion, solution) in enumerate(pairs):
        try:
            answer = extract_boxed_answer(completion_text(completion))
            if is_oversized_gold(solution):
                oversized += 1
            cached = isinstance(solution, str) and len(solution) <= MAX_GOLD_CHARS
            if cached and solution in golds_of:  # the completions of a group share their gold: read it once
                golds = golds_of[solution]
            else:
                golds = [
                    (gold, canonical_text(gold))
                    for alternative in gold_alternatives(solution)
                    for gold in gold_forms(alternative)
                ]
                if cached:
                    golds_of[solution] = golds
            if not golds or not is_admissible(answer):
                continue
            answer = answer_form(answer)  # plain characters, digit groups joined: what math_verify is given
            if not is_admissible(answer):  # what was only invisible characters, or grew past the caps
                continue
            canonical = canonical_text(answer)
            if any(gold_canonical == canonical for _, gold_canonical in golds):
                flags[row] = True
            else:
                pending.append((row, [(gold, answer) for gold, _ in golds]))
        except Exception:  # noqa: BLE001 - an unreadable completion or ground truth scores wrong
            _LOGGER.debug("row %d could not be read; it scores wrong", row, exc_info=True)
    if oversized:
        _LOGGER.warning(
            "math_verify reward: %d of %d rows have a ground truth longer than %d characters, which is not read "
            "(their answers score wrong unless another alternative matches)", oversized, len(flags), MAX_GOLD_CHARS,
        )  # fmt: skip
    all_pairs = [pair for _, pairs in pending for pair in pairs]
    if call_timeout_s is None:
        call_timeout_s = default_call_timeout(timeout_s, num_workers, len(set(all_pairs)))
    left_s = call_timeout_s - (time.monotonic() - started)  # reading the answers counts against the budget
    if all_pairs and left_s > 0:
        verdicts = verify_pairs(all_pairs, timeout_s, num_workers, left_s)
    else:  # nothing to verify, or the budget went on reading: nothing is verified
        verdicts = [None] * len(all_pairs)
    start, cut_off = 0, 0
    for row, pairs in pending:  # each row takes the verdicts of its gold alternatives, in order
        row_verdicts = verdicts[start : start + len(pairs)]
        flags[row] = any(verdict is True for verdict in row_verdicts)
        cut_off += not flags[row] and None in row_verdicts
        start += len(pairs)
    if cut_off:
        _LOGGER.warning(
            "math_verify reward: the call's budget of %.1f s ran out; %d of %d answers were not verified and score "
            "wrong (raise call_timeout_s, or timeout_s, to verify them)", call_timeout_s, cut_off, len(flags),
        )  # fmt: skip
    return flags


def is_equivalent(gold: Any, answer: str, timeout_s: float = 2.0, call_timeout_s: float | None = None) -> bool:
    r"""Whether the LaTeX `answer` (the inside of a box, e.g. ``\frac{1}{2}``) equals the ground truth `gold`."""
    return score_completions([f"\\boxed{{{answer}}}"], [gold], timeout_s=timeout_s, call_timeout_s=call_timeout_s)[0]


class MathVerifyReward:
    """A TRL reward function: `correct` when the last boxed answer matches ``solution``, else `wrong`.

    Call as ``reward(completions, solution, **kwargs) -> list[float]`` (N completions, N ground truths); TRL passes
    the dataset's ``solution`` column and extra keyword arguments, which are ignored. ``__name__`` names the metric.
    Each call is bounded per answer (`timeout_s`) and as a whole (`call_timeout_s`, default `default_call_timeout`):
    see `score_completions`. Instances are picklable (TRL may ship reward functions to other processes).

    Args:
        correct / wrong: the score of a correct answer, and of a wrong, missing or unverifiable one (-1.0 as in DGPO;
            0.0 for accuracy).
        timeout_s: wall-clock limit per answer, enforced by killing the verifier process (works in any thread).
        name: ``__name__``, which TRL uses for the metric ``rewards/<name>/mean``.
        num_workers: verifier processes used in parallel (default `DEFAULT_NUM_WORKERS`).
        call_timeout_s: wall-clock budget of one call (default `default_call_timeout`; ``math.inf`` for none).
    """

    def __init__(
        self,
        correct: float = 1.0,
        wrong: float = -1.0,
        timeout_s: float = 2.0,
        name: str = "math_verify_reward",
        num_workers: int | None = None,
        call_timeout_s: float | None = None,
    ) -> None:
        _set_scores(self, correct, wrong, name)
        self.timeout_s = _TIMEOUT(timeout_s, "timeout_s")
        self.num_workers = _NUM_WORKERS(num_workers, "num_workers")
        self.call_timeout_s = _check_call_timeout(call_timeout_s)

    def __call__(
        self, completions: Sequence[Any], solution: Sequence[Any] | None = None, **kwargs: Any
    ) -> list[float]:
        if solution is None:
            raise ValueError(
                f"{self.__name__} needs the ground-truth answers: give the dataset a `solution` column "
                "(trl_bandpo.data loaders do) or pass solution=[...]"
            )
        if isinstance(solution, (str, bytes)):
            raise ValueError("solution must be a list with one ground truth per completion, got a single string")
        flags = score_completions(
            completions, solution, self.timeout_s, num_workers=self.num_workers, call_timeout_s=self.call_timeout_s
        )
        return [self.correct if flag else self.wrong for flag in flags]

    def __repr__(self) -> str:
        return (
            f"MathVerifyReward(correct={self.correct}, wrong={self.wrong}, timeout_s={self.timeout_s}, "
            f"call_timeout_s={self.call_timeout_s}, name={self.__name__!r})"
        )


boxed_accuracy_reward = MathVerifyReward(correct=1.0, wrong=0.0, name="boxed_accuracy_reward")
boxed_signed_reward = MathVerifyReward(correct=1.0, wrong=-1.0, name="boxed_signed_reward")


class DAPOReward:
    """A TRL reward function scoring the ``Answer: ...`` line as verl's ``math_dapo`` does (`trl_bandpo.scoring.dapo`).

    Call as ``reward(completions, solution, **kwargs) -> list[float]`` (N completions, strings or conversations, and
    N gold answers); extra keyword arguments are ignored. `correct` when the normalised answer equals the normalised
    gold answer, else `wrong` (a missing ``Answer:`` line is wrong). Pure Python: no worker processes, no timeouts
    needed. Instances are picklable; ``__name__`` names the logged metric.
    """

    def __init__(self, correct: float = 1.0, wrong: float = -1.0, name: str = "dapo_reward") -> None:
        _set_scores(self, correct, wrong, name)

    def __call__(
        self, completions: Sequence[Any], solution: Sequence[Any] | None = None, **kwargs: Any
    ) -> list[float]:
        if solution is None:
            raise ValueError(f"{self.__name__} needs the gold answers: a `solution` column or solution=[...]")
        if isinstance(solution, (str, bytes)):
            raise ValueError("solution must be a list with one gold answer per completion, got a single string")
        flags = score_dapo_completions(completions, solution)
        return [self.correct if flag else self.wrong for flag in flags]

    def __repr__(self) -> str:
        return f"DAPOReward(correct={self.correct}, wrong={self.wrong}, name={self.__name__!r})"


dapo_reward = DAPOReward()

#: A number as written in a reply: digits with an optional sign, decimal part or digit groups ("1,000", "2.5").
_NUMBER = re.compile(r"-?\d+(?:[.,]\d+)*")


class LastNumberReward:
    """A TRL reward function for short numeric answers: `correct` when the last number of the reply (a sign, digits,
    decimal point and digit groups included: "12.5" is not 5) is the gold answer written the same way, else `wrong`.

    Call as ``reward(completions, solution, **kwargs) -> list[float]``; the gold answers may also come as ``answer``
    (a dataset with that column). Pure Python, picklable; ``__name__`` names the logged metric.
    """

    def __init__(self, correct: float = 1.0, wrong: float = 0.0, name: str = "last_number_reward") -> None:
        _set_scores(self, correct, wrong, name)

    def __call__(self, completions: Sequence[Any], solution: Sequence[Any] | None = None,
                 answer: Sequence[Any] | None = None, **kwargs: Any) -> list[float]:  # fmt: skip
        gold = solution if solution is not None else answer
        if gold is None or isinstance(gold, (str, bytes)):
            raise ValueError(f"{self.__name__} needs one gold answer per completion: a `solution` or `answer` column")
        last = [(_NUMBER.findall(completion_text(c)) or [None])[-1] for c in completions]
        return [self.correct if number == str(g).strip() else self.wrong for number, g in zip(last, gold)]

    def __repr__(self) -> str:
        return f"LastNumberReward(correct={self.correct}, wrong={self.wrong}, name={self.__name__!r})"

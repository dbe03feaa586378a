r"""Verifiable math rewards: `math_verify` on the last outermost ``\boxed{...}`` answer of a completion.

`MathVerifyReward` scores it +1/-1 for DGPO (`boxed_signed_reward`), 1/0 for accuracy (`boxed_accuracy_reward`).
`score_completions` settles what it can cheaply (`trl_bandpo.scoring.answers`: caps, plain characters, a pure-string
check that never accepts what `math_verify` would reject) and sends the rest to `trl_bandpo.scoring.verifier`. An
equation between two different numbers (``\boxed{2=3}``) is wrong whatever its right-hand side. Time is bounded per
answer and per call; nothing here executes model output. `DAPOReward` scores the ``Answer: ...`` line as verl's
``math_dapo`` (`trl_bandpo.scoring.dapo`), `LastNumberReward` the reply's last number.
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
    answer_form,
    canonical_text,
    completion_text,
    extract_boxed_answer,
    gold_alternatives,
    gold_forms,
    is_admissible,
    is_oversized_gold,
    paired,
    warn_oversized_golds,
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
    flags = [False] * len(completions)
    pending: list[tuple[int, list[tuple[str, str]]]] = []  # (row, [(gold, answer) for each gold alternative])
    golds_of: dict[Any, list[tuple[str, str]]] = {}  # per string ground truth: [(gold, its canonical_text)]
    oversized = 0
    for row, (completion, solution) in enumerate(paired(completions, solutions)):
        try:
            oversized += is_oversized_gold(solution)
            key = solution if isinstance(solution, str) else None  # a group's completions share their gold: read once
            golds = golds_of.get(key) if key is not None else None
            if golds is None:
                golds = [(g, canonical_text(g)) for alt in gold_alternatives(solution) for g in gold_forms(alt)]
                if key is not None:
                    golds_of[key] = golds
            answer = extract_boxed_answer(completion_text(completion))
            # plain characters, digit groups joined (what math_verify is given), and still within the caps
            if not golds or not is_admissible(answer) or not is_admissible(answer := answer_form(answer)):
                continue
            if canonical_text(answer) in {canonical for _, canonical in golds}:
                flags[row] = True
            else:
                pending.append((row, [(gold, answer) for gold, _ in golds]))
        except Exception:  # noqa: BLE001 - an unreadable completion or ground truth scores wrong
            _LOGGER.debug("row %d could not be read; it scores wrong", row, exc_info=True)
    warn_oversized_golds(_LOGGER, "math_verify reward", oversized, len(flags))
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


class _Reward:
    """A TRL reward function: ``reward(completions, solution, **kwargs) -> list[float]`` (N completions, strings or
    conversations, and N gold answers; other keyword arguments are ignored), `correct` for a right answer, else
    `wrong`. ``__name__`` names the logged metric ``rewards/<name>/mean``. Instances are picklable."""

    def __init__(self, correct: float, wrong: float, name: str) -> None:
        self.correct, self.wrong = Number()(correct, "correct"), Number()(wrong, "wrong")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ValueError(f"name must be a Python identifier (it names the logged metric), got {name!r}")
        self.__name__ = self.__qualname__ = name

    def __call__(
        self, completions: Sequence[Any], solution: Sequence[Any] | None = None, **kwargs: Any
    ) -> list[float]:
        if solution is None or isinstance(solution, (str, bytes)):
            raise ValueError(
                f"{self.__name__} needs one gold answer per completion: a `solution` column (trl_bandpo.data loaders "
                "give one) or solution=[...], a list, not a single string"
            )
        return [self.correct if flag else self.wrong for flag in self._score(completions, solution)]

    def __repr__(self) -> str:
        fields = ", ".join(f"{key}={value!r}" for key, value in vars(self).items() if not key.startswith("_"))
        return f"{type(self).__name__}({fields}, name={self.__name__!r})"


class MathVerifyReward(_Reward):
    """`correct` when the last boxed answer matches ``solution`` under `math_verify` (`score_completions`).

    Args:
        correct / wrong: the score of a correct answer, and of a wrong, missing or unverifiable one (-1.0 as in DGPO;
            0.0 for accuracy).
        timeout_s: wall-clock limit per answer, enforced by killing the verifier process (works in any thread).
        name: ``__name__``, the metric's name.
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
        super().__init__(correct, wrong, name)
        self.timeout_s = _TIMEOUT(timeout_s, "timeout_s")
        self.num_workers = _NUM_WORKERS(num_workers, "num_workers")
        self.call_timeout_s = _check_call_timeout(call_timeout_s)

    def _score(self, completions: Sequence[Any], solution: Sequence[Any]) -> list[bool]:
        return score_completions(completions, solution, self.timeout_s, self.num_workers, self.call_timeout_s)


boxed_accuracy_reward = MathVerifyReward(correct=1.0, wrong=0.0, name="boxed_accuracy_reward")
boxed_signed_reward = MathVerifyReward(correct=1.0, wrong=-1.0, name="boxed_signed_reward")


class DAPOReward(_Reward):
    """`correct` when the ``Answer: ...`` line matches ``solution`` as verl's ``math_dapo`` decides
    (`trl_bandpo.scoring.dapo`; a missing line is wrong). Pure Python: no worker processes, no timeouts."""

    def __init__(self, correct: float = 1.0, wrong: float = -1.0, name: str = "dapo_reward") -> None:
        super().__init__(correct, wrong, name)

    _score = staticmethod(score_dapo_completions)


dapo_reward = DAPOReward()

#: A number as written in a reply: digits with an optional sign, decimal part or digit groups ("1,000", "2.5").
_NUMBER = re.compile(r"-?\d+(?:[.,]\d+)*")


class LastNumberReward(_Reward):
    """`correct` when the last number of the reply (a sign, digits, decimal point and digit groups included: "12.5" is
    not 5) is the gold answer written the same way. The gold answers may also come as ``answer`` (a dataset column)."""

    def __init__(self, correct: float = 1.0, wrong: float = 0.0, name: str = "last_number_reward") -> None:
        super().__init__(correct, wrong, name)

    def __call__(
        self, completions: Sequence[Any], solution: Any = None, answer: Any = None, **kwargs: Any
    ) -> list[float]:
        return super().__call__(completions, solution if solution is not None else answer)

    @staticmethod
    def _score(completions: Sequence[Any], solution: Sequence[Any]) -> list[bool]:
        pairs = paired(completions, solution)  # one gold answer per completion
        return [(_NUMBER.findall(completion_text(c)) or [None])[-1] == str(gold).strip() for c, gold in pairs]

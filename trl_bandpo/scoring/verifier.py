r"""The `math_verify` comparison of two LaTeX answers, run in worker processes with a wall-clock bound.

`verify_pairs` returns a verdict for each ``(gold, answer)`` pair, cached per pair, each computed by `math_verify`
within a per-answer time limit, and all of them within a per-call budget.

Why worker processes: `math_verify`'s own timeouts use ``signal.alarm`` (main thread only, whole seconds) and cannot
interrupt C code (``\boxed{9^{9^{9^{9}}}}`` makes sympy build an integer of hundreds of millions of digits), so every
comparison runs in a `trl_bandpo.scoring.worker_pool.WorkerPool`, which kills a worker that misses its deadline; an
answer that times out scores wrong (without POSIX pipes, `verify_pairs` raises RuntimeError rather than run unbounded).
A worker loads this file by path, without `trl_bandpo` (`math_verify` on first use). No model output is executed:
answers go only to `math_verify.parse` with the LaTeX extractor.
"""

from __future__ import annotations

import functools
import math
import os
import threading
from collections import OrderedDict

from .worker_pool import WORKER_MEMORY_BYTES, WORKER_START_TIMEOUT_S, Failure, WorkerPool

__all__ = ["DEFAULT_NUM_WORKERS", "WORKER_MEMORY_BYTES", "WORKER_START_TIMEOUT_S", "verify_pairs"]

DEFAULT_NUM_WORKERS = max(1, min(4, os.cpu_count() or 1))
_VERDICT_CACHE_SIZE = 65536


# --- The math_verify comparison itself (runs inside a worker process) ---


@functools.lru_cache(maxsize=4096)
def _parse_answer(latex: str, timeout_s: int | None) -> list:
    """`math_verify.parse` of one answer with the LaTeX extractor only (no Python-expression parser)."""
    from math_verify import LatexExtractionConfig, parse

    config = [LatexExtractionConfig(boxed_match_priority=0)]
    return parse("\\boxed{" + latex + "}", extraction_config=config, parsing_timeout=timeout_s)


def _math_verify_equal(gold: str, answer: str, timeout_s: int | None = None) -> bool:
    """Whether `answer` is mathematically equal to `gold` according to `math_verify` (False on any error).

    One rule comes first: an answer that states an equation between two different numbers (``2=3``, ``x=2=3``,
    ``\\pi=3``) is wrong, whatever its right-hand side; `math_verify` alone compares only that side with the gold.
    """
    from math_verify import verify

    try:
        gold_parsed = _parse_answer(gold, timeout_s)
        answer_parsed = _parse_answer(answer, timeout_s)
        if not gold_parsed or not answer_parsed:
            return False
        if _states_a_false_equation(answer_parsed[0], timeout_s):
            return False
        return bool(verify(gold_parsed, answer_parsed, timeout_seconds=timeout_s))
    except Exception:  # noqa: BLE001 - a malformed answer is a wrong answer
        return False


def _states_a_false_equation(parsed: object, timeout_s: int | None) -> bool:
    """Whether a parsed answer contains an equation whose two sides are numbers (sympy's ``is_number``) that differ.

    ``2=3`` and ``\\frac{1}{0}=3`` do; ``x=3`` and ``f(2)=3`` (a variable or an unknown function on one side),
    ``1+2=3`` and ``\\frac{6}{2}=3`` do not.
    Chains (``x=2=3``, parsed as ``Eq(2, 3) & Eq(x, 2)``) and sets of equations are searched for every equation.
    """
    import sympy
    from math_verify import verify

    if not isinstance(parsed, sympy.Basic):
        return False
    for equation in parsed.atoms(sympy.Equality):
        sides = equation.lhs, equation.rhs
        if all(isinstance(side, sympy.Expr) and side.is_number for side in sides):  # no symbols, no f(2)
            if not verify(sides[1], sides[0], timeout_seconds=timeout_s):
                return True
    return False


def _worker_handler():
    """A worker's entry point (`WorkerPool`): import `math_verify`, build its LaTeX grammar, return the comparison."""
    import logging

    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    _math_verify_equal("1", "1")
    return _math_verify_equal


# --- The shared pool and the verdict cache ---

_POOL = WorkerPool(__file__, "_worker_handler", name="math_verify", max_idle=16)

_VERDICTS: OrderedDict[tuple[str, str], bool] = OrderedDict()
_VERDICTS_LOCK = threading.Lock()


def verify_pairs(
    pairs: list[tuple[str, str]], timeout_s: float, num_workers: int, call_timeout_s: float = math.inf
) -> list[bool | None]:
    """Verdicts for (gold, answer) pairs: cached ones, then the rest through the worker pool.

    Args:
        pairs: ``(gold, answer)`` LaTeX strings (the insides of boxes); repeated pairs are verified once.
        timeout_s: wall-clock limit per verified pair; a pair that exceeds it is not equal, and its answer is not
            tried again in this call with another gold.
        num_workers: verifier processes used in parallel.
        call_timeout_s: wall-clock budget of the whole call, counted from the first ready worker.

    Returns:
        One verdict per pair, in order: True or False, or None for a pair left unverified when the budget ran out
        (not cached: a later call verifies it; neither is a False for an answer that timed out with another gold).
        Never raises on bad answers: malformed or too slow answers are False.
    """
    with _VERDICTS_LOCK:
        verdicts: dict[tuple[str, str], bool | None] = {pair: _VERDICTS[pair] for pair in pairs if pair in _VERDICTS}
    todo = list(dict.fromkeys(pair for pair in pairs if pair not in verdicts))
    if todo:  # a timed-out answer is wrong with every gold (SKIPPED: not tried, not cached)
        fresh = _POOL.run(todo, timeout_s, num_workers, call_timeout_s, groups=[answer for _, answer in todo])
        with _VERDICTS_LOCK:
            for pair, outcome in zip(todo, fresh, strict=True):
                verdicts[pair] = None if outcome is Failure.OUT_OF_BUDGET else outcome is True
                if outcome not in (Failure.OUT_OF_BUDGET, Failure.SKIPPED):
                    _VERDICTS[pair] = verdicts[pair]
            while len(_VERDICTS) > _VERDICT_CACHE_SIZE:
                _VERDICTS.popitem(last=False)
    return [verdicts[pair] for pair in pairs]

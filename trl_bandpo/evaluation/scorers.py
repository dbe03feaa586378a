r"""Answer checkers by name (`SCORERS`; docs/evaluation.md compares them with verl's), and the resolution of a
``scorer`` setting to one checker per benchmark.

``"math_verify"`` is the training reward's rule (`trl_bandpo.scoring.rewards`), ``"dapo"`` verl's ``math_dapo``
(`trl_bandpo.scoring.dapo`), ``"strict"`` verl's ``prime_math`` (`trl_bandpo.scoring.strict_grader`) and
``"math_reward"`` verl's ``math_reward`` (`trl_bandpo.scoring.math_reward`). A ``scorer`` setting is one name (every
benchmark) or a mapping benchmark -> name; `check_scorer` checks it before anything is loaded, and `scorers_for`
gives each loaded benchmark its checker.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from ..scoring.dapo import score_dapo_completions
from ..scoring.math_reward import score_math_reward_completions
from ..scoring.rewards import score_completions
from ..scoring.strict_grader import strict_scores


class Scorer(NamedTuple):
    """A checker: ``function(completions, solutions[, timeout_s=...]) -> list[bool]``, its default wall-clock limit
    per answer (None: pure string work, it takes none) and one line on what it accepts."""

    function: Callable[..., list[bool]]
    timeout_s: float | None
    help: str


#: Scorer name -> `Scorer`.
SCORERS: dict[str, Scorer] = {
    "math_verify": Scorer(score_completions, 2.0,
                          "last \\boxed{} answer, math_verify equivalence (the training reward's rule)"),
    "dapo": Scorer(score_dapo_completions, None,
                   "last 'Answer: ...' line, normalised string equality (verl math_dapo)"),
    "strict": Scorer(strict_scores, 10.0, "last \\boxed{} answer, conservative prime_math rules (verl prime_math)"),
    "math_reward": Scorer(score_math_reward_completions, None,
                          "last \\boxed{} answer, Hendrycks MATH normal form, exact equality (verl math_reward)"),
}  # fmt: skip

#: Default wall-clock limit per answer of each scorer (seconds; None for the pure string scorers).
DEFAULT_TIMEOUTS: dict[str, float | None] = {name: scorer.timeout_s for name, scorer in SCORERS.items()}


def _benchmark_key(name: str) -> str:
    """The registry name of `name` when it is one (aliases such as ``aime24`` included), else `name` itself."""
    from ..data import resolve_dataset_name

    return resolve_dataset_name(name) or name


def check_scorer(scorer: Any, argument: str = "scorer") -> str | dict[str, str]:
    """Return `scorer` (a name of `SCORERS`, or a non-empty mapping benchmark -> name) with mapping keys resolved to
    registry names; ValueError naming `argument`, the value and the allowed names otherwise.

    A mapping may hold the key ``"*"``: the scorer of every benchmark it does not name.
    """
    allowed = list(SCORERS)
    if isinstance(scorer, str) and scorer in SCORERS:
        return scorer
    if isinstance(scorer, str) or not isinstance(scorer, Mapping) or not scorer:
        raise ValueError(
            f"{argument} must be one of {allowed} or a non-empty mapping benchmark -> one of them, got {scorer!r}"
        )
    resolved: dict[str, str] = {}
    for benchmark, name in scorer.items():
        if not isinstance(benchmark, str) or not benchmark.strip():
            raise ValueError(f"{argument}: every key must be a benchmark name, got {benchmark!r}")
        if not isinstance(name, str) or name not in SCORERS:
            raise ValueError(f"{argument}[{benchmark!r}] must be one of {allowed}, got {name!r}")
        resolved[benchmark if benchmark == "*" else _benchmark_key(benchmark.strip())] = name
    return resolved


def parse_scorer(scorer: Any) -> Any:
    """A scorer setting written as text: ``"bench=name,bench2=name2"`` becomes a mapping (a recipe field or a flag
    can hold it); anything else is returned as it is (check it with `check_scorer`)."""
    if isinstance(scorer, str) and "=" in scorer:
        pairs = [part.partition("=") for part in scorer.split(",") if part.strip()]
        return {bench.strip(): name.strip() for bench, _, name in pairs}
    return scorer


def scorers_for(
    scorer: str | Mapping[str, str], benchmarks: Sequence[str], argument: str = "scorer"
) -> dict[str, str]:
    """The scorer name of each benchmark in `benchmarks` under the setting `scorer` (see `check_scorer`); ValueError
    for a benchmark that a mapping names neither by itself nor by ``"*"``."""
    scorer = check_scorer(scorer, argument)
    if isinstance(scorer, str):
        return dict.fromkeys(benchmarks, scorer)
    chosen = {}
    for name in benchmarks:
        found = scorer.get(name, scorer.get(_benchmark_key(name), scorer.get("*")))
        if found is None:
            raise ValueError(
                f"{argument} has no scorer for benchmark {name!r} (it names {sorted(scorer)}): add {name}=NAME with "
                f"NAME one of {list(SCORERS)}, or give one scorer name for every benchmark"
            )
        chosen[name] = found
    return chosen


def score(
    name: str, completions: Sequence[Any], solutions: Sequence[Any], timeout_s: float | None = None
) -> list[bool]:
    """Correctness of each completion under scorer `name` (a name of `SCORERS`) against its solution. `timeout_s` is
    the limit per answer of "math_verify" and "strict" (None: `DEFAULT_TIMEOUTS`); the others ignore it."""
    scorer = SCORERS[check_scorer(name)]
    limit = {} if scorer.timeout_s is None else {"timeout_s": scorer.timeout_s if timeout_s is None else timeout_s}
    return list(scorer.function(completions, solutions, **limit))

r"""mean@n and two pass@k estimators from per-sample correctness, and the Markdown tables of results.

``mean@n`` is the mean accuracy over all samples; ``pass@k`` (`PASS_LABEL`) the unbiased estimator
``1 - C(n-c, k) / C(n, k)`` (k samples drawn without replacement; Chen et al., 2021); ``best@k`` (`BEST_LABEL`)
verl's bootstrap ``best@k/mean`` in closed form, ``1 - (1 - c/n)^k`` (k samples drawn with replacement). The DGPO
paper's Pass@32 is best@k (its reported values show it); the BandPO paper's pass@32 is inferred to be, from the
authors' verl pipeline, which logs no other. docs/evaluation.md compares the two.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from ..core.checks import Integer

#: How results label the two estimators.
PASS_LABEL = "pass@k (unbiased)"
BEST_LABEL = "best@k (bootstrap, as verl logs)"


_COUNT, _POSITIVE = Integer(low=0, any_size=True), Integer(low=1, any_size=True)


def _check_nck(n: int, c: int, k: int) -> None:
    _POSITIVE(n, "n")
    _COUNT(c, "c")
    _POSITIVE(k, "k")
    if c > n:
        raise ValueError(f"c must be <= n, got c={c}, n={n}")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from `n` samples of which `c` are correct: ``1 - C(n-c, k) / C(n, k)``.

    Computed as ``1 - prod_{i=n-c+1}^{n} (1 - k/i)`` (no large binomials, stable for n in the thousands).
    Requires ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    _check_nck(n, c, k)
    if k > n:
        raise ValueError(f"k must be <= n (pass@k needs at least k samples), got k={k}, n={n}")
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    # C(n-c, k)/C(n, k) = prod_{j=0}^{k-1} (n-c-j)/(n-j) = prod_{i=n-c+1}^{n} (i-k)/i
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def best_at_k(n: int, c: int, k: int) -> float:
    """verl's bootstrap best@k of 0/1 scores in closed form: ``1 - (1 - c/n)^k``.

    The expected value, over resamples of `k` samples drawn WITH replacement from `n` samples of which `c` are
    correct, of "at least one resampled sample is correct" (verl's ``best@k/mean``, which averages 1,000 seeded
    resamples instead). `k` may exceed `n`. Requires ``0 <= c <= n`` and ``k >= 1``; any sizes (computed as
    ``-expm1(k * log1p(-c/n))``: no overflow for a `k` beyond the float range, no cancellation when c/n is tiny).
    """
    _check_nck(n, c, k)
    if c in (0, n):
        return float(c == n)
    # k = 2**1023 already gives 1.0 unless c/n < 1e-306
    return -math.expm1(float(min(k, 2**1023)) * math.log1p(-c / n))


def bootstrap_best_at_k(n: int, c: int, k: int, resamples: int = 1000, seed: int = 42) -> float:
    """verl's estimate of `best_at_k`: the mean, over `resamples` seeded resamples of `k` samples drawn with
    replacement from the n (c correct, n - c wrong), of the best score. For checks; `best_at_k` is exact."""
    import random

    _check_nck(n, c, k)
    _POSITIVE(resamples, "resamples")
    rng = random.Random(seed)
    return sum(any(rng.randrange(n) < c for _ in range(k)) for _ in range(resamples)) / resamples


def mean_accuracy(n: int, c: int) -> float:
    """Fraction of correct samples, ``c / n`` (one problem's mean@n)."""
    _check_nck(n, c, 1)
    return c / n


def default_ks(num_samples: int) -> tuple[int, ...]:
    """Powers of two up to `num_samples`, plus `num_samples` itself: 32 -> (1, 2, 4, 8, 16, 32)."""
    num_samples = _POSITIVE(num_samples, "num_samples")
    powers = tuple(1 << p for p in range(num_samples.bit_length()))  # 1, 2, 4, ... up to num_samples
    return powers if powers[-1] == num_samples else (*powers, num_samples)


def summarize_correctness(correct: Sequence[Sequence[bool]], ks: Sequence[int]) -> dict[str, Any]:
    """Metrics of one benchmark from per-problem sample correctness.

    Args:
        correct: P problems x n samples of booleans (every problem must have the same n).
        ks: the k of each pass@k (each <= n).

    Returns:
        ``{"problems": P, "samples_per_problem": n, "mean@n": float, "pass@k": float for k in ks,
        "best@k": float for k in ks, "correct_per_problem": [c_1, ..., c_P]}``: ``pass@k`` is the unbiased
        estimator (`pass_at_k`), ``best@k`` verl's bootstrap estimate in closed form (`best_at_k`); metrics are
        averaged over problems and lie in [0, 1].
    """
    if len(correct) == 0:
        raise ValueError("correct must hold at least one problem")
    n = len(correct[0])
    if any(len(samples) != n for samples in correct):
        raise ValueError(f"every problem needs the same number of samples, got {sorted({len(s) for s in correct})}")
    _POSITIVE(n, "samples per problem")
    for k in ks:
        if _POSITIVE(k, "k") > n:
            raise ValueError(f"ks must be <= the number of samples per problem ({n}), got k={k}")
    counts = [sum(bool(x) for x in samples) for samples in correct]
    averages = average_metrics(counts, n, ks)
    return {"problems": len(correct), "samples_per_problem": n, **averages, "correct_per_problem": counts}


def average_metrics(counts: Sequence[int], n: int, ks: Sequence[int]) -> dict[str, float]:
    """``mean@n``, then ``pass@k`` and ``best@k`` for each k in `ks`, averaged over problems of `n` samples each, of
    which `counts` are correct."""
    metrics = {f"mean@{n}": sum(mean_accuracy(n, c) for c in counts) / len(counts)}
    for name, estimator in (("pass", pass_at_k), ("best", best_at_k)):
        metrics |= {f"{name}@{k}": sum(estimator(n, c, k) for c in counts) / len(counts) for k in ks}
    return metrics


def write_markdown(
    results: Mapping[str, Mapping[str, Any]], ks: Sequence[int], num_samples: int, estimator: str = "pass"
) -> str:
    """A Markdown table (percentages): benchmark, problems, mean@n, and pass@k (`estimator="pass"`, the unbiased
    estimator) or best@k (`estimator="best"`, verl's bootstrap) for each k; an average row if > 1 benchmark."""
    if estimator not in ("pass", "best"):
        raise ValueError(f"estimator must be one of ['pass', 'best'], got {estimator!r}")
    mean_key = f"mean@{num_samples}"
    columns = [mean_key] + [f"{estimator}@{k}" for k in ks]
    header = "| Benchmark | Problems | " + " | ".join(columns) + " |"
    lines = [header, "|---|---:|" + "---:|" * len(columns)]
    for name, metrics in results.items():
        cells = [f"{100 * metrics[c]:.1f}" for c in columns]
        lines.append(f"| {name} | {metrics['problems']} | " + " | ".join(cells) + " |")
    if len(results) > 1:
        averages = [sum(m[c] for m in results.values()) / len(results) for c in columns]
        total = sum(m["problems"] for m in results.values())
        lines.append(f"| **Average** | {total} | " + " | ".join(f"{100 * a:.1f}" for a in averages) + " |")
    return "\n".join(lines) + "\n"

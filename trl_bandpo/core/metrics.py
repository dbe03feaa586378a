"""Count metrics of the clipping behaviour (docs/metrics.md), as pure tensor functions. Each metric is a
`(numerator, denominator)` pair of scalar tensors, summed over steps and processes and divided once at logging."""

from __future__ import annotations

import torch

#: Old-token-probability bucket edges of the `clip_ratio_by_prob/*` metrics.
PROB_BUCKET_EDGES = (0.2, 0.4, 0.6, 0.8)
#: Tokens whose old probability is below this are "tail" tokens (BandPO Figure 3(b)).
TAIL_PROBABILITY = 0.2

#: Model-version lag buckets of the `clip_ratio_by_lag/*` metrics of the asynchronous trainers: lag 0, 1, 2, 3 or more.
LAG_BUCKETS = ("0", "1", "2", "3+")

Counts = dict[str, tuple[torch.Tensor, torch.Tensor]]


def lag_buckets(lag: torch.Tensor) -> dict[str, torch.Tensor]:
    """Boolean masks of the `LAG_BUCKETS` of `lag` (NaN, an unknown lag, is in none)."""
    return {"0": lag == 0, "1": lag == 1, "2": lag == 2, "3+": lag >= 3}


def probability_buckets(old_probs: torch.Tensor) -> dict[str, torch.Tensor]:
    """Boolean masks of the buckets `[0, 0.2), [0.2, 0.4), ..., [0.8, 1]` of `old_probs`, keyed `"p0.0-0.2"`, ..."""
    edges = (0.0, *PROB_BUCKET_EDGES, 1.0)
    buckets = {}
    for left, right in zip(edges[:-1], edges[1:]):
        upper_ok = old_probs < right if right < 1.0 else old_probs <= right  # the last bucket includes p = 1
        buckets[f"p{left:.1f}-{right:.1f}"] = (old_probs >= left) & upper_ok
    return buckets


def clip_counts(
    old_logps: torch.Tensor,
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    lower: torch.Tensor,
    upper: torch.Tensor,
    mask: torch.Tensor,
) -> Counts:
    """Counts behind the bound and clip-rate metrics of docs/metrics.md.

    A token is clipped low when `ratio < lower` and `A < 0`, clipped high when `ratio > upper` and `A > 0` (the sides
    where the clipped surrogate zeroes the gradient, TRL's `clip_ratio/*` definition).

    Args:
        old_logps (`torch.Tensor` of shape `(B, T)`): old log-probs of the sampled tokens.
        ratio (`torch.Tensor` of shape `(B, T)` or `(B, 1)`): importance ratio (per sequence with GSPO).
        advantages (`torch.Tensor` broadcastable to `(B, T)`).
        lower, upper (`torch.Tensor` broadcastable to `(B, T)`): the ratio bounds in use.
        mask (`torch.Tensor` of shape `(B, T)`): completion tokens that count.

    Returns:
        `{name: (numerator, denominator)}` for `bounds/lower_mean`, `bounds/upper_mean`,
        `clip_ratio/high_tail_share`, `clip_ratio/any_sign_mean`, `clip_ratio/any_sign_tail_high_share` and
        `clip_ratio_by_prob/{low,high}/pA-B`.
    """
    m = mask.float()
    below, above = (ratio < lower) & (m > 0), (ratio > upper) & (m > 0)  # (B, 1) ratios broadcast to (B, T)
    is_low = (below & (advantages < 0)).float()
    is_high = (above & (advantages > 0)).float()
    p = torch.exp(old_logps.float())
    tail = (p < TAIL_PROBABILITY).float()
    out_of_bounds = (below | above).float()  # whatever the advantage's sign: the BandPO authors' count
    counts = {
        "bounds/lower_mean": ((lower.float() * m).sum(), m.sum()),
        "bounds/upper_mean": ((upper.float() * m).sum(), m.sum()),
        "clip_ratio/high_tail_share": ((is_high * tail).sum(), is_high.sum()),
        # BandPO Figure 3(a) and 3(b) as its authors count them: out-of-bound tokens of either advantage sign
        "clip_ratio/any_sign_mean": (out_of_bounds.sum(), m.sum()),
        "clip_ratio/any_sign_tail_high_share": ((above.float() * tail).sum(), out_of_bounds.sum()),
    }
    for name, in_bucket in probability_buckets(p).items():
        in_bucket = in_bucket.float() * m
        counts[f"clip_ratio_by_prob/low/{name}"] = ((is_low * in_bucket).sum(), in_bucket.sum())
        counts[f"clip_ratio_by_prob/high/{name}"] = ((is_high * in_bucket).sum(), in_bucket.sum())
    return counts

"""The count metrics of docs/metrics.md on a batch small enough to count by hand."""

import math

import pytest
import torch

from trl_bandpo.core.metrics import clip_counts

# One sequence of 8 tokens (the last one padding), bounds [0.8, 1.2] everywhere.
#   token:      0     1     2     3     4     5     6     7 (pad)
P = [0.10, 0.10, 0.50, 0.90, 0.15, 0.30, 0.05, 0.10]
R = [1.50, 0.50, 1.30, 0.70, 1.00, 1.25, 1.40, 9.00]
A = [1.0, -1.0, -1.0, 1.0, 1.0, 1.0, -1.0, 1.0]
MASK = [1, 1, 1, 1, 1, 1, 1, 0]
# out of bounds (any sign): 0 (above), 1 (below), 2 (above), 3 (below), 5 (above), 6 (above) -> 6 tokens
# clipped high (r > 1.2, A > 0): 0, 5 -> 2;   clipped low (r < 0.8, A < 0): 1 -> 1
# tail (p < 0.2): 0, 1, 4, 6;  above & tail (any sign): 0, 6 -> 2


def counts():
    old_logps = torch.log(torch.tensor([P]))
    ratio = torch.tensor([R])
    advantages = torch.tensor([A])
    lower, upper = torch.full((1, 8), 0.8), torch.full((1, 8), 1.2)
    out = clip_counts(old_logps, ratio, advantages, lower, upper, torch.tensor([MASK]))
    return {name: (float(num), float(den)) for name, (num, den) in out.items()}


def test_bounds_means():
    c = counts()
    assert c["bounds/lower_mean"] == pytest.approx((0.8 * 7, 7))
    assert c["bounds/upper_mean"] == pytest.approx((1.2 * 7, 7))


def test_tail_share_of_upper_clipping_on_the_advantage_side():
    # clipped high: tokens 0 (p 0.10, tail) and 5 (p 0.30): 1 of 2
    assert counts()["clip_ratio/high_tail_share"] == (1.0, 2.0)


def test_bandpo_authors_figure_3_counts_ignore_the_advantage_sign():
    c = counts()
    assert c["clip_ratio/any_sign_mean"] == (6.0, 7.0)  # Figure 3(a): out of bounds, any sign, over tokens
    assert c["clip_ratio/any_sign_tail_high_share"] == (2.0, 6.0)  # Figure 3(b): tail & above, over all clipped


def test_clip_rates_by_probability_bucket():
    c = counts()
    # bucket p0.0-0.2: tokens 0, 1, 4, 6 -> low-clipped: 1; high-clipped: 0
    assert c["clip_ratio_by_prob/low/p0.0-0.2"] == (1.0, 4.0)
    assert c["clip_ratio_by_prob/high/p0.0-0.2"] == (1.0, 4.0)
    # p0.2-0.4: token 5 (high-clipped); p0.4-0.6: token 2 (above but A < 0: not clipped on its side)
    assert c["clip_ratio_by_prob/high/p0.2-0.4"] == (1.0, 1.0)
    assert c["clip_ratio_by_prob/high/p0.4-0.6"] == (0.0, 1.0)
    assert c["clip_ratio_by_prob/low/p0.4-0.6"] == (0.0, 1.0)
    # p0.8-1.0: token 3 (below, A > 0: not clipped on its side)
    assert c["clip_ratio_by_prob/low/p0.8-1.0"] == (0.0, 1.0)
    assert c["clip_ratio_by_prob/high/p0.6-0.8"] == (0.0, 0.0)


def test_padding_never_counts():
    c = counts()
    assert all(den <= 7 for _, den in c.values())
    assert not any(math.isnan(num) for num, _ in c.values())

"""Extensions beyond both papers (docs/extensions.md): Band x DGPO, the adaptive per-token radius, dynamic sampling."""

from __future__ import annotations

import math

import pytest
import torch

from trl_bandpo import policy_loss
from trl_bandpo.band import band_bounds

F64 = torch.float64


# ------------------------------------------------------------------------------------------------------------------
# band_dgpo: DGPO's decay outside the Band bounds
# ------------------------------------------------------------------------------------------------------------------


def test_band_dgpo_left_region_is_empty_where_the_band_saturates():
    """For tail tokens the Band's lower bound is 0 (KL, below the smallest float): no ratio is below it, so no token
    is in LN, and a ratio of exactly 0 (log r = -inf) gives a finite loss and gradient, weight r = 0."""
    old = torch.log(torch.tensor([[1e-6, 1e-5]], dtype=F64))
    lower, _ = band_bounds(old, 0.05, upper_max=10.0)
    assert torch.equal(lower, torch.zeros_like(lower))
    for log_r in (-1e4, -700.0, -60.0, float("-inf")):
        logps = (old + log_r).requires_grad_(True)
        adv = torch.tensor([[-1.0]], dtype=F64)
        loss = policy_loss("band_dgpo", logps, old, adv, n=2, m=2.0)
        (grad,) = torch.autograd.grad(loss.sum(), logps)
        assert torch.isfinite(loss).all() and torch.isfinite(grad).all(), (log_r, loss, grad)
        r = math.exp(log_r)
        torch.testing.assert_close(-grad / adv, torch.full_like(grad, r), rtol=1e-12, atol=0)  # w = r: "in"


@pytest.mark.parametrize("n,m", [(1, 2.0), (2, 2.0), (3, 1.5)])
def test_band_dgpo_weights_are_continuous_at_both_band_bounds(n, m):
    old = torch.log(torch.tensor([[0.08, 0.2, 0.5, 0.8]], dtype=F64))
    lower, upper = band_bounds(old, 0.05, upper_max=10.0)
    for bound, adv in ((lower, -1.0), (upper, 1.0)):
        weights = []
        for side in (1 - 1e-9, 1 + 1e-9):
            logps = (old + torch.log(bound * side)).requires_grad_(True)
            a = torch.full((1, 1), adv, dtype=F64)
            loss = policy_loss("band_dgpo", logps, old, a, n=n, m=m)
            (grad,) = torch.autograd.grad(loss.sum(), logps)
            weights.append(-grad / a)
        torch.testing.assert_close(weights[0], weights[1], rtol=1e-7, atol=0)

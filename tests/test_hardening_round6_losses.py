"""Hardening, round 6 (the losses): TRL's dual clip `delta` on the masking losses that keep TRL's clipped surrogate
(`trm`, `m2po`, `icepop`), exact log-ratios from half-precision inputs, and one-line errors for empty log-probs and
for a mask on another device or of complex dtype in the pure API."""

from __future__ import annotations

import math

import pytest
import torch

from trl_bandpo import PolicyLossConfig, policy_bounds, policy_loss
from trl_bandpo.core.loss_registry import policy_loss_spec
from trl_bandpo.core.losses import POLICY_LOSSES

CPU = dict(output_dir="unused", use_cpu=True, report_to="none")
F64 = torch.float64


def one_far_token(ratio: float, length: int = 2000, position: int = 700):
    """`(logps, old_logps)` of one sequence of `length` tokens at p = 0.05, all with r = 1 but one at `ratio`."""
    old = torch.full((1, length), math.log(0.05), dtype=F64)
    logps = old.clone()
    logps[0, position] += math.log(ratio)
    return logps.requires_grad_(True), old


def value_and_gradient(name, logps, old, advantages, **hp):
    loss = policy_loss(name, logps, old, advantages, **hp)
    (gradient,) = torch.autograd.grad(loss.sum(), logps)
    return loss.detach(), gradient


# -- item 6: TRL's dual clip on trm, m2po and icepop ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["trm", "m2po"])
def test_the_issue_case_one_token_at_r_10_in_a_kept_sequence(name):
    """One token at r = 10 with A = -1 in a 2,000-token sequence, every other token at r = 1. By hand: TRM's mean k3
    is (10 - 1 - ln 10) / 2000 = 0.00335 <= 0.01 and M2PO's mean (log r)^2 is (ln 10)^2 / 2000 = 0.00265 < 0.04, so
    every token is kept. TRL's surrogate there, -min(min(r, delta) A, clamp(r, 0.8, 1.2) A):
    - `delta = 3` (verl's bypass default, c = 3): -min(-3, -1.2) = 3, and no gradient (r is capped at delta);
    - no dual clip: -min(-10, -1.2) = 10, gradient d(r)/d log pi = r = 10.
    The other tokens: -A r = 1, gradient 1, either way."""
    logps, old = one_far_token(10.0)
    far = torch.zeros(1, 2000, dtype=torch.bool)
    far[0, 700] = True
    value, gradient = value_and_gradient(name, logps, old, -1.0, delta=3.0)
    assert value[far].item() == 3.0 and gradient[far].item() == 0.0
    torch.testing.assert_close(value[~far], torch.ones(1999, dtype=F64), rtol=0, atol=1e-15)
    torch.testing.assert_close(gradient[~far], torch.ones(1999, dtype=F64), rtol=0, atol=1e-15)
    value, gradient = value_and_gradient(name, logps, old, -1.0)
    assert value[far].item() == pytest.approx(10.0, rel=1e-14)
    assert gradient[far].item() == pytest.approx(10.0, rel=1e-14)


def test_icepop_kept_token_is_dual_clipped():
    """IcePop keeps r = 4 (inside [0.5, 5]); with A = -1 and delta = 3: -min(-3, -1.2) = 3, no gradient; without
    delta: 4 and 4. A token it masks (r = 6) stays 0 either way."""
    logps, old = one_far_token(4.0, length=3, position=1)
    value, gradient = value_and_gradient("icepop", logps, old, -1.0, delta=3.0)
    assert value[0, 1].item() == 3.0 and gradient[0, 1].item() == 0.0
    value, gradient = value_and_gradient("icepop", logps, old, -1.0)
    assert value[0, 1].item() == pytest.approx(4.0, rel=1e-14) and gradient[0, 1].item() == pytest.approx(4.0)
    logps, old = one_far_token(6.0, length=3, position=1)
    value, gradient = value_and_gradient("icepop", logps, old, -1.0, delta=3.0)
    assert value[0, 1].item() == 0.0 and gradient[0, 1].item() == 0.0


@pytest.mark.parametrize("name", ["trm", "m2po", "icepop"])
def test_config_accepts_delta_for_the_losses_that_keep_trls_surrogate(name):
    config = PolicyLossConfig(**CPU, policy_loss=name, delta=3.0)
    _, loss_kwargs = policy_loss_spec(name).kwargs_from_config(config)
    assert loss_kwargs["delta"] == 3.0  # what the trainer passes to the loss
    with pytest.raises(ValueError, match=r"^delta must be .*, got 0\.5\.$"):  # still checked by its owner
        PolicyLossConfig(**CPU, policy_loss=name, delta=0.5)
    with pytest.raises(ValueError, match="importance_sampling_level"):
        PolicyLossConfig(**CPU, policy_loss=name, importance_sampling_level="sequence")


@pytest.mark.parametrize("name", ["cppo", "dgpo", "band_dgpo", "gppo", "ce_gppo", "aspo", "cispo", "dppo_tv", "spo",
                                  "drpo", "ipo"])  # fmt: skip
def test_config_refuses_delta_where_the_loss_replaces_trls_surrogate(name):
    """These losses do not compute TRL's `-min(r A, clamp(r) A)`: the reason says so (not "outside the clip
    range", which CPPO, with no clip range, does not have)."""
    reason = "the dual clip caps the ratio in TRL's clipped surrogate, and this loss does not use that surrogate"
    with pytest.raises(ValueError, match=rf"^delta=3\.0 cannot be used with policy_loss='{name}': {reason}"):
        PolicyLossConfig(**CPU, policy_loss=name, delta=3.0)


# -- item 7: log r from half-precision inputs ----------------------------------------------------------------------

HALF_HP = {  # every token kept, so the loss shows the ratio
    "cppo": dict(radius=1.0, rate_min=1.0),
    "trm": dict(threshold=1e30),
    "m2po": dict(threshold=1e30),
    "icepop": dict(high=1e30),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_half_precision_inputs_give_the_float32_result_on_the_same_values(name, dtype):
    """bf16/fp16 log-probs whose float32 upcasts are the very same numbers give the float32 loss (bit for bit) and
    its gradient (rounded to the input dtype), at log r from 5 to 12. Before, `log r` was subtracted in the input
    dtype: with bf16, 1-17% off."""
    g = torch.Generator().manual_seed(0)
    new = (-0.5 * torch.rand(4, 32, generator=g)).to(dtype)
    old = (-5.5 - 6.5 * torch.rand(4, 32, generator=g)).to(dtype)
    new32, old32 = new.float(), old.float()
    assert torch.equal(new32.to(dtype), new) and bool((new32 - old32 >= 5).all())
    advantages = torch.tensor([1.0, -1.0, 0.5, -2.0])
    hp = HALF_HP.get(name, {})
    half = new.clone().requires_grad_(True)
    full = new32.clone().requires_grad_(True)
    loss_half, loss_full = (policy_loss(name, x, o, advantages, **hp) for x, o in ((half, old), (full, old32)))
    assert loss_half.dtype == torch.float32 and torch.equal(loss_half, loss_full)
    assert bool((loss_full != 0).any())
    (grad_half,) = torch.autograd.grad(loss_half.sum(), half)
    (grad_full,) = torch.autograd.grad(loss_full.sum(), full)
    assert torch.equal(grad_half, grad_full.to(dtype))


def test_drpo_bounds_from_bfloat16_old_logps_are_those_of_the_same_values_in_float32():
    """DRPO's `1 +- epsilon / p` took `log epsilon - log p` in bf16 (3 significant digits)."""
    old = -torch.linspace(0.0, 12.0, 97).to(torch.bfloat16)
    for half, full in zip(policy_bounds("drpo", old), policy_bounds("drpo", old.float())):
        assert torch.equal(half, full)


# -- item 8: the pure API on empty log-probs and on a mask it cannot use -------------------------------------------


@pytest.mark.parametrize("shape", [(3, 0), (0, 4)])
@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_empty_logps_are_one_line_naming_the_argument(name, shape):
    with pytest.raises(ValueError) as error:
        policy_loss(name, torch.zeros(shape), torch.zeros(shape), torch.zeros(shape[0]))
    assert str(error.value) == f"logps must be a non-empty tensor, got a tensor of shape {shape}."


@pytest.mark.parametrize("name", ["cppo", "trm", "m2po", "clip"])
def test_mask_of_complex_dtype_or_on_another_device_is_one_line_naming_the_argument(name):
    logps = torch.zeros(2, 3)
    for mask, got in (
        (torch.ones(2, 3, dtype=torch.complex64), "of dtype torch.complex64 on cpu"),
        (torch.ones(2, 3, device="meta"), "of dtype torch.float32 on meta"),
    ):
        with pytest.raises(ValueError) as error:
            policy_loss(name, logps, logps, torch.ones(2), mask=mask)
        assert str(error.value) == (
            "mask must be a bool, integer or floating-point tensor shaped like logps (2, 3) on cpu, got a tensor of "
            f"shape (2, 3) {got}."
        )
    assert policy_loss(name, logps, logps, torch.ones(2), mask=torch.ones(2, 3, dtype=torch.int64)).shape == (2, 3)

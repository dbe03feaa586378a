"""Tests of `trl_bandpo.core.losses` against formulas written out here from docs/band-operator.md and
docs/policy-losses.md (never the module's helpers).

Notation (docs/policy-losses.md): `p = exp(old_logp)`, `r = pi / p`, advantage `A`; the gradient weight `w` is the
coefficient on `grad log pi`, so `w = -(d loss / d logps) / A`.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from trl_bandpo.core.losses import POLICY_LOSSES, policy_bounds, policy_loss, policy_loss_spec

F64 = torch.float64
CLIPPED = ("clip", "band", "relaxed_band", "dcpo")
# A token's loss depends on its whole sequence (CPPO's budget, TRM's statistic) or the micro-batch (M2PO's second
# moment): no function of the token alone, so out of the per-token grids (tests/test_masked_losses.py covers them).
SEQUENCE_AWARE = ("cppo", "trm", "m2po")
PER_TOKEN = tuple(name for name in POLICY_LOSSES if name not in SEQUENCE_AWARE)

# Reference table of docs/band-operator.md, KL, delta = 0.05: p -> (lower, upper).
# None of these hits the upper_max = 10 cap.
BAND_KL_005 = {
    0.08: (0.2616958435, 2.410553794),
    0.2: (0.4759413514, 1.717678517),
    0.5: (0.6915156698, 1.308484330),
    0.8: (0.8205803706, 1.131014662),
    0.95: (0.8957236881, 1.044104122),
}
PS = tuple(BAND_KL_005)
RS = (0.02, 0.2, 0.3, 0.4, 0.55, 0.65, 0.75, 0.85, 0.95, 1.0, 1.05, 1.15, 1.25, 1.4, 1.6, 2.0, 2.7, 3.5, 4.5, 6.0)
RS = (*RS, 12.0)
AS = (1.0, -1.0, 0.37, -2.5)


# ------------------------------------------------------------------------------------------------------------------
# Hand-written reference formulas
# ------------------------------------------------------------------------------------------------------------------


def expected_bounds(name, p, hp):
    """(lower, upper) docs/policy-losses.md assigns to `name` at old probability `p`."""
    if name in ("band", "band_dgpo"):
        return BAND_KL_005[p]
    if name == "relaxed_band":  # union with the Clip-Higher interval [1 - 0.2, 1 + 0.28]
        lo, hi = BAND_KL_005[p]
        return min(lo, 1 - hp.get("epsilon_low", 0.2)), max(hi, 1 + hp.get("epsilon_high", 0.28))
    if name == "dcpo":
        el, eh = hp.get("epsilon_low", 0.16), hp.get("epsilon_high", 0.2)
        lo = 0.5 + 0.5 * math.sqrt(max(1 - 4 * el / p, 0.0))
        hi = min(0.5 + 0.5 * math.sqrt(1 + 4 * eh / p), hp.get("upper_max", 10.0))
        return lo, hi
    if name == "dppo_kl":  # the KL region of radius 0.05 uncapped: the table (its uppers are all below any cap)
        return BAND_KL_005[p]
    if name == "dppo_tv":  # |q - p| <= radius on each side, within the simplex [0, 1/p]
        low, high = (hp.get(k, hp.get("radius", 0.15)) for k in ("radius_low", "radius_high"))
        return max(0.0, 1 - low / p), min(1 / p, 1 + high / p)
    if name == "ipo":  # prime-rl's thresholds on q - p, the same region as dppo_tv
        low, high = hp.get("mask_low", 0.1), hp.get("mask_high", 0.1)
        return max(0.0, 1 - low / p), min(1 / p, 1 + high / p)
    if name in ("spo", "drpo"):  # where the weight changes sign: r = 1 +- eps (SPO), 1 +- eps / p (DRPO)
        eps = hp.get("epsilon", 12.5) / (p if name == "drpo" else 1.0)
        return max(0.0, 1 - eps), 1 + eps
    return 1 - hp.get("epsilon_low", 0.2), 1 + hp.get("epsilon_high", 0.2)


def region(r, a, lo, hi):
    if a == 0:
        return "zero"
    if r < lo:
        return "LN" if a < 0 else "LP"
    if r > hi:
        return "HP" if a > 0 else "HN"
    return "in"


def expected_weight(name, r, a, lo, hi, hp):
    """Gradient weight (docs/policy-losses.md) on grad log pi."""
    reg = region(r, a, lo, hi)
    if name in CLIPPED:
        if reg in ("LN", "HP"):
            return 0.0
        delta = hp.get("delta")
        if delta is not None and a < 0 and r > delta:
            return 0.0
        return r
    if name == "gppo":
        return {"LN": lo, "HP": hi}.get(reg, r)
    if name == "ce_gppo":
        return {"LN": hp.get("beta1", 0.75) * lo, "HP": hp.get("beta2", 1.0) * hi}.get(reg, r)
    if name == "aspo":
        c_pos, c_neg = hp.get("c_pos", 3.0), hp.get("c_neg", 3.0)
        if a > 0:
            if r > hi:
                return 0.0
            return c_pos if r < 1 / c_pos else 1 / r
        if r < lo:
            return 0.0
        return c_neg if r > c_neg else r
    if name == "cispo":  # the DGPO paper's CISPO: both-sided clipped weight everywhere, never 0
        return min(max(r, lo), hi)
    if name == "icepop":  # the clipped surrogate's weight where low <= r <= high, 0 (masked) outside
        if not hp.get("low", 0.5) <= r <= hp.get("high", 5.0):
            return 0.0
        return 0.0 if reg in ("LN", "HP") else r
    if name in ("dppo_tv", "dppo_kl"):  # masked where the token left the region on its advantage's side
        cap = hp.get("ratio_cap", 20.0)
        return 0.0 if reg in ("LN", "HP") else (r if cap is None else min(r, cap))
    if name in ("spo", "drpo"):  # r (1 - sign(A) (r - 1) / eps_t), eps_t = upper - 1 (eps, or eps / p for DRPO)
        return r * (1 - math.copysign(1.0, a) * (r - 1) / (hi - 1))
    if name == "ipo":  # kept: adv_tau r; masked on both sides; plus the KL term's -2 kl_tau log r, divided by A
        kl = -2 * hp.get("kl_tau", 1e-3) * math.log(r) / a
        return kl + (hp.get("adv_tau", 1.0) * r if lo <= r <= hi else 0.0)
    if name in ("dgpo", "band_dgpo"):  # band_dgpo: the same decay outside the Band bounds (docs/extensions.md)
        n, m = hp.get("n", 1), hp.get("m", 2.0)
        if reg == "LN":
            return r ** (n + 1) / lo**n
        if reg == "HP":
            return hi ** (1 / m) * r ** ((m - 1) / m)
        return r
    raise AssertionError(name)


def trl_clip_value(r, a, lo, hi, delta=None):
    """TRL 1.16 `_compute_loss`: coef_2 = clamp(coef_1, lo, hi); dual clip; -min(coef_1 A, coef_2 A)."""
    coef_2 = min(max(r, lo), hi)
    coef_1 = min(r, delta) if delta is not None else r
    return -min(coef_1 * a, coef_2 * a)


def dgpo_surrogate_value(pi, p, a, lo, hi, n, m):
    """DGPO's surrogate R (docs/policy-losses.md) evaluated from pi and p (forward value, sg is the identity
    there); loss = -A R."""
    r = pi / p
    if a < 0 and r < lo:
        big_r = pi * pi**n / (p ** (n + 1) * lo**n)
    elif a > 0 and r > hi:
        big_r = pi * pi ** (-1 / m) * hi ** (1 / m) * p ** (-(m - 1) / m)
    else:
        big_r = r
    return -a * big_r


def expected_value(name, r, a, lo, hi, hp, pi, p):
    if name == "cispo":  # forward value: -A times the clipped ratio
        return -a * min(max(r, lo), hi)
    if name == "icepop":  # TRL's clipped value where low <= r <= high, 0 outside
        return trl_clip_value(r, a, lo, hi) if hp.get("low", 0.5) <= r <= hp.get("high", 5.0) else 0.0
    if name in ("dppo_tv", "dppo_kl"):  # forward value: -A times the truncated ratio
        cap = hp.get("ratio_cap", 20.0)
        return -a * (r if cap is None else min(r, cap))
    if name in CLIPPED:
        return trl_clip_value(r, a, lo, hi, hp.get("delta"))
    if name in ("spo", "drpo"):  # -A r + |A| (r - 1)^2 / (2 eps_t)
        return -a * r + abs(a) * (r - 1) ** 2 / (2 * (hi - 1))
    if name == "ipo":  # -adv_tau A r on kept tokens, kl_tau (log r)^2 on all
        kept = hp.get("adv_tau", 1.0) * r if lo <= r <= hi else 0.0
        return -a * kept + hp.get("kl_tau", 1e-3) * math.log(r) ** 2
    if name in ("dgpo", "band_dgpo"):
        return dgpo_surrogate_value(pi, p, a, lo, hi, hp.get("n", 1), hp.get("m", 2.0))
    # GPPO: the forward value equals clip's (docs/policy-losses.md); CE-GPPO and ASPO keep it too (losses.py's
    # documented choice).
    return trl_clip_value(r, a, lo, hi)


def run(name, logps, old_logps, advantages, **hp):
    """Per-token loss and d(sum loss)/d logps."""
    logps = logps.detach().clone().requires_grad_(True)
    loss = policy_loss(name, logps, old_logps, advantages, **hp)
    loss.sum().backward()
    return loss.detach(), logps.grad


# ------------------------------------------------------------------------------------------------------------------
# Gradient weight and forward value per region, every loss
# ------------------------------------------------------------------------------------------------------------------

HP_CASES = {
    "clip": [{}, {"epsilon_high": 0.28}, {"delta": 3.0}, {"epsilon_low": 0.1, "epsilon_high": 0.28, "delta": 3.0}],
    "band": [{}, {"delta": 3.0}],
    "relaxed_band": [{}, {"delta": 3.0}],
    "dcpo": [{}, {"delta": 3.0}, {"epsilon_low": 0.1, "epsilon_high": 0.3}],
    "dgpo": [{}, {"n": 2, "m": 2.0}, {"n": 1, "m": 1.0}, {"n": 3, "m": 3.5, "epsilon_low": 0.1, "epsilon_high": 0.28}],
    "gppo": [{}, {"epsilon_high": 0.28}],
    "ce_gppo": [{}, {"beta1": 0.75, "beta2": 1.0}, {"beta1": 0.5, "beta2": 0.5}],
    "aspo": [{}, {"epsilon_high": 0.28}, {"c_pos": 2.0, "c_neg": 5.0}],
    "cispo": [{}, {"epsilon_low": 0.1, "epsilon_high": 0.28}],
    "band_dgpo": [{}, {"n": 2, "m": 2.0}, {"n": 3, "m": 1.5}],
    "dppo_tv": [{}, {"ratio_cap": None}, {"ratio_cap": 1.1, "radius": 0.05}, {"radius_low": 0.05, "radius_high": 0.3}],
    "dppo_kl": [{}, {"ratio_cap": 1.1}, {"ratio_cap": None}],
    # the authors' eps = 12.5 leaves no token of this grid outside the bounds (tests/test_drpo.py covers it)
    "spo": [{"epsilon": 0.2}, {"epsilon": 0.5}],
    "drpo": [{"epsilon": 0.05}, {"epsilon": 0.3}],
    "ipo": [{}, {"mask_low": 0.05, "mask_high": 0.2}, {"kl_tau": 0.0}, {"kl_tau": 0.1, "adv_tau": 2.0}],
    "icepop": [{}, {"low": 0.3, "high": 3.0}, {"epsilon_low": 0.1, "epsilon_high": 0.28, "low": 0.7, "high": 1.5}],
}
CASES = [(name, hp) for name in PER_TOKEN for hp in HP_CASES[name]]


def test_hp_cases_cover_every_registered_loss():
    assert set(PER_TOKEN) == set(HP_CASES)
    # the losses left out are exactly those that see the whole sequence (they declare `mask`)
    assert {name for name in POLICY_LOSSES if "mask" in policy_loss_spec(name).context} == set(SEQUENCE_AWARE)


def _critical_points(name, lo, hi, hp):
    pts = [lo, hi]
    if hp.get("delta") is not None:
        pts.append(hp["delta"])
    if name == "aspo":
        pts += [1 / hp.get("c_pos", 3.0), hp.get("c_neg", 3.0)]
    if name.startswith("dppo") and hp.get("ratio_cap", 20.0) is not None:
        pts.append(hp.get("ratio_cap", 20.0))
    if name == "icepop":
        pts += [hp.get("low", 0.5), hp.get("high", 5.0)]
    return [c for c in pts if c > 0]  # a saturated lower bound (0) is no boundary any ratio can sit on


@pytest.mark.parametrize("name,hp", CASES, ids=[f"{n}-{h}" for n, h in CASES])
def test_gradient_weight_and_value_per_region(name, hp):
    rows = []  # (r, A, p, lo, hi)
    for p, r, a in itertools.product(PS, RS, AS):
        lo, hi = expected_bounds(name, p, hp)
        if any(abs(r / c - 1) < 1e-3 for c in _critical_points(name, lo, hi, hp)):
            continue  # keep the region unambiguous
        rows.append((r, a, p, lo, hi))
    covered = {region(r, a, lo, hi) for r, a, _, lo, hi in rows}
    assert {"in", "LN", "HP", "LP", "HN"} <= covered

    r_t = torch.tensor([row[0] for row in rows], dtype=F64)
    a_t = torch.tensor([row[1] for row in rows], dtype=F64)
    p_t = torch.tensor([row[2] for row in rows], dtype=F64)
    old = torch.log(p_t)
    logps = old + torch.log(r_t)
    loss, grad = run(name, logps[None], old[None], a_t[None], **hp)
    loss, grad = loss[0], grad[0]
    w = -grad / a_t

    pi = torch.exp(logps)
    r_actual = torch.exp(logps - old)  # the ratio the module sees, to the last bit
    exp_w = torch.tensor(
        [expected_weight(name, float(ra), a, lo, hi, hp) for ra, (_, a, _, lo, hi) in zip(r_actual, rows)], dtype=F64
    )
    exp_v = torch.tensor(
        [
            expected_value(name, float(ra), a, lo, hi, hp, float(pi_), p)
            for ra, pi_, (_, a, p, lo, hi) in zip(r_actual, pi, rows)
        ],
        dtype=F64,
    )
    # Band bounds are exact to 1e-6 relative (the accuracy target of docs/band-operator.md); DCPO's bounds are
    # computed in float32 even
    # for float64 input (losses.dcpo_bounds); everything else is float64 arithmetic.
    tol = {"band": 2e-6, "relaxed_band": 2e-6, "band_dgpo": 2e-6, "dcpo": 1e-6}.get(name, 1e-10)
    torch.testing.assert_close(w, exp_w, rtol=tol, atol=tol)
    torch.testing.assert_close(loss, exp_v, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_zero_advantage_gives_zero_loss_and_gradient(name):
    old = torch.log(torch.tensor([[0.08, 0.2, 0.5, 0.8, 0.95, 0.5, 0.5]], dtype=F64))
    logps = old + torch.log(torch.tensor([[0.1, 0.7, 1.0, 1.3, 4.0, 0.5, 30.0]], dtype=F64))
    loss, grad = run(name, logps, old, torch.zeros(1, 1, dtype=F64))
    if name == "ipo":  # prime-rl's KL term acts on every token, whatever its advantage
        log_r = logps - old
        torch.testing.assert_close((loss, grad), (1e-3 * log_r**2, 2e-3 * log_r))
        return
    assert torch.equal(loss.abs(), torch.zeros_like(loss))
    assert torch.equal(grad.abs(), torch.zeros_like(grad))


# ------------------------------------------------------------------------------------------------------------------
# Clipped family: bounds, TRL parity, dual clip
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["band", "relaxed_band", "dcpo"])
def test_clipped_value_at_saturation_equals_bound(name):
    """HP tokens lose exactly upper*A, LN tokens lower*A: pins the bounds the loss actually uses."""
    for p in PS:
        lo, hi = expected_bounds(name, p, {})
        old = torch.full((1, 2), math.log(p), dtype=F64)
        logps = old + torch.log(torch.tensor([[hi * 1.5, lo * 0.5]], dtype=F64))
        adv = torch.tensor([[1.0, -1.0]], dtype=F64)
        loss = policy_loss(name, logps, old, adv)
        torch.testing.assert_close(loss, torch.tensor([[-hi, lo]], dtype=F64), rtol=2e-6, atol=0)


def test_relaxed_band_is_the_union_with_clip_higher():
    # p = 0.8 and 0.95: the Band interval is inside [0.8, 1.28], so the relaxed bounds are exactly 0.8 and 1.28
    for p in (0.8, 0.95):
        assert expected_bounds("relaxed_band", p, {}) == (0.8, 1.28)
    # p = 0.2: Band is wider on both sides, relaxing changes nothing
    assert expected_bounds("relaxed_band", 0.2, {}) == BAND_KL_005[0.2]


def _trl_clip_loss(logps, old_logps, advantages, eps_low, eps_high, delta):
    coef_1 = torch.exp(logps - old_logps)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    if delta is not None:
        coef_1 = torch.clamp(coef_1, max=delta)
    return -torch.min(coef_1 * advantages, coef_2 * advantages)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("eps_low,eps_high", [(0.2, 0.2), (0.2, 0.28), (0.1, 0.3)])
@pytest.mark.parametrize("delta", [None, 2.0, 10.0])
@pytest.mark.parametrize("adv_shape", ["B1", "BT"])
def test_clip_equals_trl_formula(dtype, eps_low, eps_high, delta, adv_shape):
    g = torch.Generator().manual_seed(0)
    B, T = 4, 32
    old = -torch.rand(B, T, generator=g, dtype=F64) * 5
    logps = old + torch.randn(B, T, generator=g, dtype=F64) * 0.6
    adv = torch.randn(B, 1 if adv_shape == "B1" else T, generator=g, dtype=F64)
    old, logps, adv = old.to(dtype), logps.to(dtype), adv.to(dtype)

    lp_ref = logps.clone().requires_grad_(True)
    ref = _trl_clip_loss(lp_ref, old, adv, eps_low, eps_high, delta)
    ref.sum().backward()
    loss, grad = run("clip", logps, old, adv, epsilon_low=eps_low, epsilon_high=eps_high, delta=delta)
    assert loss.shape == (B, T)
    torch.testing.assert_close(loss, ref.detach())
    torch.testing.assert_close(grad, lp_ref.grad)


@pytest.mark.parametrize("name", CLIPPED)
def test_dual_clip(name):
    """A < 0 and r > delta: forward -delta*A, gradient 0 (TRL's behaviour); between upper and delta: w = r."""
    p, delta = 0.2, 4.0  # every clipped loss has upper < 4 at p = 0.2
    old = torch.full((1, 3), math.log(p), dtype=F64)
    logps = old + torch.log(torch.tensor([[3.0, 7.0, 50.0]], dtype=F64))
    adv = torch.tensor([[-1.5]], dtype=F64)
    loss, grad = run(name, logps, old, adv, delta=delta)
    torch.testing.assert_close(loss, torch.tensor([[4.5, 6.0, 6.0]], dtype=F64))
    torch.testing.assert_close(grad, torch.tensor([[4.5, 0.0, 0.0]], dtype=F64))


# ------------------------------------------------------------------------------------------------------------------
# DGPO
# ------------------------------------------------------------------------------------------------------------------


def _dgpo_at(r, a, **hp):
    p = 0.3
    old = torch.full((1, len(r)), math.log(p), dtype=F64)
    logps = old + torch.log(torch.tensor([r], dtype=F64))
    adv = torch.tensor([a], dtype=F64)
    loss, grad = run("dgpo", logps, old, adv, **hp)
    return loss[0], (-grad / adv)[0]


def test_dgpo_spec_expected_weights():
    # DGPO's checked values (docs/policy-losses.md), n = 1, m = 2, eps = 0.2 / 0.2
    _, w = _dgpo_at([1.5, 4.0, 0.3, 0.7, 4.0], [1.0, 1.0, -1.0, -1.0, -1.0])
    torch.testing.assert_close(w, torch.tensor([1.3416, 2.1909, 0.1125, 0.6125, 4.0], dtype=F64), rtol=0, atol=5e-5)
    torch.testing.assert_close(
        w, torch.tensor([math.sqrt(1.8), math.sqrt(4.8), 0.09 / 0.8, 0.49 / 0.8, 4.0], dtype=F64), rtol=1e-12, atol=0
    )


def test_dgpo_default_is_n1_m2():
    loss_d, w_d = _dgpo_at([0.3, 4.0], [-1.0, 1.0])
    loss_e, w_e = _dgpo_at([0.3, 4.0], [-1.0, 1.0], n=1, m=2.0)
    assert torch.equal(w_d, w_e) and torch.equal(loss_d, loss_e)


def test_dgpo_n2_m2_and_m1():
    _, w = _dgpo_at([0.3, 0.7, 1.5, 4.0], [-1.0, -1.0, 1.0, 1.0], n=2, m=2.0)
    exp = [0.3**3 / 0.64, 0.7**3 / 0.64, math.sqrt(1.2 * 1.5), math.sqrt(1.2 * 4.0)]
    torch.testing.assert_close(w, torch.tensor(exp, dtype=F64), rtol=1e-12, atol=0)
    # m = 1: the HP weight is the constant 1 + eps_high
    _, w = _dgpo_at([1.3, 2.0, 10.0, 1e6], [1.0, 1.0, 1.0, 1.0], m=1.0)
    torch.testing.assert_close(w, torch.full((4,), 1.2, dtype=F64), rtol=1e-12, atol=0)
    _, w = _dgpo_at([1.3, 2.0, 10.0, 1e6], [1.0, 1.0, 1.0, 1.0], m=1.0, epsilon_high=0.28)
    torch.testing.assert_close(w, torch.full((4,), 1.28, dtype=F64), rtol=1e-12, atol=0)


def test_dgpo_no_dual_clip():
    with pytest.raises(TypeError):
        policy_loss("dgpo", torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), delta=3.0)
    _, w = _dgpo_at([4.0, 100.0, 1e6], [-1.0, -1.0, -1.0])
    torch.testing.assert_close(w, torch.tensor([4.0, 100.0, 1e6], dtype=F64), rtol=1e-10, atol=0)


@pytest.mark.parametrize("n,m", [(1, 2.0), (2, 2.0), (1, 1.0), (3, 1.5)])
@pytest.mark.parametrize("eps_low,eps_high", [(0.2, 0.2), (0.2, 0.28)])
def test_dgpo_continuity_at_boundaries(n, m, eps_low, eps_high):
    hp = dict(n=n, m=m, epsilon_low=eps_low, epsilon_high=eps_high)
    for boundary, a in ((1 - eps_low, -1.0), (1 + eps_high, 1.0)):
        loss, w = _dgpo_at([boundary - 1e-9, boundary + 1e-9], [a, a], **hp)
        assert abs(float(w[0] - w[1])) < 1e-6, (boundary, w)
        assert abs(float(loss[0] - loss[1])) < 1e-6, (boundary, loss)
        torch.testing.assert_close(w, torch.full((2,), boundary, dtype=F64), rtol=0, atol=1e-6)
        torch.testing.assert_close(loss, torch.full((2,), -a * boundary, dtype=F64), rtol=0, atol=1e-6)


@pytest.mark.parametrize("n,m", [(1, 2.0), (2, 2.0), (1, 1.0), (3, 1.5)])
def test_dgpo_matches_spec_surrogate_under_autograd(n, m):
    """Build DGPO's surrogates R (with sg = detach) from pi and p, differentiate them with autograd: same value and
    gradient as the module."""
    eps_low, eps_high = 0.2, 0.28
    g = torch.Generator().manual_seed(1)
    B, T = 3, 50
    old = torch.log(torch.rand(B, T, generator=g, dtype=F64) * 0.9 + 0.05)
    logps = old + torch.randn(B, T, generator=g, dtype=F64) * 0.7
    adv = torch.randn(B, T, generator=g, dtype=F64)

    lp = logps.clone().requires_grad_(True)
    pi, p = torch.exp(lp), torch.exp(old)
    r = pi / p
    sg = pi.detach()
    ln = (r.detach() < 1 - eps_low) & (adv < 0)
    hp_ = (r.detach() > 1 + eps_high) & (adv > 0)
    assert ln.any() and hp_.any() and (~ln & ~hp_).any()
    big_r = torch.where(ln, pi * sg**n / (p ** (n + 1) * (1 - eps_low) ** n), r)
    big_r = torch.where(hp_, pi * sg ** (-1 / m) * (1 + eps_high) ** (1 / m) * p ** (-(m - 1) / m), big_r)
    ref = -adv * big_r
    ref.sum().backward()

    loss, grad = run("dgpo", logps, old, adv, n=n, m=m, epsilon_low=eps_low, epsilon_high=eps_high)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, lp.grad, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------------------------------------------
# GPPO / CE-GPPO / ASPO spot values
# ------------------------------------------------------------------------------------------------------------------


def _weights(name, r, a, p=0.3, **hp):
    old = torch.full((1, len(r)), math.log(p), dtype=F64)
    logps = old + torch.log(torch.tensor([r], dtype=F64))
    adv = torch.tensor([a], dtype=F64)
    loss, grad = run(name, logps, old, adv, **hp)
    return loss[0], (-grad / adv)[0]


def test_gppo_forward_equals_clip_and_boundary_weights():
    r = [0.5, 0.9, 1.5, 0.5, 1.1, 1.5]
    a = [-1.0, -1.0, -1.0, 1.0, 1.0, 1.0]
    loss, w = _weights("gppo", r, a, epsilon_high=0.28)
    clip_loss, _ = _weights("clip", r, a, epsilon_high=0.28)
    torch.testing.assert_close(loss, clip_loss)
    torch.testing.assert_close(loss, torch.tensor([0.8, 0.9, 1.5, -0.5, -1.1, -1.28], dtype=F64))
    torch.testing.assert_close(w, torch.tensor([0.8, 0.9, 1.5, 0.5, 1.1, 1.28], dtype=F64))


@pytest.mark.parametrize("beta1,beta2", [(0.75, 1.0), (0.5, 0.5)])
def test_ce_gppo_weights(beta1, beta2):
    r = [0.5, 0.9, 1.5, 0.5, 1.1, 1.5]
    a = [-1.0, -1.0, -1.0, 1.0, 1.0, 1.0]
    loss, w = _weights("ce_gppo", r, a, beta1=beta1, beta2=beta2)
    torch.testing.assert_close(w, torch.tensor([beta1 * 0.8, 0.9, 1.5, 0.5, 1.1, beta2 * 1.2], dtype=F64))
    torch.testing.assert_close(loss, torch.tensor([0.8, 0.9, 1.5, -0.5, -1.1, -1.2], dtype=F64))


def test_ce_gppo_defaults_are_dgpo_paper_betas():
    _, w = _weights("ce_gppo", [0.5, 1.5], [-1.0, 1.0])
    torch.testing.assert_close(w, torch.tensor([0.75 * 0.8, 1.0 * 1.2], dtype=F64))


def test_aspo_weights_c3():
    # A > 0: 3 below 1/3, 1/r on [1/3, 1 + eps], 0 above; A < 0: 0 below 1 - eps, r on [1 - eps, 3], 3 above
    r = [0.1, 0.25, 0.4, 0.9, 1.1, 1.25, 5.0, 0.5, 0.79, 0.81, 1.0, 2.5, 3.5, 50.0]
    a = [1.0] * 7 + [-1.0] * 7
    _, w = _weights("aspo", r, a, c_pos=3.0, c_neg=3.0)
    exp = [3.0, 3.0, 2.5, 1 / 0.9, 1 / 1.1, 0.0, 0.0, 0.0, 0.0, 0.81, 1.0, 2.5, 3.0, 3.0]
    torch.testing.assert_close(w, torch.tensor(exp, dtype=F64))


# ------------------------------------------------------------------------------------------------------------------
# Numerical safety
# ------------------------------------------------------------------------------------------------------------------

SAFETY_HP = {
    "clip": [{}, {"epsilon_high": 0.28, "delta": 10.0}],
    "band": [{}, {"upper_max": None, "delta": 10.0}],
    "relaxed_band": [{}, {"upper_max": None}],
    "dcpo": [{}],
    "dgpo": [{}, {"n": 2, "m": 2.0}, {"n": 3, "m": 1.0}],
    "gppo": [{}],
    "ce_gppo": [{}],
    "aspo": [{}],
    "cispo": [{}, {"epsilon_low": 0.1, "epsilon_high": 0.28}],
    "band_dgpo": [{}, {"upper_max": None, "n": 2}],
    "dppo_tv": [{}, {"ratio_cap": None, "radius": 0.5}],
    "dppo_kl": [{}, {"ratio_cap": None}],
    "spo": [{}, {"epsilon": 0.2}],
    "drpo": [{}, {"epsilon": 0.05}],
    "ipo": [{}, {"mask_low": 0.5, "mask_high": 0.5, "kl_tau": 1.0}],
    # the second settings keep every token (the widest budget, threshold and interval): each one's surrogate is seen
    "cppo": [{}, {"radius": 1.0, "w_min": 1.0, "rate_min": 1.0}],
    "trm": [{}, {"divergence": "k1", "reduce": "max", "threshold": 1e30}],
    "m2po": [{}, {"threshold": 1e30}],
    "icepop": [{}, {"low": 1e-30, "high": 1e30, "epsilon_high": 0.28}],
}


def _extreme_inputs(dtype):
    olds = (math.log(1e-30), -60.0, -50.0, -20.0, -5.0, -0.5, -1e-4, 0.0)
    log_rs = (-50.0, -20.0, -3.0, -0.3, -0.1, 0.0, 0.1, 0.25, 3.0, 20.0, 50.0)
    pairs = [(o, o + lr) for o, lr in itertools.product(olds, log_rs) if o + lr <= 0.0]
    old = torch.tensor([o for o, _ in pairs], dtype=F64)
    logps = torch.tensor([lp for _, lp in pairs], dtype=F64)
    n = len(pairs)
    adv = torch.tensor([(1.0, -1.0, 2.5, -0.3)[i % 4] for i in range(n)], dtype=F64)
    old, logps, adv = (x.repeat(2, 1).to(dtype) for x in (old, logps, adv))
    adv[1] = -adv[1]  # every (old, log r) pair with both advantage signs
    return logps, old, adv


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_extreme_ratios_and_probabilities_are_finite(name, dtype):
    logps, old, adv = _extreme_inputs(dtype)
    assert (logps - old).abs().max() >= 49
    for hp in SAFETY_HP[name]:
        loss, grad = run(name, logps, old, adv, **hp)
        assert loss.dtype == dtype or loss.dtype == torch.float32, loss.dtype
        assert torch.isfinite(loss).all(), (hp, loss)
        assert torch.isfinite(grad).all(), (hp, grad)


@pytest.mark.parametrize("pad_old", [float("-inf"), -1e4, -1e30])
@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_padding_old_logps_do_not_poison_other_positions(name, pad_old):
    g = torch.Generator().manual_seed(2)
    old = -torch.rand(2, 6, generator=g) * 3
    logps = old + torch.randn(2, 6, generator=g) * 0.5
    adv = torch.tensor([[1.0], [-1.0]])
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[:, 4:] = False
    ref_loss, ref_grad = run(name, logps[:, :4], old[:, :4], adv)

    old_padded = old.clone()
    old_padded[~mask] = pad_old
    lp = logps.clone().requires_grad_(True)
    per_token = policy_loss(name, lp, old_padded, adv, mask=mask)  # the sequence-aware losses count only `mask`
    torch.where(mask, per_token, torch.zeros_like(per_token)).sum().backward()
    assert torch.isfinite(lp.grad[mask]).all()
    torch.testing.assert_close(per_token.detach()[:, :4], ref_loss)
    torch.testing.assert_close(lp.grad[:, :4], ref_grad)


@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_padding_with_equal_very_negative_logps_is_finite(name):
    """Padding filled with the same very negative value in both log-prob tensors (ratio 1) stays finite everywhere,
    also under TRL's multiplicative masking."""
    old = torch.tensor([[-1.0, -0.5, -1e4, -1e4], [-0.3, -2.0, -1e4, -1e4]])
    logps = torch.tensor([[-0.9, -0.7, -1e4, -1e4], [-0.2, -2.5, -1e4, -1e4]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    lp = logps.clone().requires_grad_(True)
    per_token = policy_loss(name, lp, old, torch.tensor([[1.0], [-1.0]]))
    total = (per_token * mask).sum()
    total.backward()
    assert torch.isfinite(total) and torch.isfinite(lp.grad).all()


# ------------------------------------------------------------------------------------------------------------------
# Shapes
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_advantage_shapes_b1_and_bt_agree(name):
    g = torch.Generator().manual_seed(3)
    B, T = 3, 7
    old = -torch.rand(B, T, generator=g, dtype=F64) * 4
    logps = old + torch.randn(B, T, generator=g, dtype=F64) * 0.6
    adv = torch.randn(B, 1, generator=g, dtype=F64)
    loss1, grad1 = run(name, logps, old, adv)
    loss2, grad2 = run(name, logps, old, adv.expand(B, T).contiguous())
    assert loss1.shape == (B, T) and grad1.shape == (B, T)
    torch.testing.assert_close(loss1, loss2, rtol=0, atol=0)
    torch.testing.assert_close(grad1, grad2, rtol=0, atol=0)


# M2PO ranks the micro-batch's tokens by their own log-ratio: it takes one per token
@pytest.mark.parametrize("name", [name for name in POLICY_LOSSES if name != "m2po"])
def test_sequence_level_log_ratio_broadcasts_against_per_token_bounds(name):
    """GSPO-style (B, 1) log ratio with (B, T) bounds: same as the expanded (B, T) log ratio, and the gradient of
    the (B, 1) ratio is the sum over T of the per-token gradients."""
    g = torch.Generator().manual_seed(4)
    B, T = 4, 6
    old = torch.log(torch.rand(B, T, generator=g, dtype=F64) * 0.9 + 0.05)
    spec = policy_loss_spec(name)
    context = {key: value for key, value in (("mask", torch.ones(B, T)), ("old_logps", old)) if key in spec.context}
    lower, upper = spec.bounds(old)
    if not torch.is_tensor(lower):  # scalar-bound losses: feed them per-token bounds (any broadcastable bounds work)
        lower, upper = policy_loss_spec("band").bounds(old)
    assert lower.shape == (B, T)
    seq_log_ratio = torch.randn(B, 1, generator=g, dtype=F64) * 0.5
    adv = torch.randn(B, 1, generator=g, dtype=F64)

    x1 = seq_log_ratio.clone().requires_grad_(True)
    out1 = spec.loss(x1, adv, lower, upper, **context)
    out1.sum().backward()
    x2 = seq_log_ratio.expand(B, T).clone().requires_grad_(True)
    out2 = spec.loss(x2, adv, lower, upper, **context)
    out2.sum().backward()
    assert out1.shape == (B, T)
    torch.testing.assert_close(out1, out2)
    torch.testing.assert_close(x1.grad, x2.grad.sum(dim=1, keepdim=True))


# ------------------------------------------------------------------------------------------------------------------
# policy_loss errors
# ------------------------------------------------------------------------------------------------------------------


def test_unknown_name_raises_value_error_listing_names():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError) as info:
        policy_loss("ppo_plus", x, x, torch.ones(1, 1))
    for name in POLICY_LOSSES:
        assert name in str(info.value)
    builtin = {"clip", "band", "relaxed_band", "dgpo", "gppo", "ce_gppo", "aspo", "dcpo", "cispo", "band_dgpo"}
    builtin |= {"dppo_tv", "dppo_kl", "spo", "drpo", "ipo", "cppo", "trm", "m2po", "icepop"}
    assert set(POLICY_LOSSES) == builtin


@pytest.mark.parametrize(
    "name,allowed",
    [
        ("clip", ["delta", "epsilon_high", "epsilon_low"]),
        ("dgpo", ["epsilon_high", "epsilon_low", "m", "n"]),
        ("band", ["delta", "radius", "upper_max"]),
        ("ce_gppo", ["beta1", "beta2"]),
        ("aspo", ["c_neg", "c_pos"]),
        ("cppo", ["radius", "rate_min", "w_min"]),
        ("trm", ["divergence", "epsilon_high", "epsilon_low", "reduce", "threshold"]),
        ("icepop", ["epsilon_high", "epsilon_low", "high", "low"]),
    ],
)
def test_unknown_hyperparameter_raises_type_error_listing_allowed(name, allowed):
    x = torch.zeros(1, 2)
    with pytest.raises(TypeError) as info:
        policy_loss(name, x, x, torch.ones(1, 1), epsilon=0.2)
    msg = str(info.value)
    assert "epsilon" in msg
    for hp in allowed:
        assert hp in msg


def test_policy_bounds_returns_each_losss_bounds():
    """The public `policy_bounds` against closed forms: TV Band at p = 0.08 is [1 - delta/p, 1 + delta/p] =
    [0.375, 1.625]; the clip interval is a pair of floats; DCPO at p = 0.5 with eps 0.16 / 0.2 is
    [1/2 + 1/2 sqrt(1 - 0.64/0.5 clamped at 0), 1/2 + 1/2 sqrt(1 + 0.8/0.5)]."""
    old = torch.log(torch.tensor([[0.08, 0.5]], dtype=torch.float64))
    lower, upper = policy_bounds("band", old, divergence="tv", radius=0.05, upper_max=None)
    assert lower[0, 0].item() == pytest.approx(0.375, rel=1e-12) and upper[0, 0].item() == pytest.approx(1.625)
    assert policy_bounds("clip", old, epsilon_low=0.2, epsilon_high=0.28) == (0.8, 1.28)
    lower, upper = policy_bounds("dcpo", old)
    assert lower[0, 1].item() == pytest.approx(0.5) and upper[0, 1].item() == pytest.approx(0.5 + 0.5 * 2.6**0.5)
    with pytest.raises(TypeError, match="unknown hyperparameters"):
        policy_bounds("clip", old, radius=0.05)


@pytest.mark.parametrize(
    "tensor, dtype",
    [(torch.tensor([[-1, -2]]), "torch.int64"), (torch.tensor([[-1.0 + 0j, -0.5 + 0j]]), "torch.complex64")],
    ids=["int64", "complex"],
)
@pytest.mark.parametrize("which", ["logps", "old_logps"])
@pytest.mark.parametrize("name", ["clip", "band", "dgpo"])
def test_policy_loss_names_a_non_float_tensor_by_its_dtype(tensor, dtype, which, name):
    good = torch.log(torch.tensor([[0.3, 0.6]]))
    logps, old_logps = (tensor, good) if which == "logps" else (good, tensor)
    with pytest.raises(ValueError, match=rf"^{which} must be floating point, got dtype {dtype}\.$"):
        policy_loss(name, logps, old_logps, torch.tensor([1.0]))


def test_dcpo_upper_max_none_is_no_cap():
    """`upper_max=None` means no cap, as for the Band: DCPO's upper bound at p = 0.001 with eps_high = 0.2 is
    1/2 + 1/2 sqrt(1 + 0.8 / 0.001) = 1/2 + 1/2 sqrt(801) (about 14.65, above the default cap of 10)."""
    from trl_bandpo.core.losses import dcpo_bounds

    old = torch.log(torch.tensor([[0.001, 0.5]], dtype=torch.float64))
    lower, upper = policy_bounds("dcpo", old, upper_max=None)
    assert upper[0, 0].item() == pytest.approx(0.5 + 0.5 * 801**0.5, rel=1e-12)
    assert upper[0, 1].item() == pytest.approx(0.5 + 0.5 * 2.6**0.5, rel=1e-12)
    assert policy_bounds("dcpo", old)[1][0, 0].item() == 10.0  # the default cap
    lower, upper = dcpo_bounds(old, upper_max=None)
    assert upper[0, 0].item() == pytest.approx(0.5 + 0.5 * 801**0.5, rel=1e-12)
    loss = policy_loss("dcpo", old.clone().requires_grad_(), old, torch.tensor([1.0]), upper_max=None)
    assert bool(torch.isfinite(loss).all())

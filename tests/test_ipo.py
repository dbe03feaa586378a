"""prime-rl's IPO (`ipo`) against its per-token loss, transcribed below from the formula of prime-rl's `ipo_loss_fn`
(and of the IPO that was prime-rl's default loss from March to April 2026), and against tokens computed by hand; its
relation to DPPO-Binary-TV (docs/band-and-dppo.md, "prime-rl's IPO").

prime-rl's loss, per token, with `log r = log pi - log mu` (mu: the inference engine's log-prob of the token): the
token is masked when `pi - mu` exceeds the upper threshold or `mu - pi` the lower one, whatever the advantage; the
loss is `-adv_tau * A * r` on kept tokens plus `kl_tau * (log r)^2` on every token, differentiated as it is.
"""

from __future__ import annotations

import math

import pytest
import torch

from trl_bandpo import PolicyLossConfig, policy_loss

F64 = torch.float64
CPU = dict(output_dir="unused", use_cpu=True, report_to="none")


def reference_loss(logps, old_logps, advantages, low, high, kl_tau, adv_tau):
    """prime-rl's per-token IPO loss, written out from its formula (no code of this package). With low == high it
    is the current `ipo_loss_fn` (`|pi - mu| > ipo_threshold`); with two thresholds, the March 2026 default."""
    log_r = logps - old_logps
    r = torch.exp(log_r)
    moved = torch.exp(logps) - torch.exp(old_logps)
    masked = (moved > high) | (moved < -low)
    return -(~masked).to(r.dtype) * adv_tau * advantages * r + kl_tau * log_r**2


def run(fn, logps, *args, **kwargs):
    logps = logps.detach().clone().requires_grad_(True)
    loss = fn(logps, *args, **kwargs)
    loss.sum().backward()
    return loss.detach(), logps.grad


def ours(logps, old_logps, advantages, **hp):
    return run(lambda lp: policy_loss("ipo", lp, old_logps, advantages, **hp), logps)


def sample(n=4000, seed=0):
    """(p, q, A) in float64: p log-uniform in [1e-6, 1) and uniform in (0, 1), q = r p <= 1 with r log-uniform in
    [0.01, 100], A of both signs and 0."""
    g = torch.Generator().manual_seed(seed)
    half = n // 2
    tails = 10 ** (-6 * torch.rand(half, generator=g, dtype=F64))
    p = torch.cat([tails, torch.rand(n - half, generator=g, dtype=F64)])
    p = p.clamp(1e-6, 1 - 1e-9)
    r = torch.exp(torch.empty(n, dtype=F64).uniform_(math.log(0.01), math.log(100.0), generator=g))
    q = torch.minimum(r * p, torch.full_like(p, 1 - 1e-12))
    a = torch.randn(n, generator=g, dtype=F64)
    a[::17] = 0.0
    return p[None], q[None], a[None]


def away_from_the_thresholds(p, q, low, high, margin=1e-9):
    return ((q - p - high).abs() > margin) & ((p - q - low).abs() > margin)


@pytest.mark.parametrize(
    "low,high,kl_tau,adv_tau",
    [(0.1, 0.1, 1e-3, 1.0), (0.2, 0.2, 1e-3, 1.0), (0.05, 0.3, 0.0, 1.0), (0.1, 0.1, 0.5, 2.0)],
)
def test_values_and_gradients_match_prime_rl(low, high, kl_tau, adv_tau):
    p, q, a = sample()
    ok = away_from_the_thresholds(p, q, low, high)
    assert ok.float().mean() > 0.99
    hp = dict(mask_low=low, mask_high=high, kl_tau=kl_tau, adv_tau=adv_tau)
    loss, grad = ours(q.log(), p.log(), a, **hp)
    ref_loss, ref_grad = run(reference_loss, q.log(), p.log(), a, low, high, kl_tau, adv_tau)
    torch.testing.assert_close(loss[ok], ref_loss[ok], rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(grad[ok], ref_grad[ok], rtol=1e-10, atol=1e-14)
    # the gradient on grad log pi derived by hand: -(A adv_tau r [kept]) + 2 kl_tau log r
    moved = q - p
    kept = ~((moved > high) | (moved < -low))
    r = q / p
    torch.testing.assert_close(grad[ok], (-(kept * adv_tau * a * r) + 2 * kl_tau * r.log())[ok], rtol=1e-9, atol=1e-14)
    # masked tokens of both advantage signs occur, on both sides
    for side in (moved > high, moved < -low):
        for sign in (a > 0, a < 0):
            assert (side & sign & ok).any()


def test_defaults_are_prime_rls_ipo_config():
    """`IPOLossConfig`: ipo_threshold 0.1, kl_tau 1e-3, adv_tau 1.0 (and the config fields' defaults are the same)."""
    p, q, a = sample(seed=1)
    ok = away_from_the_thresholds(p, q, 0.1, 0.1)
    loss, grad = ours(q.log(), p.log(), a)
    ref_loss, ref_grad = run(reference_loss, q.log(), p.log(), a, 0.1, 0.1, 1e-3, 1.0)
    torch.testing.assert_close((loss[ok], grad[ok]), (ref_loss[ok], ref_grad[ok]), rtol=1e-10, atol=1e-14)
    config = PolicyLossConfig(**CPU, policy_loss="ipo")
    assert (config.ipo_mask_low, config.ipo_mask_high, config.ipo_kl_tau, config.ipo_adv_tau) == (0.1, 0.1, 1e-3, 1.0)


def test_hand_computed_tokens():
    """Defaults (thresholds 0.1, kl_tau 1e-3). p = 0.5, q = 0.55 (r = 1.1, moved +0.05): kept;
    A = 1: loss = -1.1 + 1e-3 ln(1.1)^2 = -1.1 + 9.0840e-6, w = 1.1 - 2e-3 ln 1.1 = 1.0998094.
    p = 0.5, q = 0.65 (r = 1.3, +0.15): masked for A = +1 and for A = -1 alike: loss = 1e-3 ln(1.3)^2 = 6.8835e-5,
    gradient on log pi 2e-3 ln 1.3 = 5.2473e-4 (the KL term only). p = 0.5, q = 0.35 (r = 0.7, -0.15): masked
    for A = +1 (DPPO would keep it). A = 0, r = 1.3: the KL term still applies."""
    old = torch.log(torch.full((1, 6), 0.5, dtype=F64))
    new = torch.log(torch.tensor([[0.55, 0.65, 0.65, 0.35, 0.65, 0.5]], dtype=F64))
    a = torch.tensor([[1.0, 1.0, -1.0, 1.0, 0.0, 1.0]], dtype=F64)
    loss, grad = ours(new, old, a)
    kl13, kl07, kl11 = (1e-3 * math.log(x) ** 2 for x in (1.3, 0.7, 1.1))
    want_loss = torch.tensor([[-1.1 + kl11, kl13, kl13, kl07, kl13, -1.0]], dtype=F64)
    want_grad = torch.tensor(
        [[-1.1 + 2e-3 * math.log(1.1), 2e-3 * math.log(1.3), 2e-3 * math.log(1.3), 2e-3 * math.log(0.7),
          2e-3 * math.log(1.3), -1.0]], dtype=F64
    )  # fmt: skip
    torch.testing.assert_close(loss, want_loss, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-15)
    assert loss[0, 0].item() == pytest.approx(-1.0999909160, abs=1e-9)


def test_the_bounds_are_dppo_tvs_region():
    from trl_bandpo import policy_bounds

    old = torch.log(torch.tensor([[0.05, 0.5, 0.95]], dtype=F64))
    lower, upper = policy_bounds("ipo", old, mask_low=0.1, mask_high=0.2)
    torch.testing.assert_close(lower, torch.tensor([[0.0, 0.8, 1 - 0.1 / 0.95]], dtype=F64))
    torch.testing.assert_close(upper, torch.tensor([[5.0, 1.4, 1 / 0.95]], dtype=F64))


def test_relation_to_dppo_tv():
    """Without the KL term (kl_tau 0) and DPPO's truncation (ratio_cap None), IPO and DPPO-Binary-TV of the same radii
    weigh a token the same unless it left the region against its advantage (r < lower with A > 0, r > upper with
    A < 0): DPPO keeps r there, IPO masks it (docs/band-and-dppo.md)."""
    p, q, a = sample(seed=2)
    ok = away_from_the_thresholds(p, q, 0.1, 0.2) & (a != 0)
    _, g_ipo = ours(q.log(), p.log(), a, mask_low=0.1, mask_high=0.2, kl_tau=0.0)
    _, g_dppo = run(
        lambda lp: policy_loss("dppo_tv", lp, p.log(), a, radius_low=0.1, radius_high=0.2, ratio_cap=None), q.log()
    )
    against = ((a > 0) & (p - q > 0.1)) | ((a < 0) & (q - p > 0.2))
    assert (against & ok).any() and (~against & ok).any()
    torch.testing.assert_close(g_ipo[ok & ~against], g_dppo[ok & ~against], rtol=1e-12, atol=0)
    assert torch.all(g_ipo[ok & against] == 0)
    torch.testing.assert_close(g_dppo[ok & against], (-a * q / p)[ok & against], rtol=1e-12, atol=0)


def test_extreme_inputs_are_finite():
    old = torch.log(torch.tensor([[0.3, 0.3, 0.3, 0.3]], dtype=F64))
    logps = old + torch.tensor([[-1000.0, 0.0, 100.0, 1000.0]], dtype=F64)
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        loss, grad = ours(logps.to(dtype), old.to(dtype), torch.tensor([[1.0, -1.0, -1.0, 0.0]]))
        assert torch.isfinite(loss).all() and torch.isfinite(grad.float()).all()
    padded_old = torch.tensor([[float("-inf"), -1e30, -0.5, -0.5]])  # padding: finite, so TRL's `loss * mask` is too
    loss, grad = ours(torch.tensor([[-3.0, -3.0, -0.7, -0.4]]), padded_old, torch.tensor([[1.0, -1.0, 1.0, -1.0]]))
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
    assert torch.equal(grad[:, :2], torch.zeros(1, 2))


# --- Metrics, config, trainer -----------------------------------------------------------------------------------


def test_metrics_count_by_hand():
    """p = 0.5 for all; ratios 1.3 (up 0.15: masked high), 0.7 (down 0.15: masked low), 1.1 (kept), 1.0 (kept), 2.0
    (outside the mask). k3 = r - ln r - 1: 0.3 - ln 1.3, -0.3 - ln 0.7, 0.1 - ln 1.1, 0."""
    from trl_bandpo.core.losses import ipo_bounds, ipo_metrics

    old = torch.log(torch.full((1, 5), 0.5, dtype=F64))
    log_ratio = torch.log(torch.tensor([[1.3, 0.7, 1.1, 1.0, 2.0]], dtype=F64))
    a = torch.tensor([[1.0, 1.0, -1.0, 0.0, 1.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    counts = ipo_metrics(log_ratio, a, *ipo_bounds(old), mask)
    values = {k: (float(n), float(d)) for k, (n, d) in counts.items()}
    assert values["ipo/is_masked"] == (2.0, 4.0)
    assert values["ipo/is_masked_low"] == (1.0, 4.0) and values["ipo/is_masked_high"] == (1.0, 4.0)
    masked_kl = (0.3 - math.log(1.3)) + (-0.3 - math.log(0.7))
    assert values["ipo/masked_mismatch_kl"] == pytest.approx((masked_kl, 2.0), rel=1e-12)
    assert values["ipo/unmasked_mismatch_kl"] == pytest.approx((0.1 - math.log(1.1), 2.0), rel=1e-12)


@pytest.mark.parametrize(
    "fields,needle",
    [
        (dict(ipo_mask_low=0.0), "ipo_mask_low"),
        (dict(ipo_mask_high=-0.1), "ipo_mask_high"),
        (dict(ipo_mask_high="0.1"), "ipo_mask_high"),
        (dict(ipo_kl_tau=-1e-3), "ipo_kl_tau"),
        (dict(ipo_kl_tau=float("inf")), "ipo_kl_tau"),
        (dict(ipo_adv_tau=float("nan")), "ipo_adv_tau"),
        (dict(ipo_adv_tau=None), "ipo_adv_tau"),
        (dict(delta=10.0), "delta"),
        (dict(importance_sampling_level="sequence"), "importance_sampling_level"),
    ],
)
def test_config_refuses_bad_ipo_settings(fields, needle):
    with pytest.raises(ValueError, match=needle):
        PolicyLossConfig(**CPU, policy_loss="ipo", **fields)


def test_ipo_trains_and_logs_its_metrics(tiny_model_dir, tmp_path):
    from test_trainers import addition_dataset, shaped_reward, train_args

    from trl_bandpo import BandPOTrainer

    args = train_args(PolicyLossConfig, tmp_path, policy_loss="ipo", loss_type="dapo", ipo_kl_tau=0.01, max_steps=2)
    trainer = BandPOTrainer(
        model=tiny_model_dir, reward_funcs=shaped_reward, args=args, train_dataset=addition_dataset()
    )
    trainer.train()
    steps = [e for e in trainer.state.log_history if "loss" in e]
    assert steps and all(math.isfinite(e["loss"]) for e in steps)
    names = {"ipo/is_masked", "ipo/unmasked_mismatch_kl", "clip_ratio/any_sign_mean", "bounds/upper_mean"}
    assert all(names <= set(e) for e in steps)
    # IPO masks exactly the tokens outside the bounds, whatever the advantage: BandPO's any-sign count
    assert all(e["ipo/is_masked"] == pytest.approx(e["clip_ratio/any_sign_mean"]) for e in steps)


def test_grid_covers_tokens_far_outside_the_region():
    """The sampled grid reaches ratios near 100 and 1/100, far beyond every threshold used above."""
    p, q, _ = sample()
    assert (q / p).max() > 50 and (q / p).min() < 0.02

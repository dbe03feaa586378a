"""DPPO-Binary (`dppo_tv`, `dppo_kl`) against its definition written out by hand, and its exact relation to Band
(docs/band-and-dppo.md): with matching caps the two give identical gradients, token for token."""

from __future__ import annotations

import math

import pytest
import torch

from trl_bandpo import PolicyLossConfig, policy_loss


def binary_kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """KL(Bern(p) || Bern(q)) in float64, written out."""
    return p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q))


def dppo_mask(p, q, advantages, divergence, radius_low, radius_high):
    """DPPO-Binary's mask as the paper and verl define it: a token is masked when the update leaves the region in
    the direction its advantage pushes."""
    if divergence == "tv":
        return ((advantages > 0) & (q - p > radius_high)) | ((advantages < 0) & (p - q > radius_low))
    d = binary_kl(p, q)
    return ((advantages > 0) & (d > radius_high) & (q > p)) | ((advantages < 0) & (d > radius_low) & (q < p))


def weights_and_values(name, logps, old_logps, advantages, **hyperparameters):
    """(w, value): w = -(d loss / d log pi) / A, the weight on grad log pi, and value = -loss / A."""
    logps = logps.clone().requires_grad_(True)
    loss = policy_loss(name, logps, old_logps, advantages, **hyperparameters)
    loss.sum().backward()
    return -logps.grad / advantages, -loss.detach() / advantages


def sample(n=4000, seed=0):
    """Random (p, r, A) in float64: p log-uniform in [1e-6, 1 - 1e-6] (both tails), r log-uniform in [0.02, 200]
    and capped at 1/p (q = r p <= 1), A of both signs."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=g, dtype=torch.float64)
    p = torch.where(u < 0.5, 10 ** (-6 * torch.rand(n, generator=g, dtype=torch.float64)), 0.5)
    p = torch.where(u >= 0.75, 1 - 10 ** (-6 * torch.rand(n, generator=g, dtype=torch.float64)), p)
    p = torch.where((u >= 0.5) & (u < 0.75), torch.rand(n, generator=g, dtype=torch.float64) * 0.98 + 0.01, p)
    r = torch.exp(torch.empty(n, dtype=torch.float64).uniform_(math.log(0.02), math.log(200), generator=g))
    q = torch.minimum(r * p, torch.full_like(p, 1 - 1e-12))
    a = torch.where(torch.rand(n, generator=g, dtype=torch.float64) < 0.5, -1.0, 1.0) * (
        0.1 + torch.rand(n, generator=g, dtype=torch.float64)
    )  # noqa: E501
    return p.reshape(1, -1), q.reshape(1, -1), a.reshape(1, -1)


def away_from_the_boundary(p, q, divergence, radius_low, radius_high, margin=1e-9):
    """Points whose divergence is not within `margin` of either radius (there the float root decides the side)."""
    d = (q - p).abs() if divergence == "tv" else binary_kl(p, q)
    return ((d - radius_low).abs() > margin) & ((d - radius_high).abs() > margin)


@pytest.mark.parametrize("divergence,radius", [("tv", 0.15), ("kl", 0.05), ("kl", 0.3)])
@pytest.mark.parametrize("ratio_cap", [20.0, None, 1.5])
def test_weights_and_values_follow_the_definition(divergence, radius, ratio_cap):
    p, q, a = sample()
    name = f"dppo_{divergence}"
    w, value = weights_and_values(name, q.log(), p.log(), a, radius=radius, ratio_cap=ratio_cap)
    r = q / p
    truncated = r if ratio_cap is None else r.clamp(max=ratio_cap)
    want_w = torch.where(dppo_mask(p, q, a, divergence, radius, radius), 0.0, truncated)
    ok = away_from_the_boundary(p, q, divergence, radius, radius)
    assert ok.float().mean() > 0.99
    torch.testing.assert_close(w[ok], want_w[ok], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(value, truncated, rtol=1e-12, atol=0)
    masked = dppo_mask(p, q, a, divergence, radius, radius) & ok
    assert masked.any() and (~masked & ok).any()  # both cases occur on this grid


@pytest.mark.parametrize("divergence", ["tv", "kl"])
def test_asymmetric_radii_apply_to_their_side(divergence):
    p, q, a = sample(seed=1)
    low, high = (0.1, 0.2) if divergence == "tv" else (0.02, 0.08)
    w, _ = weights_and_values(
        f"dppo_{divergence}", q.log(), p.log(), a, radius_low=low, radius_high=high, ratio_cap=None
    )
    want = torch.where(dppo_mask(p, q, a, divergence, low, high), 0.0, q / p)
    ok = away_from_the_boundary(p, q, divergence, low, high)
    torch.testing.assert_close(w[ok], want[ok], rtol=1e-9, atol=1e-12)


def test_hand_computed_tokens():
    """KL δ = 0.05: p = 0.5, q = 0.9 has KL = 0.5 ln(0.5/0.9) + 0.5 ln(0.5/0.1) = 0.5108 > δ, q > p: masked for A > 0,
    kept for A < 0 (w = r = 1.8); p = 0.2, q = 0.3 has KL = 0.0257 < δ: kept, w = 1.5. TV δ = 0.15: p = 0.5, q = 0.6
    (|Δ| = 0.1): kept; q = 0.7 (0.2): masked for A > 0."""
    old = torch.log(torch.tensor([[0.5, 0.5, 0.2]], dtype=torch.float64))
    new = torch.log(torch.tensor([[0.9, 0.9, 0.3]], dtype=torch.float64))
    w, _ = weights_and_values("dppo_kl", new, old, torch.tensor([[1.0, -1.0, 1.0]], dtype=torch.float64))
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.8, 1.5]], dtype=torch.float64))
    old = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    new = torch.log(torch.tensor([[0.6, 0.7]], dtype=torch.float64))
    w, _ = weights_and_values("dppo_tv", new, old, torch.tensor([[1.0, 1.0]], dtype=torch.float64))
    torch.testing.assert_close(w, torch.tensor([[1.2, 0.0]], dtype=torch.float64))


# --- The relation to Band -------------------------------------------------------------------------------------


@pytest.mark.parametrize("divergence", ["tv", "kl"])
@pytest.mark.parametrize("per_token", [False, True])
def test_band_and_dppo_give_identical_gradients_with_matching_caps(divergence, per_token):
    """Band (no cap, no dual clip) and DPPO (no truncation) weigh every token the same: 0 where the token left the
    region in its advantage's direction, r elsewhere."""
    p, q, a = sample(seed=2)
    radius = 0.05 if divergence == "kl" else 0.15
    if per_token:  # a different radius per token, as the adaptive radius gives
        g = torch.Generator().manual_seed(3)
        radius = torch.empty_like(p).uniform_(0.5 * radius, 2 * radius, generator=g)
    w_band, _ = weights_and_values(
        "band", q.log(), p.log(), a, radius=radius, divergence=divergence, upper_max=None, solver="torch"
    )
    w_dppo, _ = weights_and_values(f"dppo_{divergence}", q.log(), p.log(), a, radius=radius, ratio_cap=None)
    assert torch.equal(w_band, w_dppo)


def test_where_the_caps_differ_the_documented_difference_holds():
    """With the authors' caps the two differ exactly where docs/band-and-dppo.md says: DPPO truncates a kept token's
    weight at C (Band keeps r, or 0 under its dual clip); Band's upper_max zeroes a positive-advantage token between
    the cap and the region's edge (DPPO keeps min(r, C))."""
    p, q, a = sample(seed=4)
    r = q / p
    w_dppo, _ = weights_and_values("dppo_kl", q.log(), p.log(), a, radius=0.05, ratio_cap=20.0)
    w_free, _ = weights_and_values("dppo_kl", q.log(), p.log(), a, radius=0.05, ratio_cap=None)
    w_band, _ = weights_and_values("band", q.log(), p.log(), a, radius=0.05, upper_max=10.0, solver="torch")
    kept = w_free != 0
    torch.testing.assert_close(w_dppo[kept & (r > 20)], torch.full_like(r[kept & (r > 20)], 20.0))
    assert (kept & (r > 20)).any()
    between = kept & (a > 0) & (r > 10)  # inside DPPO's region, above Band's cap
    assert between.any() and torch.all(w_band[between] == 0)
    same = ~(kept & (r > 10))
    assert torch.equal(w_band[same], w_dppo[same])


# --- Metrics, config, trainer -----------------------------------------------------------------------------------


def test_metrics_count_masked_and_truncated_tokens():
    from trl_bandpo.core.losses import dppo_kl_bounds, dppo_metrics

    # p = 0.5 for all; ratios 1.8 (masked if A > 0), 1.0, 0.2 (KL(0.5||0.1) = 0.51 > δ: masked if A < 0), 1.9
    old = torch.log(torch.full((1, 4), 0.5, dtype=torch.float64))
    log_ratio = torch.log(torch.tensor([[1.8, 1.0, 0.2, 1.9]], dtype=torch.float64))
    a = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    lower, upper = dppo_kl_bounds(old, radius=0.05)
    counts = dppo_metrics(log_ratio, a, lower, upper, torch.ones(1, 4), ratio_cap=1.5)
    values = {k: (float(n), float(d)) for k, (n, d) in counts.items()}
    assert values["dppo/masked_pos_share"] == (1.0, 2.0)
    assert values["dppo/masked_neg_share"] == (1.0, 2.0)
    assert values["dppo/truncated_share"] == (1.0, 4.0)  # the kept 1.9 (A < 0) is above C = 1.5


@pytest.mark.parametrize(
    "fields,needle",
    [
        (dict(dppo_kl_radius=0.0), "dppo_kl_radius"),
        (dict(dppo_ratio_cap=0.5), "dppo_ratio_cap"),
        (dict(dppo_radius_low=-1.0), "dppo_radius_low"),
        (dict(delta=10.0), "delta"),
        (dict(importance_sampling_level="sequence"), "importance_sampling_level"),
    ],
)
def test_config_refuses_bad_dppo_settings(fields, needle):
    with pytest.raises(ValueError, match=needle):
        PolicyLossConfig(output_dir="unused", use_cpu=True, report_to="none", policy_loss="dppo_kl", **fields)


def test_dppo_trains_and_logs_its_metrics(tiny_model_dir, tmp_path):
    from test_trainers import addition_dataset, shaped_reward, train_args

    from trl_bandpo import BandPOTrainer

    args = train_args(PolicyLossConfig, tmp_path, policy_loss="dppo_tv", max_steps=2)
    trainer = BandPOTrainer(
        model=tiny_model_dir, reward_funcs=shaped_reward, args=args, train_dataset=addition_dataset()
    )
    trainer.train()
    steps = [e for e in trainer.state.log_history if "loss" in e]
    assert steps and all(math.isfinite(e["loss"]) for e in steps)
    assert all({"dppo/masked_pos_share", "dppo/truncated_share", "bounds/upper_mean"} <= set(e) for e in steps)


def test_per_token_radii_are_for_the_pure_api_only():
    with pytest.raises(ValueError, match="dppo_kl_radius must be a number in a config"):
        PolicyLossConfig(output_dir="unused", use_cpu=True, report_to="none", dppo_kl_radius=torch.tensor(0.05))
    old = torch.log(torch.full((1, 3), 0.5))
    with pytest.raises(ValueError, match="radius must be a number or a floating-point tensor that does not require"):
        policy_loss("dppo_kl", old.clone(), old, 1.0, radius=torch.full((1, 3), 0.05, requires_grad=True))
    with pytest.raises(ValueError, match="radius"):  # a per-token radius must broadcast to the old log-probs
        policy_loss("dppo_tv", old.clone(), old, 1.0, radius=torch.full((2, 5), 0.05))

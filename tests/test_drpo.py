"""DRPO and SPO (`drpo`, `spo`) against the DRPO authors' per-token loss, transcribed below from its formula, and
against tokens computed by hand (docs/policy-losses.md, "SPO and DRPO").

The authors' function (UniRL, `unirl/algorithms/drpo.py`, `_drpo_loss`) computes, per token, with `mu` the old
probability: the log-ratio clamped to [-20, 20], `r` its exponential, the penalty `|A| * c * (r - 1)^2 / (2 eps)` with
`c = mu` (DRPO, `penalty_mu_weighted=True`) or `c = 1` (SPO), and the loss `-A r + penalty`, differentiated as it is.
"""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch

from trl_bandpo import PolicyLossConfig, policy_loss

F64 = torch.float64
CPU = dict(output_dir="unused", use_cpu=True, report_to="none")


def reference_loss(logps, old_logps, advantages, eps, mu_weighted):
    """The authors' per-token loss, written out in float64 from its formula (no code of this package)."""
    log_r = torch.clamp(logps - old_logps, min=-20.0, max=20.0)
    r = torch.exp(log_r)
    c = torch.exp(old_logps) if mu_weighted else torch.ones_like(old_logps)
    return -advantages * r + advantages.abs() * c * (r - 1.0) ** 2 / (2.0 * eps)


def reference_weight(logps, old_logps, advantages, eps, mu_weighted):
    """The weight on grad log pi derived by hand from the loss: d loss / d log pi = r (-A + |A| c (r - 1) / eps), so
    w = -(d loss / d log pi) / A = r (1 - sign(A) c (r - 1) / eps), which is r (1 - sign(A) (pi - mu) / eps) for DRPO
    (c = mu, c (r - 1) = pi - mu); 0 where the clamp holds the log-ratio."""
    log_r = logps - old_logps
    r = torch.exp(log_r.clamp(-20.0, 20.0))
    c = torch.exp(old_logps) if mu_weighted else torch.ones_like(old_logps)
    w = r * (1.0 - torch.sign(advantages) * c * (r - 1.0) / eps)
    return torch.where(log_r.abs() > 20.0, torch.zeros_like(w), w)


def ours(name, logps, old_logps, advantages, **hp):
    """(per-token loss, gradient of its sum with respect to the log-probs) of the registered loss."""
    logps = logps.detach().clone().requires_grad_(True)
    loss = policy_loss(name, logps, old_logps, advantages, **hp)
    loss.sum().backward()
    return loss.detach(), logps.grad


def reference(logps, old_logps, advantages, eps, mu_weighted):
    logps = logps.detach().clone().requires_grad_(True)
    loss = reference_loss(logps, old_logps, advantages, eps, mu_weighted)
    loss.sum().backward()
    return loss.detach(), logps.grad


PS = (1e-9, 1e-4, 0.02, 0.3, 0.7, 0.999)
# Ratios from far below to far above any region, both sides of the authors' clamp at exp(+-20) (where q = r p > 1 a
# token cannot reach the ratio, but the formula is still defined and is what the function computes).
LOG_RS = (-30.0, -21.0, -19.0, -6.0, -1.2, -0.3, -0.05, 0.0, 0.04, 0.2, 0.7, 1.5, 2.6, 4.0, 9.0, 19.5, 20.5, 28.0)
AS = (-2.5, -1.0, -0.3, 0.4, 1.0, 3.0)


def grid():
    rows = list(itertools.product(PS, LOG_RS, AS))
    p = torch.tensor([row[0] for row in rows], dtype=F64)
    log_r = torch.tensor([row[1] for row in rows], dtype=F64)
    a = torch.tensor([row[2] for row in rows], dtype=F64)
    old = torch.log(p)
    return (old + log_r)[None], old[None], a[None]


@pytest.mark.parametrize("name,mu_weighted", [("drpo", True), ("spo", False)])
@pytest.mark.parametrize("eps", [12.5, 1.0, 0.2, 0.01])
def test_values_and_gradients_match_the_authors_function(name, mu_weighted, eps):
    logps, old, a = grid()
    loss, grad = ours(name, logps, old, a, epsilon=eps)
    ref_loss, ref_grad = reference(logps, old, a, eps, mu_weighted)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)
    # and the weight derived by hand, token by token
    torch.testing.assert_close(-grad / a, reference_weight(logps, old, a, eps, mu_weighted), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name,mu_weighted", [("drpo", True), ("spo", False)])
def test_the_default_threshold_is_the_authors_and_both_regions_occur(name, mu_weighted):
    """Defaults: eps = 12.5 (UniRL `DRPOConfig.drpo_epsilon`). With eps = 0.2 the grid has tokens on both sides of
    the bounds, so the weights checked above include corrective (negative) ones and amplified ones."""
    logps, old, a = grid()
    loss, grad = ours(name, logps, old, a)
    torch.testing.assert_close(loss, reference_loss(logps, old, a, 12.5, mu_weighted), rtol=1e-10, atol=1e-12)
    _, grad = ours(name, logps, old, a, epsilon=0.2)
    w = -grad / a
    assert (w < 0).any() and (w > torch.exp((logps - old).clamp(-20, 20))).any() and (w == 0).any()


def test_drpo_weight_factor_stays_within_one_over_eps_for_reachable_tokens():
    """For q = r p <= 1, |q - p| <= 1, so DRPO's factor w / r = 1 - sign(A) (q - p) / eps is within [1 - 1/eps,
    1 + 1/eps]: at the default 12.5 no reachable token's weight changes sign (docs/policy-losses.md)."""
    logps, old, a = grid()
    reachable = (logps <= 0) & ((logps - old).abs() < 20)
    _, grad = ours("drpo", logps, old, a)
    factor = (-grad / a) / torch.exp(logps - old)
    assert reachable.sum() > 100
    low, high = 1 - 1 / 12.5 - 1e-12, 1 + 1 / 12.5 + 1e-12
    assert torch.all(factor[reachable] >= low) and torch.all(factor[reachable] <= high)


def test_hand_computed_tokens():
    """p = 0.5, q = 0.75 (r = 1.5), eps = 12.5:
    DRPO, A = +1: loss = -1.5 + 0.5 * 0.25 / 25 = -1.495; w = 1.5 (1 - 0.25 / 12.5) = 1.47.
    DRPO, A = -1: loss = 1.5 + 0.005 = 1.505; w = 1.5 (1 + 0.02) = 1.53.
    DRPO, eps = 0.1, A = +1: w = 1.5 (1 - 0.25 / 0.1) = -2.25 (past the boundary |q - p| = 0.1: corrective).
    SPO, eps = 0.25, r = 1.5, A = +1: loss = -1.5 + 0.25 / 0.5 = -1.0; w = 1.5 (1 - 0.5 / 0.25) = -1.5.
    SPO, eps = 12.5, r = 0.5, A = -2: loss = 1.0 + 2 * 0.25 / 25 = 1.02; w = 0.5 (1 + (0.5 - 1) / 12.5) = 0.48.
    log r = 25 (beyond the clamp), SPO, eps = 12.5, A = 1: loss at r = e^20, no gradient."""
    old = torch.log(torch.tensor([[0.5, 0.5]], dtype=F64))
    new = torch.log(torch.tensor([[0.75, 0.75]], dtype=F64))
    a = torch.tensor([[1.0, -1.0]], dtype=F64)
    loss, grad = ours("drpo", new, old, a)
    torch.testing.assert_close(loss, torch.tensor([[-1.495, 1.505]], dtype=F64))
    torch.testing.assert_close(-grad / a, torch.tensor([[1.47, 1.53]], dtype=F64))
    _, grad = ours("drpo", new[:, :1], old[:, :1], 1.0, epsilon=0.1)
    torch.testing.assert_close(-grad, torch.tensor([[-2.25]], dtype=F64))

    old = torch.log(torch.tensor([[0.4, 0.4, 1e-12]], dtype=F64))
    new = old + torch.tensor([[math.log(1.5), math.log(0.5), 25.0]], dtype=F64)
    loss, grad = ours("spo", new[:, :1], old[:, :1], 1.0, epsilon=0.25)
    torch.testing.assert_close((loss, -grad), (torch.tensor([[-1.0]], dtype=F64), torch.tensor([[-1.5]], dtype=F64)))
    loss, grad = ours("spo", new[:, 1:], old[:, 1:], torch.tensor([[-2.0, 1.0]], dtype=F64))
    e20 = math.exp(20.0)
    want = torch.tensor([[1.02, -e20 + (e20 - 1) ** 2 / 25]], dtype=F64)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, torch.tensor([[2.0 * 0.48, 0.0]], dtype=F64))


@pytest.mark.parametrize("name", ["drpo", "spo"])
def test_zero_advantage_and_padding_are_harmless(name):
    """A = 0: loss and gradient 0. Old log-probs of -inf or -1e30 (padding) and a ratio of exp(1000) stay finite."""
    old = torch.log(torch.tensor([[0.3, 0.3, 0.3]], dtype=F64))
    logps = old + torch.tensor([[0.0, 5.0, 1000.0]], dtype=F64)
    loss, grad = ours(name, logps, old, 0.0)
    assert torch.equal(loss.abs(), torch.zeros_like(loss)) and torch.equal(grad.abs(), torch.zeros_like(grad))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        loss, grad = ours(name, logps.to(dtype), old.to(dtype), torch.tensor([[1.0, -1.0, 1.0]]))
        assert loss.dtype == torch.float32 and torch.isfinite(loss).all() and torch.isfinite(grad.float()).all()
    padded_old = torch.tensor([[float("-inf"), -1e30, -0.5]])
    loss, grad = ours(name, torch.tensor([[-3.0, -3.0, -0.7]]), padded_old, torch.tensor([[1.0, -1.0, 1.0]]))
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all()


def test_bounds_are_where_the_weight_changes_sign():
    """DRPO: [max(1 - eps/p, 0), 1 + eps/p]; SPO: [max(1 - eps, 0), 1 + eps] (numbers)."""
    from trl_bandpo import policy_bounds

    old = torch.log(torch.tensor([[0.05, 0.5, 1.0]], dtype=F64))
    lower, upper = policy_bounds("drpo", old, epsilon=0.1)
    torch.testing.assert_close(lower, torch.tensor([[0.0, 0.8, 0.9]], dtype=F64))
    torch.testing.assert_close(upper, torch.tensor([[3.0, 1.2, 1.1]], dtype=F64))
    assert policy_bounds("spo", old, epsilon=0.2) == (0.8, 1.2)
    assert policy_bounds("spo", old) == (0.0, 13.5)


# --- Metrics, config, trainer -----------------------------------------------------------------------------------


def test_metrics_count_by_hand():
    """p = 0.5 for all, eps = 0.1 (DRPO bounds [0.8, 1.2]); ratios 1.5 (A > 0: reversed), 1.5 (A < 0: above but
    amplified), 0.5 (A < 0: reversed), 1.1 (inside). Penalties |A| p (r - 1)^2 / (2 eps): 0.625, 0.625, 0.625 * 2,
    0.025; the last token is masked out."""
    from trl_bandpo.core.losses import drpo_bounds, policy_loss_spec

    old = torch.log(torch.full((1, 5), 0.5, dtype=F64))
    log_ratio = torch.log(torch.tensor([[1.5, 1.5, 0.5, 1.1, 3.0]], dtype=F64))
    a = torch.tensor([[1.0, -1.0, -2.0, 1.0, 1.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    lower, upper = drpo_bounds(old, epsilon=0.1)
    counts = policy_loss_spec("drpo").metrics(log_ratio, a, lower, upper, mask)
    values = {k: (float(n), float(d)) for k, (n, d) in counts.items()}
    assert values["drpo/reversed_share"] == (2.0, 4.0)
    assert values["drpo/clipfrac_upper"] == (2.0, 4.0)
    assert values["drpo/clipfrac_lower"] == (1.0, 4.0)
    assert values["drpo/penalty_mean"][1] == 4.0
    assert values["drpo/penalty_mean"][0] == pytest.approx(0.625 * 4 + 0.025, rel=1e-12)
    spo = policy_loss_spec("spo")
    counts = spo.metrics(log_ratio, a, *spo.bounds(old, epsilon=0.2), mask)
    assert set(counts) == {"spo/penalty_mean", "spo/clipfrac_upper", "spo/clipfrac_lower", "spo/reversed_share"}
    assert float(counts["spo/reversed_share"][0]) == 2.0


@pytest.mark.parametrize("field", ["drpo_epsilon", "spo_epsilon"])
@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf"), "12.5", None])
def test_config_refuses_a_bad_threshold_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        PolicyLossConfig(**CPU, policy_loss=field.split("_")[0], **{field: value})


@pytest.mark.parametrize("name", ["drpo", "spo"])
def test_config_refuses_what_the_loss_cannot_honour(name):
    with pytest.raises(ValueError, match="delta"):
        PolicyLossConfig(**CPU, policy_loss=name, delta=10.0)
    with pytest.raises(ValueError, match="importance_sampling_level"):
        PolicyLossConfig(**CPU, policy_loss=name, importance_sampling_level="sequence")
    with pytest.raises(ValueError, match="^epsilon "):
        policy_loss(name, torch.zeros(1, 2), torch.zeros(1, 2), 1.0, epsilon=0.0)


def test_config_reads_the_fields_and_warns_about_the_other_one():
    config = PolicyLossConfig(**CPU, policy_loss="drpo", drpo_epsilon=5)
    assert config.drpo_epsilon == 5.0 and isinstance(config.drpo_epsilon, float)
    with pytest.warns(UserWarning, match="spo_epsilon=1.0 has no effect with policy_loss='drpo'"):
        PolicyLossConfig(**CPU, policy_loss="drpo", spo_epsilon=1.0)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*no effect.*", category=UserWarning)
        PolicyLossConfig(**CPU, policy_loss="spo", spo_epsilon=0.3)


def test_drpo_trains_and_logs_its_metrics(tiny_model_dir, tmp_path):
    from test_trainers import addition_dataset, shaped_reward, train_args

    from trl_bandpo import BandPOTrainer

    args = train_args(PolicyLossConfig, tmp_path, policy_loss="drpo", drpo_epsilon=0.05, max_steps=2)
    trainer = BandPOTrainer(
        model=tiny_model_dir, reward_funcs=shaped_reward, args=args, train_dataset=addition_dataset()
    )
    trainer.train()
    steps = [e for e in trainer.state.log_history if "loss" in e]
    assert steps and all(math.isfinite(e["loss"]) for e in steps)
    names = {"drpo/penalty_mean", "drpo/reversed_share", "drpo/clipfrac_upper", "bounds/upper_mean"}
    assert all(names <= set(e) for e in steps)
    assert any(e["drpo/penalty_mean"] > 0 for e in steps)  # the second pass over each batch is off-policy

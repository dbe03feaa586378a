"""Hostile inputs to the configs, the pure policy-loss API and the trainers: each gets a clear, early error naming the
field, or is handled correctly (docs/policy-losses.md, "Numerics"; tests/test_checkpointing.py covers resuming)."""

from __future__ import annotations

import inspect
import math
import warnings

import pytest
import torch
from test_trainers import addition_dataset
from trl import GRPOTrainer

from trl_bandpo import BandPOConfig, BandPOTrainer, DGPOTrainer, PolicyLossConfig, PolicyLossTrainer, policy_loss
from trl_bandpo.core.band import band_bounds, register_divergence
from trl_bandpo.core.losses import POLICY_LOSSES, RATIO_LOG_MAX

CPU = dict(output_dir="unused", use_cpu=True, report_to="none")


def make_config(**kwargs):
    return PolicyLossConfig(**{**CPU, **kwargs})


# ------------------------------------------------------------------------------------------------------------------
# Config: bad values fail when the config is built, naming the field
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(delta=0.0), "delta"),
        (dict(delta=-1.0), "delta"),
        (dict(delta=float("nan")), "delta"),
        (dict(delta=0.5), "delta"),
        (dict(delta=float("inf")), "delta"),
        (dict(dynamic_sampling="false"), "dynamic_sampling"),
        (dict(dynamic_sampling=1), "dynamic_sampling"),
        (dict(loss_type="foo"), "loss_type"),
        (dict(learning_rate="abc"), "learning_rate"),
        (dict(learning_rate=float("nan")), "learning_rate"),
        (dict(max_completion_length=0), "max_completion_length"),
        (dict(max_completion_length=-5), "max_completion_length"),
        (dict(band_divergence=lambda u: (u - 1) ** 2), "band_divergence"),
        (dict(dgpo_m=None), "dgpo_m"),
        (dict(dgpo_m="2"), "dgpo_m"),
        (dict(dgpo_m=[2.0]), "dgpo_m"),
        (dict(dgpo_n=None), "dgpo_n"),
        (dict(ce_gppo_beta1=None), "ce_gppo_beta1"),
        (dict(ce_gppo_beta2="1"), "ce_gppo_beta2"),
        (dict(aspo_c_pos="3"), "aspo_c_pos"),
        (dict(aspo_c_neg=None), "aspo_c_neg"),
        (dict(epsilon=[0.2]), "epsilon"),
        (dict(epsilon_high="0.28"), "epsilon_high"),
        (dict(band_divergence=["kl"]), "band_divergence"),
        (dict(band_upper_max="abc"), "band_upper_max"),
        (dict(band_radius="0.05"), "band_radius"),
        (dict(policy_loss=["band"]), "policy_loss"),
        (dict(policy_loss="cppo", cppo_delta=0.0), "cppo_delta"),
        (dict(policy_loss="cppo", cppo_w_min=1.5), "cppo_w_min"),
        (dict(policy_loss="cppo", cppo_delta_b=-0.1), "cppo_delta_b"),
        (dict(policy_loss="trm", trm_divergence="kl"), "trm_divergence"),
        (dict(policy_loss="trm", trm_reduce="sum"), "trm_reduce"),
        (dict(policy_loss="trm", trm_threshold=float("nan")), "trm_threshold"),
        (dict(policy_loss="m2po", m2po_threshold=0.0), "m2po_threshold"),
        (dict(policy_loss="icepop", icepop_low=0.0), "icepop_low"),
        (dict(policy_loss="icepop", icepop_high=0.5), "icepop_high"),
        (dict(policy_loss="icepop", icepop_low=1.0, icepop_high=1.0), "icepop_low"),
    ],
)
def test_config_rejects_with_the_field_name(kwargs, field):
    with pytest.raises(ValueError, match=field):
        make_config(**kwargs)


def test_config_accepts_valid_edge_values():
    assert make_config(delta=1.5).delta == 1.5
    assert make_config(band_upper_max="none").band_upper_max is None  # a YAML/CLI spelling of "no cap"
    assert make_config(max_completion_length=1).max_completion_length == 1


@pytest.mark.parametrize(
    "policy,kwargs,unused",
    [
        ("clip", dict(band_radius=0.1), ["band_radius"]),
        ("band", dict(dgpo_n=2, aspo_c_pos=2.0), ["aspo_c_pos", "dgpo_n"]),
        ("dgpo", dict(band_upper_max=None, ce_gppo_beta1=0.5), ["band_upper_max", "ce_gppo_beta1"]),
        ("clip", dict(band_divergence="tv", band_solver="torch"), ["band_divergence", "band_solver"]),
        ("cppo", dict(trm_threshold=0.1, icepop_low=0.2), ["icepop_low", "trm_threshold"]),
        ("icepop", dict(cppo_delta=0.1, m2po_threshold=0.1), ["cppo_delta", "m2po_threshold"]),
    ],
)
def test_fields_the_loss_ignores_warn_by_name(policy, kwargs, unused):
    with pytest.warns(UserWarning, match="no effect") as record:
        make_config(policy_loss=policy, **kwargs)
    message = next(str(w.message) for w in record if "no effect" in str(w.message))
    assert all(name in message for name in unused) and policy in message


def test_fields_the_loss_reads_do_not_warn():
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*no effect.*", category=UserWarning)
        make_config(policy_loss="band", band_radius=0.1, band_upper_max=None, band_divergence="tv")
        make_config(policy_loss="dgpo", dgpo_n=2, dgpo_m=3.0)
        make_config(policy_loss="relaxed_band", band_radius=0.1, epsilon_high=0.28)
        make_config(policy_loss="clip")
        make_config(policy_loss="cppo", cppo_delta=0.1, cppo_w_min=0.5, cppo_delta_b=0.05)
        make_config(policy_loss="trm", trm_divergence="k1", trm_reduce="max", trm_threshold=0.1, epsilon_high=0.28)
        make_config(policy_loss="m2po", m2po_threshold=0.1, epsilon_high=0.28)
        make_config(policy_loss="icepop", icepop_low=0.125, icepop_high=8.0, epsilon_high=0.28)


@pytest.mark.parametrize("name", [n for n in POLICY_LOSSES if n != "clip"])
def test_sequence_level_importance_sampling_needs_clip(name):
    with pytest.raises(ValueError, match="importance_sampling_level"):
        make_config(policy_loss=name, importance_sampling_level="sequence")
    assert make_config(policy_loss="clip", importance_sampling_level="sequence").policy_loss == "clip"


def test_registered_divergence_is_usable_by_name_in_a_config():
    register_divergence("test_squared_hellinger", lambda u: 2 * (torch.sqrt(u) - 1) ** 2)
    config = make_config(policy_loss="band", band_divergence="test_squared_hellinger")
    # 2 x Hellinger at radius 2 delta is Hellinger at radius delta: same bounds as the built-in generator
    x = torch.log(torch.tensor([0.01, 0.2, 0.7], dtype=torch.float64))
    mine = band_bounds(x, 2 * 0.05, config.band_divergence)
    builtin = band_bounds(x, 0.05, "hellinger")
    torch.testing.assert_close(mine, builtin, rtol=1e-9, atol=0)
    with pytest.raises(ValueError, match="f\\(1\\) = 0"):
        register_divergence("test_bad", lambda u: u)


# ------------------------------------------------------------------------------------------------------------------
# Band radius far beyond saturation
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("radius", [1e3, 1e30, 1e300])
def test_huge_radius_gives_the_simplex_limits_not_nan(dtype, radius):
    """For KL the lower root is below exp(-radius) and the upper one is 1/p to float precision once radius is large:
    bounds are exactly [0, min(1/p, cap)], never NaN (a radius of 1e300 used to overflow the float32 solver)."""
    logp = torch.log(torch.tensor([1e-8, 1e-3, 0.3, 0.999, 1.0], dtype=torch.float64)).to(dtype)
    for cap in (None, 10.0):
        lower, upper = band_bounds(logp, radius, "kl", upper_max=cap, solver="torch")
        inv_p = torch.exp(-logp.to(lower.dtype))
        assert torch.equal(lower, torch.zeros_like(lower))
        want = inv_p if cap is None else inv_p.clamp(max=cap)
        torch.testing.assert_close(upper, want, rtol=2e-7 if lower.dtype == torch.float32 else 1e-15, atol=0)


# ------------------------------------------------------------------------------------------------------------------
# Pure policy_loss API
# ------------------------------------------------------------------------------------------------------------------


def _inputs(B, T, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    old = torch.log(torch.rand(B, T, generator=g, dtype=dtype) * 0.9 + 0.05)
    logps = (old + 0.6 * torch.randn(B, T, generator=g, dtype=dtype)).requires_grad_(True)
    return logps, old


@pytest.mark.parametrize("name", POLICY_LOSSES)
@pytest.mark.parametrize("B,T", [(4, 4), (3, 5)])
def test_advantages_of_shape_B_are_per_sequence(name, B, T):
    """TRL's advantages are (B,): one per sequence, never broadcast along T (even when B == T)."""
    logps, old = _inputs(B, T)
    adv = torch.linspace(-1.5, 2.0, B, dtype=torch.float64)
    flat = policy_loss(name, logps, old, adv)
    column = policy_loss(name, logps, old, adv[:, None])
    torch.testing.assert_close(flat, column, rtol=0, atol=0)
    if name == "m2po":
        return  # M2PO's mask is over the whole micro-batch: row b alone has another one
    # and the per-sequence reading is the only one: row b uses adv[b] at every t
    for b in range(B):
        row = policy_loss(name, logps[b : b + 1], old[b : b + 1], adv[b : b + 1])
        torch.testing.assert_close(flat[b : b + 1], row, rtol=0, atol=0)


def test_advantages_that_do_not_fit_are_a_clear_error():
    logps, old = _inputs(3, 5)
    with pytest.raises(ValueError, match="one value per sequence"):
        policy_loss("band", logps, old, torch.ones(5, dtype=torch.float64))
    with pytest.raises(ValueError, match="do not broadcast"):
        policy_loss("band", logps, old, torch.ones(2, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="advantages must be a tensor or a number"):
        policy_loss("band", logps, old, [1.0, 2.0, 3.0])


@pytest.mark.parametrize("name", POLICY_LOSSES)
@pytest.mark.parametrize("value", [1.5, -0.5, True, False, 2])
def test_number_and_bool_advantages_match_tensors(name, value):
    logps, old = _inputs(2, 3)
    got = policy_loss(name, logps, old, value)
    want = policy_loss(name, logps, old, torch.tensor(float(value), dtype=torch.float64))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    got_bool_tensor = policy_loss(name, logps, old, torch.full((2, 1), bool(value)))
    torch.testing.assert_close(got_bool_tensor, policy_loss(name, logps, old, float(bool(value))), rtol=0, atol=0)


@pytest.mark.parametrize(
    "name,kwargs,field",
    [
        ("dgpo", dict(n=1.5), "n"),
        ("dgpo", dict(n=0), "n"),
        ("dgpo", dict(m=float("nan")), "m"),
        ("dgpo", dict(m=0.5), "m"),
        ("clip", dict(epsilon_low=1.0), "epsilon_low"),
        ("clip", dict(epsilon_high=-0.1), "epsilon_high"),
        ("clip", dict(delta=-1.0), "delta"),
        ("band", dict(delta=0.5), "delta"),
        ("band", dict(radius=0.0), "radius"),
        ("band", dict(upper_max=0.5), "upper_max"),
        ("ce_gppo", dict(beta1=-1.0), "beta1"),
        ("ce_gppo", dict(beta2=float("inf")), "beta2"),
        ("aspo", dict(c_pos=0.5), "c_pos"),
        ("aspo", dict(c_neg="3"), "c_neg"),
        ("dcpo", dict(upper_max=0.5), "upper_max"),
        ("cppo", dict(radius=1.5), "radius"),
        ("cppo", dict(w_min=0.0), "w_min"),
        ("cppo", dict(rate_min=float("inf")), "rate_min"),
        ("trm", dict(divergence="k2"), "divergence"),
        ("trm", dict(reduce=None), "reduce"),
        ("trm", dict(threshold=-0.01), "threshold"),
        ("m2po", dict(threshold="0.04"), "threshold"),
        ("icepop", dict(low=-0.5), "low"),
        ("icepop", dict(high=0.9), "high"),
    ],
)
def test_pure_api_checks_hyperparameters_like_the_config(name, kwargs, field):
    logps, old = _inputs(2, 3)
    with pytest.raises(ValueError, match=f"^{field} "):
        policy_loss(name, logps, old, torch.ones(2, 1, dtype=torch.float64), **kwargs)


# ------------------------------------------------------------------------------------------------------------------
# Extreme ratios in every dtype: no NaN, the right zeros
# ------------------------------------------------------------------------------------------------------------------

LOG_RATIOS = [0.0, 5.0, 11.2, 12.0, 50.0, 88.5, 89.0, 100.0, 709.0, 710.0, 1000.0, -50.0, -89.0, -100.0, -1000.0]


@pytest.mark.parametrize("name", POLICY_LOSSES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_extreme_log_ratios_never_give_nan(name, dtype):
    """fp16 overflows exp at log-ratio 11.1 and fp32 at 88.7: computed in float32 or wider with the ratio capped,
    no loss and no gradient is NaN; A = 0 gives 0 and 0; tokens clipped on the advantage's side get no gradient."""
    old = torch.full((3, len(LOG_RATIOS)), math.log(0.3), dtype=torch.float64)
    log_r = torch.tensor(LOG_RATIOS, dtype=torch.float64).expand(3, -1)
    logps = (old + log_r).to(dtype).requires_grad_(True)
    adv = torch.tensor([[1.0], [0.0], [-1.0]])
    loss = policy_loss(name, logps, old.to(dtype), adv)
    loss.sum().backward()
    assert loss.dtype in (torch.float32, torch.float64)
    assert not torch.isnan(loss).any(), loss
    assert not torch.isnan(logps.grad.float()).any(), logps.grad
    if name != "ipo":  # prime-rl's KL term acts on A = 0 tokens too (docs/band-and-dppo.md)
        assert torch.equal(loss[1], torch.zeros_like(loss[1]))
        assert torch.equal(logps.grad[1], torch.zeros_like(logps.grad[1]))
    if name in ("clip", "band", "relaxed_band", "dcpo"):
        far = torch.tensor(LOG_RATIOS) >= 50.0  # far above every upper bound: clipped for A > 0
        assert torch.equal(logps.grad[0][far].float(), torch.zeros(int(far.sum())))
    if name == "icepop":  # far outside [0.5, 5]: masked whatever the advantage's sign
        far = torch.tensor(LOG_RATIOS).abs() >= 5.0
        assert torch.equal(logps.grad[:, far].float(), torch.zeros(3, int(far.sum())))
        assert torch.equal(loss[:, far], torch.zeros(3, int(far.sum())))


def test_ratio_cap_is_the_largest_finite_value_with_a_margin():
    for dtype, log_max in RATIO_LOG_MAX.items():
        assert torch.isfinite(torch.exp(torch.tensor(log_max, dtype=dtype)))
        assert log_max > math.log(torch.finfo(dtype).max) - 0.02


# ------------------------------------------------------------------------------------------------------------------
# Trainers: GRPOTrainer's signature, reward sources, resuming inside a generation batch
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("trainer_class", [PolicyLossTrainer, BandPOTrainer, DGPOTrainer])
def test_constructor_accepts_exactly_what_grpo_trainer_accepts(trainer_class):
    """Same parameter names, order, kinds and defaults as GRPOTrainer.__init__: a TRL upgrade that adds one fails."""

    def described(cls):
        params = inspect.signature(cls.__init__).parameters.values()
        return [(p.name, p.kind, p.default) for p in params]

    assert described(trainer_class) == described(GRPOTrainer)


def _outcome(call):
    try:
        call()
    except Exception as err:  # noqa: BLE001 - the outcome is what is compared
        return type(err).__name__, str(err).splitlines()[0]
    return ("ok", "")


def test_no_reward_source_fails_like_grpo_trainer(tiny_model_dir, tmp_path):
    args = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    ours = _outcome(lambda: BandPOTrainer(model=tiny_model_dir, args=BandPOConfig(**args)))
    theirs = _outcome(lambda: GRPOTrainer(model=tiny_model_dir, args=__import__("trl").GRPOConfig(**args)))
    assert ours == theirs and ours[0] == "ValueError" and "No reward source" in ours[1]


class _EnvironmentWithReward:
    def reset(self, **kwargs):
        return None

    def get_reward(self):
        return 1.0


def test_environment_factory_reaches_grpo_trainer(tiny_model_dir, tmp_path, monkeypatch):
    """An environment that owns its reward is a valid reward source: our constructor passes it on, and the
    outcome is GRPOTrainer's for the same arguments (whatever TRL decides about this tokenizer)."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    args = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    kwargs = dict(model=tiny_model_dir, train_dataset=addition_dataset(), environment_factory=_EnvironmentWithReward)
    ours = _outcome(lambda: BandPOTrainer(args=BandPOConfig(policy_loss="clip", **args), **kwargs))
    theirs = _outcome(lambda: GRPOTrainer(args=__import__("trl").GRPOConfig(**args), **kwargs))
    assert ours == theirs
    assert "reward_funcs" not in ours[1]  # never "missing 1 required positional argument: 'reward_funcs'"

"""Hardening, round 5 (issue 33): settings checked again where they are used, finite settings that overflow float32
refused (or computed exactly), nothing trains to NaN in silence, resuming under changed settings, constrained
decoding with rollout log-probs. Each case failed before its fix. The command-line cases are in
tests/test_hardening_round5_cli.py; the values every config surface refuses alike in tests/test_config_surfaces.py."""

from __future__ import annotations

import dataclasses
import math
import shutil
import warnings

import mpmath
import pytest
import torch
from test_checkpointing import BUFFER, _copy, _resume_run
from test_checkpointing import saved_checkpoint as saved_checkpoint  # noqa: F401 - the fixture
from test_trainers import addition_dataset, shaped_reward, train_args

import trl_bandpo.core.loss_registry as registry
from trl_bandpo import BandPOConfig, BandPOTrainer, PolicyLossConfig
from trl_bandpo.core.band import DIVERGENCES, MIN_RADIUS, band_bounds
from trl_bandpo.core.checks import FLOAT32_MAX, Number
from trl_bandpo.core.losses import POLICY_LOSSES, PolicyLossSpec, policy_loss, policy_loss_spec
from trl_bandpo.training.configs import UnusedSettingWarning
from trl_bandpo.training.nonfinite import NonFiniteTrainingError

pytest.importorskip("trl.experimental.async_grpo")

CPU = dict(use_cpu=True, report_to="none")
ROLLOUT = dict(old_logps_source="rollout", use_vllm=True, vllm_importance_sampling_correction=False)
NOT_LOADED = "no/model-is-loaded-before-this"  # a hub id: loading it offline would fail with an OSError


# -- 1. a trainer checks its config again: a value set after construction is refused before any model loads -------

# (field, value, the config's other settings, families that have the field)
AFTER_CONSTRUCTION = [
    ("band_radius", math.nan, dict(policy_loss="band"), ("sync", "async")),
    ("band_radius", -1.0, dict(policy_loss="band"), ("sync", "async")),
    ("dgpo_n", 0, dict(policy_loss="dgpo"), ("sync", "async")),
    ("ipo_kl_tau", -5.0, dict(policy_loss="ipo"), ("sync", "async")),
    ("dynamic_sampling", "yes", {}, ("sync",)),
    ("band_divergence", lambda u: u - 1 - torch.log(u), dict(policy_loss="band"), ("sync", "async")),
    ("top_p", 0.5, ROLLOUT, ("sync", "async")),  # the async trainer's old policy is always the rollout's
    ("generation_kwargs", ("min_p", 0.2), ROLLOUT, ("sync",)),  # an item set in the config's own dict
    ("vllm_importance_sampling_correction", True, ROLLOUT, ("sync",)),
    ("temperature", 0.0, {}, ("sync", "async")),
    ("learning_rate", 10**400, {}, ("sync", "async")),
]


def _family(family):
    if family == "sync":
        return PolicyLossConfig, BandPOTrainer
    from trl_bandpo.training.async_trainer import AsyncPolicyLossConfig, AsyncPolicyLossTrainer

    return AsyncPolicyLossConfig, AsyncPolicyLossTrainer


def _set(config, field, value):
    if isinstance(value, tuple):  # an item of a mapping field
        config.__dict__.setdefault(field, None)
        setattr(config, field, dict(getattr(config, field) or {}))
        getattr(config, field)[value[0]] = value[1]
    else:
        setattr(config, field, value)


@pytest.mark.parametrize("moment", ["mutation", "subclass"])
@pytest.mark.parametrize("family", ["sync", "async"])
@pytest.mark.parametrize("field, value, base, families", AFTER_CONSTRUCTION, ids=[c[0] for c in AFTER_CONSTRUCTION])
def test_a_value_set_after_construction_is_refused_by_the_trainer(family, moment, field, value, base, families,
                                                                   tmp_path):  # fmt: skip
    """Before: the trainer read such a value unchecked (a NaN radius trained NaN bounds; top_p=0.5 with rollout
    log-probs clipped tokens that had not moved)."""
    if family not in families:
        pytest.skip(f"the {family} configs have no {field}")
    config_class, trainer_class = _family(family)
    base = dict(base) if family == "sync" else {k: v for k, v in base.items() if k in ("policy_loss",)}
    if moment == "mutation":
        args = config_class(output_dir=str(tmp_path), **CPU, **base)
        _set(args, field, value)
    else:

        def __post_init__(self):
            config_class.__post_init__(self)
            _set(self, field, value)

        subclass = dataclasses.dataclass(type("ProjectConfig", (config_class,), {"__post_init__": __post_init__}))
        args = subclass(output_dir=str(tmp_path), **CPU, **base)
    with pytest.raises(ValueError, match=field):
        trainer_class(model=NOT_LOADED, reward_funcs=shaped_reward, args=args)


def test_an_unused_setting_is_said_once_and_again_when_it_changes(tmp_path):
    with pytest.warns(UnusedSettingWarning, match="epsilon=0.3"):
        args = PolicyLossConfig(output_dir=str(tmp_path), **CPU, policy_loss="band", epsilon=0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnusedSettingWarning)  # the trainer's check says nothing new
        with pytest.raises(OSError):  # past our checks: loading the model fails offline
            BandPOTrainer(model=NOT_LOADED, reward_funcs=shaped_reward, args=args)
    args.epsilon_high = 0.4
    with pytest.warns(UnusedSettingWarning, match="epsilon_high=0.4"), pytest.raises(OSError):
        BandPOTrainer(model=NOT_LOADED, reward_funcs=shaped_reward, args=args)


# -- 2. finite values that overflow float32, or are too small to act ------------------------------------------------


def _number_checks():
    """(loss, keyword, check) for every built-in loss hyper-parameter checked as a number."""
    for name in POLICY_LOSSES:
        for hp in policy_loss_spec(name).hyperparameters:
            if isinstance(hp.check, Number):
                yield name, hp.name, hp.check


NUMBER_CHECKS = list(_number_checks())


def test_every_float_a_loss_reads_is_bounded_within_float32():
    unbounded = [(name, kw) for name, kw, check in NUMBER_CHECKS if check.high is None or check.high > FLOAT32_MAX]
    # a cap may be infinite (no cap): the Band's upper_max; it is clamped to the dtype's range where applied
    assert set(unbounded) <= {(name, "upper_max") for name in POLICY_LOSSES}, unbounded


@pytest.mark.parametrize("name, keyword, check", NUMBER_CHECKS, ids=[f"{n}.{k}" for n, k, _ in NUMBER_CHECKS])
@pytest.mark.parametrize("end", ["low", "high"])
def test_each_loss_stays_finite_at_the_ends_of_its_accepted_range(name, keyword, check, end):
    """Ratios from 1e-3 to 1e3, advantages -2, 0 and 2, and the hyper-parameter at the end of its range: the loss and
    its gradient are finite. Before: ipo_kl_tau=3.4e38 gave inf * 0 = NaN, ce_gppo_beta2=3.5e38 a RuntimeError."""
    value = check.low if end == "low" else check.high
    if value is None or math.isinf(value) or (check.low_open if end == "low" else check.high_open):
        pytest.skip("no finite end on this side")
    if name == "ipo" and keyword in ("mask_low", "mask_high"):
        pytest.skip("a radius: its ends are tested with the Band below")
    old = torch.log(torch.tensor([[0.05, 0.3, 0.6, 0.9, 0.99, 0.999]] * 3))
    logps = (old + torch.linspace(-6.9, 6.9, 6)).clamp(max=0.0).requires_grad_()
    advantages = torch.tensor([-2.0, 0.0, 2.0])
    loss = policy_loss(name, logps, old, advantages, **{keyword: value})
    loss.sum().backward()
    assert torch.isfinite(loss).all(), loss
    assert torch.isfinite(logps.grad).all(), logps.grad


@pytest.mark.parametrize(
    "field, value, loss",
    [
        ("spo_epsilon", 1e-16, "spo"),  # rounds away: NaN on every token before
        ("spo_epsilon", 1e-7, "spo"),
        ("drpo_epsilon", 1e-7, "drpo"),  # 19% off before (1 + 1e-7/p rounded in float32)
        ("ipo_kl_tau", 3.4e38, "ipo"),
        ("ipo_adv_tau", 3.4e38, "ipo"),
        ("ce_gppo_beta1", 3.5e38, "ce_gppo"),
        ("ce_gppo_beta2", 3.5e38, "ce_gppo"),
        ("aspo_c_pos", 3.5e38, "aspo"),
        ("aspo_c_neg", 1e300, "aspo"),
        ("epsilon_high", 1e300, "clip"),
        ("delta", 1e300, "clip"),
        ("band_radius", 1e-40, "band"),
        ("dgpo_n", 2**63, "dgpo"),
    ],
)
def test_values_beyond_the_usable_range_are_refused_with_it(field, value, loss, tmp_path):
    with pytest.raises(ValueError, match=rf"^{field} must be .*(\d|\]|64 bits), got"):
        PolicyLossConfig(output_dir=str(tmp_path), **CPU, policy_loss=loss, **{field: value})


def test_drpo_threshold_is_exact_at_the_smallest_accepted_epsilon():
    """DRPO's gradient weight `r (1 - (q - p)/eps)` by hand at eps = 1e-3 (its float32 read-back is accurate)."""
    p = torch.tensor([[0.5, 0.2, 0.9]], dtype=torch.float64)
    q = p + torch.tensor([[4e-4, -3e-4, 2e-4]], dtype=torch.float64)
    logps = q.log().float().requires_grad_()
    policy_loss("drpo", logps, p.log().float(), torch.tensor([1.0]), epsilon=1e-3).sum().backward()
    r = q / p
    expected = r * (1 - (q - p) / 1e-3)  # -d loss / d log pi for A = 1
    torch.testing.assert_close(-logps.grad.double(), expected, rtol=2e-3, atol=1e-4)


def test_dgpo_weight_is_exact_for_a_large_power():
    """Left of the clip (A < 0) DGPO's weight is `(1-eps) (r/(1-eps))^(n+1)`: for n = 1000 at r = 0.7999 by hand;
    written as `(n+1) log r - n log(1-eps)` in float32 it cancelled to 10% off."""
    from trl_bandpo.core.losses import dgpo_log_weights

    log_ratio = torch.tensor([math.log(0.7999)])
    got = dgpo_log_weights(log_ratio, torch.tensor([-1.0]), 0.8, 1.2, n=1000, m=2.0).exp().item()
    expected = float(mpmath.mpf(0.8) * (mpmath.mpf(0.7999) / mpmath.mpf(0.8)) ** 1001)
    assert got == pytest.approx(expected, rel=1e-4)


RADII = [MIN_RADIUS, *torch.logspace(math.log10(MIN_RADIUS), 3, 160, dtype=torch.float64).tolist()[1:], 1e10, 1e300]
PROBS = torch.tensor([0.0, 1e-40, 1e-30, 1e-8, 1e-4, 0.01, 0.3, 0.38, 0.5, 0.9, 0.999, 1 - 1e-7, 1 - 1e-12, 1.0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_band_bounds_are_monotone_in_the_radius_down_to_the_smallest_accepted(divergence, dtype):
    """Before: in float32 a KL radius of 1e-17 gave p = 0.5 the bounds [0.89, 1.11], wider than at 1e-7 (Newton
    started at t = 0, where h' = 0); float64 did the same below 1e-30."""
    old = PROBS.double().log().to(dtype)
    previous = None
    for radius in RADII:
        lower, upper = band_bounds(old, radius, divergence, solver="torch")
        assert not (torch.isnan(lower).any() or torch.isnan(upper).any()), radius
        assert (lower <= 1).all() and (upper >= 1).all() and (lower >= 0).all(), radius
        if previous is not None:
            assert (lower <= previous[0]).all() and (upper >= previous[1]).all(), (radius, lower, upper, previous)
        previous = lower, upper


def _kl_root(p, radius, side):
    """q with KL(Bern(p) || Bern(q)) = radius on `side` of p, at 60 digits (the reference)."""
    with mpmath.workdps(80):
        p, radius = mpmath.mpf(p), mpmath.mpf(radius)
        inside, outside = (p, mpmath.mpf(0)) if side == "lower" else (p, mpmath.mpf(1))
        for _ in range(300):  # bisection: KL grows from 0 at p to infinity at 0 and 1
            q = (inside + outside) / 2
            if p * mpmath.log(p / q) + (1 - p) * mpmath.log((1 - p) / (1 - q)) > radius:
                outside = q
            else:
                inside = q
        return inside / p


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 2e-6), (torch.float64, 1e-12)])
@pytest.mark.parametrize("radius", [MIN_RADIUS, 1e-30, 1e-20, 1e-15, 1e-12, 1e-9])
def test_kl_bounds_at_tiny_radii_match_a_high_precision_solution(radius, dtype, tolerance):
    """Where the KL bisection of the authors (and Newton before this fix) lost precision, the bounds are the exact ones
    to rounding: 1 where the exact bound rounds to 1, and never wider."""
    ps = [1e-8, 1e-4, 0.01, 0.3, 0.5, 0.9, 0.999]
    lower, upper = band_bounds(torch.tensor(ps, dtype=torch.float64).log().to(dtype), radius, "kl", solver="torch")
    for i, p in enumerate(ps):
        for side, got in (("lower", lower[i]), ("upper", upper[i])):
            want = float(_kl_root(p, radius, side))
            assert abs(got.item() - want) <= tolerance * max(1.0, want), (p, side, got.item(), want)


# -- 3. never NaN in silence ----------------------------------------------------------------------------------------


@pytest.fixture
def clean_registry(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_REGISTERED_BY", dict(registry._REGISTERED_BY))


def _fixed_bounds(old_logps):
    return 0.8, 1.2


def _nan_on_first_token(log_ratio, advantages, lower, upper):
    loss = -torch.exp(log_ratio) * advantages
    return torch.cat([loss[:, :1] * math.nan, loss[:, 1:]], dim=1)


def _nan_gradient(log_ratio, advantages, lower, upper):
    """A finite loss whose gradient is NaN (the branch torch.where does not select still back-propagates)."""
    return torch.where(log_ratio > -1e9, -log_ratio * advantages, torch.sqrt(log_ratio - 1e9))


def _run(tiny_model_dir, tmp_path, policy, **overrides):
    args = train_args(BandPOConfig, tmp_path, **{"policy_loss": policy, "max_steps": 2, **overrides})
    dataset = addition_dataset()
    trainer = BandPOTrainer(model=tiny_model_dir, reward_funcs=shaped_reward, args=args, train_dataset=dataset)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    return trainer, before


def _unchanged(trainer, before):
    return all(torch.equal(p.detach(), before[name]) for name, p in trainer.model.named_parameters())


@pytest.mark.parametrize(
    "loss, needle",
    [
        (_nan_on_first_token, r"the loss of a micro-step is nan with policy_loss='bad' at optimizer step 0 \(first "
         r"non-finite quantity: per_token_loss \(\d+ of 48 values, e\.g\. nan\)\)"),
        (_nan_gradient, r"the gradient norm is nan with policy_loss='bad' at optimizer step 0 though every loss was "
         r"finite \(first non-finite gradient: model\.embed_tokens\.weight"),
    ],
    ids=["loss", "gradient"],
)  # fmt: skip
def test_a_non_finite_step_stops_before_the_update(tiny_model_dir, tmp_path, clean_registry, loss, needle):
    """Before: the run finished with rc 0, NaN weights, and the loss logged as 0.0 (transformers filters NaN)."""
    registry.register_policy_loss(PolicyLossSpec("bad", _fixed_bounds, loss))
    trainer, before = _run(tiny_model_dir, tmp_path, "bad")
    with pytest.raises(NonFiniteTrainingError, match=needle):
        trainer.train()
    assert _unchanged(trainer, before)  # stopped before the optimizer stepped


def test_skip_drops_each_non_finite_update(tiny_model_dir, tmp_path, clean_registry):
    """Every step's loss is NaN: with on_nonfinite='skip' the run ends, each step warned, and no parameter moved (not
    even by AdamW's momentum or weight decay: the gradients are None, not 0)."""
    registry.register_policy_loss(PolicyLossSpec("bad", _fixed_bounds, _nan_on_first_token))
    trainer, before = _run(tiny_model_dir, tmp_path, "bad", on_nonfinite="skip", weight_decay=0.1)
    with pytest.warns(RuntimeWarning, match="this optimizer update is skipped") as caught:
        trainer.train()
    assert len([w for w in caught if "skipped" in str(w.message)]) == 2
    assert trainer.state.global_step == 2 and _unchanged(trainer, before)


def test_a_last_update_that_breaks_the_parameters_is_an_error(tiny_model_dir, tmp_path):
    """lr 1e39: the one update has a finite loss and gradient and leaves infinite weights; no loss follows it."""
    trainer, _ = _run(tiny_model_dir, tmp_path, "band", learning_rate=1e39, max_steps=1)
    with pytest.raises(NonFiniteTrainingError, match=r"ended with non-finite parameters \(model\..* after optimizer"):
        trainer.train()


def test_skip_is_refused_with_deepspeed(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ValueError, match="on_nonfinite='skip' cannot be used with DeepSpeed"):
        PolicyLossConfig(output_dir=str(tmp_path), **CPU, on_nonfinite="skip")


# -- 3 and 4. the generation buffer at resume: refused when unusable, regenerated when its settings changed ----------


def _edit_buffer(run_dir, edit):
    path = run_dir / "checkpoint-1" / BUFFER
    state = torch.load(path, weights_only=True)
    edit(state["buffered_inputs"][0])
    torch.save(state, path)


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda b: b["advantages"].__setitem__(0, math.nan), "batch 0 has advantages that are not all finite"),
        (lambda b: b["old_per_token_logps"].__setitem__((0, 0), math.inf), "old_per_token_logps that are not finite"),
        (lambda b: b.__setitem__("policy_upper_bound", b["policy_upper_bound"][:, :2]), "upper_bound not shaped"),
        (lambda b: b.__setitem__("advantages", b["advantages"].long()), "no floating advantages"),
        (lambda b: b.__setitem__("completion_ids", [1, 2]), "no completion_ids of shape"),
    ],
    ids=["nan-advantage", "inf-old-logp", "bound-shape", "integer-advantages", "ids-list"],
)  # fmt: skip
def test_an_unusable_buffered_batch_is_refused_at_load(tiny_model_dir, saved_checkpoint, tmp_path, edit, needle):  # noqa: F811
    """Before: read as it was, and trained on at the first step (NaN weights) or failed there."""
    run_dir = _copy(saved_checkpoint, tmp_path)
    _edit_buffer(run_dir, edit)
    resumed = _resume_run(tiny_model_dir, run_dir)
    with pytest.raises(ValueError, match=f"cannot read .*{BUFFER}.*{needle}"):
        resumed.train(resume_from_checkpoint=str(run_dir / "checkpoint-1"))
    assert resumed.state.global_step == 1  # refused at load: no step ran


@pytest.mark.parametrize(
    "changed, named",
    [
        (dict(temperature=0.7), "temperature: 1.0 then, 0.7 now"),
        (dict(scale_rewards="batch"), "scale_rewards: 'group' then, 'batch' now"),
        (dict(reward_weights=[2.0]), "reward_weights: None then, '[2.0]' now"),
        (dict(gradient_accumulation_steps=1, steps_per_generation=2), "gradient_accumulation_steps: 2 then, 1 now"),
    ],
)
def test_a_buffer_made_under_other_sampling_or_advantages_is_not_replayed(
    tiny_model_dir,
    saved_checkpoint,
    tmp_path,
    changed,
    named,  # noqa: F811
):
    """Before: a changed temperature or scale_rewards replayed old log-probs / advantages as if current; a changed
    gradient_accumulation_steps was called "truncated or damaged"."""
    run_dir = _copy(saved_checkpoint, tmp_path)
    resumed = _resume_run(tiny_model_dir, run_dir, **changed)
    with pytest.warns(UserWarning, match="made under other settings.*" + named.replace("[", r"\[")):
        resumed.train(resume_from_checkpoint=str(run_dir / "checkpoint-1"))
    assert resumed.state.global_step == resumed.args.max_steps
    shutil.rmtree(run_dir)


# -- 5. rollout log-probs under constrained decoding; generation_kwargs that are no JSON mapping ---------------------


@pytest.mark.parametrize(
    "settings, named",
    [
        (dict(vllm_structured_outputs_regex=r"\d+"), "vllm_structured_outputs_regex="),
        (dict(generation_kwargs={"structured_outputs": {"regex": "a+"}}), "generation_kwargs['structured_outputs']"),
        (dict(generation_kwargs={"guided_json": {"type": "object"}}), "generation_kwargs['guided_json']"),
        (dict(generation_kwargs={"guided_regex": "a+"}), "generation_kwargs['guided_regex']"),
        (dict(generation_kwargs={"guided_choice": ["a", "b"]}), "generation_kwargs['guided_choice']"),
        (dict(generation_kwargs={"guided_grammar": "root ::= 'a'"}), "generation_kwargs['guided_grammar']"),
        (dict(generation_kwargs={"guided_decoding": {"regex": "a"}}), "generation_kwargs['guided_decoding']"),
    ],
)
def test_rollout_logps_refuse_constrained_decoding(settings, named, tmp_path):
    """Constrained decoding masks the tokens its grammar forbids before sampling: the engine's log-probs are not the
    model's, as under top-p. Before: accepted (only allowed_token_ids was refused)."""
    with pytest.raises(ValueError, match=r"old_logps_source='rollout' cannot be combined with " + re_escape(named)):
        PolicyLossConfig(output_dir=str(tmp_path), **CPU, **ROLLOUT, **settings)
    PolicyLossConfig(output_dir=str(tmp_path), **CPU, **settings)  # the trainer's own old policy: fine


def re_escape(text):
    import re

    return re.escape(text)


@pytest.mark.parametrize("value", ["{not json", "[1, 2]", 5, {"stop": object()}, ["min_p", 0.2]])
def test_generation_kwargs_must_be_a_json_mapping(value, tmp_path):
    """Before: '{not json' was a JSONDecodeError from transformers, 5 and [1, 2] were accepted (and ignored or a crash
    at generation), an object() failed when the config was saved with the first checkpoint."""
    with pytest.raises(ValueError, match=r"^generation_kwargs must be None or a mapping of JSON values"):
        PolicyLossConfig(output_dir=str(tmp_path), **CPU, generation_kwargs=value)


# -- 7. TRL's per-loss-type fields without their loss type warn like ours --------------------------------------------


@pytest.mark.parametrize("field, value", [("sapo_temperature_pos", 2.0), ("vespo_k_neg", 1.0)])
def test_trl_loss_type_fields_without_their_loss_type_warn(field, value, tmp_path):
    loss_type = field.split("_")[0]
    with pytest.warns(UnusedSettingWarning, match=rf"{field}={value} has no effect without loss_type='{loss_type}'"):
        PolicyLossConfig(output_dir=str(tmp_path), **CPU, **{field: value})
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnusedSettingWarning)
        PolicyLossConfig(output_dir=str(tmp_path), **CPU, loss_type=loss_type, **{field: value})


@pytest.mark.parametrize("field", ["max_steps", "logging_steps", "warmup_steps", "num_train_epochs", "weight_decay"])
def test_a_401_digit_integer_is_a_named_error_in_any_numeric_field(field, tmp_path):
    """Before: OverflowError from math.isnan, or accepted and a crash when the scheduler or a tensor met it."""
    with pytest.raises(ValueError, match=rf"^{field} must be .*, got an integer of 401 digits\."):
        PolicyLossConfig(output_dir=str(tmp_path), **CPU, **{field: 10**400})

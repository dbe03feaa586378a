"""Configurations of the BandPO and DGPO trainers: `GRPOConfig` plus the fields of our policy losses.

Each field is checked by one owner (`check_fields`): the loss registry for loss hyper-parameters,
`PolicyLossConfig.FIELD_CHECKS` for our other fields, `TRL_FIELD_CHECKS` for TRL fields TRL leaves unchecked; then
the settings together (`check_settings`). Every config surface (async configs, `policy_settings`) runs both.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import transformers
import trl
from transformers.utils import logging
from trl import GRPOConfig

from ..core.band import DIVERGENCES, SOLVERS
from ..core.checks import INT64_LIMIT, Choice, Flag, Integer, JSONObject, Number, Text, refuse
from ..core.losses import POLICY_LOSSES, policy_loss_spec, registered_policy_losses
from .library_noise import library_noise_filtered

logger = logging.get_logger(__name__)

# TRL loss types GRPOTrainer handles with code of its own (cispo, sapo, vespo: their own per-token terms; luspo: grpo's
# term summed per sequence, docs/policy-losses.md); they run TRL's method unchanged and only combine with "clip".
TRL_PER_TOKEN_LOSS_TYPES = ("cispo", "sapo", "vespo", "luspo")
# TRL loss types that aggregate the clipped per-token term: every registered policy loss runs under these.
CLIP_AGGREGATION_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
TRL_LOSS_TYPES = CLIP_AGGREGATION_LOSS_TYPES + TRL_PER_TOKEN_LOSS_TYPES
#: Sampling settings TRL leaves unchecked, as fields and as `generation_kwargs` keys: what vLLM and transformers take.
SAMPLING_CHECKS = {
    "top_p": Number(low=0, low_open=True, high=1),
    "top_k": Integer(low=-1),  # 0 and -1: no top-k for vLLM; transformers takes 0 only (`check_settings`)
    "min_p": Number(low=0, high=1, optional=True),
    "repetition_penalty": Number(low=0, low_open=True),
}


@dataclass(frozen=True)
class GenerationKwargs(JSONObject):
    """A JSON object whose sampling keys are spelled as vLLM and transformers read them (they ignore or reject `TOP_P`
    and `top-p`, mid-run) and hold values both accept (`SAMPLING_CHECKS`)."""

    def __call__(self, value: Any, field: str) -> Any:
        value = super().__call__(value, field)
        for key, item in (value or {}).items():
            spelled = str(key).lower().replace("-", "_")
            if spelled != key and spelled in SAMPLING_KEYS:
                refuse(f"{field} key {key!r}", f"spelled {spelled!r}, the key vLLM and transformers read", key)
            if key in SAMPLING_CHECKS:
                SAMPLING_CHECKS[key](item, f"{field}[{key!r}]")
        return value


#: TRL fields that TRL itself does not check, checked by our configs (a NaN learning rate trains NaN weights).
#: Each is refused here, before anything loads, instead of by a late crash or NaN (a batch size of 0, a seed numpy
#: refuses, a temperature the logits are divided by, an output_dir of '', ...).
TRL_FIELD_CHECKS = {
    "learning_rate": Number(low=0),
    "max_completion_length": Integer(low=1, optional=True),
    "loss_type": Choice(TRL_LOSS_TYPES),
    "temperature": Number(low=0, low_open=True),
    "per_device_train_batch_size": Integer(low=1),
    "gradient_accumulation_steps": Integer(low=1),
    "num_generations": Integer(low=2),  # GRPO's advantages compare completions of one prompt
    "seed": Integer(low=0, high=2**32 - 1),
    "output_dir": Text(optional=True),
    "generation_kwargs": GenerationKwargs(optional=True),
    **SAMPLING_CHECKS,
}
#: TRL fields read only under their `loss_type` (TRL's own per-token losses), as `sapo_temperature_pos`.
TRL_LOSS_TYPE_PREFIXES = ("sapo", "vespo")


class UnusedSettingWarning(UserWarning):
    """A setting changed from its default that the run ignores (e.g. `epsilon` with `policy_loss="band"`); the
    recipe entry point turns it into an error."""


# No argparse `choices`: a loss registered at run time (docs/adding-a-policy-loss.md) is valid too; __post_init__
# checks the name against the live registry.
_POLICY_LOSS_HELP = f"Per-token policy loss: one of {list(POLICY_LOSSES)} or any registered later."


def _field(default, help: str, **metadata):
    return field(default=default, metadata={"help": help, **metadata})


@dataclass
class PolicyLossConfig(GRPOConfig):
    r"""
    Configuration shared by [`BandPOTrainer`] and [`DGPOTrainer`]: every parameter of [`trl.GRPOConfig`], plus the
    choice of per-token policy loss and the hyper-parameters of each. Any trainer runs any policy loss;
    `BandPOConfig` and `DGPOConfig` differ only in their defaults. Each field's help says what it is; more here.

    Parameters:
        policy_loss (`str`, defaults to `"clip"`):
            Per-token policy term (docs/policy-losses.md lists them all): `"clip"` (GRPO/PPO), `"band"` (BandPO,
            [paper](https://arxiv.org/abs/2603.04918)), `"relaxed_band"`, `"dcpo"`, `"dgpo"`
            ([paper](https://arxiv.org/abs/2603.14389)), `"gppo"`, `"ce_gppo"`, `"aspo"`, `"cispo"`, `"band_dgpo"`,
            `"dppo_tv"`, `"dppo_kl"`, `"drpo"`, `"spo"`, `"ipo"`, `"cppo"`, `"trm"`, `"m2po"`, `"icepop"`, any loss
            registered since, or an import path `package.module:loss`. Everything but `"clip"` requires `loss_type`
            in `grpo`, `bnpo`, `dr_grpo`, `dapo`.
        band_divergence (`str`, defaults to `"kl"`):
            f-divergence of the Band trust region: `"kl"`, `"tv"`, `"chi2"`, `"reverse_kl"`, `"hellinger"`, `"js"`.
        band_radius (`float`, defaults to `0.05`):
            Trust-region radius δ (BandPO: 0.05, ablation 0.03 and 0.1).
        band_solver (`str`, defaults to `"auto"`):
            `"auto"` (Triton kernel on CUDA when installed, torch elsewhere), `"torch"` or `"triton"`.
        band_upper_max (`float` or `None`, defaults to `10.0`):
            Cap on the Band upper bound, as the BandPO authors trained. `None` keeps only the simplex limit `1/p`.
        dgpo_n (`int`, defaults to `1`), dgpo_m (`float`, defaults to `2.0`):
            DGPO's decay power n ≥ 1 on the left boundary (weight ∝ π^n for r < 1-ε, A < 0; paper: 2 at 1.5B, 1 at
            7B/14B) and root m ≥ 1 on the right one (weight ∝ π^(-1/m) for r > 1+ε_high, A > 0).
        ce_gppo_beta1 (`float`, defaults to `0.75`), ce_gppo_beta2 (`float`, defaults to `1.0`):
            CE-GPPO weight scales on the left and right boundaries (DGPO paper's setting).
        aspo_c_pos (`float`, defaults to `3.0`), aspo_c_neg (`float`, defaults to `3.0`):
            ASPO caps on the flipped weight 1/r of positive-advantage tokens and the weight r of negative ones.
        dppo_tv_radius (`float`, defaults to `0.15`), dppo_kl_radius (`float`, defaults to `0.05`):
            DPPO-Binary radius δ on `|q - p|` (TV) or `KL(Bern(p) || Bern(q))` (KL) (the authors' settings).
        dppo_radius_low, dppo_radius_high (`float` or `None`, defaults to `None`):
            DPPO radius for `A < 0` / `A > 0` instead of the variant's (verl's `clip_ratio_low` / `clip_ratio_high`).
        dppo_ratio_cap (`float` or `None`, defaults to `20.0`):
            DPPO's truncation `min(r, C)` (verl's fallback; the authors' scripts, and our recipes, set 10,000).
        drpo_epsilon (`float`, defaults to `12.5`), spo_epsilon (`float`, defaults to `12.5`):
            Threshold ε > 0 of DRPO's penalty `|A| p (r - 1)^2 / (2 ε)` and SPO's `|A| (r - 1)^2 / (2 ε)`, as the DRPO
            authors trained.
        ipo_mask_low, ipo_mask_high (`float`, defaults to `0.1`):
            prime-rl's IPO masks a token whose probability fell (`p - q`) / rose (`q - p`) by more than this.
        ipo_kl_tau (`float`, defaults to `0.001`), ipo_adv_tau (`float`, defaults to `1.0`):
            IPO's weight of its KL term `(log r)^2` (prime-rl's `kl_tau`, not TRL's `beta`) and its advantage scale.
        cppo_delta (`float`, defaults to `0.2`), cppo_w_min (`float`, defaults to `0.8`), cppo_delta_b (`float`,
        defaults to `0.02`):
            CPPO's per-token cap and initial budget on `|q - p|`, position weight of the last token, least budget
            rate.
        trm_divergence (`"k3"` or `"k1"`), trm_reduce (`"mean"` or `"max"`), trm_threshold (`float`, `0.01`):
            TRM drops a sequence whose mean or max token divergence exceeds the threshold (verl's estimators).
        m2po_threshold (`float`, defaults to `0.04`):
            M2PO masks the largest `(log r)^2` of the micro-batch until the mean of the rest is below it.
        icepop_low (`float`, defaults to `0.5`), icepop_high (`float`, defaults to `5.0`):
            IcePop masks a token with ratio `r < α` or `r > β` (prime-rl trained with 0.125 and 8.0).
        band_radius_by (`str` or `None`, defaults to `None`):
            `"entropy"`: token t gets `clip(band_radius * (H_t / H_mean) ** band_radius_exponent, band_radius_min,
            band_radius_max)`, `H_t` the old policy's entropy (docs/extensions.md).
        dynamic_sampling (`bool`, defaults to `False`), dynamic_sampling_max_rounds (`int`, defaults to `3`):
            DAPO's group filter: drop prompt groups with zero advantage and generate more, up to that many extra
            rounds (then the missing groups are masked out). Needs `per_device_train_batch_size *
            steps_per_generation` to be a multiple of `num_generations`.
        old_logps_source (`str`, defaults to `"trainer"`):
            The old policy: `"trainer"` (TRL's old-policy pass) or `"rollout"` (vLLM's sampling log-probs; needs
            `use_vllm=True` and `vllm_importance_sampling_correction=False`; docs/off-policy-and-async.md).
        on_nonfinite (`str`, defaults to `"stop"`):
            A NaN or infinite loss, gradient norm or reward: `"stop"` (raise `NonFiniteTrainingError`) or `"skip"`
            (warn and drop the update, or the group; not with DeepSpeed). docs/training.md.
    """

    policy_loss: str = _field("clip", _POLICY_LOSS_HELP)
    band_divergence: str = _field("kl", "Band f-divergence.", choices=list(DIVERGENCES))
    band_radius: float = _field(0.05, "Band trust-region radius delta.")
    band_solver: str = _field("auto", "Band bound solver.", choices=list(SOLVERS))
    band_upper_max: float | None = _field(10.0, "Cap on the Band upper bound (authors: 10); None for no cap.")
    dgpo_n: int = _field(1, "DGPO left-boundary decay power n >= 1.")
    dgpo_m: float = _field(2.0, "DGPO right-boundary decay root m >= 1.")
    ce_gppo_beta1: float = _field(0.75, "CE-GPPO left-boundary weight scale.")
    ce_gppo_beta2: float = _field(1.0, "CE-GPPO right-boundary weight scale.")
    aspo_c_pos: float = _field(3.0, "ASPO cap on 1/r for positive advantages.")
    aspo_c_neg: float = _field(3.0, "ASPO cap on r for negative advantages.")
    dppo_tv_radius: float = _field(0.15, "DPPO-Binary-TV radius delta.")
    dppo_kl_radius: float = _field(0.05, "DPPO-Binary-KL radius delta.")
    dppo_radius_low: float | None = _field(None, "DPPO radius for negative advantages (None: the variant's radius).")
    dppo_radius_high: float | None = _field(None, "DPPO radius for positive advantages (None: the variant's radius).")
    dppo_ratio_cap: float | None = _field(
        20.0, "DPPO truncation C of the importance weight min(r, C); None: no truncation."
    )
    drpo_epsilon: float = _field(12.5, "DRPO regularization threshold epsilon > 0.")
    spo_epsilon: float = _field(12.5, "SPO regularization threshold epsilon > 0.")
    ipo_mask_low: float = _field(0.1, "IPO: mask tokens whose probability fell by more than this (any advantage).")
    ipo_mask_high: float = _field(0.1, "IPO: mask tokens whose probability rose by more than this (any advantage).")
    ipo_kl_tau: float = _field(0.001, "IPO: weight of its KL term (log r)^2 on every token.")
    ipo_adv_tau: float = _field(1.0, "IPO: scale of the advantages in its policy term.")
    cppo_delta: float = _field(0.2, "CPPO: per-token cap and initial budget on |q - p|.")
    cppo_w_min: float = _field(0.8, "CPPO: position weight of the last token.")
    cppo_delta_b: float = _field(0.02, "CPPO: least budget rate per token.")
    trm_divergence: str = _field("k3", "TRM: 'k3' or 'k1'.", choices=["k1", "k3"])
    trm_reduce: str = _field("mean", "TRM: 'mean' or 'max'.", choices=["max", "mean"])
    trm_threshold: float = _field(0.01, "TRM: drop a sequence above this divergence.")
    m2po_threshold: float = _field(0.04, "M2PO: bound on the kept tokens' mean (log r)^2.")
    icepop_low: float = _field(0.5, "IcePop: mask a token whose ratio is below this.")
    icepop_high: float = _field(5.0, "IcePop: mask a token whose ratio is above this.")
    band_radius_by: str | None = _field(None, "Per-token Band radius: None (one radius for every token) or 'entropy'.")
    band_radius_exponent: float = _field(
        1.0, "Exponent (>= 0) of H_t / H_mean in the radius (0: one radius for every token)."
    )
    band_radius_min: float = _field(0.005, "Smallest per-token Band radius.")
    band_radius_max: float = _field(0.5, "Largest per-token Band radius.")
    dynamic_sampling: bool = _field(False, "Drop zero-advantage prompt groups and refill the batch (DAPO).")
    dynamic_sampling_max_rounds: int = _field(3, "Extra generation rounds allowed per batch with dynamic_sampling.")
    old_logps_source: str = _field(
        "trainer",
        "Old log-probs of the ratio and the bounds: 'trainer' (TRL's forward pass) or 'rollout' (the log-probs vLLM "
        "sampled with; use_vllm only).",
        choices=["trainer", "rollout"],
    )
    on_nonfinite: str = _field(
        "stop",
        "A step whose loss or gradient norm is NaN or inf: 'stop' (raise) or 'skip' (drop the update).",
        choices=["stop", "skip"],
    )
    #: The check of each field above that is no loss hyper-parameter (those are the loss registry's).
    FIELD_CHECKS: ClassVar[dict] = {
        "band_radius_by": Choice(("entropy",), optional=True),
        "band_radius_exponent": Number(low=0),
        "band_radius_min": Number(low=0, low_open=True),
        "band_radius_max": Number(low=0, low_open=True),
        "dynamic_sampling": Flag(),
        "dynamic_sampling_max_rounds": Integer(low=0),
        "old_logps_source": Choice(("trainer", "rollout")),
        "on_nonfinite": Choice(("stop", "skip")),
    }

    def __post_init__(self):
        checked_post_init(self, super().__post_init__)


def checked_post_init(config, trl_post_init) -> None:
    """A config's `__post_init__`: our checks first (a bad value of ours, or of the TRL fields we check, must not hide
    behind a TRL error), then TRL's `trl_post_init`, then the settings together."""
    check_fields(config)
    with library_noise_filtered():  # TRL's own default, gradient_checkpointing, is deprecated in transformers
        trl_post_init()
    check_settings(config)


# -- The checks every config family runs: field by field, then together ------------------------------------------


def _field_checks() -> dict[str, tuple[Any, bool]]:
    """`{field: (check, whether None means "read the fallback field")}`: our fields' own checks (`FIELD_CHECKS`), the
    loss registry's (one per config field, whichever loss reads it) and `TRL_FIELD_CHECKS`."""
    checks = {name: (check, False) for name, check in PolicyLossConfig.FIELD_CHECKS.items()}
    for spec in registered_policy_losses().values():
        for hp in spec.hyperparameters:
            if hp.field is not None:
                checks.setdefault(hp.field, (hp.check, hp.fallback_field is not None))
    return {**{name: (check, False) for name, check in TRL_FIELD_CHECKS.items()}, **checks}


def check_fields(config) -> None:
    """Check every field of `config` that has a check (`_field_checks`) and store the normalised value: a
    `ValueError` names the first bad field, its value and what is allowed. `policy_loss` is checked (and a loss
    given by import path imported) first: its fields may be among the others."""
    policy_loss_spec(config.policy_loss)
    for name, (check, falls_back) in _field_checks().items():
        if not hasattr(config, name):
            continue  # a field of another config family, or of a loss whose config subclass is not this one
        value = getattr(config, name)
        if type(value).__module__.startswith("torch"):
            refuse(
                name, "a number in a config (per-token tensors are for the pure API, trl_bandpo.policy_loss)", value
            )
        if callable(value):
            refuse(name, "a name in a config (a function cannot be saved with the checkpoints nor sent to other "
                   "processes: register it once with trl_bandpo.core.band.register_divergence('name', f) and pass "
                   "'name')", value)  # fmt: skip
        if value is None and falls_back:
            continue  # TRL reads the fallback field, checked under its own name
        setattr(config, name, check(value, name))
    for f in dataclasses.fields(config._args if isinstance(config, PolicySettings) else config):
        value = getattr(config, f.name, None)  # any field, ours or TRL's: no integer beyond what a tensor holds
        if isinstance(value, int) and not isinstance(value, bool) and not -INT64_LIMIT <= value < INT64_LIMIT:
            refuse(f.name, "a number within the range of 64-bit integers", value)


def check_settings(config, defaults: dict | None = None) -> None:
    """The settings of `config` checked together (after TRL's own checks): the selected loss with TRL's loss types,
    where training runs and the TRL settings it cannot honour; dynamic sampling's batch; the old policy's source;
    the radius range; and one `UnusedSettingWarning` naming every setting the run ignores. `defaults`: the field
    defaults to compare with (default: those of `config`'s own dataclass)."""
    spec = policy_loss_spec(config.policy_loss)
    defaults = defaults if defaults is not None else {f.name: f.default for f in dataclasses.fields(config)}
    loss_type = getattr(config, "loss_type", None)
    if spec.name != "clip" and loss_type in TRL_PER_TOKEN_LOSS_TYPES:
        raise ValueError(
            f"policy_loss={config.policy_loss!r} cannot be combined with loss_type={loss_type!r}: that loss type has "
            f"its own per-token policy term. Use policy_loss='clip' with it, or a loss_type among "
            f"{list(CLIP_AGGREGATION_LOSS_TYPES)}."
        )
    if spec.check is not None:
        bound_kwargs, loss_kwargs = spec.kwargs_from_config(config)
        labels = {hp.name: hp.field for hp in spec.hyperparameters if hp.field is not None}
        device = "cpu" if getattr(config, "use_cpu", False) or not torch.cuda.is_available() else "cuda"
        spec.check({**bound_kwargs, **loss_kwargs}, labels, device)
    for name, reason in spec.incompatible.items():
        if hasattr(config, name) and getattr(config, name) != defaults[name]:
            raise ValueError(
                f"{name}={getattr(config, name)!r} cannot be used with policy_loss={config.policy_loss!r}: {reason}. "
                f"Set {name}={defaults[name]!r}."
            )
    if getattr(config, "band_radius_min", 0) > getattr(config, "band_radius_max", 1):
        raise ValueError(
            f"band_radius_min ({config.band_radius_min!r}) must not exceed band_radius_max "
            f"({config.band_radius_max!r})."
        )
    if getattr(config, "dynamic_sampling", False):
        local_batch = config.per_device_train_batch_size * config.steps_per_generation
        if local_batch % config.num_generations:
            raise ValueError(
                f"dynamic_sampling needs each process's generation batch (per_device_train_batch_size x "
                f"steps_per_generation = {local_batch}) to be a multiple of num_generations "
                f"({config.num_generations}), so that no prompt group straddles two processes."
            )
    _check_rollout_source(config)
    extra = getattr(config, "generation_kwargs", None) or {}
    label = "generation_kwargs['top_k']" if "top_k" in extra else "top_k"  # the key overrides the field
    if extra.get("top_k", getattr(config, "top_k", 0)) == -1 and not getattr(config, "use_vllm", True):  # async: vLLM
        refuse(label, "0 or more without use_vllm (transformers' generate refuses -1; 0 means no top-k)", -1)
    deepspeed = getattr(config, "deepspeed", None) or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"
    if getattr(config, "on_nonfinite", "stop") == "skip" and deepspeed:
        raise ValueError(
            "on_nonfinite='skip' cannot be used with DeepSpeed: its engine steps the optimizer within the backward "
            "pass, before the gradient norm is known. Use on_nonfinite='stop'."
        )
    unused = _unused_settings(config, spec, defaults)
    message = "; ".join(f"{name}={getattr(config, name)!r} has no effect {why}" for name, why in unused.items())
    # Said once per config: the trainer checks its config again, and warns only of what changed since.
    if unused and config.__dict__.get(_WARNED_KEY) != message:
        warnings.warn(
            message + " (docs/policy-losses.md lists what each loss reads).",
            UnusedSettingWarning,
            stacklevel=user_stacklevel(),
        )
    config.__dict__[_WARNED_KEY] = message


_WARNED_KEY = "_trl_bandpo_unused_settings_warned"


def _check_rollout_source(config) -> None:
    """Where the old policy is the engine's sampling log-probs, the settings that cannot go with it, each refused by
    name: `old_logps_source="rollout"` needs vLLM and refuses the settings that would read the trainer-side
    old-policy pass it skips; it and the asynchronous configs (no `old_logps_source`: their old log-probs are always
    the rollout's) refuse sampling settings under which those log-probs are not the model's
    (`_rollout_logps_distortions`)."""
    source = getattr(config, "old_logps_source", None)
    if source is None:  # the asynchronous family: the old policy is each rollout sample's log-probs
        distorted = _rollout_logps_distortions(config)
        if distorted:
            raise ValueError(
                f"The asynchronous trainer takes the log-probs vLLM sampled each token with as the old policy, which "
                f"cannot be combined with {', '.join(distorted)}: {_DISTORTION_REASON} It has no trainer-side "
                f"old-policy pass to use instead: sample without them ({_NEUTRAL_SAMPLING_ASYNC})."
            )
        return
    if source != "rollout":
        return
    if not config.use_vllm:
        raise ValueError(
            "old_logps_source='rollout' needs use_vllm=True: the old log-probs are those vLLM returns with each "
            "sampled token, and generation without vLLM returns none. Use old_logps_source='trainer'."
        )
    if config.vllm_importance_sampling_correction:
        raise ValueError(
            "old_logps_source='rollout' cannot be combined with vllm_importance_sampling_correction=True (TRL's "
            "default): the ratio is already taken against the engine's log-probs, so TRL's correction of the "
            "engine/trainer mismatch would apply a second time. Set vllm_importance_sampling_correction=False."
        )
    if config.band_radius_by is not None:
        raise ValueError(
            f"band_radius_by={config.band_radius_by!r} cannot be combined with old_logps_source='rollout': the "
            "adaptive radius reads the old policy's entropies, which vLLM does not return (they come from the "
            "trainer's old-policy pass that 'rollout' skips). Use old_logps_source='trainer' or band_radius_by=None."
        )
    distorted = _rollout_logps_distortions(config)
    if distorted:
        raise ValueError(
            f"old_logps_source='rollout' cannot be combined with {', '.join(distorted)}: {_DISTORTION_REASON} Use "
            f"old_logps_source='trainer' (the trainer's own old-policy pass: every ratio starts at 1), or sample "
            f"without them ({_NEUTRAL_SAMPLING})."
        )


_DISTORTION_REASON = (
    "vLLM returns each sampled token's log-prob after its sampling processing (top-p, top-k and min-p keep part of "
    "the vocabulary and renormalise over it; min_tokens removes the end-of-sequence token; structured outputs "
    "(guided decoding) remove every token the grammar forbids; penalties and biases shift the logits), which the "
    "trainer's model does not apply, so every token's ratio would start away from 1 (at the kept probability mass "
    "under truncation) and the trust region would clip or mask tokens that have not moved."
)
_NEUTRAL_SAMPLING_ASYNC = "top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0"
_NEUTRAL_SAMPLING = (
    f"{_NEUTRAL_SAMPLING_ASYNC}, no vllm_structured_outputs_regex, and generation_kwargs without sampling settings "
    "such as min_tokens or structured_outputs"
)


#: The sampling settings (TRL's fields, vLLM's `SamplingParams` and server keys) under which vLLM's sampling log-probs
#: are not the model's, each with the test of a value that makes them differ.
ROLLOUT_DISTORTIONS = {
    "top_p": lambda v: v < 1,
    **dict.fromkeys(("top_k", "min_p", "min_tokens"), lambda v: v > 0),  # top_k 0 and -1: no top-k
    "repetition_penalty": lambda v: v != 1,
    **dict.fromkeys(("presence_penalty", "frequency_penalty"), lambda v: v != 0),
    **dict.fromkeys(("logit_bias", "allowed_token_ids", "bad_words", "logits_processors", "extra_args"), bool),
    "vllm_xargs": bool,  # a server's extra_args, read by custom logits processors
    # constrained decoding (guided decoding before structured outputs): any value
    **dict.fromkeys(("vllm_structured_outputs_regex", "structured_outputs", "response_format"), lambda v: True),
    **dict.fromkeys((f"guided_{kind}" for kind in ("decoding", "json", "regex", "choice", "grammar")), lambda v: True),
}
#: The `generation_kwargs` keys whose other spellings (`TOP_P`, `top-p`) are refused.
SAMPLING_KEYS = (*ROLLOUT_DISTORTIONS, "temperature")


def _rollout_logps_distortions(config) -> list[str]:
    """The sampling settings of `config` under which vLLM's sampling log-probs (its `processed_logprobs`) differ from
    the log-probs of the model the trainer holds (`ROLLOUT_DISTORTIONS`), each as `name=value` (`top_p=0.8`,
    `generation_kwargs['min_tokens']=16`), and a sampling temperature other than the one the trainer divides the
    logits by. A key of `generation_kwargs` (a mapping once checked: `check_fields`) overrides the config's field of
    that name, as in TRL's vLLM generation; fields a config family lacks (the async configs have no
    `generation_kwargs`) are skipped."""
    extra = getattr(config, "generation_kwargs", None) or {}
    found = []
    for name, is_changed in ROLLOUT_DISTORTIONS.items():
        label, value = (
            (f"generation_kwargs[{name!r}]", extra[name]) if name in extra else (name, getattr(config, name, None))
        )
        try:
            distorts = value is not None and (is_changed(value) or value != value)  # NaN: not a neutral value
        except TypeError:  # a value of the wrong type ("0.8") is no neutral value either
            distorts = True
        if distorts:
            found.append(f"{label}={value!r}")
    if "temperature" in extra and extra["temperature"] != getattr(config, "temperature", 1.0):
        found.append(
            f"generation_kwargs['temperature']={extra['temperature']!r} (the trainer divides the logits by "
            f"temperature={getattr(config, 'temperature', 1.0)!r})"
        )
    return found


def _unused_settings(config, spec, defaults: dict) -> dict[str, str]:
    """The settings changed from their default that this run ignores, each with the reason."""

    def changed(name: str) -> bool:
        return name in defaults and hasattr(config, name) and getattr(config, name) != defaults[name]

    read = set(spec.config_fields)
    unused = {
        name: f"with policy_loss={config.policy_loss!r}, which does not read it"
        for name in sorted(_loss_fields() - read)
        if changed(name)
    }
    radius_fields = ("band_radius_exponent", "band_radius_min", "band_radius_max")
    if getattr(config, "band_radius_by", None) is not None and "band_radius" not in read:
        unused["band_radius_by"] = (
            f"with policy_loss={config.policy_loss!r}, which has no Band radius (use band, relaxed_band or band_dgpo)"
        )
    elif getattr(config, "band_radius_by", None) is None:
        unused.update({name: "without band_radius_by='entropy'" for name in radius_fields if changed(name)})
    if not (getattr(config, "use_vllm", False) and getattr(config, "vllm_importance_sampling_correction", False)):
        names = [f"vllm_importance_sampling_{name}" for name in ("mode", "cap", "clip_min", "clip_max")]
        why = "without use_vllm=True and vllm_importance_sampling_correction=True"
        unused.update({name: why for name in names if changed(name)})
    # Without vLLM, TRL's off-policy mask compares the policy with its old-policy pass, which it makes only when a
    # generation batch spans several optimizer steps (the sampling policy is the trained one otherwise).
    if changed("off_policy_mask_threshold") and not config.use_vllm:
        if not config.gradient_accumulation_steps % (config.steps_per_generation * config.num_iterations):
            unused["off_policy_mask_threshold"] = "without use_vllm=True or generation batches over several steps"
    if changed("dynamic_sampling_max_rounds") and not getattr(config, "dynamic_sampling", False):
        unused["dynamic_sampling_max_rounds"] = "without dynamic_sampling=True"
    for loss_type in TRL_LOSS_TYPE_PREFIXES:
        if getattr(config, "loss_type", None) != loss_type:
            names = sorted(name for name in defaults if name.startswith(f"{loss_type}_") and changed(name))
            unused.update(dict.fromkeys(names, f"without loss_type={loss_type!r}"))
    return unused


def _loss_fields() -> set[str]:
    """The fields, ours and TRL's (`epsilon`, `epsilon_high`, `delta`), that some registered loss reads."""
    return {name for spec in registered_policy_losses().values() for name in spec.config_fields}


#: The papers, for the model card TRL writes on save.
BANDPO_PAPER = {
    "title": "BandPO: Bridging Trust Regions and Ratio Clipping via Probability-Aware Bounds for LLM "
    "Reinforcement Learning",
    "id": "2603.04918",
    "citation": "@article{li2026bandpo,\n  title   = {{BandPO: Bridging Trust Regions and Ratio Clipping via "
    "Probability-Aware Bounds for LLM Reinforcement Learning}},\n  author  = {Li, Yuan and others},\n  "
    "year    = 2026,\n  eprint  = {arXiv:2603.04918}\n}",
}
DGPO_PAPER = {
    "title": "From log pi to pi: Taming Divergence in Soft Clipping via Bilateral Decoupled Decay of Probability "
    "Gradient Weight",
    "id": "2603.14389",
    "citation": "@article{fu2026dgpo,\n  title   = {{From log pi to pi: Taming Divergence in Soft Clipping via "
    "Bilateral Decoupled Decay of Probability Gradient Weight}},\n  author  = {Fu, Xiaoliang and Lin, Jiaye and "
    "others},\n  year    = 2026,\n  eprint  = {arXiv:2603.14389}\n}",
}


@dataclass
class BandPOConfig(PolicyLossConfig):
    r"""
    Configuration of [`BandPOTrainer`]: [`PolicyLossConfig`] with `policy_loss="band"`, i.e. BandPO's
    probability-aware bounds from a KL trust region of radius `band_radius` in place of GRPO's fixed clip
    ([BandPO](https://arxiv.org/abs/2603.04918)). The authors also trained with `delta=10` (dual clip),
    `loss_type="grpo"`, `beta=0.001`; the recipes in `recipes/` set those.

    Parameters:
        policy_loss (`str`, defaults to `"band"`):
            Per-token policy loss; see [`PolicyLossConfig`].
    """

    policy_loss: str = _field("band", _POLICY_LOSS_HELP)


@dataclass
class DGPOConfig(PolicyLossConfig):
    r"""
    Configuration of [`DGPOTrainer`]: [`PolicyLossConfig`] with `policy_loss="dgpo"`, i.e. tokens outside the clip
    range keep a gradient whose weight decays continuously as π^n (left) and π^(-1/m) (right)
    ([DGPO](https://arxiv.org/abs/2603.14389)). The paper uses ε = 0.2/0.2, token-mean aggregation (`loss_type`
    `"dapo"`, TRL's default) and no KL penalty.

    Parameters:
        policy_loss (`str`, defaults to `"dgpo"`):
            Per-token policy loss; see [`PolicyLossConfig`].
    """

    policy_loss: str = _field("dgpo", _POLICY_LOSS_HELP)


# -- Serving a config of the GRPOConfig family (a project's own `class MyConfig(GRPOConfig)`) -------------------------


class PolicySettings:
    """A config of TRL's family without our fields (a `GRPOConfig`, an `AsyncGRPOConfig`, or a project's own
    subclass), seen with them at `config_class`'s defaults. The trainer keeps the user's object as `trainer.args`,
    untouched, and reads our settings (and the TRL fields our losses read, checked and normalised) from this view."""

    def __init__(self, args, config_class: type):
        self._args = args
        self.__dict__.update(
            {f.name: f.default for f in dataclasses.fields(config_class) if not hasattr(args, f.name)}
        )

    def __getattr__(self, name: str):  # anything not ours: the user's config
        return getattr(self.__dict__["_args"], name)


def policy_settings(trainer_name: str, args, config_class: type, family: type):
    """The settings a trainer reads our fields from, checked again by the same owners as when the config was built
    (a config is mutable: a value set after `__post_init__`, by the user or a subclass's own `__post_init__`, is
    refused here, before any model loads): `args` itself when it is a config of ours, else, for a config of TRL's
    `family` (a project's `GRPOConfig` subclass, say), a `PolicySettings` view with our fields at `config_class`'s
    defaults; said once in the log."""
    own = [
        f.name for f in dataclasses.fields(config_class) if f.name not in {g.name for g in dataclasses.fields(family)}
    ]
    if all(hasattr(args, name) for name in own):
        check_fields(args)
        check_settings(args)
        return args
    if not isinstance(args, family):
        article = "an" if family.__name__[0] in "AEIOU" else "a"
        raise TypeError(
            f"{trainer_name} needs {article} {family.__name__} ({config_class.__name__}, or any {family.__name__} "
            f"subclass), got {type(args).__name__}."
        )
    view = PolicySettings(args, config_class)
    check_fields(view)
    check_settings(view, {f.name: f.default for f in dataclasses.fields(config_class)})
    logger.warning_once(
        f"{trainer_name} got a {type(args).__name__}: it trains with it as it is (trainer.args is your object), and "
        f"trl-bandpo's own settings, which it lacks, take {config_class.__name__}'s defaults "
        f"(policy_loss={view.policy_loss!r}). To set them, derive your config from {config_class.__name__}."
    )
    return view


def config_class_with_loss_fields(config_class: type[PolicyLossConfig], policy_loss: str) -> type[PolicyLossConfig]:
    """`config_class`, extended by the config fields that the policy loss `policy_loss` (a name, or an import path
    `package.module:loss` of a loss registered in user code) reads and `config_class` lacks, each with the default
    of its keyword in the loss's functions: the recipe entry point uses it so that a recipe sets a user loss's
    hyper-parameters like ours (docs/adding-a-policy-loss.md)."""
    spec = policy_loss_spec(policy_loss)
    present = {f.name for f in dataclasses.fields(config_class)}
    missing = []
    for hp in spec.hyperparameters:
        if hp.field is None or hp.field in present or hp.field in {m[0] for m in missing}:
            continue
        default = _keyword_default(spec, hp.name)
        kind = {bool: bool, int: int, float: float, str: str}.get(type(default), float)
        annotation = kind | None if default is None else kind
        help_text = f"{hp.name} of policy_loss {spec.name!r} (declared by its registry entry)."
        missing.append((hp.field, annotation, _field(default, help_text)))
    if not missing:
        return config_class
    name = f"{config_class.__name__}With{''.join(part.title() for part in spec.name.split('_'))}Fields"
    extended = dataclasses.make_dataclass(name, missing, bases=(config_class,), namespace={"__module__": __name__})
    globals()[name] = extended  # found by pickle in this process (the trainer saves the config)
    return extended


def _keyword_default(spec, keyword: str):
    for function in (spec.bounds, spec.loss):
        parameter = inspect.signature(function).parameters.get(keyword)
        if parameter is not None and parameter.default is not inspect.Parameter.empty:
            return parameter.default
    return None


# -- Warnings that point at the user's line ------------------------------------------------------------------------

# Frames in these folders are library code: a warning is attributed to the first frame outside them (a dataclass's
# generated `__init__` counts as library code too).
_LIBRARY_FOLDERS = tuple(
    os.path.dirname(module.__file__) + os.sep
    for module in (sys.modules[__name__.rpartition(".")[0]], trl, transformers)
)


def is_library_file(filename: str) -> bool:
    """Whether `filename` is library code: trl_bandpo, TRL, transformers, a dataclass's generated code, or a TRL
    method we patched (compiled from its own file, `trl_patches`)."""
    from .trl_patches import PATCHED_FILES

    return filename.startswith(_LIBRARY_FOLDERS) or filename == "<string>" or filename in PATCHED_FILES


def user_frame(depth: int = 1):
    """`(frame, stacklevel)` of the first frame outside trl_bandpo, TRL and transformers (the user's line), searched
    from the frame `depth` levels above this function (1: its caller), which is `stacklevel` 1."""
    frame, level = sys._getframe(depth), 1
    while frame.f_back is not None and is_library_file(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return frame, level


def user_stacklevel() -> int:
    """The `stacklevel` for `warnings.warn` called right where this is called that attributes the warning to the
    user's line."""
    return user_frame(2)[1]

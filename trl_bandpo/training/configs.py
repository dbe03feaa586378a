"""Configurations of the BandPO and DGPO trainers: `GRPOConfig` plus the fields of our policy losses.

The config holds the fields; what each policy loss reads, and how each field is checked, comes from the loss
registry (`trl_bandpo.core.losses`, docs/adding-a-policy-loss.md): this module has no per-loss tables.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import sys
import warnings
from dataclasses import dataclass, field

import transformers
import trl
from trl import GRPOConfig

from ..core.band import DIVERGENCES, SOLVERS
from ..core.losses import POLICY_LOSSES, policy_loss_spec, registered_policy_losses

# TRL loss types whose per-token policy term is TRL's own (not a clipped ratio); they only combine with "clip".
TRL_PER_TOKEN_LOSS_TYPES = ("cispo", "sapo", "vespo", "luspo")
# TRL loss types that aggregate the clipped per-token term: every registered policy loss runs under these.
CLIP_AGGREGATION_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
TRL_LOSS_TYPES = CLIP_AGGREGATION_LOSS_TYPES + TRL_PER_TOKEN_LOSS_TYPES


# No argparse `choices`: a loss registered at run time (docs/adding-a-policy-loss.md) is valid too; __post_init__
# checks the name against the live registry.
_POLICY_LOSS_HELP = f"Per-token policy loss: one of {list(POLICY_LOSSES)} or any registered later."


@dataclass
class PolicyLossConfig(GRPOConfig):
    r"""
    Configuration shared by [`BandPOTrainer`] and [`DGPOTrainer`]: every parameter of [`trl.GRPOConfig`], plus the
    choice of per-token policy loss and the hyper-parameters of each. Any trainer runs any policy loss, so one tool
    reruns both papers' comparisons; `BandPOConfig` and `DGPOConfig` differ only in their defaults.

    Parameters:
        policy_loss (`str`, defaults to `"clip"`):
            Per-token policy term: `"clip"` (GRPO/PPO; Clip-Higher with `epsilon_high=0.28`), `"band"` (BandPO,
            [paper](https://arxiv.org/abs/2603.04918)), `"relaxed_band"` (Band united with the Clip-Higher
            interval, BandPO's ablation), `"dcpo"` (DCPO's dynamic bounds), `"dgpo"`
            ([paper](https://arxiv.org/abs/2603.14389)), `"gppo"`, `"ce_gppo"`, `"aspo"`, `"cispo"` (the DGPO
            paper's baselines; `"cispo"` clips the weight on both sides as that paper ran it), `"band_dgpo"` (DGPO's
            decay outside the Band bounds, beyond both papers). Everything but `"clip"` requires `loss_type` in
            `grpo`, `bnpo`, `dr_grpo`, `dapo`.
        band_divergence (`str`, defaults to `"kl"`):
            f-divergence of the Band trust region: `"kl"`, `"tv"`, `"chi2"`, `"reverse_kl"`, `"hellinger"`, `"js"`.
        band_radius (`float`, defaults to `0.05`):
            Trust-region radius δ (BandPO: 0.05, ablation 0.03 and 0.1).
        band_solver (`str`, defaults to `"auto"`):
            `"auto"` (Triton kernel on CUDA when installed, torch elsewhere), `"torch"` or `"triton"`.
        band_upper_max (`float` or `None`, defaults to `10.0`):
            Cap on the Band upper bound, as the BandPO authors trained. `None` keeps only the simplex limit `1/p`.
        dgpo_n (`int`, defaults to `1`):
            DGPO left-boundary decay power n ≥ 1 (weight on ∇π ∝ π^n for r < 1-ε, A < 0). Paper: 2 at 1.5B, 1 at
            7B/14B.
        dgpo_m (`float`, defaults to `2.0`):
            DGPO right-boundary decay root m ≥ 1 (weight on ∇π ∝ π^(-1/m) for r > 1+ε_high, A > 0).
        ce_gppo_beta1 (`float`, defaults to `0.75`):
            CE-GPPO weight scale on the left boundary (DGPO paper's setting).
        ce_gppo_beta2 (`float`, defaults to `1.0`):
            CE-GPPO weight scale on the right boundary.
        aspo_c_pos (`float`, defaults to `3.0`):
            ASPO cap on the flipped weight 1/r of positive-advantage tokens.
        aspo_c_neg (`float`, defaults to `3.0`):
            ASPO cap on the weight r of negative-advantage tokens.
        dppo_tv_radius (`float`, defaults to `0.15`):
            DPPO-Binary-TV radius δ: a token is masked once `|q - p|` exceeds it in its advantage's direction (the
            authors' setting).
        dppo_kl_radius (`float`, defaults to `0.05`):
            DPPO-Binary-KL radius δ on `KL(Bern(p) || Bern(q))` (the authors' setting).
        dppo_radius_low (`float` or `None`, defaults to `None`):
            DPPO radius on the lower side (`A < 0`) instead of the variant's radius (verl's `clip_ratio_low`).
        dppo_radius_high (`float` or `None`, defaults to `None`):
            DPPO radius on the upper side (`A > 0`) instead of the variant's radius (verl's `clip_ratio_high`).
        dppo_ratio_cap (`float` or `None`, defaults to `20.0`):
            DPPO's truncation `C` of the importance weight, `min(r, C)` (`None`: no truncation). 20 is verl's own
            fallback; the authors' scripts set 10,000 (effectively off), as our DPPO recipes do.

        > Adaptive per-token radius (an extension, docs/extensions.md)

        band_radius_by (`str` or `None`, defaults to `None`):
            `None`: one radius `band_radius` for every token. `"entropy"`: token t gets
            `clip(band_radius * (H_t / H_mean) ** band_radius_exponent, band_radius_min, band_radius_max)`, `H_t` the
            old policy's entropy at t and `H_mean` its mean over the generation batch.
        band_radius_exponent (`float`, defaults to `1.0`):
            Exponent alpha >= 0 of the entropy ratio (0: one radius for every token; a negative one is refused: it
            would widen the Band of confident tokens and tighten that of uncertain ones).
        band_radius_min (`float`, defaults to `0.005`):
            Smallest per-token radius.
        band_radius_max (`float`, defaults to `0.5`):
            Largest per-token radius.

        > Dynamic sampling (DAPO's group filter; an extension, docs/extensions.md)

        dynamic_sampling (`bool`, defaults to `False`):
            Drop prompt groups whose rewards all agree (zero advantage) and generate fresh prompts until the
            generation batch is full. Needs `per_device_train_batch_size * steps_per_generation` to be a multiple of
            `num_generations` (groups must not straddle processes).
        dynamic_sampling_max_rounds (`int`, defaults to `3`):
            Extra generation rounds allowed per generation batch; when they run out the batch trains with what it
            has (the missing groups masked out) and `dynamic_sampling/filled_share` says how full it was.

        > Old policy of the ratio (docs/off-policy-and-async.md)

        old_logps_source (`str`, defaults to `"trainer"`):
            Where the old log-probs of the ratio and of every loss's bounds come from: `"trainer"` (TRL's forward pass
            of the trainer's model, or the current log-probs when TRL skips it) or `"rollout"` (the log-probs vLLM
            returned with each sampled token; needs `use_vllm=True` and `vllm_importance_sampling_correction=False`,
            and skips the trainer's old-policy pass).
    """

    policy_loss: str = field(
        default="clip",
        metadata={"help": _POLICY_LOSS_HELP},
    )
    band_divergence: str = field(default="kl", metadata={"help": "Band f-divergence.", "choices": list(DIVERGENCES)})
    band_radius: float = field(default=0.05, metadata={"help": "Band trust-region radius delta."})
    band_solver: str = field(default="auto", metadata={"help": "Band bound solver.", "choices": list(SOLVERS)})
    band_upper_max: float | None = field(
        default=10.0, metadata={"help": "Cap on the Band upper bound (authors: 10); None for no cap."}
    )
    dgpo_n: int = field(default=1, metadata={"help": "DGPO left-boundary decay power n >= 1."})
    dgpo_m: float = field(default=2.0, metadata={"help": "DGPO right-boundary decay root m >= 1."})
    ce_gppo_beta1: float = field(default=0.75, metadata={"help": "CE-GPPO left-boundary weight scale."})
    ce_gppo_beta2: float = field(default=1.0, metadata={"help": "CE-GPPO right-boundary weight scale."})
    aspo_c_pos: float = field(default=3.0, metadata={"help": "ASPO cap on 1/r for positive advantages."})
    aspo_c_neg: float = field(default=3.0, metadata={"help": "ASPO cap on r for negative advantages."})
    dppo_tv_radius: float = field(default=0.15, metadata={"help": "DPPO-Binary-TV radius delta."})
    dppo_kl_radius: float = field(default=0.05, metadata={"help": "DPPO-Binary-KL radius delta."})
    dppo_radius_low: float | None = field(
        default=None, metadata={"help": "DPPO radius for negative advantages (None: the variant's radius)."}
    )
    dppo_radius_high: float | None = field(
        default=None, metadata={"help": "DPPO radius for positive advantages (None: the variant's radius)."}
    )
    dppo_ratio_cap: float | None = field(
        default=20.0, metadata={"help": "DPPO truncation C of the importance weight min(r, C); None: no truncation."}
    )
    band_radius_by: str | None = field(
        default=None, metadata={"help": "Per-token Band radius: None (one radius for every token) or 'entropy'."}
    )
    band_radius_exponent: float = field(
        default=1.0, metadata={"help": "Exponent (>= 0) of H_t / H_mean in the radius."}
    )
    band_radius_min: float = field(default=0.005, metadata={"help": "Smallest per-token Band radius."})
    band_radius_max: float = field(default=0.5, metadata={"help": "Largest per-token Band radius."})
    dynamic_sampling: bool = field(
        default=False, metadata={"help": "Drop zero-advantage prompt groups and refill the batch (DAPO)."}
    )
    dynamic_sampling_max_rounds: int = field(
        default=3, metadata={"help": "Extra generation rounds allowed per batch with dynamic_sampling."}
    )
    old_logps_source: str = field(
        default="trainer",
        metadata={
            "help": "Old log-probs of the ratio and the bounds: 'trainer' (TRL's forward pass) or 'rollout' (the "
            "log-probs vLLM sampled with; use_vllm only).",
            "choices": ["trainer", "rollout"],
        },
    )

    def __post_init__(self):
        # Our checks first: a bad value of ours (or of the TRL fields below) must not hide behind a TRL error.
        spec = policy_loss_spec(self.policy_loss)  # raises ValueError naming the allowed values
        self._check_field_types()
        self._check_hyperparameters()
        super().__post_init__()
        if self.policy_loss != "clip" and self.loss_type in TRL_PER_TOKEN_LOSS_TYPES:
            raise ValueError(
                f"policy_loss={self.policy_loss!r} cannot be combined with loss_type={self.loss_type!r}: that loss "
                f"type has its own per-token policy term. Use policy_loss='clip' with it, or a loss_type among "
                f"{list(CLIP_AGGREGATION_LOSS_TYPES)}."
            )
        self._check_selected_loss(spec)
        self._warn_unused_fields(spec)
        self._check_dynamic_sampling()
        self._check_adaptive_radius(spec)
        self._check_old_logps_source()

    def _check_old_logps_source(self):
        """`old_logps_source="rollout"` takes the engine's sampling log-probs as the old policy: it needs vLLM, and
        refuses the two settings that would read the old policy's trainer-side pass it skips."""
        if self.old_logps_source not in ("trainer", "rollout"):
            raise ValueError(f"old_logps_source must be 'trainer' or 'rollout', got {self.old_logps_source!r}.")
        if self.old_logps_source == "trainer":
            return
        if not self.use_vllm:
            raise ValueError(
                "old_logps_source='rollout' needs use_vllm=True: the old log-probs are those vLLM returns with each "
                "sampled token, and generation without vLLM returns none. Use old_logps_source='trainer'."
            )
        if self.vllm_importance_sampling_correction:
            raise ValueError(
                "old_logps_source='rollout' cannot be combined with vllm_importance_sampling_correction=True (TRL's "
                "default): the ratio is already taken against the engine's log-probs, so TRL's correction of the "
                "engine/trainer mismatch would apply a second time. Set vllm_importance_sampling_correction=False."
            )
        if self.band_radius_by is not None:
            raise ValueError(
                f"band_radius_by={self.band_radius_by!r} cannot be combined with old_logps_source='rollout': the "
                "adaptive radius reads the old policy's entropies, which vLLM does not return (they come from the "
                "trainer's old-policy pass that 'rollout' skips). Use old_logps_source='trainer' or "
                "band_radius_by=None."
            )

    def _check_selected_loss(self, spec):
        """The fields the selected loss reads, its cross-field checks where training will run (e.g.
        `band_solver="triton"`), and the TRL settings it cannot honour (an error, not a silent no-op). Shared with the
        async configs (`trl_bandpo.training.async_trainer`)."""
        bound_kwargs, loss_kwargs = spec.kwargs_from_config(self)
        if spec.check is not None:
            labels = {hp.name: hp.field for hp in spec.hyperparameters if hp.field is not None}
            device = "cpu" if self.use_cpu or not _cuda_available() else "cuda"
            spec.check({**bound_kwargs, **loss_kwargs}, labels, device)
        for name, reason in spec.incompatible.items():
            if not hasattr(self, name):  # a TRL field this config family has not (no GSPO in the async trainer)
                continue
            default = _default(type(self), name)
            if getattr(self, name) != default:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} cannot be used with policy_loss={self.policy_loss!r}: {reason}. "
                    f"Set {name}={default!r}."
                )

    def _check_adaptive_radius(self, spec):
        if isinstance(self.band_radius_by, str) and self.band_radius_by.strip().lower() in ("none", "null"):
            self.band_radius_by = None  # YAML / command-line spelling of None
        if self.band_radius_by not in (None, "entropy"):
            raise ValueError(f"band_radius_by must be None or 'entropy', got {self.band_radius_by!r}.")
        for name in ("band_radius_exponent", "band_radius_min", "band_radius_max"):
            value = getattr(self, name)
            real = isinstance(value, (int, float)) and not isinstance(value, bool)
            if name == "band_radius_exponent":
                if not real or not math.isfinite(value) or value < 0:
                    raise ValueError(
                        f"band_radius_exponent must be a finite number >= 0 (0: one radius for every token; a "
                        f"negative exponent would give confident tokens the wider Band, the method reversed), got "
                        f"{value!r}."
                    )
            elif not real or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}.")
        if self.band_radius_min > self.band_radius_max:
            raise ValueError(
                f"band_radius_min ({self.band_radius_min!r}) must not exceed band_radius_max "
                f"({self.band_radius_max!r})."
            )
        if self.band_radius_by is not None and "band_radius" not in spec.config_fields:
            warnings.warn(
                f"band_radius_by={self.band_radius_by!r} has no effect with policy_loss={self.policy_loss!r}, which "
                "has no Band radius (use band, relaxed_band or band_dgpo).",
                UserWarning,
                stacklevel=user_stacklevel(),
            )

    def _check_dynamic_sampling(self):
        rounds = self.dynamic_sampling_max_rounds
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
            raise ValueError(f"dynamic_sampling_max_rounds must be an integer >= 0, got {rounds!r}.")
        local_batch = self.per_device_train_batch_size * self.steps_per_generation
        if self.dynamic_sampling and local_batch % self.num_generations:
            raise ValueError(
                f"dynamic_sampling needs each process's generation batch (per_device_train_batch_size x "
                f"steps_per_generation = {local_batch}) to be a multiple of num_generations ({self.num_generations}), "
                "so that no prompt group straddles two processes."
            )

    def _check_field_types(self):
        """Types and ranges the dataclass cannot enforce (values from YAML or keyword arguments are not converted)."""
        for f in dataclasses.fields(PolicyLossConfig):
            if f.name in _OWN_FIELDS and f.type in (bool, "bool") and not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"{f.name} must be true or false (a bool), got {getattr(self, f.name)!r}.")
        if callable(self.band_divergence):
            raise ValueError(
                f"band_divergence must be a divergence name, got the callable {self.band_divergence!r}: a function "
                f"cannot be saved with checkpoints or sent to other processes. Register it once with "
                f"trl_bandpo.core.band.register_divergence('my_divergence', f) and pass "
                "band_divergence='my_divergence'."
            )
        if self.loss_type not in TRL_LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {list(TRL_LOSS_TYPES)}, got {self.loss_type!r}.")
        if not (isinstance(self.learning_rate, (int, float)) and not isinstance(self.learning_rate, bool)) or not (
            math.isfinite(self.learning_rate) and self.learning_rate >= 0
        ):
            raise ValueError(f"learning_rate must be a finite number >= 0, got {self.learning_rate!r}.")
        length = self.max_completion_length
        if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 1):
            raise ValueError(f"max_completion_length must be an integer >= 1, got {length!r}.")

    def _check_hyperparameters(self):
        """Check (and normalise) every field the registered losses read, whichever loss is selected."""
        for hp in _registry_hyperparameters():
            if not hasattr(self, hp.field):
                continue  # a run-time loss whose field lives in a config subclass: checked when selected
            value = getattr(self, hp.field)
            if type(value).__module__.startswith("torch"):  # per-token tensors are for the pure API only
                raise ValueError(f"{hp.field} must be a number in a config, got a {type(value).__name__}.")
            if value is None and hp.fallback_field is not None:
                continue  # TRL reads the fallback field (checked under its own name)
            setattr(self, hp.field, hp.check(value, hp.field))

    def _warn_unused_fields(self, spec):
        """Loss fields set away from their default but ignored by the selected loss, ours and TRL's (`epsilon` means
        nothing to Band): say so, once, by name."""
        read = set(spec.config_fields)
        candidates = _loss_fields() & {f.name for f in dataclasses.fields(self)}  # a user loss's fields may be absent
        unused = [name for name in sorted(candidates - read) if getattr(self, name) != _default(type(self), name)]
        if unused:
            warnings.warn(
                f"{', '.join(f'{name}={getattr(self, name)!r}' for name in unused)} "
                f"{'has' if len(unused) == 1 else 'have'} no effect with policy_loss={self.policy_loss!r}, which "
                f"does not read {'it' if len(unused) == 1 else 'them'} (docs/policy-losses.md lists what each loss "
                "reads). Did you mean another policy_loss?",
                UserWarning,
                stacklevel=user_stacklevel(),
            )


def _registry_hyperparameters():
    """Every (field-backed) hyper-parameter of every registered loss, one per config field."""
    seen = {}
    for spec in registered_policy_losses().values():
        for hp in spec.hyperparameters:
            if hp.field is not None:
                seen.setdefault(hp.field, hp)
    return tuple(seen.values())


_OWN_FIELDS = {f.name for f in dataclasses.fields(PolicyLossConfig)} - {f.name for f in dataclasses.fields(GRPOConfig)}


def _loss_fields() -> set[str]:
    """The fields, ours and TRL's (`epsilon`, `epsilon_high`, `delta`), that some registered loss reads."""
    fields = set()
    for spec in registered_policy_losses().values():
        fields |= set(spec.config_fields)
    return fields


def _default(config_class, name: str):
    return {f.name: f.default for f in dataclasses.fields(config_class)}[name]


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


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

    policy_loss: str = field(
        default="band",
        metadata={"help": _POLICY_LOSS_HELP},
    )


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

    policy_loss: str = field(
        default="dgpo",
        metadata={"help": _POLICY_LOSS_HELP},
    )


# -- Serving a config of the GRPOConfig family (a project's own `class MyConfig(GRPOConfig)`) -------------------------


def with_policy_loss_fields(args: GRPOConfig, config_class: type[PolicyLossConfig]) -> PolicyLossConfig:
    """`args` (a `GRPOConfig`, or a project's subclass of it with fields of its own) as an instance of a subclass of
    both its class and `config_class`: every field keeps its value, ours get `config_class`'s defaults, and all are
    checked as if the project's class had subclassed `config_class` in the first place.

    The combined class is registered in this module under its name, so the trainer can save the config with the
    model (`training_args.bin` is a pickle) in this process.
    """
    user_class = type(args)
    name = f"{user_class.__name__}With{config_class.__name__.removesuffix('Config')}Fields"
    combined = config_class if user_class in config_class.__mro__ else globals().get(name)  # a plain GRPOConfig
    if combined is None or combined is not config_class and combined.__mro__[1:3] != (user_class, config_class):
        combined = dataclass(type(name, (user_class, config_class), {"__module__": __name__, "__qualname__": name}))
        globals()[name] = combined
    # `generation_batch_size` is derived from `steps_per_generation` (or the reverse) when a config is built: pass
    # one of them, as a user would, or GRPOConfig refuses the pair.
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
    values.pop("generation_batch_size", None)
    return combined(**values)


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
        missing.append((hp.field, annotation, field(default=default, metadata={"help": help_text})))
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
    return filename.startswith(_LIBRARY_FOLDERS) or filename == "<string>"


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

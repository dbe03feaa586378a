"""The policy-loss registry: how a loss declares its hyper-parameters, and the one-call entry point.

A loss is recorded once as a `PolicyLossSpec` (`register_policy_loss`): its bounds and loss functions, each
hyper-parameter (`Hyperparameter`) with the config field it is read from and its check, and optional extra metrics and
checks. `trl_bandpo.core.losses` registers the built-in losses; the configs and trainers read only this registry
(docs/adding-a-policy-loss.md). `policy_loss(name, logps, old_logps, advantages, **hyperparameters)` runs any of them
on tensors.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

__all__ = [
    "DUAL_CLIP",
    "EPSILON_HIGH",
    "EPSILON_LOW",
    "Hyperparameter",
    "PolicyLossSpec",
    "check_at_least_one",
    "check_dual_clip",
    "check_epsilon_high",
    "check_epsilon_low",
    "check_non_negative",
    "check_power",
    "policy_bounds",
    "policy_loss",
    "policy_loss_spec",
    "register_policy_loss",
    "registered_policy_losses",
]


# ----------------------------------------------------------------------------------------------------------------
# Hyper-parameter checks: (value, label) -> normalised value; a ValueError names `label` (a config field or keyword),
# in the argument order of `trl_bandpo.core.band`'s checks
# ----------------------------------------------------------------------------------------------------------------


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_epsilon_low(value: Any, label: str = "epsilon_low") -> float:
    if not _is_real(value) or not 0 <= value < 1:
        raise ValueError(f"{label} must be a number in [0, 1), got {value!r}.")
    return float(value)


def check_epsilon_high(value: Any, label: str = "epsilon_high") -> float:
    if not _is_real(value) or not 0 <= value < math.inf:
        raise ValueError(f"{label} must be a finite number >= 0, got {value!r}.")
    return float(value)


def check_dual_clip(value: Any, label: str = "delta") -> float | None:
    """TRL's dual clip `delta`: the ratio of a negative-advantage token is capped at it, so it must exceed 1 (at or
    below 1 it would cap ratios that are inside the clip interval; 0 or less would zero every such gradient)."""
    if value is None:
        return None
    if not _is_real(value) or not math.isfinite(value) or value <= 1:
        raise ValueError(f"{label} (dual clip) must be None or a finite number > 1, got {value!r}.")
    return float(value)


def check_power(value: Any, label: str = "n") -> int:
    if not _is_real(value) or not math.isfinite(value) or not float(value).is_integer() or value < 1:
        raise ValueError(f"{label} must be an integer >= 1, got {value!r}.")
    return int(value)


def _check_finite_at_least(minimum: float) -> Callable[[Any, str], float]:
    def check(value: Any, label: str = "value") -> float:
        if not _is_real(value) or not math.isfinite(value) or value < minimum:
            raise ValueError(f"{label} must be a finite number >= {minimum:g}, got {value!r}.")
        return float(value)

    return check


check_at_least_one = _check_finite_at_least(1.0)
check_non_negative = _check_finite_at_least(0.0)


# ----------------------------------------------------------------------------------------------------------------
# Declaring and registering a loss
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hyperparameter:
    """One hyper-parameter of a policy loss.

    Attributes:
        name: keyword argument of the loss's bounds or loss function.
        field: the `PolicyLossConfig` field it is read from (TRL's own fields included), or `None` for a keyword of
            the pure API that the trainer leaves at the function's default.
        check: `(value, label) -> value`, the validation (and normalisation) both the config and the pure API apply;
            its `ValueError` names `label`.
        fallback_field: field read when `field` is `None` (TRL's `epsilon_high` defaults to `epsilon`).
    """

    name: str
    field: str | None
    check: Callable[[str, Any], Any]
    fallback_field: str | None = None


# Shared by several losses: the clip interval and TRL's dual clip.
EPSILON_LOW = Hyperparameter("epsilon_low", "epsilon", check_epsilon_low)
EPSILON_HIGH = Hyperparameter("epsilon_high", "epsilon_high", check_epsilon_high, fallback_field="epsilon")
DUAL_CLIP = Hyperparameter("delta", "delta", check_dual_clip)


@dataclass(frozen=True)
class PolicyLossSpec:
    """A registered policy loss: everything the trainer and the config need to run it.

    Attributes:
        name: the `policy_loss` value that selects it.
        bounds: `(old_logps, **bound_kwargs) -> (lower, upper)`, floats or tensors shaped like `old_logps`.
        loss: `(log_ratio, advantages, lower, upper, **loss_kwargs) -> per-token loss`.
        hyperparameters: every keyword `bounds` and `loss` take, with the config field it is read from.
        clipped: `True` for the clipped-surrogate family (gradient 0 where clipped; TRL's dual clip `delta`).
        metrics: optional `(log_ratio, advantages, lower, upper, mask, **loss_kwargs) -> {name: (num, den)}`, extra
            count metrics the trainer logs for this loss (docs/metrics.md).
        check: optional cross-field check `(kwargs, labels, device) -> None` run when the config is built
            (`labels` maps each keyword to the name the user wrote, `device` is where training runs).
        incompatible: config fields that must keep their default with this loss, with the reason (TRL settings
            GRPOTrainer would apply but this loss cannot honour: an error, never a silent no-op).
    """

    name: str
    bounds: Callable
    loss: Callable
    hyperparameters: tuple[Hyperparameter, ...] = ()
    clipped: bool = False
    metrics: Callable | None = None
    check: Callable | None = None
    incompatible: Mapping[str, str] = field(default_factory=dict)
    bound_names: frozenset[str] = field(init=False, repr=False)
    loss_names: frozenset[str] = field(init=False, repr=False)

    def __post_init__(self):
        def keywords(fn, positional):
            params = inspect.signature(fn).parameters
            return {name for name in params if name not in positional}

        bound_names = keywords(self.bounds, {"old_logps"})
        loss_names = keywords(self.loss, {"log_ratio", "advantages", "lower", "upper"})
        declared = {hp.name for hp in self.hyperparameters}
        # Every keyword of the functions is declared (so the pure API and the trainer see the same set) and every
        # declared hyper-parameter reaches a function: a mistake fails at import, not at the first training step.
        if declared != bound_names | loss_names:
            raise TypeError(
                f"policy loss {self.name!r}: declared hyper-parameters {sorted(declared)} differ from the keywords of "
                f"its functions {sorted(bound_names | loss_names)}."
            )
        object.__setattr__(self, "bound_names", frozenset(bound_names))
        object.__setattr__(self, "loss_names", frozenset(loss_names))

    @property
    def config_fields(self) -> tuple[str, ...]:
        """The config fields this loss reads (fallbacks included)."""
        names = [hp.field for hp in self.hyperparameters if hp.field is not None]
        names += [hp.fallback_field for hp in self.hyperparameters if hp.fallback_field is not None]
        return tuple(dict.fromkeys(names))

    def split(self, kwargs: Mapping[str, Any]) -> tuple[dict, dict]:
        """`kwargs` split into those of `bounds` and those of `loss` (a keyword both take goes to both)."""
        bound_kwargs = {k: v for k, v in kwargs.items() if k in self.bound_names}
        loss_kwargs = {k: v for k, v in kwargs.items() if k in self.loss_names}
        return bound_kwargs, loss_kwargs

    def kwargs_from_config(self, config: Any) -> tuple[dict, dict]:
        """`(bound_kwargs, loss_kwargs)` read from a config's fields and checked (messages name the fields)."""
        kwargs = {}
        for hp in self.hyperparameters:
            if hp.field is None:
                continue
            if not hasattr(config, hp.field):
                raise ValueError(
                    f"policy_loss={self.name!r} reads the config field {hp.field!r}, which {type(config).__name__} "
                    f"does not have: add it to the config class (docs/adding-a-policy-loss.md)."
                )
            label, value = hp.field, getattr(config, hp.field)
            if value is None and hp.fallback_field is not None:
                label, value = hp.fallback_field, getattr(config, hp.fallback_field)
            kwargs[hp.name] = hp.check(value, label)
        return self.split(kwargs)


_REGISTRY: dict[str, PolicyLossSpec] = {}


def register_policy_loss(spec: PolicyLossSpec) -> PolicyLossSpec:
    """Add `spec` to the registry under `spec.name` (docs/adding-a-policy-loss.md); returns it."""
    if spec.name in _REGISTRY:
        raise ValueError(f"a policy loss named {spec.name!r} is already registered.")
    _REGISTRY[spec.name] = spec
    return spec


def registered_policy_losses() -> Mapping[str, PolicyLossSpec]:
    """Every registered policy loss by name (a read-only view: built-in ones and any registered since)."""
    return MappingProxyType(_REGISTRY)


def policy_loss_spec(name: str) -> PolicyLossSpec:
    """The registered `PolicyLossSpec` for `name`, or a ValueError listing the allowed names.

    `name` may also be an import path `package.module:loss` (as prime-rl's `import_path` and slime's custom loss
    path): the module is imported (it registers the loss) and the loss registered as `loss` is returned.
    """
    if isinstance(name, str) and ":" in name and name not in _REGISTRY:
        return _REGISTRY[_import_policy_loss(name)]
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(
            f"policy_loss must be one of {list(_REGISTRY)} or an import path 'package.module:loss' of a module that "
            f"registers it, got {name!r}."
        )
    return _REGISTRY[name]


def _import_policy_loss(path: str) -> str:
    """Import the module of `path` (`package.module:loss`) and return the name of the loss it registered."""
    module, _, loss = path.partition(":")
    if not module or not loss or ":" in loss:
        raise ValueError(f"policy_loss={path!r}: an import path is 'package.module:loss', with one ':'.")
    try:
        importlib.import_module(module)
    except Exception as error:  # noqa: BLE001 - whatever the user's module raises, name it
        raise ValueError(
            f"policy_loss={path!r}: cannot import {module!r} ({type(error).__name__}: {error}); it must be importable "
            "from where training runs (installed, or on PYTHONPATH)."
        ) from error
    if loss not in _REGISTRY:
        raise ValueError(
            f"policy_loss={path!r}: importing {module!r} registered no policy loss named {loss!r} "
            f"(registered: {list(_REGISTRY)}); the module must call "
            f"register_policy_loss(PolicyLossSpec({loss!r}, ...))."
        )
    return loss


def _split_hyperparameters(name: str, spec: PolicyLossSpec, hyperparameters: dict):
    """Unknown keywords are a TypeError; known ones pass the same checks as the config fields they map to."""
    by_name = {hp.name: hp for hp in spec.hyperparameters}
    unknown = set(hyperparameters) - set(by_name)
    if unknown:
        raise TypeError(
            f"policy loss {name!r} got unknown hyperparameters {sorted(unknown)}; allowed: {sorted(by_name)}."
        )
    return spec.split({key: by_name[key].check(value, key) for key, value in hyperparameters.items()})


def _as_advantages(advantages: Any, logps: torch.Tensor) -> torch.Tensor:
    """Advantages as a floating tensor broadcastable to `logps` (`(B, T)`).

    Python numbers and bools become a scalar tensor, bool/int tensors become floating; a 1-D tensor of length `B`
    (TRL's own shape) is one advantage per sequence, `(B, 1)`; anything that does not broadcast is an error.
    """
    if isinstance(advantages, (bool, int, float)):
        advantages = torch.tensor(float(advantages), device=logps.device)
    if not torch.is_tensor(advantages):
        raise ValueError(f"advantages must be a tensor or a number, got {type(advantages).__name__}.")
    if not advantages.is_floating_point():
        advantages = advantages.to(torch.promote_types(logps.dtype, torch.float32))
    if advantages.dim() == 1 and logps.dim() == 2:
        if advantages.shape[0] != logps.shape[0]:
            raise ValueError(
                f"advantages of shape {tuple(advantages.shape)} must have one value per sequence: logps is "
                f"{tuple(logps.shape)} (B, T), so give B = {logps.shape[0]} values, or shape (B, 1) or (B, T)."
            )
        return advantages.unsqueeze(-1)  # per sequence, never broadcast along T
    try:
        shape = torch.broadcast_shapes(advantages.shape, logps.shape)
    except RuntimeError:
        shape = None
    if shape != logps.shape:
        raise ValueError(
            f"advantages of shape {tuple(advantages.shape)} do not broadcast to logps {tuple(logps.shape)}: use "
            f"(B,), (B, 1) or (B, T)."
        )
    return advantages


def policy_bounds(name: str, old_logps: torch.Tensor, **hyperparameters):
    """The ratio bounds `(lower, upper)` the policy loss `name` uses for these old log-probs."""
    spec = policy_loss_spec(name)
    bound_kwargs, _ = _split_hyperparameters(name, spec, hyperparameters)
    return spec.bounds(old_logps, **bound_kwargs)


def policy_loss(
    name: str,
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    **hyperparameters,
) -> torch.Tensor:
    """Per-token loss of the policy loss `name` (one of `POLICY_LOSSES`), before masking and aggregation.

    Args:
        name: "clip", "band", "relaxed_band", "dcpo", "dgpo", "gppo", "ce_gppo" or "aspo".
        logps (`torch.Tensor` of shape `(B, T)`): current log-probs of the sampled tokens (with gradient).
        old_logps (`torch.Tensor` of shape `(B, T)`): log-probs under the policy that sampled them.
        advantages (`torch.Tensor` of shape `(B,)`, `(B, 1)` or `(B, T)`, or a number): `(B,)` is one advantage per
            sequence (TRL's shape); bools and integers count as numbers.
        **hyperparameters: those of the loss and its bounds: `epsilon_low`, `epsilon_high` (clip family, DGPO and
            the GPPO/ASPO baselines), `delta` (dual clip, clipped family), `radius`, `divergence`, `upper_max`,
            `solver` (Band), `n`, `m` (DGPO), `beta1`, `beta2` (CE-GPPO), `c_pos`, `c_neg` (ASPO). Each is checked
            as the config checks its field (docs/policy-losses.md, "Hyper-parameters"); a bad value is a
            `ValueError` naming it.

    Returns:
        `torch.Tensor` of shape `(B, T)`: the loss to minimise per token.
    """
    spec = policy_loss_spec(name)
    bound_kwargs, loss_kwargs = _split_hyperparameters(name, spec, hyperparameters)
    for label, tensor in (("logps", logps), ("old_logps", old_logps)):
        if not torch.is_tensor(tensor):
            raise ValueError(f"{label} must be a floating-point tensor, got {type(tensor).__name__}.")
        if not tensor.is_floating_point():
            raise ValueError(f"{label} must be floating point, got dtype {tensor.dtype}.")
    advantages = _as_advantages(advantages, logps)
    lower, upper = spec.bounds(old_logps, **bound_kwargs)
    return spec.loss(logps - old_logps.detach(), advantages, lower, upper, **loss_kwargs)

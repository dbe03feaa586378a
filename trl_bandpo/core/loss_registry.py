"""The policy-loss registry (docs/adding-a-policy-loss.md): each loss is one `PolicyLossSpec` (its bounds and loss
functions, its `Hyperparameter`s with their config fields and checks), which the configs and trainers read.
`policy_loss(name, logps, old_logps, advantages, **hyperparameters)` runs any of them on tensors.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from .band import broadcasts_to, check_floating_tensor
from .checks import FLOAT32_MAX, Integer, Number, refuse, shown


def upcast(x: torch.Tensor) -> torch.Tensor:
    """`x` in float32 or wider: a half-precision ratio overflows at log-ratio 11.1 (fp16) and rounds the bounds."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


@dataclass(frozen=True)
class Hyperparameter:
    """One hyper-parameter of a policy loss.

    Attributes:
        name: keyword argument of the loss's bounds or loss function.
        field: the `PolicyLossConfig` field it is read from (TRL's own fields included), or `None` for a keyword of
            the pure API that the trainer leaves at the function's default.
        check: `(value, field) -> value`, its one check (`trl_bandpo.core.checks`): the config applies it to the
            field once, when it is built; the pure API (`policy_loss`) to the keyword at each call.
        fallback_field: field read when `field` is `None` (TRL's `epsilon_high` defaults to `epsilon`).
    """

    name: str
    field: str | None
    check: Callable[[Any, str], Any]
    fallback_field: str | None = None


# Shared by several losses: the clip interval and TRL's dual clip (above 1: at or below 1 it would cap ratios inside
# the clip interval).
# Every float a loss reads stays within float32, where the losses compute (`FLOAT32_MAX`).
EPSILON_LOW = Hyperparameter("epsilon_low", "epsilon", Number(low=0, high=1, high_open=True))
EPSILON_HIGH = Hyperparameter(
    "epsilon_high", "epsilon_high", Number(low=0, high=FLOAT32_MAX), fallback_field="epsilon"
)
DUAL_CLIP = Hyperparameter("delta", "delta", Number(low=1, high=FLOAT32_MAX, low_open=True, optional=True))
#: The check of an integral power such as DGPO's `n`.
POWER = Integer(low=1)
#: What the trainer knows of the batch beyond one token, which a loss (or its metrics) receives by declaring the
#: keyword: `mask` (`(B, T)`, 1 on the completion tokens that count), `old_logps` (`(B, T)`) and `all_reduce`
#: (`tensor -> its sum over processes`; the identity in one process). Never hyper-parameters.
CONTEXT = ("mask", "old_logps", "all_reduce")
_LOSS_ARGUMENTS = ("log_ratio", "advantages", "lower", "upper")


@dataclass(frozen=True)
class PolicyLossSpec:
    """A registered policy loss: everything the trainer and the config need to run it.

    Attributes:
        name: the `policy_loss` value that selects it.
        bounds: `(old_logps, **bound_kwargs) -> (lower, upper)`, floats or tensors shaped like `old_logps`.
        loss: `(log_ratio, advantages, lower, upper, **loss_kwargs) -> per-token loss`; it also takes any of the
            `CONTEXT` keywords it declares (a loss that sees whole sequences declares `mask`).
        hyperparameters: every keyword `bounds` and `loss` take, with the config field it is read from.
        metrics: optional `(log_ratio, advantages, lower, upper, mask, **loss_kwargs) -> {name: (num, den)}`, extra
            count metrics the trainer logs for this loss (docs/metrics.md); also given the `CONTEXT` it declares.
        check: optional cross-field check `(kwargs, labels, device) -> None` run when the config is built
            (`labels` maps each keyword to the name the user wrote, `device` is where training runs).
        incompatible: config fields that must keep their default with this loss, with the reason (TRL settings
            GRPOTrainer would apply but this loss cannot honour: an error, never a silent no-op).
    """

    name: str
    bounds: Callable
    loss: Callable
    hyperparameters: tuple[Hyperparameter, ...] = ()
    metrics: Callable | None = None
    check: Callable | None = None
    incompatible: Mapping[str, str] = field(default_factory=dict)
    bound_names: frozenset[str] = field(init=False, repr=False)
    loss_names: frozenset[str] = field(init=False, repr=False)
    context: frozenset[str] = field(init=False, repr=False)

    def __post_init__(self):
        loss_params = set(inspect.signature(self.loss).parameters)
        bound_names = set(inspect.signature(self.bounds).parameters) - {"old_logps"}
        loss_names = loss_params - {*_LOSS_ARGUMENTS, *CONTEXT}
        object.__setattr__(self, "context", frozenset(loss_params & set(CONTEXT)))
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
        """`(bound_kwargs, loss_kwargs)` read from a config's fields, which its owner checked when it was built."""
        kwargs = {}
        for hp in self.hyperparameters:
            if hp.field is None:
                continue
            if not hasattr(config, hp.field):
                raise ValueError(
                    f"policy_loss={self.name!r} reads the config field {hp.field!r}, which {type(config).__name__} "
                    f"does not have: add it to the config class (docs/adding-a-policy-loss.md)."
                )
            value = getattr(config, hp.field)
            kwargs[hp.name] = getattr(config, hp.fallback_field) if value is None and hp.fallback_field else value
        return self.split(kwargs)


_REGISTRY: dict[str, PolicyLossSpec] = {}
_REGISTERED_BY: dict[str, str] = {}  # loss name -> the module that registered it


def register_policy_loss(spec: PolicyLossSpec) -> PolicyLossSpec:
    """Add `spec` to the registry under `spec.name` (docs/adding-a-policy-loss.md); returns it."""
    if spec.name in _REGISTRY:
        raise ValueError(f"a policy loss named {spec.name!r} is already registered.")
    _REGISTRY[spec.name] = spec
    _REGISTERED_BY[spec.name] = sys._getframe(1).f_globals.get("__name__", "")
    return spec


def registered_policy_losses() -> Mapping[str, PolicyLossSpec]:
    """Every registered policy loss by name (a read-only view: built-in ones and any registered since)."""
    return MappingProxyType(_REGISTRY)


def policy_loss_spec(name: str) -> PolicyLossSpec:
    """The registered `PolicyLossSpec` for `name`, or a ValueError listing the allowed names.

    `name` may also be an import path `package.module:loss` (as prime-rl's `import_path` and slime's custom loss
    path): the loss that `package.module` registered as `loss`, the module imported first.
    """
    if isinstance(name, str) and ":" in name:
        return _REGISTRY[_import_policy_loss(name)]
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(
            f"policy_loss must be one of {list(_REGISTRY)} or an import path 'package.module:loss' of a module that "
            f"registers it, got {name!r}."
        )
    return _REGISTRY[name]


def _import_policy_loss(path: str) -> str:
    """Import the module of `path` (`package.module:loss`) and return `loss` if that module registered it."""
    module, _, loss = path.partition(":")
    if not module or not loss or ":" in loss:
        raise ValueError(f"policy_loss={path!r}: an import path is 'package.module:loss', with one ':'.")
    before = set(_REGISTRY)
    try:
        importlib.import_module(module)
    except Exception as error:  # noqa: BLE001 - whatever the user's module raises, name it
        for name in set(_REGISTRY) - before:  # no half-registered loss survives a failed import
            del _REGISTRY[name], _REGISTERED_BY[name]
        raise ValueError(
            f"policy_loss={path!r}: cannot import {module!r} ({type(error).__name__}: {error}); it must be importable "
            "from where training runs (installed, or on PYTHONPATH)."
        ) from error
    for name in set(_REGISTRY) - before:
        _REGISTERED_BY[name] = module  # registered while importing it, whichever helper made the call
    if _REGISTERED_BY.get(loss) != module:
        own = sorted(name for name, by in _REGISTERED_BY.items() if by == module)
        elsewhere = f" ({loss!r} is registered by {_REGISTERED_BY[loss]})" if loss in _REGISTERED_BY else ""
        raise ValueError(
            f"policy_loss={path!r}: {module!r} registered no policy loss named {loss!r}{elsewhere}; it registered "
            f"{own or 'none'}. The module must call register_policy_loss(PolicyLossSpec({loss!r}, ...))."
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
    if not broadcasts_to(advantages.shape, logps.shape):
        raise ValueError(
            f"advantages of shape {tuple(advantages.shape)} do not broadcast to logps {tuple(logps.shape)}: use "
            f"(B,), (B, 1) or (B, T)."
        )
    return advantages


def policy_bounds(name: str, old_logps: torch.Tensor, **hyperparameters):
    """The ratio bounds `(lower, upper)` the policy loss `name` uses for these old log-probs."""
    spec = policy_loss_spec(name)
    bound_kwargs, _ = _split_hyperparameters(name, spec, hyperparameters)
    return spec.bounds(check_floating_tensor(old_logps, "old_logps"), **bound_kwargs)


def policy_loss(
    name: str, logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask=None, **hyperparameters
) -> torch.Tensor:
    """Per-token loss of the policy loss `name`, before masking and aggregation.

    Args:
        name: a registered policy loss (`registered_policy_losses()`; the built-in ones are `POLICY_LOSSES`), or an
            import path `package.module:loss`.
        logps (`torch.Tensor` of shape `(B, T)`, not empty): current log-probs of the sampled tokens (with
            gradient). `log r = logps - old_logps` is taken in float32 or wider, so half-precision inputs are exact.
        old_logps (`torch.Tensor` of shape `(B, T)`): log-probs under the policy that sampled them.
        advantages (`torch.Tensor` of shape `(B,)`, `(B, 1)` or `(B, T)`, or a number): `(B,)` is one advantage per
            sequence (TRL's shape); bools and integers count as numbers.
        mask (`torch.Tensor` of shape `(B, T)`, *optional*): 1 on the tokens that count (default: every token), on the
            device of `logps`, not complex; for the losses that see whole sequences (`cppo`, `trm`, `m2po`), the
            others ignore it.
        **hyperparameters: the keywords of the loss and its bounds (docs/policy-losses.md lists each loss's), each
            checked at every call by the check its config field has; a bad value is a `ValueError` naming it.

    Returns:
        `torch.Tensor` of shape `(B, T)`: the loss to minimise per token.
    """
    spec = policy_loss_spec(name)
    bound_kwargs, loss_kwargs = _split_hyperparameters(name, spec, hyperparameters)
    if check_floating_tensor(logps, "logps").numel() == 0:
        refuse("logps", "a non-empty tensor", logps)
    check_floating_tensor(old_logps, "old_logps")
    advantages = _as_advantages(advantages, logps)
    lower, upper = spec.bounds(old_logps, **bound_kwargs)
    if mask is None:
        mask = torch.ones_like(logps, dtype=torch.bool)
    elif not torch.is_tensor(mask) or (mask.shape, mask.device) != (logps.shape, logps.device) or mask.is_complex():
        got = shown(mask) + (f" of dtype {mask.dtype} on {mask.device}" if torch.is_tensor(mask) else "")
        raise ValueError(
            f"mask must be a bool, integer or floating-point tensor shaped like logps {tuple(logps.shape)} on "
            f"{logps.device}, got {got}."
        )
    context = {"mask": mask, "old_logps": old_logps.detach(), "all_reduce": _same}
    context = {key: value for key, value in context.items() if key in spec.context}
    # upcast first: log r subtracted in half precision is rounded (up to 17% of the loss at log r = 5)
    log_ratio = upcast(logps) - upcast(old_logps.detach())
    return spec.loss(log_ratio, advantages, lower, upper, **loss_kwargs, **context)


def _same(tensor: torch.Tensor) -> torch.Tensor:
    """`all_reduce` in one process: the sum over one process is the tensor itself."""
    return tensor

"""Per-token policy losses of BandPO, DGPO and the baselines both papers compare against.

Every loss is a small pure function `loss(log_ratio, advantages, lower, upper, **hyperparameters)` returning the
per-token loss (before masking and aggregation, which the trainer shares with TRL). `lower`/`upper` are the ratio
bounds in use (floats or tensors broadcastable to `log_ratio`), produced by the matching `*_bounds` function from
the old log-probs. Notation as in SPEC: `r = exp(log_ratio)`, advantage `A`; the gradient weight `w` is the
coefficient on `grad log pi` (`-grad loss = A * w * grad log pi`).

Two families:
- clipped surrogates (`clip`, `band`, `relaxed_band`, `dcpo`): PPO's `-min(r A, clamp(r, lower, upper) A)`, which is
  TRL's formula (dual clip `delta` included), only with other bounds; `w = r` inside, `0` where clipped.
- re-weighted surrogates (`dgpo`, `gppo`, `ce_gppo`, `aspo`): the forward value is chosen per method and the
  gradient weight is set explicitly, `loss = -A * (sg(value) + sg(w) * (log_ratio - sg(log_ratio)))`.

`policy_loss(name, logps, old_logps, advantages, **hyperparameters)` is the one-call entry point.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .band import band_bounds

__all__ = [
    "POLICY_LOSSES",
    "CLIPPED_LOSSES",
    "clip_bounds",
    "band_policy_bounds",
    "relaxed_band_bounds",
    "dcpo_bounds",
    "clipped_surrogate_loss",
    "clip_regions",
    "dgpo_log_weights",
    "dgpo_loss",
    "gppo_loss",
    "ce_gppo_loss",
    "aspo_loss",
    "policy_loss",
    "policy_bounds",
    "policy_loss_fn",
]

Bound = float | torch.Tensor


# ----------------------------------------------------------------------------------------------------------------
# Bounds: (old_logps, **hyperparameters) -> (lower, upper)
# ----------------------------------------------------------------------------------------------------------------


def clip_bounds(old_logps: torch.Tensor, *, epsilon_low: float = 0.2, epsilon_high: float = 0.2):
    """GRPO / PPO bounds `[1 - epsilon_low, 1 + epsilon_high]` (Clip-Higher: `epsilon_high = 0.28`)."""
    return 1.0 - epsilon_low, 1.0 + epsilon_high


def band_policy_bounds(
    old_logps: torch.Tensor,
    *,
    radius: float = 0.05,
    divergence: str | Callable = "kl",
    upper_max: float | None = 10.0,
    solver: str = "auto",
):
    """BandPO bounds (see `trl_bandpo.band.band_bounds`); `upper_max=10` as the BandPO authors trained."""
    return band_bounds(old_logps, radius, divergence, solver=solver, upper_max=upper_max)


def relaxed_band_bounds(
    old_logps: torch.Tensor,
    *,
    radius: float = 0.05,
    divergence: str | Callable = "kl",
    upper_max: float | None = 10.0,
    solver: str = "auto",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.28,
):
    """Relaxed Band (BandPO paper's ablation): the union of the Band and Clip-Higher intervals at every p."""
    return band_bounds(
        old_logps, radius, divergence, solver=solver, upper_max=upper_max, relax=(epsilon_low, epsilon_high)
    )


def dcpo_bounds(
    old_logps: torch.Tensor, *, epsilon_low: float = 0.16, epsilon_high: float = 0.2, upper_max: float = 10.0
):
    """DCPO's dynamic bounds: `lower = 1/2 + 1/2 sqrt(max(1 - 4 eps_low / p, 0))`,
    `upper = min(1/2 + 1/2 sqrt(1 + 4 eps_high / p), upper_max)` (SPEC §3)."""
    with torch.no_grad():
        dtype = torch.float64 if old_logps.dtype == torch.float64 else torch.float32
        inv_p = torch.exp(-old_logps.detach().to(dtype).clamp(max=0.0))
        lower = 0.5 + 0.5 * torch.sqrt((1 - 4 * epsilon_low * inv_p).clamp(min=0.0))
        upper = (0.5 + 0.5 * torch.sqrt(1 + 4 * epsilon_high * inv_p)).clamp(max=upper_max)
    return lower, upper


# ----------------------------------------------------------------------------------------------------------------
# Losses: (log_ratio, advantages, lower, upper, **hyperparameters) -> per-token loss
# ----------------------------------------------------------------------------------------------------------------


def _clamp(x: torch.Tensor, lower: Bound, upper: Bound) -> torch.Tensor:
    if torch.is_tensor(lower) or torch.is_tensor(upper):  # torch.clamp takes two tensors or two numbers
        lower, upper = torch.as_tensor(lower, dtype=x.dtype), torch.as_tensor(upper, dtype=x.dtype)
        lower, upper = lower.to(x.device, x.dtype), upper.to(x.device, x.dtype)
    return torch.clamp(x, lower, upper)


def clipped_surrogate_loss(
    log_ratio: torch.Tensor, advantages: torch.Tensor, lower: Bound, upper: Bound, *, delta: float | None = None
) -> torch.Tensor:
    """PPO's pessimistic clipped surrogate with (per-token) bounds, written exactly as TRL writes it:
    `-min(min(r, delta) A, clamp(r, lower, upper) A)`. `delta` is the dual-clip constant (TRL's `delta`)."""
    ratio = torch.exp(log_ratio)
    clipped_ratio = _clamp(ratio, lower, upper)
    if delta is not None:
        ratio = torch.clamp(ratio, max=delta)
    return -torch.min(ratio * advantages, clipped_ratio * advantages)


def _reweighted_surrogate(
    log_ratio: torch.Tensor, advantages: torch.Tensor, value: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """`-A * (sg(value) + sg(weight) * (log_ratio - sg(log_ratio)))`: forward `-A * value`, gradient weight `weight`."""
    return -advantages * (value.detach() + weight.detach() * (log_ratio - log_ratio.detach()))


def _clip_value(log_ratio, advantages, lower, upper):
    """Forward value of the clipped surrogate, `min(r A, clamp(r) A) / A` written without dividing by A."""
    ratio = torch.exp(log_ratio.detach())
    clipped = _clamp(ratio, lower, upper)
    return torch.where(advantages >= 0, torch.minimum(ratio, clipped), torch.maximum(ratio, clipped))


def _log(bound: Bound) -> Bound:
    return torch.log(bound) if torch.is_tensor(bound) else math.log(bound)


def clip_regions(log_ratio, advantages, lower, upper):
    """DGPO's regions (SPEC §2): LN `r < lower, A < 0`; HP `r > upper, A > 0`; LP `r < lower, A > 0`;
    HN `r > upper, A < 0`."""
    log_ratio = log_ratio.detach()
    below, above = log_ratio < _log(lower), log_ratio > _log(upper)
    pos, neg = advantages > 0, advantages < 0
    return {"LN": below & neg, "HP": above & pos, "LP": below & pos, "HN": above & neg}


def dgpo_log_weights(
    log_ratio: torch.Tensor, advantages: torch.Tensor, lower: Bound, upper: Bound, *, n: int = 1, m: float = 2.0
) -> torch.Tensor:
    """`log w` of DGPO (SPEC §2), on `grad log pi`: LN `(n+1) log r - n log(1-eps_low)`,
    HP `(m-1)/m log r + log(1+eps_high)/m`, elsewhere `log r`. Only linear maps of `log r` are selected, and the
    single `exp` happens afterwards, so no branch can overflow where it does not apply."""
    log_ratio = log_ratio.detach()
    regions = clip_regions(log_ratio, advantages, lower, upper)
    left = (n + 1) * log_ratio - n * _log(lower)
    right = (m - 1) / m * log_ratio + _log(upper) / m
    return torch.where(regions["LN"], left, torch.where(regions["HP"], right, log_ratio))


def dgpo_loss(
    log_ratio: torch.Tensor, advantages: torch.Tensor, lower: Bound, upper: Bound, *, n: int = 1, m: float = 2.0
) -> torch.Tensor:
    """DGPO (https://arxiv.org/abs/2603.14389): outside the clip range the weight on `grad pi` decays as `pi^n`
    (left, A < 0) or `pi^(-1/m)` (right, A > 0), continuous at both boundaries. The forward value is the
    surrogate `R` of SPEC §2, which equals the weight `w` on `grad log pi`."""
    weight = torch.exp(dgpo_log_weights(log_ratio, advantages, lower, upper, n=n, m=m))
    return _reweighted_surrogate(log_ratio, advantages, weight, weight)


def _boundary_weights(log_ratio, advantages, lower, upper, left_weight, right_weight):
    ratio = torch.exp(log_ratio.detach())
    regions = clip_regions(log_ratio, advantages, lower, upper)
    weight = torch.where(regions["LN"], left_weight, ratio)
    weight = torch.where(regions["HP"], right_weight, weight)
    value = _clip_value(log_ratio, advantages, lower, upper)
    return _reweighted_surrogate(log_ratio, advantages, value, weight)


def gppo_loss(log_ratio: torch.Tensor, advantages: torch.Tensor, lower: Bound, upper: Bound) -> torch.Tensor:
    """GPPO (Klear-Reasoner): the clip's forward value, but clipped tokens keep the boundary's weight
    (`1 + eps_high` right, `1 - eps_low` left) instead of 0."""
    return ce_gppo_loss(log_ratio, advantages, lower, upper, beta1=1.0, beta2=1.0)


def ce_gppo_loss(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    lower: Bound,
    upper: Bound,
    *,
    beta1: float = 0.75,
    beta2: float = 1.0,
) -> torch.Tensor:
    """CE-GPPO: as GPPO with the boundary weights scaled, `beta1 (1 - eps_low)` (LN) and `beta2 (1 + eps_high)` (HP)."""
    return _boundary_weights(
        log_ratio, advantages, lower, upper, beta1 * _as_weight(lower), beta2 * _as_weight(upper)
    )


def aspo_loss(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    lower: Bound,
    upper: Bound,
    *,
    c_pos: float = 3.0,
    c_neg: float = 3.0,
) -> torch.Tensor:
    """ASPO: positive-advantage tokens use the flipped weight `1/r` on `[1/c_pos, upper]` (`c_pos` below, 0 above);
    negative ones keep `r` on `[lower, c_neg]` (0 below, `c_neg` above). Forward value: the clipped surrogate's."""
    log_ratio_d = log_ratio.detach()
    ratio = torch.exp(log_ratio_d)
    pos = advantages > 0
    weight_pos = torch.where(
        log_ratio_d > _log(upper), torch.zeros_like(ratio), torch.exp(-log_ratio_d).clamp(max=c_pos)
    )
    weight_neg = torch.where(log_ratio_d < _log(lower), torch.zeros_like(ratio), ratio.clamp(max=c_neg))
    weight = torch.where(pos, weight_pos, weight_neg)
    value = _clip_value(log_ratio, advantages, lower, upper)
    return _reweighted_surrogate(log_ratio, advantages, value, weight)


def _as_weight(bound: Bound) -> Bound:
    return bound.detach() if torch.is_tensor(bound) else bound


# ----------------------------------------------------------------------------------------------------------------
# Registry and the one-call entry point
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicyLossSpec:
    """A named policy loss: how its bounds come from the old log-probs, and the per-token loss using them."""

    bounds: Callable
    loss: Callable
    clipped: bool  # True: the clipped-surrogate family (dual clip `delta` applies, gradient 0 where clipped)


_REGISTRY: dict[str, PolicyLossSpec] = {
    "clip": PolicyLossSpec(clip_bounds, clipped_surrogate_loss, clipped=True),
    "band": PolicyLossSpec(band_policy_bounds, clipped_surrogate_loss, clipped=True),
    "relaxed_band": PolicyLossSpec(relaxed_band_bounds, clipped_surrogate_loss, clipped=True),
    "dcpo": PolicyLossSpec(dcpo_bounds, clipped_surrogate_loss, clipped=True),
    "dgpo": PolicyLossSpec(clip_bounds, dgpo_loss, clipped=False),
    "gppo": PolicyLossSpec(clip_bounds, gppo_loss, clipped=False),
    "ce_gppo": PolicyLossSpec(clip_bounds, ce_gppo_loss, clipped=False),
    "aspo": PolicyLossSpec(clip_bounds, aspo_loss, clipped=False),
}
POLICY_LOSSES = tuple(_REGISTRY)
CLIPPED_LOSSES = tuple(name for name, spec in _REGISTRY.items() if spec.clipped)


def policy_loss_fn(name: str) -> PolicyLossSpec:
    """The registered `PolicyLossSpec` for `name`, or a ValueError listing the allowed names."""
    if name not in _REGISTRY:
        raise ValueError(f"policy_loss must be one of {list(POLICY_LOSSES)}, got {name!r}.")
    return _REGISTRY[name]


def _split_hyperparameters(name: str, spec: PolicyLossSpec, hyperparameters: dict):
    bound_names = set(inspect.signature(spec.bounds).parameters) - {"old_logps"}
    loss_names = set(inspect.signature(spec.loss).parameters) - {"log_ratio", "advantages", "lower", "upper"}
    unknown = set(hyperparameters) - bound_names - loss_names
    if unknown:
        raise TypeError(
            f"policy loss {name!r} got unknown hyperparameters {sorted(unknown)}; "
            f"allowed: {sorted(bound_names | loss_names)}."
        )
    bound_kwargs = {k: v for k, v in hyperparameters.items() if k in bound_names}
    loss_kwargs = {k: v for k, v in hyperparameters.items() if k in loss_names}
    return bound_kwargs, loss_kwargs


def policy_bounds(name: str, old_logps: torch.Tensor, **hyperparameters):
    """The ratio bounds `(lower, upper)` the policy loss `name` uses for these old log-probs."""
    spec = policy_loss_fn(name)
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
        advantages (`torch.Tensor` broadcastable to `(B, T)`, e.g. `(B, 1)`).
        **hyperparameters: those of the loss and its bounds: `epsilon_low`, `epsilon_high` (clip family, DGPO and
            the GPPO/ASPO baselines), `delta` (dual clip, clipped family), `radius`, `divergence`, `upper_max`,
            `solver` (Band), `n`, `m` (DGPO), `beta1`, `beta2` (CE-GPPO), `c_pos`, `c_neg` (ASPO).

    Returns:
        `torch.Tensor` of shape `(B, T)`: the loss to minimise per token.
    """
    spec = policy_loss_fn(name)
    bound_kwargs, loss_kwargs = _split_hyperparameters(name, spec, hyperparameters)
    lower, upper = spec.bounds(old_logps, **bound_kwargs)
    return spec.loss(logps - old_logps.detach(), advantages, lower, upper, **loss_kwargs)

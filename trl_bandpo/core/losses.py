"""Per-token policy losses of BandPO, DGPO and the baselines both papers compare against, and their registry.

Every loss is a small pure function `loss(log_ratio, advantages, lower, upper, **hyperparameters)` returning the
per-token loss (before masking and aggregation, which the trainer shares with TRL). `lower`/`upper` are the ratio
bounds in use (floats or tensors broadcastable to `log_ratio`), produced by the matching `*_bounds` function below
from the old log-probs: fixed bounds are floats, probability-aware ones (Band, DCPO) tensors shaped like the old
log-probs, computed without gradient. Notation (docs/policy-losses.md): `r = exp(log_ratio)`, advantage `A`; the
gradient weight `w` is the coefficient on `grad log pi` (`-grad loss = A * w * grad log pi`).

Two families:
- clipped surrogates (`clip`, `band`, `relaxed_band`, `dcpo`): PPO's `-min(r A, clamp(r, lower, upper) A)`, which is
  TRL's formula (dual clip `delta` included), only with other bounds; `w = r` inside, `0` where clipped.
- re-weighted surrogates (`dgpo`, `gppo`, `ce_gppo`, `aspo`): the forward value is chosen per method and the
  gradient weight is set explicitly, `loss = -A * (sg(value) + sg(w) * (log_ratio - sg(log_ratio)))`.

Each loss is registered once at the end of this module (`register_policy_loss`, from `trl_bandpo.core.loss_registry`)
as a `PolicyLossSpec`: its bounds and loss functions, the hyper-parameters they take with the config field each is read
from and its check, and any extra metrics. The trainer and the config read only the registry
(docs/adding-a-policy-loss.md). `policy_loss(name, logps, old_logps, advantages, **hyperparameters)` (re-exported here)
is the one-call entry point.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .band import (
    RADIUS,
    SOLVER,
    UPPER_MAX,
    check_divergence,
    check_radius_tensor,
    solve_band,
    solver_unavailable_reason,
)
from .band_solvers import Radius
from .checks import Number, none_word
from .loss_registry import (
    DUAL_CLIP,
    EPSILON_HIGH,
    EPSILON_LOW,
    POWER,
    Hyperparameter,
    PolicyLossSpec,
    policy_bounds,
    policy_loss,
    policy_loss_spec,
    register_policy_loss,
    registered_policy_losses,
)

__all__ = [
    "BAND",
    "DUAL_CLIP",
    "EPSILON_HIGH",
    "EPSILON_LOW",
    "POLICY_LOSSES",
    "RATIO_LOG_MAX",
    "Hyperparameter",
    "PolicyLossSpec",
    "aspo_loss",
    "band_policy_bounds",
    "ce_gppo_loss",
    "cispo_loss",
    "clip_bounds",
    "clip_regions",
    "clip_value",
    "clipped_surrogate_loss",
    "dcpo_bounds",
    "dgpo_log_weights",
    "dgpo_loss",
    "dgpo_metrics",
    "gppo_loss",
    "policy_bounds",
    "policy_loss",
    "policy_loss_spec",
    "register_policy_loss",
    "registered_policy_losses",
    "relaxed_band_bounds",
    "reweighted_surrogate",
    "safe_exp",
    "upcast",
]

Bound = float | torch.Tensor


# ----------------------------------------------------------------------------------------------------------------
# Numerics of importance ratios: float32 or wider, capped below overflow (docs/policy-losses.md, "Inputs and numerics")
# ----------------------------------------------------------------------------------------------------------------

# Largest exponent whose exp is finite, with a margin for rounding, per compute dtype: ratios and weights are capped
# there, so no token's ratio is inf and no `inf * 0` turns a loss or a gradient into NaN.
RATIO_LOG_MAX = {dtype: math.log(torch.finfo(dtype).max) - 0.01 for dtype in (torch.float32, torch.float64)}


def upcast(x: torch.Tensor) -> torch.Tensor:
    """`x` in float32 or wider: a half-precision ratio overflows at log-ratio 11.1 (fp16) and rounds the bounds."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def safe_exp(log_x: torch.Tensor) -> torch.Tensor:
    """`exp(log_x)` in float32 or wider, capped at the dtype's largest finite value (differentiable below the cap)."""
    log_x = upcast(log_x)
    return torch.exp(log_x.clamp(max=RATIO_LOG_MAX[log_x.dtype]))


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
    """BandPO bounds (see `trl_bandpo.core.band.band_bounds`); `upper_max=10` as the BandPO authors trained."""
    return _band(old_logps, radius, divergence, solver=solver, upper_max=upper_max)


def _band(old_logps, radius, divergence, **options):
    """The Band bounds of hyper-parameters their owner checked; a per-token radius tensor is checked here against
    the log-probs it applies to (its shape and device: metadata only)."""
    if torch.is_tensor(radius):
        check_radius_tensor(radius, old_logps)
    return solve_band(old_logps, radius, divergence, **options)


def _dppo_bounds(old_logps, divergence, radius, radius_low, radius_high, solver):
    """DPPO's trust region as ratio bounds: the ratios at which the binary divergence between `p` and `q = r p`
    reaches the radius, i.e. the Band bounds of that divergence without a cap (docs/band-and-dppo.md). `radius_low`
    and `radius_high`, when given, replace `radius` on their side."""
    low = radius if radius_low is None else radius_low
    high = radius if radius_high is None else radius_high
    lower, upper = _band(old_logps, low, divergence, solver=solver)
    if high is not low:
        upper = _band(old_logps, high, divergence, solver=solver)[1]
    return lower, upper


def dppo_tv_bounds(
    old_logps: torch.Tensor,
    *,
    radius: Radius = 0.15,
    radius_low: Radius | None = None,
    radius_high: Radius | None = None,
):
    """DPPO-Binary-TV: a token may move until `|q - p| = radius`, i.e. `r` in `[1 - radius/p, 1 + radius/p]` (within
    `[0, 1/p]`)."""
    return _dppo_bounds(old_logps, "tv", radius, radius_low, radius_high, "torch")


def dppo_kl_bounds(
    old_logps: torch.Tensor,
    *,
    radius: Radius = 0.05,
    radius_low: Radius | None = None,
    radius_high: Radius | None = None,
    solver: str = "auto",
):
    """DPPO-Binary-KL: a token may move until `KL(Bern(p) || Bern(q)) = radius` (the Band KL root finder)."""
    return _dppo_bounds(old_logps, "kl", radius, radius_low, radius_high, solver)


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
    return _band(old_logps, radius, divergence, solver=solver, upper_max=upper_max, relax=(epsilon_low, epsilon_high))


def dcpo_bounds(
    old_logps: torch.Tensor,
    *,
    epsilon_low: float = 0.16,
    epsilon_high: float = 0.2,
    upper_max: float | None = 10.0,
):
    """DCPO's dynamic bounds: `lower = 1/2 + 1/2 sqrt(max(1 - 4 eps_low / p, 0))`,
    `upper = min(1/2 + 1/2 sqrt(1 + 4 eps_high / p), upper_max)` (docs/policy-losses.md, "DCPO"); `upper_max=None`
    is no cap, as for the Band."""
    with torch.no_grad():
        dtype = torch.float64 if old_logps.dtype == torch.float64 else torch.float32
        inv_p = torch.exp(-old_logps.detach().to(dtype).clamp(max=0.0))
        lower = 0.5 + 0.5 * torch.sqrt((1 - 4 * epsilon_low * inv_p).clamp(min=0.0))
        upper = 0.5 + 0.5 * torch.sqrt(1 + 4 * epsilon_high * inv_p)
        if upper_max is not None:
            upper = upper.clamp(max=upper_max)
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
    `-min(min(r, delta) A, clamp(r, lower, upper) A)`. `delta` is the dual-clip constant (TRL's `delta`).
    Computed in float32 or wider, with the ratio capped at the largest finite value (`safe_exp`)."""
    ratio = safe_exp(log_ratio)
    clipped_ratio = _clamp(ratio, lower, upper)
    if delta is not None:
        ratio = torch.clamp(ratio, max=delta)
    return -torch.min(ratio * advantages, clipped_ratio * advantages)


def reweighted_surrogate(
    log_ratio: torch.Tensor, advantages: torch.Tensor, value: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """`-A * (sg(value) + sg(weight) * (log_ratio - sg(log_ratio)))`: forward `-A * value`, gradient weight
    `weight`. `value` and `weight` must be finite where `A = 0` (they are, from `safe_exp`)."""
    log_ratio = upcast(log_ratio)
    # 0 in value, weight in gradient; `inf - inf` at log r = -inf (pi = 0) would make it NaN: 0 there, no gradient
    zero_with_gradient = torch.nan_to_num(log_ratio - log_ratio.detach(), nan=0.0)
    return -advantages * (value.detach() + weight.detach() * zero_with_gradient)


def clip_value(log_ratio, advantages, lower, upper):
    """Forward value of the clipped surrogate, `min(r A, clamp(r) A) / A` written without dividing by A."""
    ratio = safe_exp(log_ratio.detach())
    clipped = _clamp(ratio, lower, upper)
    return torch.where(advantages >= 0, torch.minimum(ratio, clipped), torch.maximum(ratio, clipped))


def _log(bound: Bound) -> Bound:
    return torch.log(bound) if torch.is_tensor(bound) else math.log(bound)


def clip_regions(log_ratio, advantages, lower, upper):
    """DGPO's regions (DGPO §4, docs/policy-losses.md): LN `r < lower, A < 0`; HP `r > upper, A > 0`;
    LP `r < lower, A > 0`; HN `r > upper, A < 0`."""
    log_ratio = log_ratio.detach()
    below, above = log_ratio < _log(lower), log_ratio > _log(upper)
    pos, neg = advantages > 0, advantages < 0
    return {"LN": below & neg, "HP": above & pos, "LP": below & pos, "HN": above & neg}


def dgpo_log_weights(
    log_ratio: torch.Tensor, advantages: torch.Tensor, lower: Bound, upper: Bound, *, n: int = 1, m: float = 2.0
) -> torch.Tensor:
    """`log w` of DGPO (docs/policy-losses.md, "DGPO"), on `grad log pi`: LN `(n+1) log r - n log(1-eps_low)`,
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
    surrogate `R` whose gradient gives these weights (DGPO §4; docs/policy-losses.md), which equals the weight `w`
    on `grad log pi`."""
    weight = safe_exp(dgpo_log_weights(log_ratio, advantages, lower, upper, n=n, m=m))
    return reweighted_surrogate(log_ratio, advantages, weight, weight)


def _boundary_weights(log_ratio, advantages, lower, upper, left_weight, right_weight):
    ratio = safe_exp(log_ratio.detach())
    regions = clip_regions(log_ratio, advantages, lower, upper)
    weight = torch.where(regions["LN"], left_weight, ratio)
    weight = torch.where(regions["HP"], right_weight, weight)
    value = clip_value(log_ratio, advantages, lower, upper)
    return reweighted_surrogate(log_ratio, advantages, value, weight)


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
    """CE-GPPO: as GPPO with the boundary weights scaled, `beta1 (1 - eps_low)` (LN) and `beta2 (1 + eps_high)`
    (HP)."""
    return _boundary_weights(log_ratio, advantages, lower, upper, beta1 * _as_weight(lower), beta2 * _as_weight(upper))


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
    log_ratio_d = upcast(log_ratio.detach())
    ratio = safe_exp(log_ratio_d)
    pos = advantages > 0
    flipped = safe_exp(-log_ratio_d).clamp(max=c_pos)
    weight_pos = torch.where(log_ratio_d > _log(upper), torch.zeros_like(ratio), flipped)
    weight_neg = torch.where(log_ratio_d < _log(lower), torch.zeros_like(ratio), ratio.clamp(max=c_neg))
    weight = torch.where(pos, weight_pos, weight_neg)
    value = clip_value(log_ratio, advantages, lower, upper)
    return reweighted_surrogate(log_ratio, advantages, value, weight)


def _as_weight(bound: Bound) -> Bound:
    return bound.detach() if torch.is_tensor(bound) else bound


def cispo_loss(log_ratio: torch.Tensor, advantages: torch.Tensor, lower: Bound, upper: Bound) -> torch.Tensor:
    """CISPO as the DGPO paper ran it (its Table 12: eps = 0.2 / 0.2): every token keeps a gradient, with the
    importance weight clipped on both sides, `w = sg(clip(r, lower, upper))` on `grad log pi` in all four regions.
    Forward value: the clipped ratio. (TRL's `loss_type="cispo"` caps from above only, `min(r, epsilon_high)`:
    without the lower cap the left-boundary weight of CISPO differs; docs/policy-losses.md, "CISPO".)"""
    weight = _clamp(safe_exp(log_ratio.detach()), lower, upper)
    return reweighted_surrogate(log_ratio, advantages, weight, weight)


def dppo_loss(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    lower: Bound,
    upper: Bound,
    *,
    ratio_cap: float | None = 20.0,
) -> torch.Tensor:
    """DPPO-Binary (https://arxiv.org/abs/2602.04879): a token whose update leaves the trust region in the direction
    its advantage pushes (`r > upper` with `A > 0`, `r < lower` with `A < 0`) is masked (weight 0); every other token
    keeps the truncated importance weight `w = min(r, ratio_cap)` on `grad log pi` (`ratio_cap=None`: `w = r`).
    Forward value: `min(r, ratio_cap)` (docs/band-and-dppo.md for what verl logs instead)."""
    ratio = safe_exp(log_ratio.detach())
    truncated = ratio if ratio_cap is None else ratio.clamp(max=ratio_cap)
    regions = clip_regions(log_ratio, advantages, lower, upper)
    weight = torch.where(regions["HP"] | regions["LN"], torch.zeros_like(truncated), truncated)
    return reweighted_surrogate(log_ratio, advantages, truncated, weight)


def dppo_metrics(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    lower: Bound,
    upper: Bound,
    mask: torch.Tensor,
    *,
    ratio_cap: float | None = 20.0,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """DPPO's metrics (docs/metrics.md) as `(numerator, denominator)` pairs: the share of positive-advantage tokens
    masked above the region (`dppo/masked_pos_share`), of negative-advantage ones masked below it
    (`dppo/masked_neg_share`), and of all tokens whose kept weight the cap truncated (`dppo/truncated_share`)."""
    regions = clip_regions(log_ratio, advantages, lower, upper)
    mask = mask.float()
    pos, neg = (advantages > 0).float() * mask, (advantages < 0).float() * mask
    kept = ~(regions["HP"] | regions["LN"])
    capped = (log_ratio.detach() > math.log(ratio_cap)) if ratio_cap is not None else torch.zeros_like(kept)
    return {
        "dppo/masked_pos_share": ((regions["HP"].float() * mask).sum(), pos.sum()),
        "dppo/masked_neg_share": ((regions["LN"].float() * mask).sum(), neg.sum()),
        "dppo/truncated_share": (((kept & capped).float() * mask).sum(), mask.sum()),
    }


def dgpo_metrics(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    lower: Bound,
    upper: Bound,
    mask: torch.Tensor,
    *,
    n: int = 1,
    m: float = 2.0,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """DGPO's extra metrics (docs/metrics.md) as `(numerator, denominator)` pairs: the share of tokens in each region
    (`dgpo/frac_LN`, `_HP`, `_LP`, `_HN`) and the mean gradient weight in LN and HP (`dgpo/weight_{LN,HP}_mean`)."""
    regions = clip_regions(log_ratio, advantages, lower, upper)
    weights = safe_exp(dgpo_log_weights(log_ratio, advantages, lower, upper, n=n, m=m))
    mask = mask.float()
    counts = {}
    for name, region in regions.items():
        region = region.float() * mask
        counts[f"dgpo/frac_{name}"] = (region.sum(), mask.sum())
        if name in ("LN", "HP"):
            counts[f"dgpo/weight_{name}_mean"] = ((weights * region).sum(), region.sum())
    return counts


# ----------------------------------------------------------------------------------------------------------------
# The built-in losses, registered
# ----------------------------------------------------------------------------------------------------------------


def check_radius_value(value: Any, field: str = "radius") -> Radius:
    """A radius: a finite number > 0, or, in the pure API, a floating tensor of per-token radii that does not require
    grad and holds a finite number > 0 at every element (one host read: a bad radius would silently turn the Band's
    bounds to NaN and DPPO's mask off; the shape and device are checked against the old log-probs by the bounds)."""
    if not torch.is_tensor(value):
        return RADIUS(value, field)
    if not value.is_floating_point() or value.requires_grad:
        raise ValueError(
            f"{field} must be a number or a floating-point tensor that does not require grad, got a tensor of "
            f"dtype {value.dtype}{' requiring grad' if value.requires_grad else ''}."
        )
    bad = ~(torch.isfinite(value) & (value > 0))
    if bool(bad.any()):
        raise ValueError(
            f"{field} must be a finite number > 0 at every token, got a tensor with {int(bad.sum())} element(s) that "
            f"are not (e.g. {value[bad][0].item()!r})."
        )
    return value


def check_optional_radius(value: Any, field: str = "radius") -> Radius | None:
    """`None` (or the word "none"/"null") or a radius (`check_radius_value`)."""
    return None if none_word(value) is None else check_radius_value(value, field)


#: DPPO's truncation `C` of the importance weight: None (no truncation) or >= 1 (below 1 it would shrink the weight
#: of tokens that did not move), and finite in float32, where the weights are computed.
RATIO_CAP = Number(low=1, high=float(torch.finfo(torch.float32).max), optional=True)


BAND = (
    Hyperparameter("radius", "band_radius", check_radius_value),
    Hyperparameter("divergence", "band_divergence", check_divergence),
    Hyperparameter("upper_max", "band_upper_max", UPPER_MAX),
    Hyperparameter("solver", "band_solver", SOLVER),
)


def _check_band_solver_runs(kwargs: Mapping[str, Any], labels: Mapping[str, str], device: str) -> None:
    """A kernel solver (`band_solver="triton"`) must run where training runs: checked when the config is built."""
    reason = solver_unavailable_reason(kwargs["solver"], kwargs.get("divergence", "kl"), device)
    if reason is not None:
        label = labels["solver"]
        raise ValueError(f"{label}={kwargs['solver']!r} cannot run here: {reason}. Use {label}='auto' or 'torch'.")


_CLIP = (EPSILON_LOW, EPSILON_HIGH)
# The re-weighted losses set their own weights outside the clip range: TRL's dual clip has no meaning there.
# Per-token bounds and weights are defined on per-token ratios; against GSPO's sequence-level ratio neither paper
# defines them (which token's bound would clip a sequence?), so the combination is refused, not guessed.
_TOKEN_LEVEL_ONLY = {
    "importance_sampling_level": "its bounds and weights are per token, and neither paper defines them for GSPO's "
    "sequence-level ratio (use policy_loss='clip' for GSPO)"
}
_NO_DUAL_CLIP = {
    **_TOKEN_LEVEL_ONLY,
    "delta": "the dual clip applies to the clipped losses only; this one sets its own weights outside the clip range",
}
register_policy_loss(PolicyLossSpec("clip", clip_bounds, clipped_surrogate_loss, (*_CLIP, DUAL_CLIP)))
register_policy_loss(
    PolicyLossSpec(
        "band",
        band_policy_bounds,
        clipped_surrogate_loss,
        (*BAND, DUAL_CLIP),
        check=_check_band_solver_runs,
        incompatible=_TOKEN_LEVEL_ONLY,
    )
)
register_policy_loss(
    PolicyLossSpec(
        "relaxed_band",
        relaxed_band_bounds,
        clipped_surrogate_loss,
        (*BAND, *_CLIP, DUAL_CLIP),
        check=_check_band_solver_runs,
        incompatible=_TOKEN_LEVEL_ONLY,
    )
)
register_policy_loss(
    PolicyLossSpec(
        "dcpo",
        dcpo_bounds,
        clipped_surrogate_loss,
        # DCPO keeps its own cap (10) in training: band_upper_max is the Band's, not DCPO's.
        (*_CLIP, Hyperparameter("upper_max", None, UPPER_MAX), DUAL_CLIP),
        incompatible=_TOKEN_LEVEL_ONLY,
    )
)
register_policy_loss(
    PolicyLossSpec(
        "dgpo",
        clip_bounds,
        dgpo_loss,
        (*_CLIP, Hyperparameter("n", "dgpo_n", POWER), Hyperparameter("m", "dgpo_m", Number(low=1))),
        metrics=dgpo_metrics,
        incompatible=_NO_DUAL_CLIP,
    )
)
# Band x DGPO (beyond both papers; docs/extensions.md): DGPO's decoupled decay outside the Band bounds instead of the
# fixed clip interval. Where the Band saturates (lower = 0 for tail tokens) the left region is empty.
register_policy_loss(
    PolicyLossSpec(
        "band_dgpo",
        band_policy_bounds,
        dgpo_loss,
        (*BAND, Hyperparameter("n", "dgpo_n", POWER), Hyperparameter("m", "dgpo_m", Number(low=1))),
        metrics=dgpo_metrics,
        check=_check_band_solver_runs,
        incompatible=_NO_DUAL_CLIP,
    )
)
register_policy_loss(PolicyLossSpec("gppo", clip_bounds, gppo_loss, _CLIP, incompatible=_NO_DUAL_CLIP))
register_policy_loss(PolicyLossSpec("cispo", clip_bounds, cispo_loss, _CLIP, incompatible=_NO_DUAL_CLIP))
register_policy_loss(
    PolicyLossSpec(
        "ce_gppo",
        clip_bounds,
        ce_gppo_loss,
        (
            *_CLIP,
            Hyperparameter("beta1", "ce_gppo_beta1", Number(low=0)),
            Hyperparameter("beta2", "ce_gppo_beta2", Number(low=0)),
        ),
        incompatible=_NO_DUAL_CLIP,
    )
)
register_policy_loss(
    PolicyLossSpec(
        "aspo",
        clip_bounds,
        aspo_loss,
        (
            *_CLIP,
            Hyperparameter("c_pos", "aspo_c_pos", Number(low=1)),
            Hyperparameter("c_neg", "aspo_c_neg", Number(low=1)),
        ),
        incompatible=_NO_DUAL_CLIP,
    )
)

# DPPO-Binary (Qi et al., 2026): the Band region of TV or KL without a cap, masking instead of clipping, and a
# truncated importance weight (docs/band-and-dppo.md). Radii as the authors trained: 0.15 (TV), 0.05 (KL).
_DPPO_SIDES = (
    Hyperparameter("radius_low", "dppo_radius_low", check_optional_radius),
    Hyperparameter("radius_high", "dppo_radius_high", check_optional_radius),
    Hyperparameter("ratio_cap", "dppo_ratio_cap", RATIO_CAP),
)
register_policy_loss(
    PolicyLossSpec(
        "dppo_tv",
        dppo_tv_bounds,
        dppo_loss,
        (Hyperparameter("radius", "dppo_tv_radius", check_radius_value), *_DPPO_SIDES),
        metrics=dppo_metrics,
        incompatible=_NO_DUAL_CLIP,
    )
)
register_policy_loss(
    PolicyLossSpec(
        "dppo_kl",
        dppo_kl_bounds,
        dppo_loss,
        (
            Hyperparameter("radius", "dppo_kl_radius", check_radius_value),
            *_DPPO_SIDES,
            Hyperparameter("solver", "band_solver", SOLVER),
        ),
        metrics=dppo_metrics,
        check=_check_band_solver_runs,
        incompatible=_NO_DUAL_CLIP,
    )
)

#: The built-in policy losses (`registered_policy_losses()` also lists any registered later).
POLICY_LOSSES = tuple(registered_policy_losses())

"""Per-token policy losses of BandPO, DGPO and their baselines, registered in the loss registry.

Every loss is a pure function `loss(log_ratio, advantages, lower, upper, **hyperparameters)` of tensors `log_ratio`
`(B, T)` and `advantages` broadcastable to it, returning the per-token loss `(B, T)` before masking and aggregation;
`lower`/`upper` are the ratio bounds from the matching `*_bounds(old_logps, **hyperparameters)` function (floats, or
tensors shaped like the old log-probs, without gradient). A loss's `*_metrics` takes the same arguments and the mask
`(B, T)` and returns `Counts`. Notation (docs/policy-losses.md):
`r = exp(log_ratio)`, advantage `A`, gradient weight `w` on `grad log pi` (`-grad loss = A * w * grad log pi`).
Clipped surrogates (`clip`, `band`, `relaxed_band`, `dcpo`) are TRL's `-min(r A, clamp(r, lower, upper) A)`;
re-weighted ones (`dgpo`, `gppo`, `ce_gppo`, `aspo`, ...) set their forward value and weight explicitly
(`reweighted_surrogate`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .band import (
    RADIUS,
    SOLVER,
    UPPER_MAX,
    check_divergence,
    check_radius_tensor,
    compute_dtype_for,
    solve_band,
    solver_unavailable_reason,
)
from .band_solvers import Radius
from .checks import FLOAT32_MAX, Choice, Number, none_word
from .loss_registry import (  # noqa: F401  (re-exported)
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
    upcast,
)
from .metrics import Counts

Bound = float | Tensor


# Largest exponent whose exp is finite (with a rounding margin), per compute dtype: ratios and weights are capped
# there, so no `inf * 0` turns a loss or a gradient into NaN (docs/policy-losses.md, "Inputs and numerics").
RATIO_LOG_MAX = {dtype: math.log(torch.finfo(dtype).max) - 0.01 for dtype in (torch.float32, torch.float64)}


def safe_exp(log_x: Tensor) -> Tensor:
    """`exp(log_x)` in float32 or wider, capped at the dtype's largest finite value (differentiable below the cap)."""
    log_x = upcast(log_x)
    return torch.exp(log_x.clamp(max=RATIO_LOG_MAX[log_x.dtype]))


# -- Bounds: (old_logps, **hyperparameters) -> (lower, upper) ----------------------------------------------------


def clip_bounds(old_logps, *, epsilon_low=0.2, epsilon_high=0.2):
    """GRPO / PPO bounds `[1 - epsilon_low, 1 + epsilon_high]` (Clip-Higher: `epsilon_high = 0.28`)."""
    return 1.0 - epsilon_low, 1.0 + epsilon_high


def band_policy_bounds(old_logps, *, radius=0.05, divergence="kl", upper_max=10.0, solver="auto"):
    """BandPO bounds (see `trl_bandpo.core.band.band_bounds`); `upper_max=10` as the BandPO authors trained."""
    return _band(old_logps, radius, divergence, solver=solver, upper_max=upper_max)


def _band(old_logps, radius, divergence, **options):
    """The Band bounds of hyper-parameters their owner checked; a radius tensor is checked here against the
    log-probs it applies to (metadata only)."""
    if torch.is_tensor(radius):
        check_radius_tensor(radius, old_logps)
    return solve_band(old_logps, radius, divergence, **options)


def _dppo_bounds(old_logps, divergence, radius, radius_low, radius_high, solver):
    """DPPO's trust region: the Band bounds of the binary divergence without a cap (docs/band-and-dppo.md);
    `radius_low` and `radius_high`, when given, replace `radius` on their side."""
    low = radius if radius_low is None else radius_low
    high = radius if radius_high is None else radius_high
    lower, upper = _band(old_logps, low, divergence, solver=solver)
    if high is not low:
        upper = _band(old_logps, high, divergence, solver=solver)[1]
    return lower, upper


def dppo_tv_bounds(old_logps, *, radius=0.15, radius_low=None, radius_high=None):
    """DPPO-Binary-TV: a token may move until `|q - p| = radius`, i.e. `r` in `[1 - radius/p, 1 + radius/p]` (within
    `[0, 1/p]`)."""
    return _dppo_bounds(old_logps, "tv", radius, radius_low, radius_high, "torch")


def dppo_kl_bounds(old_logps, *, radius=0.05, radius_low=None, radius_high=None, solver="auto"):
    """DPPO-Binary-KL: a token may move until `KL(Bern(p) || Bern(q)) = radius` (the Band KL root finder)."""
    return _dppo_bounds(old_logps, "kl", radius, radius_low, radius_high, solver)


def relaxed_band_bounds(
    old_logps, *, radius=0.05, divergence="kl", upper_max=10.0, solver="auto", epsilon_low=0.2, epsilon_high=0.28
):
    """Relaxed Band (BandPO paper's ablation): the union of the Band and Clip-Higher intervals at every p."""
    return _band(old_logps, radius, divergence, solver=solver, upper_max=upper_max, relax=(epsilon_low, epsilon_high))


def dcpo_bounds(old_logps, *, epsilon_low=0.16, epsilon_high=0.2, upper_max=10.0):
    """DCPO's dynamic bounds: `lower = 1/2 + 1/2 sqrt(max(1 - 4 eps_low / p, 0))`,
    `upper = min(1/2 + 1/2 sqrt(1 + 4 eps_high / p), upper_max)` (docs/policy-losses.md, "DCPO"); `upper_max=None`
    is no cap, as for the Band."""
    with torch.no_grad():
        inv_p = torch.exp(-old_logps.detach().to(compute_dtype_for(old_logps.dtype)).clamp(max=0.0))
        lower = 0.5 + 0.5 * torch.sqrt((1 - 4 * epsilon_low * inv_p).clamp(min=0.0))
        upper = 0.5 + 0.5 * torch.sqrt(1 + 4 * epsilon_high * inv_p)
        if upper_max is not None:  # (a cap beyond the dtype's range caps nothing)
            upper = upper.clamp(max=min(upper_max, torch.finfo(upper.dtype).max))
    return lower, upper


def spo_bounds(old_logps, *, epsilon=12.5):
    """SPO's fixed threshold as ratio bounds `[max(1 - epsilon, 0), 1 + epsilon]`: the ratios past which its gradient
    weight changes sign (docs/policy-losses.md, "SPO and DRPO"). `spo_loss` reads `epsilon = upper - 1` back."""
    return max(1.0 - epsilon, 0.0), 1.0 + epsilon


def drpo_bounds(old_logps, *, epsilon=12.5):
    """DRPO's token-adaptive threshold `epsilon / p` as ratio bounds `[max(1 - epsilon/p, 0), 1 + epsilon/p]`, i.e.
    the ratios at which `|q - p| = epsilon` (the Binary-TV boundary of radius `epsilon`), computed without gradient in
    float32 or wider and kept finite (`safe_exp`). `spo_loss` reads `epsilon / p = upper - 1` back."""
    with torch.no_grad():
        adaptive = safe_exp(math.log(epsilon) - upcast(old_logps.detach()))
        return (1.0 - adaptive).clamp(min=0.0), 1.0 + adaptive


def ipo_bounds(old_logps, *, mask_low=0.1, mask_high=0.1):
    """prime-rl's IPO trust region: a token may move until `p - q = mask_low` (down) or `q - p = mask_high` (up), i.e.
    DPPO-Binary-TV's region with those radii, `r` in `[max(1 - mask_low/p, 0), min(1 + mask_high/p, 1/p)]`."""
    return _dppo_bounds(old_logps, "tv", mask_low, None, mask_high, "torch")


# -- Losses: (log_ratio, advantages, lower, upper, **hyperparameters) -> per-token loss ---------------------------


def _clamp(x: Tensor, lower: Bound, upper: Bound) -> Tensor:
    if torch.is_tensor(lower) or torch.is_tensor(upper):  # torch.clamp takes two tensors or two numbers
        lower, upper = (torch.as_tensor(bound, dtype=x.dtype, device=x.device) for bound in (lower, upper))
    return torch.clamp(x, lower, upper)


def clipped_surrogate_loss(log_ratio, advantages, lower, upper, *, delta=None):
    """PPO's clipped surrogate with (per-token) bounds, as TRL writes it: `-min(min(r, delta) A, clamp(r, lower,
    upper) A)`, `delta` TRL's dual clip. In float32 or wider, the ratio capped below overflow (`safe_exp`)."""
    ratio = safe_exp(log_ratio)
    clipped_ratio = _clamp(ratio, lower, upper)
    if delta is not None:
        ratio = torch.clamp(ratio, max=delta)
    return -torch.min(ratio * advantages, clipped_ratio * advantages)


def reweighted_surrogate(log_ratio, advantages, value, weight):
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


def dgpo_log_weights(log_ratio, advantages, lower, upper, *, n=1, m=2.0):
    """`log w` of DGPO (docs/policy-losses.md, "DGPO"), on `grad log pi`: LN `(n+1) log r - n log(1-eps_low)`,
    HP `(m-1)/m log r + log(1+eps_high)/m`, elsewhere `log r`. Only linear maps of `log r` are selected, and the
    single `exp` happens afterwards, so no branch can overflow where it does not apply."""
    log_ratio = log_ratio.detach()
    regions = clip_regions(log_ratio, advantages, lower, upper)
    # as offsets from the boundary: no cancellation of two large terms when n is large
    left = (n + 1) * (log_ratio - _log(lower)) + _log(lower)
    right = (m - 1) / m * (log_ratio - _log(upper)) + _log(upper)
    return torch.where(regions["LN"], left, torch.where(regions["HP"], right, log_ratio))


def dgpo_loss(log_ratio, advantages, lower, upper, *, n=1, m=2.0):
    """DGPO (https://arxiv.org/abs/2603.14389): outside the clip range the weight on `grad pi` decays as `pi^n`
    (left, A < 0) or `pi^(-1/m)` (right, A > 0), continuous at both boundaries. The forward value is the
    surrogate `R` whose gradient gives these weights (DGPO §4; docs/policy-losses.md), which equals the weight `w`
    on `grad log pi`."""
    weight = safe_exp(dgpo_log_weights(log_ratio, advantages, lower, upper, n=n, m=m))
    return reweighted_surrogate(log_ratio, advantages, weight, weight)


def gppo_loss(log_ratio, advantages, lower, upper):
    """GPPO (Klear-Reasoner): the clip's forward value, but clipped tokens keep the boundary's weight
    (`1 + eps_high` right, `1 - eps_low` left) instead of 0."""
    return ce_gppo_loss(log_ratio, advantages, lower, upper, beta1=1.0, beta2=1.0)


def ce_gppo_loss(log_ratio, advantages, lower, upper, *, beta1=0.75, beta2=1.0):
    """CE-GPPO: as GPPO with the boundary weights scaled, `beta1 (1 - eps_low)` (LN) and `beta2 (1 + eps_high)`
    (HP)."""
    regions = clip_regions(log_ratio, advantages, lower, upper)
    weight = torch.where(regions["LN"], _scaled_bound(beta1, lower), safe_exp(log_ratio.detach()))
    weight = torch.where(regions["HP"], _scaled_bound(beta2, upper), weight)
    return reweighted_surrogate(log_ratio, advantages, clip_value(log_ratio, advantages, lower, upper), weight)


def aspo_loss(log_ratio, advantages, lower, upper, *, c_pos=3.0, c_neg=3.0):
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


def _scaled_bound(scale: float, bound: Bound) -> Bound:
    """`scale * bound` as a weight: no gradient, at most float32's largest number (both may be that large)."""
    if torch.is_tensor(bound):
        return (bound.detach() * scale).clamp(max=FLOAT32_MAX)
    return min(scale * bound, FLOAT32_MAX)


def cispo_loss(log_ratio, advantages, lower, upper):
    """CISPO as the DGPO paper ran it: every token keeps a gradient, with the importance weight clipped on both
    sides, `w = sg(clip(r, lower, upper))` on `grad log pi`; forward value the clipped ratio (docs/policy-losses.md,
    "CISPO", for TRL's one-sided `loss_type="cispo"`)."""
    weight = _clamp(safe_exp(log_ratio.detach()), lower, upper)
    return reweighted_surrogate(log_ratio, advantages, weight, weight)


def dppo_loss(log_ratio, advantages, lower, upper, *, ratio_cap=20.0):
    """DPPO-Binary (https://arxiv.org/abs/2602.04879): a token whose update leaves the trust region in the direction
    its advantage pushes (`r > upper` with `A > 0`, `r < lower` with `A < 0`) is masked (weight 0); every other token
    keeps the truncated importance weight `w = min(r, ratio_cap)` on `grad log pi` (`ratio_cap=None`: `w = r`).
    Forward value: `min(r, ratio_cap)`."""
    ratio = safe_exp(log_ratio.detach())
    truncated = ratio if ratio_cap is None else ratio.clamp(max=ratio_cap)
    regions = clip_regions(log_ratio, advantages, lower, upper)
    weight = torch.where(regions["HP"] | regions["LN"], torch.zeros_like(truncated), truncated)
    return reweighted_surrogate(log_ratio, advantages, truncated, weight)


def dppo_metrics(log_ratio, advantages, lower, upper, mask, *, ratio_cap=20.0):
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


#: SPO, DRPO, CPPO and TRM clamp `log r` to [-20, 20] before `exp`, as their authors (and verl) do: beyond, no
#: gradient.
LOG_RATIO_CLAMP = 20.0


def _clamped(log_ratio: Tensor) -> Tensor:
    return upcast(log_ratio).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _spo_terms(log_ratio, advantages, upper):
    """`(r, penalty)` of SPO/DRPO with `r = exp(clamp(log r, -20, 20))` (differentiable inside the clamp) and
    `penalty = |A| (r - 1)^2 / (2 eps)`, the threshold `eps = upper - 1` read back from the bounds."""
    ratio = torch.exp(_clamped(log_ratio))
    threshold = upper.detach() - 1.0 if torch.is_tensor(upper) else upper - 1.0
    return ratio, advantages.abs() * (ratio - 1.0).square() / (2.0 * threshold)


def spo_loss(log_ratio, advantages, lower, upper):
    """SPO's quadratic surrogate, `-A r + |A| (r - 1)^2 / (2 eps)`, with the threshold `eps = upper - 1` of the
    bounds: a number for `spo`, the token-adaptive `eps / p` for `drpo`, where the penalty is DRPO's
    `|A| p (r - 1)^2 / (2 eps)`. Gradient weight on `grad log pi`: `r (1 - sign(A) (r - 1) / eps_t)`, i.e.
    `r (1 - sign(A) (q - p) / eps)` for DRPO (docs/policy-losses.md). `log r` is clamped to [-20, 20] before `exp`,
    and the whole loss is differentiated (no re-weighting)."""
    ratio, penalty = _spo_terms(log_ratio, advantages, upper)
    return -advantages * ratio + penalty


def _spo_metrics(prefix: str) -> Callable:
    def metrics(log_ratio, advantages, lower, upper, mask):
        """The DRPO authors' metrics: the mean penalty (`<prefix>/penalty_mean`), the shares of tokens above
        `1 + eps_t` and below `1 - eps_t` whatever the advantage's sign (`<prefix>/clipfrac_upper`, `_lower`), and
        the share whose gradient weight is negative (`<prefix>/reversed_share`)."""
        log_ratio = log_ratio.detach()
        ratio, penalty = _spo_terms(log_ratio, advantages, upper)
        mask = mask.float()
        below, above = (side.float() * mask for side in _outside(_clamped(log_ratio), lower, upper))
        reversed_ = torch.where(advantages > 0, above, torch.where(advantages < 0, below, torch.zeros_like(below)))
        total = mask.sum()
        return {
            f"{prefix}/penalty_mean": ((penalty * mask).sum(), total),
            f"{prefix}/clipfrac_upper": (above.sum(), total),
            f"{prefix}/clipfrac_lower": (below.sum(), total),
            f"{prefix}/reversed_share": (reversed_.sum(), total),
        }

    metrics.__name__ = f"{prefix}_metrics"
    return metrics


def ipo_loss(log_ratio, advantages, lower, upper, *, kl_tau=1e-3, adv_tau=1.0):
    """prime-rl's IPO (docs/band-and-dppo.md): a token outside `[lower, upper]` is masked whatever its advantage's
    sign; kept tokens have `-adv_tau * A * r`; every token adds the KL term `kl_tau * (log r)^2`. The ratio and
    `log r` are capped below overflow (`safe_exp`)."""
    log_ratio = upcast(log_ratio)
    ratio = safe_exp(log_ratio)
    below, above = _outside(log_ratio.detach(), lower, upper)
    policy = torch.where(below | above, 0.0, -adv_tau * advantages * ratio)  # masked: 0, never inf * 0
    log_max = RATIO_LOG_MAX[log_ratio.dtype]  # as `safe_exp`: finite, and no gradient beyond the cap
    return policy + kl_tau * log_ratio.clamp(-log_max, log_max).square()


def _outside(log_ratio, lower, upper):
    """`(log r < log lower, log r > log upper)` for float or tensor bounds (a lower bound of 0: nothing below)."""
    lower_t = torch.as_tensor(lower, dtype=log_ratio.dtype, device=log_ratio.device)
    upper_t = torch.as_tensor(upper, dtype=log_ratio.dtype, device=log_ratio.device)
    return log_ratio < torch.log(lower_t), log_ratio > torch.log(upper_t)


def ipo_metrics(log_ratio, advantages, lower, upper, mask, *, kl_tau=1e-3, adv_tau=1.0):
    """prime-rl's IPO metrics (docs/metrics.md): the share of masked tokens (`ipo/is_masked`), split by the side they
    left on (`ipo/is_masked_low`, `_high`), and the mean `r - log r - 1` (k3 estimate of the mismatch KL) over masked
    and over kept tokens (`ipo/masked_mismatch_kl`, `ipo/unmasked_mismatch_kl`)."""
    log_ratio = upcast(log_ratio.detach())
    below, above = _outside(log_ratio, lower, upper)
    mask = mask.float()
    masked = (below | above).float() * mask
    kept = mask - masked
    mismatch = safe_exp(log_ratio) - log_ratio - 1.0
    return {
        "ipo/is_masked": (masked.sum(), mask.sum()),
        "ipo/is_masked_low": ((below.float() * mask).sum(), mask.sum()),
        "ipo/is_masked_high": ((above.float() * mask).sum(), mask.sum()),
        "ipo/masked_mismatch_kl": ((mismatch * masked).sum(), masked.sum()),
        "ipo/unmasked_mismatch_kl": ((mismatch * kept).sum(), kept.sum()),
    }


def dgpo_metrics(log_ratio, advantages, lower, upper, mask, *, n=1, m=2.0):
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


# -- The built-in losses, registered --------------------------------------------------------------------------------


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
RATIO_CAP = Number(low=1, high=FLOAT32_MAX, optional=True)


BAND = (
    Hyperparameter("radius", "band_radius", check_radius_value),
    Hyperparameter("divergence", "band_divergence", check_divergence),
    Hyperparameter("upper_max", "band_upper_max", UPPER_MAX),
    Hyperparameter("solver", "band_solver", SOLVER),
)


def _check_band_solver_runs(kwargs, labels, device):
    """A kernel solver (`band_solver="triton"`) must run where training runs: checked when the config is built."""
    reason = solver_unavailable_reason(kwargs["solver"], kwargs.get("divergence", "kl"), device)
    if reason is not None:
        label = labels["solver"]
        raise ValueError(f"{label}={kwargs['solver']!r} cannot run here: {reason}. Use {label}='auto' or 'torch'.")


_CLIP = (EPSILON_LOW, EPSILON_HIGH)
_DGPO = (Hyperparameter("n", "dgpo_n", POWER), Hyperparameter("m", "dgpo_m", Number(low=1, high=FLOAT32_MAX)))
#: SPO's and DRPO's threshold: from 1e-3, as their losses read it back from float32 bounds `1 + eps/p`, whose rounding
#: (6e-8) must stay small beside it; below, the threshold rounds away (to 0 at ~1e-16: NaN on every token).
_THRESHOLD = Number(low=1e-3, high=FLOAT32_MAX)
#: A cap on a weight (ASPO): >= 1, and a float32 number.
_WEIGHT_CAP = Number(low=1, high=FLOAT32_MAX)
#: A scale of a term or a weight (CE-GPPO's betas, IPO's taus): up to 1e34, so that IPO's `kl_tau * (log r)^2` stays
#: finite in float32 at the largest `|log r|` (88.7); CE-GPPO's scaled weights are capped at float32's largest number.
_SCALE = Number(low=0, high=1e34)
_DPPO_SIDES = (
    Hyperparameter("radius_low", "dppo_radius_low", check_optional_radius),
    Hyperparameter("radius_high", "dppo_radius_high", check_optional_radius),
    Hyperparameter("ratio_cap", "dppo_ratio_cap", RATIO_CAP),
)
# Per-token bounds and weights are undefined for GSPO's sequence-level ratio (which token's bound would clip a
# sequence?): refused, not guessed. TRL's dual clip caps the ratio in its clipped surrogate: the losses that replace
# that surrogate by their own weights (re-weighted, DPPO, SPO, IPO, CPPO) refuse it.
_TOKEN_LEVEL_ONLY = {
    "importance_sampling_level": "its bounds and weights are per token, and neither paper defines them for GSPO's "
    "sequence-level ratio (use policy_loss='clip' for GSPO)"
}
_NO_DUAL_CLIP = {
    **_TOKEN_LEVEL_ONLY,
    "delta": "the dual clip caps the ratio in TRL's clipped surrogate, and this loss does not use that surrogate: it "
    "sets its own per-token weights",
}


def _register(name, bounds, loss, hyperparameters, metrics=None, **options):
    """Register a built-in loss: one that keeps TRL's dual clip refuses only GSPO's sequence-level ratio, any other
    the dual clip too; a Band solver setting is checked to run where training runs."""
    dual_clip = DUAL_CLIP in hyperparameters
    options.setdefault("incompatible", _TOKEN_LEVEL_ONLY if dual_clip else _NO_DUAL_CLIP)
    if any(hp.name == "solver" for hp in hyperparameters):
        options["check"] = _check_band_solver_runs
    register_policy_loss(PolicyLossSpec(name, bounds, loss, hyperparameters, metrics, **options))


_register("clip", clip_bounds, clipped_surrogate_loss, (*_CLIP, DUAL_CLIP), incompatible={})
_register("band", band_policy_bounds, clipped_surrogate_loss, (*BAND, DUAL_CLIP))
_register("relaxed_band", relaxed_band_bounds, clipped_surrogate_loss, (*BAND, *_CLIP, DUAL_CLIP))
# DCPO keeps its own cap (10) in training: band_upper_max is the Band's, not DCPO's.
_DCPO_CAP = Hyperparameter("upper_max", None, UPPER_MAX)
_register("dcpo", dcpo_bounds, clipped_surrogate_loss, (*_CLIP, _DCPO_CAP, DUAL_CLIP))
_register("dgpo", clip_bounds, dgpo_loss, (*_CLIP, *_DGPO), dgpo_metrics)
# Band x DGPO (docs/extensions.md): DGPO's decay outside the Band bounds instead of the clip interval.
_register("band_dgpo", band_policy_bounds, dgpo_loss, (*BAND, *_DGPO), dgpo_metrics)
_register("gppo", clip_bounds, gppo_loss, _CLIP)
_register("cispo", clip_bounds, cispo_loss, _CLIP)
_BETAS = (Hyperparameter("beta1", "ce_gppo_beta1", _SCALE), Hyperparameter("beta2", "ce_gppo_beta2", _SCALE))
_register("ce_gppo", clip_bounds, ce_gppo_loss, (*_CLIP, *_BETAS))
_ASPO_CAPS = (
    Hyperparameter("c_pos", "aspo_c_pos", _WEIGHT_CAP),
    Hyperparameter("c_neg", "aspo_c_neg", _WEIGHT_CAP),
)
_register("aspo", clip_bounds, aspo_loss, (*_CLIP, *_ASPO_CAPS))
# DPPO-Binary (docs/band-and-dppo.md): radii as the authors trained, 0.15 (TV) and 0.05 (KL).
_TV_RADIUS = Hyperparameter("radius", "dppo_tv_radius", check_radius_value)
_register("dppo_tv", dppo_tv_bounds, dppo_loss, (_TV_RADIUS, *_DPPO_SIDES), dppo_metrics)
_KL_RADIUS = Hyperparameter("radius", "dppo_kl_radius", check_radius_value)
_KL_SOLVER = Hyperparameter("solver", "band_solver", SOLVER)
_register("dppo_kl", dppo_kl_bounds, dppo_loss, (_KL_RADIUS, *_DPPO_SIDES, _KL_SOLVER), dppo_metrics)
# SPO and DRPO (docs/policy-losses.md, "SPO and DRPO"): threshold 12.5 as the DRPO authors trained both.
for _name, _bounds in (("spo", spo_bounds), ("drpo", drpo_bounds)):
    _epsilon = Hyperparameter("epsilon", f"{_name}_epsilon", _THRESHOLD)
    _register(_name, _bounds, spo_loss, (_epsilon,), _spo_metrics(_name))
# prime-rl's IPO (docs/band-and-dppo.md), with the defaults of its `IPOLossConfig`.
_IPO = (
    Hyperparameter("mask_low", "ipo_mask_low", check_radius_value),
    Hyperparameter("mask_high", "ipo_mask_high", check_radius_value),
    Hyperparameter("kl_tau", "ipo_kl_tau", _SCALE),
    Hyperparameter("adv_tau", "ipo_adv_tau", _SCALE),
)
_register("ipo", ipo_bounds, ipo_loss, _IPO, ipo_metrics)

# -- Masking trust regions (docs/policy-losses.md, "Masking trust regions"): CPPO, TRM and M2PO see the sequence or
# micro-batch through the loss API's `mask` (`(B, T)`, 1 on the tokens that count: the others take no part, so padding
# changes nothing); IcePop is per token. Each is a keep rule (`*_keep`, bool, no gradient) and a loss: kept tokens
# have their base term, masked ones 0 (never `inf * 0`), in TRL's normaliser still.


def _kept(keep: Tensor, term: Tensor) -> Tensor:
    return torch.where(keep, term, torch.zeros_like(term))


def _kept_surrogate(keep, log_ratio, advantages, lower, upper, delta):
    """TRM, M2PO and IcePop: the clipped surrogate (TRL's `epsilon`, `epsilon_high`, `delta`) on the kept tokens, 0
    on the masked ones."""
    return _kept(keep, clipped_surrogate_loss(log_ratio, advantages, lower, upper, delta=delta))


def _masked_share(prefix: str, keep: Tensor, mask: Tensor) -> Counts:
    counted = mask > 0
    return {f"{prefix}/masked_share": ((~keep & counted).sum(), counted.sum())}


# -- CPPO (arXiv 2606.10968): a per-sequence budget on the position-weighted running Binary-TV divergence ----------


@torch.no_grad()
def cppo_keep(log_ratio, advantages, mask, old_logps, *, radius=0.2, w_min=0.8, rate_min=0.02) -> Tensor:
    """CPPO's keep rule. Per token `D_t = |q_t - p_t|` (new and old probability of the sampled token) and
    `w_t = 1 - (1 - w_min) (t - 1) / max(T - 1, 1)` over the sequence's `T` counted tokens; with the exclusive running
    sums `S_t = sum_{j<t} w_j D_j`, `W_t = sum_{j<t} w_j` and the rate `b = clamp(q90(D), rate_min, 2 rate_min)` (the
    sequence's 0.9 quantile, linear interpolation) a token is kept when its update moves against its advantage
    (`A (r - 1) <= 0`) or `w_t D_t <= min(radius, radius + b W_t - S_t)`."""
    log_ratio, old_logps = upcast(log_ratio.detach()), upcast(old_logps.detach())
    divergence = (torch.exp(old_logps + log_ratio) - torch.exp(old_logps)).abs()
    # r - 1 as the authors round it (exp, then - 1): a log-ratio one ulp above 0 counts as r = 1, toward p
    toward = advantages * (torch.exp(_clamped(log_ratio)) - 1) <= 0
    counted = mask > 0
    length = counted.sum(-1, keepdim=True)
    position = counted.cumsum(-1) - 1  # 0-based among the counted tokens
    weight = torch.where(counted, 1 - (1 - w_min) * position / (length - 1).clamp(min=1), 0.0)
    z = torch.where(counted, weight * divergence, 0.0)
    spent, allowance = z.cumsum(-1) - z, weight.cumsum(-1) - weight
    ordered = torch.where(counted, divergence, torch.inf).sort(-1).values  # counted values first, ascending
    at = 0.9 * (length - 1).clamp(min=0)
    low, high = at.floor().long(), at.ceil().long()
    below, above = ordered.gather(-1, low), ordered.gather(-1, high)
    quantile = below + (above - below).nan_to_num(0.0) * (at - low)
    rate = quantile.clamp(rate_min, 2 * rate_min)
    budget = torch.clamp(radius + rate * allowance - spent, max=radius)
    return toward | (z <= budget)


def cppo_bounds(old_logps: Tensor, *, radius=0.2):
    """DPPO-TV's region of `radius` (CPPO's per-token cap at `w = 1`): the bounds the clip-ratio metrics count."""
    return dppo_tv_bounds(old_logps, radius=radius)


def cppo_loss(log_ratio, advantages, lower, upper, *, mask, old_logps, radius=0.2, w_min=0.8, rate_min=0.02):
    """CPPO: `-A r` on the kept tokens (`cppo_keep`), `r` the plain ratio (`log r` clamped to [-20, 20]); gradient
    weight `r` on a kept token, 0 on a masked one. `lower`/`upper` (DPPO-TV's region of `radius`) only feed the
    clip-ratio metrics."""
    keep = cppo_keep(log_ratio, advantages, mask, old_logps, radius=radius, w_min=w_min, rate_min=rate_min)
    return _kept(keep, -advantages * torch.exp(_clamped(log_ratio)))


def cppo_metrics(log_ratio, advantages, lower, upper, mask, *, old_logps, **options):
    """`cppo/masked_share`: counted tokens the budget masks (the authors' `masked_fraction`)."""
    keep = cppo_keep(log_ratio, advantages, mask, old_logps, **options)
    return _masked_share("cppo", keep, mask)


# -- TRM (arXiv 2512.23075): drop a sequence whose max or mean token divergence exceeds a threshold ----------------


@torch.no_grad()
def trm_keep(log_ratio, mask, *, divergence="k3", reduce="mean", threshold=0.01) -> Tensor:
    """TRM's keep rule, as verl's `rollout_rs` computes it on `x = clamp(log r, -20, 20)`: `k3 = r - 1 - x` or
    `k1 = -x` per counted token, reduced over the sequence by its `max` or masked `mean` (0 for a sequence without
    counted tokens); the sequence is kept when the statistic is at most `threshold` (`|statistic|` for `k1`: the
    symmetric band of verl's `seq_mean_k1` with threshold `e^threshold`; `max` of `k1` is `max |x|`)."""
    x = _clamped(log_ratio.detach())
    token = torch.expm1(x) - x if divergence == "k3" else -x
    counted = mask > 0
    if reduce == "max":
        magnitude = token if divergence == "k3" else token.abs()
        statistic = torch.where(counted, magnitude, -torch.inf).amax(-1, keepdim=True).clamp(min=0.0)
    else:
        total = torch.where(counted, token, 0.0).sum(-1, keepdim=True)
        statistic = total / (counted.sum(-1, keepdim=True) + 1e-8)
    statistic = statistic if divergence == "k3" else statistic.abs()
    return (statistic <= threshold).expand_as(x)


def trm_loss(log_ratio, advantages, lower, upper, *, mask, divergence="k3", reduce="mean", threshold=0.01, delta=None):
    keep = trm_keep(log_ratio, mask, divergence=divergence, reduce=reduce, threshold=threshold)
    return _kept_surrogate(keep, log_ratio, advantages, lower, upper, delta)


def trm_metrics(log_ratio, advantages, lower, upper, mask, *, delta=None, **options):
    """`trm/masked_share` (counted tokens) and `trm/sequence_masked_share` (sequences with counted tokens)."""
    keep = trm_keep(log_ratio, mask, **options)
    sequences = mask.any(-1)
    return {
        **_masked_share("trm", keep, mask),
        "trm/sequence_masked_share": ((~keep[:, 0] & sequences).sum(), sequences.sum()),
    }


# -- M2PO (arXiv 2510.01161, as AReaL computes it): mask the largest (log r)^2 until their mean is below a threshold -


@torch.no_grad()
def m2po_keep(log_ratio, mask, *, threshold=0.04) -> Tensor:
    """M2PO's keep rule over the counted tokens of this call (one micro-batch of one process, as in AReaL): sorted by
    `(log r)^2` from the largest, the fewest largest are masked such that the mean of the rest is `< threshold`; if
    no such count exists, only the smallest is kept. Ties are broken by position (a stable sort)."""
    m2 = upcast(log_ratio.detach()).square()
    counted = (mask > 0).reshape(-1)
    values = torch.where(counted, m2.reshape(-1), -torch.inf)
    order = values.argsort(descending=True, stable=True)
    ordered = values[order][: int(counted.sum())]
    if ordered.numel() == 0:
        return mask > 0
    rest_sum = ordered.flip(0).cumsum(0).flip(0)  # sum of the values from rank i on
    rest_mean = rest_sum / torch.arange(ordered.numel(), 0, -1, device=ordered.device)
    below = rest_mean < threshold
    dropped = below.int().argmax() if bool(below.any()) else ordered.numel() - 1
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return (rank >= dropped).reshape(mask.shape) & (mask > 0)


def m2po_loss(log_ratio, advantages, lower, upper, *, mask, threshold=0.04, delta=None):
    keep = m2po_keep(log_ratio, mask, threshold=threshold)
    return _kept_surrogate(keep, log_ratio, advantages, lower, upper, delta)


def m2po_metrics(log_ratio, advantages, lower, upper, mask, *, threshold=0.04, delta=None):
    """`m2po/masked_share` and the second moments `m2po/m2` (counted tokens) and `m2po/m2_kept` (kept ones)."""
    keep = m2po_keep(log_ratio, mask, threshold=threshold)
    m2, counted = upcast(log_ratio.detach()).square(), mask > 0
    return {
        **_masked_share("m2po", keep, mask),
        "m2po/m2": (torch.where(counted, m2, 0.0).sum(), counted.sum()),
        "m2po/m2_kept": (torch.where(keep, m2, 0.0).sum(), keep.sum()),
    }


# -- IcePop (arXiv 2510.18855): mask a token whose ratio leaves [low, high] ----------------------------------------


def icepop_keep(log_ratio, *, low=0.5, high=5.0) -> Tensor:
    """Kept: `low <= r <= high`, `r` the loss's ratio (the engine/trainer mismatch with the engine's old log-probs)."""
    ratio = safe_exp(log_ratio.detach())
    return (ratio >= low) & (ratio <= high)


def icepop_loss(log_ratio, advantages, lower, upper, *, low=0.5, high=5.0, delta=None):
    keep = icepop_keep(log_ratio, low=low, high=high)
    return _kept_surrogate(keep, log_ratio, advantages, lower, upper, delta)


def icepop_metrics(log_ratio, advantages, lower, upper, mask, *, low=0.5, high=5.0, delta=None):
    """`icepop/masked_share`, split into `icepop/masked_low_share` (`r < low`) and `_high_share` (`r > high`)."""
    ratio, counted = safe_exp(log_ratio.detach()), mask > 0
    low_side, high_side = (ratio < low) & counted, (ratio > high) & counted
    return {
        "icepop/masked_share": ((low_side | high_side).sum(), counted.sum()),
        "icepop/masked_low_share": (low_side.sum(), counted.sum()),
        "icepop/masked_high_share": (high_side.sum(), counted.sum()),
    }


def _check_icepop(kwargs, labels, device) -> None:
    if not kwargs["low"] < kwargs["high"]:
        raise ValueError(f"{labels['low']} ({kwargs['low']!r}) must be below {labels['high']} ({kwargs['high']!r}).")


_UNIT, _POSITIVE = Number(low=0, low_open=True, high=1), Number(low=0, low_open=True, high=FLOAT32_MAX)
_CPPO = (
    Hyperparameter("radius", "cppo_delta", _UNIT),
    Hyperparameter("w_min", "cppo_w_min", _UNIT),
    Hyperparameter("rate_min", "cppo_delta_b", Number(low=0, high=1)),
)
_TRM = (
    Hyperparameter("divergence", "trm_divergence", Choice(("k1", "k3"))),
    Hyperparameter("reduce", "trm_reduce", Choice(("max", "mean"))),
    Hyperparameter("threshold", "trm_threshold", _POSITIVE),
)
_ICEPOP = (
    *_CLIP,
    Hyperparameter("low", "icepop_low", _UNIT),
    Hyperparameter("high", "icepop_high", Number(low=1, high=FLOAT32_MAX)),
    DUAL_CLIP,
)
_register("cppo", cppo_bounds, cppo_loss, _CPPO, cppo_metrics)
# TRM, M2PO and IcePop keep TRL's clipped surrogate, dual clip included, on the tokens they keep.
_register("trm", clip_bounds, trm_loss, (*_CLIP, *_TRM, DUAL_CLIP), trm_metrics)
_M2PO = Hyperparameter("threshold", "m2po_threshold", _POSITIVE)
_register("m2po", clip_bounds, m2po_loss, (*_CLIP, _M2PO, DUAL_CLIP), m2po_metrics)
_register("icepop", clip_bounds, icepop_loss, _ICEPOP, icepop_metrics, check=_check_icepop)

#: The built-in policy losses (`registered_policy_losses()` also lists any registered later).
POLICY_LOSSES = tuple(registered_policy_losses())

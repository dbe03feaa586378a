"""The torch solvers of the Band bounds (docs/band-operator.md, "Solver and error bound"): safeguarded Newton for KL,
closed forms for TV and chi-square, bisection for any other generator. All are vectorised with a fixed number of
steps (no host synchronisation); `trl_bandpo.core.band.band_bounds` is the entry point.

`radius` is a float or a tensor of radii, validated (finite, > 0) and in the compute dtype: for `kl_bounds` 0-d or
shaped like `logp`, for the others any shape that broadcasts with `logp`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Union

import torch

#: A trust-region radius: one float for every token, or a tensor of per-token radii.
Radius = Union[float, torch.Tensor]

# Newton steps of the KL solver per compute dtype (the Triton kernels use the same): 3 meet the float32 accuracy
# target, 4 give float64 full precision (docs/band-operator.md, "Solver and error bound"; tests/test_band.py).
KL_NEWTON_STEPS = {torch.float32: 3, torch.float64: 4}
# Bisection steps of the generic solver: 2^-60 of the bracket, far below float32 resolution and at the float64 target.
_BISECTION_STEPS = 60


def closed_form_bounds(logp: torch.Tensor, half_width: torch.Tensor):
    """`[1 - w, 1 + w]` clamped to the simplex `[0, 1/p]` (TV: `w = delta/p`; chi2: `w = sqrt(delta (1-p)/p)`)."""
    lower = (1 - half_width).clamp(min=0.0)
    upper = torch.minimum(1 + half_width, torch.exp(-logp))
    return lower, upper


def chi2_half_width(logp: torch.Tensor, radius: Radius) -> torch.Tensor:
    """chi-square's `w = sqrt(delta (1 - p) / p)`, exactly 0 at `p = 1` whatever `delta`: a radius that overflows
    the compute dtype (inf) would otherwise make `inf * 0 = NaN` there. NaN `logp` stays NaN."""
    one_minus_p = -torch.expm1(logp)
    width = torch.sqrt(radius * one_minus_p / torch.exp(logp))
    return torch.where(one_minus_p == 0, torch.zeros_like(width), width)


# On CPU the solver runs over chunks of this many tokens: its ~40 elementwise passes then stay in cache instead of
# streaming 8 MB temporaries through memory (measured 30% faster at 1M tokens, benchmarks/RESULTS.md).
_CPU_CHUNK = 1 << 16


def kl_bounds(logp: torch.Tensor, radius: Radius):
    """KL bounds as flat tensors (see `_kl_bounds_flat`), in cache-sized chunks on CPU; `radius` a float, or a
    tensor 0-d or shaped like `logp`."""
    logp = logp.reshape(-1)
    per_element = torch.is_tensor(radius) and radius.dim() > 0
    if per_element:
        radius = radius.reshape(-1)
    if logp.device.type != "cpu" or logp.numel() <= _CPU_CHUNK:
        return _kl_bounds_flat(logp, radius)
    lower, upper = torch.empty_like(logp), torch.empty_like(logp)
    for start in range(0, logp.numel(), _CPU_CHUNK):  # a loop over sizes, not data: no synchronisation
        chunk = slice(start, start + _CPU_CHUNK)
        lower[chunk], upper[chunk] = _kl_bounds_flat(logp[chunk], radius[chunk] if per_element else radius)
    return lower, upper


def _kl_bounds_flat(logp: torch.Tensor, radius: Radius):
    """KL bounds for 1-D `logp`. Binary KL is symmetric under (p, q) -> (1-p, 1-q), so both roots are lower roots
    (docs/band-operator.md, "Both roots are lower roots"): `lower = exp(t(p))` and
    `upper = (1 - (1-p) exp(t(1-p))) / p`, `t(s)` from `_solve_binary_kl_lower`."""
    p = torch.exp(logp)
    one_minus_p = torch.expm1(logp).neg_()
    if torch.is_tensor(radius) and radius.dim() > 0:  # per element: both halves of the batch take the same radii
        radius = torch.cat([radius, radius])
    # Both sides in one batch: half the kernel launches of two separate solves.
    t_low, t_high = _solve_binary_kl_lower(torch.cat([p, one_minus_p]), torch.cat([one_minus_p, p]), radius).chunk(2)
    # upper = q/p with 1 - q = (1 - p) e^t, i.e. 1 - expm1(t) (1-p)/p: one rounding of a term that grows as the
    # radius does (monotone), no cancellation when q is small; 0 * inf (p = 0, t = 0) is no widening
    widening = torch.expm1(t_high).mul_(one_minus_p / p).neg_()
    upper = torch.where(t_high == 0, 1.0, widening.add_(1.0))
    return t_low.exp(), upper


def _solve_binary_kl_lower(s: torch.Tensor, one_minus_s: torch.Tensor, radius: Radius) -> torch.Tensor:
    """`t = log(q/s) < 0` solving `KL(Bern(s) || Bern(q)) = radius` with `q < s`, for 1-D tensors `s`, `1 - s` and
    `radius` a float, a 0-d tensor or a 1-D tensor like `s` (every step below is elementwise in it).

    With `u = s expm1(t)` (so `1 - q = (1 - s) - u`) the equation reads, free of cancellation beyond the inherent
    first-order one,
        h(t) = -s t - (1 - s) log1p(-u / (1 - s)) - radius = 0,
        h'(t) = u / (1 - q) < 0,    h''(t) = s (1 - s) e^t / (1 - q)^2 > 0.
    `h` is convex and decreasing, and lies above its asymptote `-s t + (1-s) log(1-s) - radius` (t -> -inf), whose
    root `t_floor` is therefore left of the root. Right of the root lies any `t` where `KL <= radius`: `t = -radius`
    (`KL <= -s t <= -t`), and `log(1 - w/2)` with `w = sqrt(2 radius (1-s)/s)` clamped at 1 (while `q >= s/2`,
    `KL <= chi2 <= 2 s (1 - e^t)^2 / (1-s)`), the lesser of which is `t_ceil`. Newton on a convex decreasing function
    lands left of the root after any step and then increases monotonically to it; clamping every iterate to
    `[t_floor, t_ceil]` keeps a poor first step bounded and away from `t = 0`, where `h' = 0`. Start: the chi-square
    estimate `log(1 - w)`, clamped to that bracket.

    Where `radius <= 3/8 eps min(s, 1-s)` (eps of the dtype) that estimate is the root to rounding (its error, of the
    order `radius / p` in the bound, is below eps/4), while `h`'s cancellation would make Newton's steps noise of
    the order eps: there the estimate is returned, so the bounds tighten to 1 as the radius shrinks, never widen.
    """
    tiny = torch.finfo(s.dtype).tiny
    # Padding-safe: s = 0 gives t = -huge (q = 0), 1 - s = 0 gives t = -radius (q = e^-radius), as the limits do.
    s = s.clamp(min=tiny)
    one_minus_s = one_minus_s.clamp(min=tiny)
    neg_inv_one_minus_s = one_minus_s.reciprocal().neg_()
    # Floored at 2 log(tiny): any t below underflows exp(t) to 0 anyway, and -inf would turn Newton into NaN.
    # (log1p(-s) for small s, where 1 - s rounds to 1)
    log_one_minus_s = torch.where(s < 0.5, torch.log1p(-s), one_minus_s.log())
    t_floor = (one_minus_s * log_one_minus_s).sub_(radius).div_(s).clamp_(min=2 * math.log(tiny))
    w = (2 * radius * one_minus_s / s).sqrt_().clamp_(max=1.0)
    t_ceil = (w * -0.5).log1p_()
    # a float radius as a 0-d tensor, as a tensor one is taken: both give the same bits
    t_ceil = torch.minimum(t_ceil, radius.neg() if torch.is_tensor(radius) else t_ceil.new_tensor(-radius))
    # log1p, not log(1 - w): below radius ~1e-15 (float32) 1 - w rounds to 1
    estimate = torch.clamp(w.neg().log1p_(), t_floor, t_ceil)
    t = estimate.clone()
    steps = KL_NEWTON_STEPS[s.dtype]
    for _ in range(steps):  # fixed count: no host synchronisation
        u = torch.expm1(t).mul_(s)
        minus_h = torch.addcmul(s * t, one_minus_s, (u * neg_inv_one_minus_s).log1p_()).add_(radius)
        # t_next = t - h / h' = t + minus_h * (1 - q) / u
        t = torch.clamp(t.addcmul_(minus_h, (one_minus_s - u).div_(u)), t_floor, t_ceil)
    exact = torch.minimum(s, one_minus_s).mul_(0.375 * torch.finfo(s.dtype).eps) >= radius
    return torch.where(exact, estimate, t)


def generic_bounds(logp: torch.Tensor, radius: Radius, f: Callable[[torch.Tensor], torch.Tensor]):
    """Bounds for any convex generator by bracketed bisection (float64): on `r` in `[0, 1]` for the lower root and
    on `log r` in `[0, -log p]` for the upper one, so both reach the accuracy target in `_BISECTION_STEPS` steps.
    A tensor `radius` broadcasts with `logp` (e.g. `(B, 1)` against `(B, T)`); so do the outputs."""
    tiny = torch.finfo(logp.dtype).tiny
    underflow = logp < math.log(tiny)  # p = 0 to float precision: upper is the cap, as 1/p overflows for KL/TV/chi2
    logp = logp.clamp(min=math.log(tiny))
    p = torch.exp(logp)
    one_minus_p = -torch.expm1(logp)

    # At p = 1 the second term of g is (1 - r) * lim_{u->inf} f(u)/u, not 0 (KL: lower -> e^-delta, BandPO Appendix
    # 9.4): flooring 1 - p at `tiny` evaluates that limit instead of 0 * f(0/0).
    one_minus_p = one_minus_p.clamp(min=tiny)

    def excess(r: torch.Tensor) -> torch.Tensor:  # g_f(p, r) - radius
        c = ((1 - r * p) / one_minus_p).clamp(min=0.0)
        return p * f(r) + one_minus_p * f(c) - radius

    # Lower root on r in [0, 1]: g is decreasing there; saturated (lower = 0) if g(p, 0) <= radius.
    lo, hi = torch.zeros_like(p), torch.ones_like(p)
    for _ in range(_BISECTION_STEPS):
        mid = 0.5 * (lo + hi)
        above = excess(mid) > 0  # NaN (e.g. f(0) undefined) counts as outside the region
        lo, hi = torch.where(above, mid, lo), torch.where(above, hi, mid)
    lower = torch.where(excess(torch.zeros_like(p)) <= 0, torch.zeros_like(p), hi)

    # Upper root on log r in [0, -log p]: g is increasing there; saturated (upper = 1/p) if g(p, 1/p) <= radius.
    lo, hi = torch.zeros_like(p), -logp
    for _ in range(_BISECTION_STEPS):
        mid = 0.5 * (lo + hi)
        above = excess(torch.exp(mid)) > 0
        lo, hi = torch.where(above, lo, mid), torch.where(above, mid, hi)
    upper = torch.where(excess(torch.exp(-logp)) <= 0, torch.exp(-logp), torch.exp(lo))
    upper = upper.masked_fill(underflow, math.inf)
    nan = torch.isnan(logp)  # comparisons above treat NaN as False; propagate it explicitly
    return lower.masked_fill(nan, math.nan), upper.masked_fill(nan, math.nan)

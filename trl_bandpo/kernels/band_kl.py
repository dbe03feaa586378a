"""Fused Triton kernel for the KL Band bounds: the algorithm of the torch solver (`core.band_solvers.kl_bounds`) in
one pass over `old_logps`, then the `upper_max` cap and the `relax` union (docs/band-operator.md). fp16 / bf16 / fp32
input is solved and written in fp32, fp64 in fp64. A radius tensor is checked, rounded and clamped per element in the
kernel, as the torch solver does, so nothing is read on the host. The launcher is the custom op
`torch.ops.trl_bandpo.band_bounds_kl`, usable inside `torch.compile` graphs and CUDA-graph captures.

Under `TRITON_INTERPRET=1` (set before import) the kernel runs on CPU through Triton's interpreter, which has no
libdevice: `expm1` / `log1p` are built from `exp` / `log` with Kahan's compensations. On GPU all four are libdevice's
(`tl.exp` / `tl.log` in fp32 may lower to the approximate `ex2` / `lg2`, too coarse for the float32 target at small p).
"""

import math
from typing import Optional, Union

import torch
import triton
import triton.language as tl

from ..core.band import KL_SATURATION_RADIUS, MIN_RADIUS, compute_dtype_for
from ..core.band_solvers import KL_NEWTON_STEPS
from .runtime import interpreter_enabled

#: Whether `triton.jit` builds interpreted kernels in this process (decided when this module is imported).
INTERPRETED = interpreter_enabled()

if INTERPRETED:

    @triton.jit
    def _exp(x):
        return tl.exp(x)

    @triton.jit
    def _log(x):
        return tl.log(x)

    @triton.jit
    def _sqrt(x):
        return tl.sqrt(x)

    @triton.jit
    def _expm1(x):
        # Kahan: (e^x - 1) * x / log(e^x) cancels the rounding error of e^x to first order. Here x <= 0 always.
        u = tl.exp(x)
        um1 = u - 1.0
        exact = (u == 1.0) | (um1 == -1.0)
        ratio = x / tl.log(tl.where(exact, 0.5, u))
        return tl.where(u == 1.0, x, tl.where(um1 == -1.0, um1, um1 * ratio))

    @triton.jit
    def _log1p(x):
        # Kahan: log(1 + x) * x / ((1 + x) - 1) for small x; plain log(1 + x) when there is nothing to cancel.
        w = 1.0 + x
        wm1 = tl.where(w == 1.0, 1.0, w - 1.0)
        small = x * (tl.log(w) / wm1)
        return tl.where(w == 1.0, x, tl.where(x > 1.0, tl.log(w), small))

else:
    from triton.language.extra import libdevice

    @triton.jit
    def _exp(x):
        return libdevice.exp(x)

    @triton.jit
    def _log(x):
        return libdevice.log(x)

    @triton.jit
    def _sqrt(x):
        return libdevice.sqrt(x)

    @triton.jit
    def _expm1(x):
        return libdevice.expm1(x)

    @triton.jit
    def _log1p(x):
        return libdevice.log1p(x)


@triton.jit
def _kl_lower_root_log_ratio(s, one_minus_s, radius, tiny, t_min, eps, NEWTON_STEPS: tl.constexpr):
    """`t = log(q/s)` with `KL(Bern(s) || Bern(q)) = radius`, `q < s`, step for step as
    `band_solvers._solve_binary_kl_lower` (its docstring derives the bracket and the exact-estimate condition).

    Newton on the convex, decreasing h(t) = -s t - (1-s) log1p(-s expm1(t) / (1-s)) - radius from the chi-square
    estimate, every iterate clamped to [t_floor, t_ceil]. `t_floor` is floored at `t_min = 2 log(tiny)`: any t below
    underflows exp(t) to 0 anyway, and `radius / tiny` can overflow to -inf, which turns Newton into NaN.
    """
    s = tl.maximum(s, tiny)
    one_minus_s = tl.maximum(one_minus_s, tiny)
    neg_inv_one_minus_s = -1.0 / one_minus_s
    log_one_minus_s = tl.where(s < 0.5, _log1p(-s), _log(one_minus_s))
    t_floor = tl.maximum((one_minus_s * log_one_minus_s - radius) / s, t_min)
    w = tl.minimum(_sqrt(2.0 * radius * one_minus_s / s), 1.0)
    t_ceil = tl.minimum(_log1p(-0.5 * w), -radius)
    estimate = tl.minimum(tl.maximum(_log1p(-w), t_floor), t_ceil)
    t = estimate
    for _ in tl.static_range(NEWTON_STEPS):
        u = _expm1(t) * s
        minus_h = s * t + one_minus_s * _log1p(u * neg_inv_one_minus_s) + radius
        # t - h / h' with h' = u / (1 - q) and 1 - q = (1 - s) - u
        t = t + minus_h * ((one_minus_s - u) / u)
        t = tl.minimum(tl.maximum(t, t_floor), t_ceil)
    return tl.where(tl.minimum(s, one_minus_s) * (0.375 * eps) >= radius, estimate, t)


@triton.jit
def _band_kl_kernel(
    logp_ptr,
    radius_ptr,
    lower_ptr,
    upper_ptr,
    n_elements,
    radius_arg: tl.float64,
    cap_arg: tl.float64,
    relax_lower_arg: tl.float64,
    relax_upper_arg: tl.float64,
    nan_arg: tl.float64,
    COMPUTE_DTYPE: tl.constexpr,
    TINY: tl.constexpr,
    T_MIN: tl.constexpr,
    EPS: tl.constexpr,
    HAS_RELAX: tl.constexpr,
    RADIUS_MODE: tl.constexpr,
    KL_SATURATION: tl.constexpr,
    MIN_RADIUS: tl.constexpr,
    NEWTON_STEPS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """Reads `logp[n]` (any float dtype) and, for RADIUS_MODE 1 / 2, `radius[0]` / `radius[n]` (any float dtype;
    mode 0 takes `radius_arg`), writes `lower[n]`, `upper[n]` in COMPUTE_DTYPE (fp32 or fp64)."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(logp_ptr + offsets, mask=mask, other=0.0).to(COMPUTE_DTYPE)
    if RADIUS_MODE == 0:
        # Scalars arrive as fp64 and are rounded once to the compute dtype, as torch does with Python scalars.
        radius = tl.full([BLOCK_SIZE], radius_arg, COMPUTE_DTYPE)  # checked on the host by `band_bounds`
    else:
        # Stride 0 (one radius) or 1 (per element). Checked before rounding, as the torch solver does: NaN, +-inf
        # and <= 0 fail (inf - inf is NaN); a failing radius is solved as 1 and its bounds are NaN below.
        raw = tl.load(radius_ptr + offsets * (RADIUS_MODE - 1), mask=mask, other=1.0)
        radius_ok = (raw > 0) & (raw - raw == 0)
        radius = tl.minimum(tl.maximum(tl.where(radius_ok, raw.to(COMPUTE_DTYPE), 1.0), MIN_RADIUS), KL_SATURATION)
    tiny = tl.full([BLOCK_SIZE], TINY, COMPUTE_DTYPE)
    t_min = tl.full([BLOCK_SIZE], T_MIN, COMPUTE_DTYPE)

    is_nan = x != x
    logp = tl.minimum(x, 0.0)  # positive log-probabilities count as p = 1
    # Both roots are "lower roots" by the symmetry (p, q) -> (1-p, 1-q) of the binary KL (docs/band-operator.md).
    p = _exp(logp)
    one_minus_p = -_expm1(logp)
    eps = tl.full([BLOCK_SIZE], EPS, COMPUTE_DTYPE)
    t_low = _kl_lower_root_log_ratio(p, one_minus_p, radius, tiny, t_min, eps, NEWTON_STEPS)
    t_high = _kl_lower_root_log_ratio(one_minus_p, p, radius, tiny, t_min, eps, NEWTON_STEPS)
    lower = _exp(t_low)
    # upper = q / p = 1 - expm1(t_high) (1-p)/p, as the torch solver writes it
    upper = tl.where(t_high == 0, 1.0, 1.0 - _expm1(t_high) * (one_minus_p / p))
    upper = tl.minimum(upper, tl.full([BLOCK_SIZE], cap_arg, COMPUTE_DTYPE))
    if HAS_RELAX:
        lower = tl.minimum(lower, tl.full([BLOCK_SIZE], relax_lower_arg, COMPUTE_DTYPE))
        upper = tl.maximum(upper, tl.full([BLOCK_SIZE], relax_upper_arg, COMPUTE_DTYPE))
    lower = tl.where(is_nan, x, lower)
    upper = tl.where(is_nan, x, upper)
    if RADIUS_MODE != 0:
        nan = tl.full([BLOCK_SIZE], nan_arg, COMPUTE_DTYPE)
        lower = tl.where(radius_ok, lower, nan)
        upper = tl.where(radius_ok, upper, nan)
    tl.store(lower_ptr + offsets, lower, mask=mask)
    tl.store(upper_ptr + offsets, upper, mask=mask)


def _launch_config(compute_dtype: torch.dtype) -> tuple[int, int]:
    """`(BLOCK_SIZE, num_warps)`: 4 fp32 / 2 fp64 elements per thread (the kernel is bound by its arithmetic)."""
    return (1024, 8) if compute_dtype == torch.float32 else (512, 8)


def _supported(x: torch.Tensor) -> torch.Tensor:
    """`x` in a dtype the kernel reads (fp16, bf16, fp32, fp64), else in fp32 (e.g. float8: exactly representable)."""
    return x if x.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64) else x.float()


def _band_kl_launch(
    old_logps, radius, upper_max=None, relax_low=None, relax_high=None, block_size=None, num_warps=None
):
    """Launch `_band_kl_kernel` on `old_logps` (any shape) with one float `radius` or a tensor of radii that
    broadcasts to it (same device); returns `(lower, upper)` shaped like `old_logps`."""
    if not old_logps.is_cuda and not INTERPRETED:
        raise ValueError(
            f"the Triton Band kernel needs a CUDA tensor, got one on {old_logps.device.type} "
            "(set TRITON_INTERPRET=1 before importing trl_bandpo.kernels.band_kl to run it on CPU)."
        )
    old_logps = _supported(old_logps)
    compute_dtype = compute_dtype_for(old_logps.dtype)
    x = old_logps.detach().reshape(-1).contiguous()
    lower = torch.empty(old_logps.shape, dtype=compute_dtype, device=old_logps.device)
    upper = torch.empty(old_logps.shape, dtype=compute_dtype, device=old_logps.device)
    n = x.numel()
    if n == 0:
        return lower, upper
    radius_mode, radius_arg, radii = 0, math.nan, x  # mode 0 never reads `radii`: any pointer does
    if torch.is_tensor(radius):
        radii = _supported(radius.detach())
        # one radius: stride 0, nothing materialised; several: broadcast and flattened in the order of `x`
        radius_mode = 1 if radii.numel() == 1 else 2
        radii = radii.reshape(1) if radius_mode == 1 else radii.expand(old_logps.shape).reshape(-1).contiguous()
    else:
        radius_arg = float(radius)
    default_block, default_warps = _launch_config(compute_dtype)
    block_size = block_size or default_block
    finfo = torch.finfo(compute_dtype)
    has_relax = relax_low is not None or relax_high is not None
    grid = (triton.cdiv(n, block_size),)
    if x.is_cuda:
        guard = torch.cuda.device(x.device)
    else:  # the interpreter: numpy warns about the infinities the kernel handles (exp(-logp) at p = 0, ...)
        import numpy as np

        guard = np.errstate(all="ignore")
    with guard:
        _band_kl_kernel[grid](
            x,
            radii,
            lower,
            upper,
            n,
            radius_arg,
            finfo.max if upper_max is None else float(upper_max),
            1.0 - float(relax_low or 0.0),
            1.0 + float(relax_high or 0.0),
            math.nan,
            COMPUTE_DTYPE=tl.float64 if compute_dtype == torch.float64 else tl.float32,
            TINY=finfo.tiny,
            T_MIN=2 * math.log(finfo.tiny),
            EPS=finfo.eps,
            HAS_RELAX=has_relax,
            RADIUS_MODE=radius_mode,
            KL_SATURATION=KL_SATURATION_RADIUS,
            MIN_RADIUS=MIN_RADIUS,
            NEWTON_STEPS=KL_NEWTON_STEPS[compute_dtype],
            BLOCK_SIZE=block_size,
            num_warps=num_warps or default_warps,
        )
    return lower, upper


@torch.library.custom_op("trl_bandpo::band_bounds_kl", mutates_args=())
def _band_bounds_kl_op(
    old_logps: torch.Tensor,
    radius: float,
    upper_max: Optional[float],
    relax_low: Optional[float],
    relax_high: Optional[float],
    radius_tensor: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`radius_tensor` (per-token radii broadcastable to `old_logps`, same device), when given, replaces `radius`."""
    return _band_kl_launch(
        old_logps, radius if radius_tensor is None else radius_tensor, upper_max, relax_low, relax_high
    )


@_band_bounds_kl_op.register_fake
def _(old_logps, radius, upper_max, relax_low, relax_high, radius_tensor=None):
    dtype = compute_dtype_for(old_logps.dtype)
    return old_logps.new_empty(old_logps.shape, dtype=dtype), old_logps.new_empty(old_logps.shape, dtype=dtype)


def band_bounds_kl_triton(
    old_logps: torch.Tensor,
    radius: Union[float, torch.Tensor],
    *,
    upper_max: Optional[float] = None,
    relax: Optional[tuple[float, float]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL Band bounds `(lower, upper)` from the fused kernel, with the arguments and results of
    `band_bounds(old_logps, radius, "kl", upper_max=..., relax=...)`, whose checks they have passed (this is its
    registered solver); `old_logps` on CUDA (or CPU under the interpreter)."""
    relax_low, relax_high = (None, None) if relax is None else (float(relax[0]), float(relax[1]))
    upper_max = None if upper_max is None else float(upper_max)
    radii = radius.detach() if torch.is_tensor(radius) else None
    value = 1.0 if radii is not None else float(radius)  # the op's float radius, unused when `radii` is given
    return torch.ops.trl_bandpo.band_bounds_kl(old_logps.detach(), value, upper_max, relax_low, relax_high, radii)

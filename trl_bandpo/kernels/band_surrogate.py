"""Fused Band-clipped surrogate: KL Band bounds, ratio, PPO's pessimistic clipped loss and its gradient, one kernel.

Per token the kernel reads `logps` (current), `old_logps` and the advantage `A` (per row, `(B, 1)`, or per token,
`(B, T)`), solves the KL Band bounds `[lower, upper]` from `old_logps` with the device functions of `band_kl.py`
(the same device code as `band_bounds(..., solver="triton")`, so the same bounds), and writes

    loss = -min(min(r, delta) * A, clamp(r, lower, min(upper, upper_max)) * A),    r = exp(logps - old_logps)

(TRL's formula, `trl_bandpo.losses.clipped_surrogate_loss`; `delta`: optional dual clip) and `d loss / d logps`.
The gradient is the one torch autograd gives `clipped_surrogate_loss`, including its rules at ties:
`torch.minimum(a, b)` sends half the gradient to each side when `a == b` (and all of it to both when one is NaN);
`torch.clamp(r, lower, upper)` passes it where `lower <= r <= upper` (bounds included), `clamp(r, max=delta)` where
`r <= delta`. So `d loss / d logps = -(w_a A [r <= delta] + w_b A [lower <= r <= upper]) * r` with
`w_a = 0 if a > b, 1/2 if a == b, else 1` and `w_b` likewise with `a < b` (`a`, `b` the two products): `-A r` where
the unclipped term is the active minimum and not dual-clipped, 0 where clipped, and the same NaN / infinity
results as autograd for NaN or infinite inputs (the masks apply after the product with `A`, as in autograd).
`band_clipped_surrogate_triton` wraps the kernel in a `torch.autograd.Function` whose backward is
`grad_output * saved gradient` (one elementwise product; the per-token gradient is written by the forward, and only
when `logps` requires it). `old_logps` and `advantages` get no gradient (as in `policy_loss`, where `old_logps` is
detached; advantages requiring grad are refused).

Precision and dtypes. The kernel computes in float32 for fp16 / bf16 / fp32 inputs, in float64 when the loss dtype
is float64 (then also the bounds, where `band_bounds` would solve them in float32 for float32 `old_logps`).
The loss is returned in the dtype `clipped_surrogate_loss` returns for the same inputs, the promoted dtype of
`logps`, `old_logps` and `advantages` but float32 at least (all bf16: float32); the gradient of `logps` has `logps`'
dtype. Like `clipped_surrogate_loss`, the ratio is capped at `exp(RATIO_LOG_MAX)`, the largest finite value with a
margin, and the gradient is 0 above the cap. The kernel thus matches `band_bounds` + `clipped_surrogate_loss` to
rounding (the bounds agree with the torch solver to ~4e-6 relative in float32; `exp` may differ by an ulp); for
half-precision inputs the torch path (`policy_loss`) forms `logps - old_logps` in half precision before upcasting,
the kernel in float32, so a token within that rounding of a bound may fall on the other side of it.

`band_clipped_surrogate(..., solver="auto" | "torch" | "triton")` is the entry point: "torch" is the reference path
`band_bounds(..., solver="torch")` + `clipped_surrogate_loss` (what `policy_loss("band", ...)` computes), "triton" the
fused kernel (CUDA tensors; CPU tensors under `TRITON_INTERPRET=1`), "auto" the kernel where it can run.
The launcher is the opaque custom op `torch.ops.trl_bandpo.band_clipped_surrogate_kl` (with a fake implementation),
so the function can sit in `torch.compile` graphs and CUDA-graph captures; nothing syncs with the host.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..band import band_bounds, validate_band_args
from ..band_solvers import KL_NEWTON_STEPS
from ..losses import clipped_surrogate_loss
from ..numerics import RATIO_LOG_MAX
from .runtime import triton_unavailable_reason

__all__ = ["band_clipped_surrogate", "band_clipped_surrogate_triton", "surrogate_dtypes"]

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path works without Triton
    triton = None


def surrogate_dtypes(
    logps_dtype: torch.dtype, old_logps_dtype: torch.dtype, advantages_dtype: torch.dtype
) -> tuple[torch.dtype, torch.dtype]:
    """`(loss dtype, compute dtype)`: the loss dtype is what `clipped_surrogate_loss` returns for these input
    dtypes (the promoted dtype, float32 at least: half-precision ratios overflow); the kernel computes in float64 if
    that is float64, else in float32."""
    out = torch.promote_types(torch.promote_types(logps_dtype, old_logps_dtype), advantages_dtype)
    out = torch.promote_types(out, torch.float32) if out.is_floating_point else torch.get_default_dtype()
    return out, (torch.float64 if out == torch.float64 else torch.float32)


def _validate_delta(delta) -> None:
    if delta is not None and (
        isinstance(delta, bool) or not isinstance(delta, (int, float)) or not math.isfinite(delta) or delta <= 0
    ):
        raise ValueError(f"delta (dual clip) must be None or a finite number > 0, got {delta!r}.")


def _check_inputs(logps, old_logps, advantages) -> None:
    for name, t in (("logps", logps), ("old_logps", old_logps)):
        if not torch.is_tensor(t) or not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {type(t).__name__}.")
    if not torch.is_tensor(advantages):
        raise ValueError(f"advantages must be a tensor, got {type(advantages).__name__}.")
    try:
        shape = torch.broadcast_shapes(logps.shape, old_logps.shape, advantages.shape)
    except RuntimeError as err:
        raise ValueError(
            f"logps {tuple(logps.shape)}, old_logps {tuple(old_logps.shape)} and advantages "
            f"{tuple(advantages.shape)} do not broadcast: {err}"
        ) from err
    if shape != logps.shape:
        raise ValueError(
            f"old_logps {tuple(old_logps.shape)} and advantages {tuple(advantages.shape)} must broadcast to the shape "
            f"of logps {tuple(logps.shape)} (e.g. advantages (B, 1) or (B, T) for logps (B, T))."
        )


# ----------------------------------------------------------------------------------------------------------------
# The kernel


if triton is not None:
    from .band_kl import INTERPRETED, _exp, _kl_band_bounds

    @triton.jit
    def _band_surrogate_kernel(
        logp_ptr,
        old_ptr,
        adv_ptr,
        loss_ptr,
        grad_ptr,
        n_elements,
        row_len,
        radius_arg: tl.float64,
        cap_arg: tl.float64,
        delta_arg: tl.float64,
        COMPUTE_DTYPE: tl.constexpr,
        TINY: tl.constexpr,
        T_MIN: tl.constexpr,
        LOG_RATIO_MAX: tl.constexpr,
        HAS_DELTA: tl.constexpr,
        ADV_PER_ROW: tl.constexpr,
        WRITE_GRAD: tl.constexpr,
        NEWTON_STEPS: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
    ):
        """Reads `logp[n]`, `old[n]`, `adv[n]` (or `adv[n // row_len]`); writes `loss[n]` (its pointer's dtype) and,
        if WRITE_GRAD, `grad[n] = d loss / d logp` in COMPUTE_DTYPE."""
        offsets = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        mask = offsets < n_elements
        x = tl.load(logp_ptr + offsets, mask=mask, other=0.0).to(COMPUTE_DTYPE)
        old = tl.load(old_ptr + offsets, mask=mask, other=0.0).to(COMPUTE_DTYPE)
        if ADV_PER_ROW:
            adv = tl.load(adv_ptr + offsets // row_len, mask=mask, other=0.0).to(COMPUTE_DTYPE)
        else:
            adv = tl.load(adv_ptr + offsets, mask=mask, other=0.0).to(COMPUTE_DTYPE)
        # Scalars arrive as fp64 and are rounded once to the compute dtype, as torch does with Python scalars.
        radius = tl.full([BLOCK_SIZE], radius_arg, COMPUTE_DTYPE)
        tiny = tl.full([BLOCK_SIZE], TINY, COMPUTE_DTYPE)
        t_min = tl.full([BLOCK_SIZE], T_MIN, COMPUTE_DTYPE)

        # Band bounds exactly as `_band_kl_kernel` computes them (no relax): NaN old log-prob -> NaN bounds.
        lower, upper = _kl_band_bounds(tl.minimum(old, 0.0), radius, tiny, t_min, NEWTON_STEPS)
        upper = tl.minimum(upper, tl.full([BLOCK_SIZE], cap_arg, COMPUTE_DTYPE))
        old_is_nan = old != old
        lower = tl.where(old_is_nan, old, lower)
        upper = tl.where(old_is_nan, old, upper)

        # The ratio is capped as `losses.safe_exp` caps it (torch.clamp(log_r, max=LOG_RATIO_MAX): NaN stays NaN).
        log_r = x - old
        ratio = _exp(tl.minimum(log_r, LOG_RATIO_MAX, propagate_nan=tl.PropagateNan.ALL))
        # torch.clamp(ratio, lower, upper): NaN in the input or in a bound propagates.
        clipped = tl.maximum(ratio, lower, propagate_nan=tl.PropagateNan.ALL)
        clipped = tl.minimum(clipped, upper, propagate_nan=tl.PropagateNan.ALL)
        if HAS_DELTA:
            delta = tl.full([BLOCK_SIZE], delta_arg, COMPUTE_DTYPE)
            unclipped = tl.minimum(ratio, delta, propagate_nan=tl.PropagateNan.ALL)  # torch.clamp(ratio, max=delta)
        else:
            unclipped = ratio
        a = unclipped * adv
        b = clipped * adv
        loss = -tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)
        tl.store(loss_ptr + offsets, loss.to(loss_ptr.dtype.element_ty), mask=mask)

        if WRITE_GRAD:
            # torch.minimum's backward: each side gets the gradient unless it is the larger one, half of it at a tie.
            tie = a == b
            w_a = tl.where(a > b, 0.0, tl.where(tie, 0.5, 1.0))
            w_b = tl.where(a < b, 0.0, tl.where(tie, 0.5, 1.0))
            # torch.clamp's backward passes the gradient where the bounds hold, bounds included (False for NaN).
            # The products' backward (* A) comes before the clamps' masks, as in autograd: a masked side adds 0 even
            # for an infinite A, an unmasked side with weight 0 adds 0 * A (NaN for an infinite A). Then exp's (* r).
            w_a = w_a.to(COMPUTE_DTYPE)
            w_b = w_b.to(COMPUTE_DTYPE)
            term_a = -w_a * adv
            if HAS_DELTA:
                term_a = tl.where(ratio <= delta, term_a, 0.0)
            term_b = tl.where((ratio >= lower) & (ratio <= upper), -w_b * adv, 0.0)
            grad = (term_a + term_b) * ratio
            # torch.clamp's backward: 0 above the cap and for NaN, whatever flows in
            grad = tl.where(log_r <= LOG_RATIO_MAX, grad, 0.0)
            tl.store(grad_ptr + offsets, grad, mask=mask)

else:  # pragma: no cover - exercised only without Triton
    INTERPRETED = False


def _launch_config(compute_dtype: torch.dtype) -> tuple[int, int]:
    """`(BLOCK_SIZE, num_warps)`, as for the bounds kernel (compute-bound on the two Newton solves)."""
    return (1024, 8) if compute_dtype == torch.float32 else (512, 8)


def _band_surrogate_launch(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    radius: float,
    upper_max: Optional[float],
    delta: Optional[float],
    need_grad: bool,
    block_size: Optional[int] = None,
    num_warps: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernel. `old_logps` has the shape of `logps`; `advantages` too, or `logps.shape[:-1] + (1,)` (one
    per row). Returns `(loss, grad)`: `loss` shaped like `logps`, `grad` too if `need_grad`, else empty."""
    if triton is None:
        raise ValueError("the fused Band surrogate needs Triton (pip install 'trl-bandpo[triton]').")
    if not logps.is_cuda and not INTERPRETED:
        raise ValueError(
            f"the fused Band surrogate kernel needs CUDA tensors, got {logps.device.type} "
            "(set TRITON_INTERPRET=1 before importing trl_bandpo.kernels to run it on CPU)."
        )
    shape = logps.shape
    out_dtype, compute_dtype = surrogate_dtypes(logps.dtype, old_logps.dtype, advantages.dtype)
    per_row = logps.dim() > 0 and advantages.shape != shape
    if per_row and advantages.shape != shape[:-1] + (1,) or old_logps.shape != shape:
        raise ValueError(
            f"old_logps {tuple(old_logps.shape)} must have the shape of logps {tuple(shape)}, and advantages "
            f"{tuple(advantages.shape)} that shape or {tuple(shape[:-1] + (1,))} (one per row)."
        )
    loss = torch.empty(shape, dtype=out_dtype, device=logps.device)
    grad = torch.empty(shape if need_grad else (0,), dtype=compute_dtype, device=logps.device)
    n = logps.numel()
    if n == 0:
        return loss, grad
    x = logps.detach().reshape(-1).contiguous()
    old = old_logps.detach().reshape(-1).contiguous()
    adv = advantages.detach().reshape(-1).contiguous()
    default_block, default_warps = _launch_config(compute_dtype)
    block_size = block_size or default_block
    finfo = torch.finfo(compute_dtype)
    grid = (triton.cdiv(n, block_size),)
    if x.is_cuda:
        guard = torch.cuda.device(x.device)
    else:  # the interpreter: numpy warns about the infinities the kernel handles
        import numpy as np

        guard = np.errstate(all="ignore")
    with guard:
        _band_surrogate_kernel[grid](
            x,
            old,
            adv,
            loss,
            grad if need_grad else loss,  # not written without WRITE_GRAD
            n,
            shape[-1] if per_row else 1,
            float(radius),
            finfo.max if upper_max is None else float(upper_max),
            0.0 if delta is None else float(delta),
            COMPUTE_DTYPE=tl.float64 if compute_dtype == torch.float64 else tl.float32,
            TINY=finfo.tiny,
            T_MIN=2 * math.log(finfo.tiny),
            LOG_RATIO_MAX=RATIO_LOG_MAX[compute_dtype],
            HAS_DELTA=delta is not None,
            ADV_PER_ROW=per_row,
            WRITE_GRAD=need_grad,
            NEWTON_STEPS=KL_NEWTON_STEPS[compute_dtype],
            BLOCK_SIZE=block_size,
            num_warps=num_warps or default_warps,
        )
    return loss, grad


@torch.library.custom_op("trl_bandpo::band_clipped_surrogate_kl", mutates_args=())
def _band_surrogate_op(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    radius: float,
    upper_max: Optional[float],
    delta: Optional[float],
    need_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _band_surrogate_launch(logps, old_logps, advantages, radius, upper_max, delta, need_grad)


@_band_surrogate_op.register_fake
def _(logps, old_logps, advantages, radius, upper_max, delta, need_grad):
    out_dtype, compute_dtype = surrogate_dtypes(logps.dtype, old_logps.dtype, advantages.dtype)
    grad_shape = logps.shape if need_grad else (0,)
    return logps.new_empty(logps.shape, dtype=out_dtype), logps.new_empty(grad_shape, dtype=compute_dtype)


class _BandClippedSurrogate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logps, old_logps, advantages, radius, upper_max, delta, need_grad):
        loss, grad = torch.ops.trl_bandpo.band_clipped_surrogate_kl(
            logps, old_logps, advantages, radius, upper_max, delta, need_grad
        )
        ctx.save_for_backward(grad)
        ctx.logps_dtype = logps.dtype
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        (grad,) = ctx.saved_tensors
        return (grad_output * grad).to(ctx.logps_dtype), None, None, None, None, None, None


def _prepare(logps, old_logps, advantages):
    """`old_logps` expanded to `logps`' shape; `advantages` as one value per row (`shape[:-1] + (1,)`) when constant
    along the last dim, else expanded to `logps`' shape; non-float advantages in the loss dtype."""
    shape = logps.shape
    old_logps = old_logps.detach().expand(shape)
    advantages = advantages.detach()
    if not advantages.is_floating_point():
        advantages = advantages.to(surrogate_dtypes(logps.dtype, old_logps.dtype, advantages.dtype)[0])
    if logps.dim() > 0 and (advantages.dim() == 0 or advantages.shape[-1] == 1):
        advantages = advantages.expand(shape[:-1] + (1,))
    else:
        advantages = advantages.expand(shape)
    return old_logps, advantages


def band_clipped_surrogate_triton(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    radius: float,
    *,
    upper_max: Optional[float] = None,
    delta: Optional[float] = None,
) -> torch.Tensor:
    """Per-token Band-clipped surrogate loss from the fused kernel (differentiable in `logps`).

    Args:
        logps (`torch.Tensor`, e.g. `(B, T)`, fp16/bf16/fp32/fp64, CUDA): current log-probs (with gradient).
        old_logps (`torch.Tensor` broadcastable to `logps`): old log-probs; the KL Band bounds come from them.
        advantages (`torch.Tensor` broadcastable to `logps`, e.g. `(B, 1)` or `(B, T)`): not differentiated.
        radius (`float`): the KL radius `delta > 0` of the Band.
        upper_max (`float`, *optional*): cap on the upper bound (the BandPO authors trained with 10).
        delta (`float`, *optional*): TRL's dual-clip constant (the unclipped ratio is capped at `delta`).

    Returns:
        `torch.Tensor` shaped like `logps`: `-min(min(r, delta) A, clamp(r, lower, upper) A)`, in the dtype
        `clipped_surrogate_loss` returns (see the module docstring), with torch autograd's gradient.
    """
    validate_band_args(radius, "kl", "triton", upper_max, None)
    _validate_delta(delta)
    _check_inputs(logps, old_logps, advantages)
    if advantages.requires_grad:
        raise ValueError(
            "the fused Band surrogate does not differentiate the advantages: detach them, or use solver='torch'."
        )
    old_logps, advantages = _prepare(logps, old_logps, advantages)
    return _BandClippedSurrogate.apply(
        logps,
        old_logps,
        advantages,
        float(radius),
        None if upper_max is None else float(upper_max),
        None if delta is None else float(delta),
        logps.requires_grad and torch.is_grad_enabled(),  # write the per-token gradient only when it can be used
    )


def band_clipped_surrogate(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    radius: float = 0.05,
    *,
    upper_max: Optional[float] = None,
    delta: Optional[float] = None,
    solver: str = "auto",
) -> torch.Tensor:
    """Per-token BandPO loss (KL Band, PPO clipped surrogate), fused or as the torch reference.

    `solver="torch"`: `band_bounds(old_logps, radius, solver="torch", upper_max=upper_max)` then
    `clipped_surrogate_loss(logps - old_logps.detach(), advantages, lower, upper, delta=delta)`.
    `solver="triton"`: `band_clipped_surrogate_triton` (raises where it cannot run). `solver="auto"`: the kernel
    where it can run (CUDA tensors, or the interpreter; advantages not requiring grad), else the torch path.
    Arguments as in `band_clipped_surrogate_triton`.
    """
    validate_band_args(radius, "kl", solver, upper_max, None)
    _validate_delta(delta)
    _check_inputs(logps, old_logps, advantages)
    if solver != "torch":
        reason = triton_unavailable_reason(logps)
        if reason is None and advantages.requires_grad:
            reason = "the advantages require grad, which the fused kernel does not compute"
        if reason is None:
            return band_clipped_surrogate_triton(
                logps, old_logps, advantages, radius, upper_max=upper_max, delta=delta
            )
        if solver == "triton":
            raise ValueError(f"solver='triton' cannot run here: {reason}. Use solver='torch' or 'auto'.")
    lower, upper = band_bounds(old_logps, radius, solver="torch", upper_max=upper_max)
    return clipped_surrogate_loss(logps - old_logps.detach(), advantages, lower, upper, delta=delta)

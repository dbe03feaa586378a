"""Numerics of importance ratios: computed in float32 or wider and capped below overflow (docs/policy-losses.md,
"Inputs and numerics").
"""

from __future__ import annotations

import math

import torch

__all__ = ["RATIO_LOG_MAX", "safe_exp", "upcast"]

# Largest exponent whose exp is finite, with a margin for rounding, per compute dtype: ratios and weights are capped
# there, so no token's ratio is inf and no `inf * 0` turns a loss or a gradient into NaN (docs/policy-losses.md,
# "Numerics").
RATIO_LOG_MAX = {dtype: math.log(torch.finfo(dtype).max) - 0.01 for dtype in (torch.float32, torch.float64)}


def upcast(x: torch.Tensor) -> torch.Tensor:
    """`x` in float32 or wider: a half-precision ratio overflows at log-ratio 11.1 (fp16) and rounds the bounds."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def safe_exp(log_x: torch.Tensor) -> torch.Tensor:
    """`exp(log_x)` in float32 or wider, capped at the dtype's largest finite value (differentiable below the cap)."""
    log_x = upcast(log_x)
    return torch.exp(log_x.clamp(max=RATIO_LOG_MAX[log_x.dtype]))

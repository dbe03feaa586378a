"""Triton kernels for the Band operator, loaded on first use (importing this package needs neither torch nor
Triton). The KL kernel (`band_kl.py`) registers here as `band_bounds(..., solver="triton")`, which "auto" uses where
it can run and where it passed its one-time check (`self_check.py`)."""

from __future__ import annotations

from ..core.kernel_registry import KernelSolver, register_kernel_solver
from .runtime import interpreter_enabled, triton_unavailable_reason

__all__ = ["band_bounds_kl_triton", "interpreter_enabled", "triton_unavailable_reason"]


def band_bounds_kl_triton(old_logps, radius, *, upper_max=None, relax=None):
    """KL Band bounds computed by the fused Triton kernel (see `band_kl.py`); `radius` is a float or a tensor of
    per-token radii broadcastable to `old_logps` (docs/band-operator.md, "Per-token radius")."""
    from .band_kl import band_bounds_kl_triton as launch

    return launch(old_logps, radius, upper_max=upper_max, relax=relax)


def _kl_kernel_unavailable_reason(tensor):
    from .self_check import kl_kernel_unavailable_reason

    return kl_kernel_unavailable_reason(tensor)


register_kernel_solver(
    "triton",
    KernelSolver(divergences=("kl",), unavailable_reason=_kl_kernel_unavailable_reason, bounds=band_bounds_kl_triton),
)

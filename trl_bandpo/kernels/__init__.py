"""Triton kernels for the Band operator. Importing this package needs neither torch nor Triton: the kernels load on
first use.

- `band_kl.py`: the KL Band bounds (`band_bounds(..., solver="triton")`), registered here with
  `trl_bandpo.core.kernel_registry`, so `band_bounds(..., solver="auto")` uses it wherever it can run.
- `runtime.py`: where kernels can run (CUDA, or CPU under `TRITON_INTERPRET=1`).
- `self_check.py`: the KL kernel's one-time check against the torch solver on each device, and the
  `TRL_BANDPO_KL_KERNEL` switch (auto / trust / off): where the kernel disagrees, "auto" uses the torch solver.
"""

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

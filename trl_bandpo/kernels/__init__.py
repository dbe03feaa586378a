"""Triton kernels. Importing this package never requires Triton; the kernels load lazily on first use.

The kernels run on CUDA tensors. With `TRITON_INTERPRET=1` in the environment (before the first kernel use), they
also run on CPU tensors through Triton's interpreter (slow: for tests), and `band_bounds(..., solver="auto")` then
picks them on CPU too.
"""

from __future__ import annotations

import os

import torch


def _interpreter_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on", "y")


def triton_unavailable_reason(tensor: torch.Tensor) -> str | None:
    """Why the Triton kernels cannot run on `tensor` (`None` if they can)."""
    if not tensor.is_cuda and not _interpreter_requested():
        return f"the input is on {tensor.device.type}, the Triton kernel needs a CUDA tensor"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed (pip install 'trl-bandpo[triton]')"
    return None


def band_bounds_kl_triton(old_logps, radius, *, upper_max=None, relax=None):
    """KL Band bounds computed by the fused Triton kernel (see `band_kl.py`)."""
    from .band_kl import band_bounds_kl_triton as _impl

    return _impl(old_logps, radius, upper_max=upper_max, relax=relax)

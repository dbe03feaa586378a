"""Triton kernels. Importing this package never requires Triton; the kernels load lazily on first use."""

from __future__ import annotations

import torch


def triton_unavailable_reason(tensor: torch.Tensor) -> str | None:
    """Why the Triton kernels cannot run on `tensor` (`None` if they can)."""
    if not tensor.is_cuda:
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

"""Where the Triton kernels can run: the interpreter switch and the availability check, defined once.

Kernels run on CUDA tensors. With `TRITON_INTERPRET=1` in the environment before Triton is imported they also run
on CPU tensors through Triton's interpreter (slow: for tests).
"""

from __future__ import annotations

import os

__all__ = ["interpreter_enabled", "triton_unavailable_reason"]

_TRUE_STRINGS = ("1", "true", "yes", "on", "y")


def interpreter_enabled() -> bool:
    """Whether Triton kernels are interpreted on the CPU in this process: `TRITON_INTERPRET` is set (the variable
    Triton itself reads). Plain environment access, so `torch.compile` can trace a caller without a graph break."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in _TRUE_STRINGS


def triton_unavailable_reason(tensor) -> str | None:
    """Why the Triton kernels cannot run on `tensor` (`None` if they can)."""
    if not tensor.is_cuda and not interpreter_enabled():
        return f"the input is on {tensor.device.type}, the Triton kernel needs a CUDA tensor"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed (install the repository with its `triton` extra: pip install -e '.[triton]')"
    return None

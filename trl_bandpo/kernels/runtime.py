"""Where the Triton kernels can run: on CUDA tensors, and on CPU tensors through Triton's interpreter when
`TRITON_INTERPRET=1` is set before Triton is imported (slow: for tests)."""

from __future__ import annotations

import os

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

"""Checks of `trl_bandpo.evaluation.evaluate`'s settings, run before any model or data is loaded.

Every message names the setting, the value and what is allowed.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .summary import _check_count, default_ks

__all__ = ["DTYPES", "check_device", "check_output_dir", "check_sampling", "check_top_k"]

# Model dtypes that both backends accept ("auto": the checkpoint's own).
DTYPES = ("auto", "bfloat16", "float16", "float32")


def check_output_dir(output_dir: str | os.PathLike) -> Path:
    """Create `output_dir` if needed and make sure a file can be written in it; ValueError saying why not."""
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{str(out)!r} is an existing file, not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as err:
        raise ValueError(f"{str(out)!r} is not a writable folder ({err.strerror or err})") from None
    return out


def check_device(device: str) -> str:
    """`device` if torch parses it and such a device is present here ("cpu", "cuda", "cuda:1", "mps", ...)."""
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{device!r} is not a torch device (such as 'cpu', 'cuda', 'cuda:1' or 'mps')") from None
    if parsed.type == "cpu":
        return device
    module = getattr(torch, parsed.type, None)
    is_available = getattr(module, "is_available", None) or getattr(
        getattr(torch.backends, parsed.type, None), "is_available", None
    )
    if is_available is None or not is_available():
        raise ValueError(f"{device!r}: no {parsed.type} device is available here")
    count = getattr(module, "device_count", None)
    if parsed.index is not None and count is not None and parsed.index >= count():
        raise ValueError(f"{device!r}: there are only {count()} {parsed.type} device(s) (indices from 0)")
    return device


def check_top_k(top_k: Any, argument: str = "top_k") -> int | None:
    """`top_k` when it is None (no top-k) or an integer >= 1; ValueError naming `argument` otherwise."""
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"{argument} must be None (no top-k) or an integer >= 1, got {top_k!r}")
    return top_k


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


def check_sampling(
    num_samples: Any,
    ks: Sequence[int] | None,
    max_new_tokens: Any,
    temperature: Any,
    top_p: Any,
    top_k: Any = None,
    names: dict[str, str] | None = None,
) -> tuple[int, ...]:
    """Check the sampling settings shared by `evaluate` and the validation callback; return the sorted ks.

    Args:
        names: how messages name each setting (default: its argument name), e.g. ``{"num_samples":
            "val_num_samples"}`` for a recipe's fields.
    """
    names = names or {}

    def name(key: str) -> str:
        return names.get(key, key)

    _check_count(name("num_samples"), num_samples, 1)
    _check_count(name("max_new_tokens"), max_new_tokens, 1)
    if not _is_number(temperature) or not 0 <= temperature < math.inf:
        raise ValueError(f"{name('temperature')} must be a finite number >= 0, got {temperature!r}")
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise ValueError(f"{name('top_p')} must be in (0, 1], got {top_p!r}")
    check_top_k(top_k, name("top_k"))
    if ks is not None and (isinstance(ks, (str, bytes)) or not isinstance(ks, Sequence)):
        raise ValueError(f"{name('ks')} must be None or a list of integers, got {ks!r}")
    ks = tuple(default_ks(num_samples) if ks is None else sorted(set(ks)))
    if not ks:
        raise ValueError(f"{name('ks')} must hold at least one k")
    for k in ks:
        _check_count("k", k, 1)
        if k > num_samples:
            raise ValueError(f"every k in {name('ks')} must be <= {name('num_samples')}={num_samples}, got k={k}")
    return ks


def check_settings(
    num_samples, ks, max_new_tokens, temperature, top_p, top_k, seed, dtype, batch_size, timeout_s, device,
    max_problems,
) -> tuple[int, ...]:  # fmt: skip
    """`evaluate`'s settings; the sorted pass@k values, or ValueError naming the first bad setting."""
    _check_count("num_samples", num_samples, 1)
    if max_problems is not None:
        _check_count("max_problems", max_problems, 1)
    _check_count("max_new_tokens", max_new_tokens, 1)
    _check_count("batch_size", batch_size, 1)
    if timeout_s is not None and (not _is_number(timeout_s) or not 0 < timeout_s < math.inf):
        raise ValueError(f"timeout_s must be None or a finite number of seconds > 0, got {timeout_s!r}")
    if _check_count("seed", seed, 0) >= 2**32:
        raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if device is not None:
        try:
            check_device(device)
        except ValueError as err:
            raise ValueError(f"device: {err}") from None
    return check_sampling(num_samples, ks, max_new_tokens, temperature, top_p, top_k)

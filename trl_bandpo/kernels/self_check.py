"""The Triton KL kernel's one-time check against the torch solver (docs/band-operator.md, "Solvers and speed").

Before `band_bounds(..., solver="auto" | "triton")` first runs the kernel on a device, in each process, the kernel
and the torch solver (`trl_bandpo.core.band_solvers.kl_bounds`) solve a small fixed grid: float32 and float64
log-probs, p log-spaced over [1e-6, 0.5] and 1 - p over [1e-6, 0.5], at the float radii `CHECK_RADII` and at the radii
`PER_TOKEN_RADII` given as one per-token radius tensor. They must agree within the accuracy targets of
docs/band-operator.md: `TOLERANCE[dtype] * max(1, r)`. If they do not, or the kernel fails to run, a
`KernelCheckWarning` names the worst point (dtype, bound, p, radius, both values) and the kernel is not used on
that device for the rest of the process: "auto" solves with torch, an explicit "triton" is an error.

Only the check reads values on the host; afterwards the verdict is a dictionary lookup, so later calls never
synchronise. Under `torch.compile` the check runs when the call is traced and its verdict is a constant of the
graph; inside a CUDA-graph capture an unchecked device cannot be checked (a host read breaks the capture), so
that call does not use the kernel: call `band_bounds` once before capturing.

`TRL_BANDPO_KL_KERNEL` (`ENV_VAR`) chooses: `auto` (the default) checks, `trust` uses the kernel unchecked, `off`
never uses it.
"""

from __future__ import annotations

import math
import os
import threading
import warnings
from dataclasses import dataclass

import torch

from ..core.band_solvers import kl_bounds
from .runtime import triton_unavailable_reason

__all__ = [
    "CHECK_RADII",
    "ENV_VAR",
    "MODES",
    "PER_TOKEN_RADII",
    "TOLERANCE",
    "CheckResult",
    "KernelCheckWarning",
    "compare_kernel_with_torch",
    "kernel_check_verdicts",
    "kl_kernel_mode",
    "kl_kernel_unavailable_reason",
]

ENV_VAR = "TRL_BANDPO_KL_KERNEL"
#: auto: check once per device, then use the kernel if it agrees; trust: use it unchecked; off: never use it.
MODES = ("auto", "trust", "off")
#: The accuracy targets of docs/band-operator.md ("Solver and error bound"), relative to max(1, r), by dtype.
TOLERANCE = {torch.float32: 2e-6, torch.float64: 1e-6}
CHECK_RADII = (1e-3, 0.05, 1.0)
PER_TOKEN_RADII = (1e-3, 0.01, 0.05, 0.3, 1.0, 3.0)  # cycled over the grid in one call
_GRID_POINTS = 24  # per half of the grid: p in [1e-6, 0.5], 1 - p in [1e-6, 0.5]


class KernelCheckWarning(RuntimeWarning):
    """The Triton KL kernel failed its one-time check on a device: the torch solver is used there instead."""


def kl_kernel_mode() -> str:
    """`TRL_BANDPO_KL_KERNEL`, checked: one of `MODES` (unset or empty: "auto"). Plain environment access, so
    `torch.compile` traces it."""
    raw = os.environ.get(ENV_VAR, "")
    mode = raw.strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(
            f"{ENV_VAR}={raw!r} is not one of {list(MODES)}: auto (check the Triton KL kernel against the torch "
            "solver once per device, the default), trust (use it unchecked), off (never use it)."
        )
    return mode


@dataclass(frozen=True)
class CheckResult:
    """The largest kernel-vs-torch difference of the check, relative to its tolerance (`ok`: within it)."""

    dtype: torch.dtype
    side: str  # "lower" or "upper"
    p: float
    radius: float
    kernel: float
    torch: float
    difference: float  # |kernel - torch| / max(1, |torch|); inf where the kernel gave NaN
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.difference <= self.tolerance

    def describe(self) -> str:
        name = str(self.dtype).removeprefix("torch.")
        return (
            f"{name} {self.side} bound at p = {self.p:.6g}, radius = {self.radius:.6g}: kernel {self.kernel!r}, "
            f"torch solver {self.torch!r} (difference {self.difference:.3g} x max(1, r), tolerance {self.tolerance:g})"
        )


def _grid(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Sorted log p: p log-spaced over [1e-6, 0.5], then 1 - p log-spaced over [1e-6, 0.5]."""
    small = torch.logspace(-6, math.log10(0.5), _GRID_POINTS, dtype=torch.float64).log()
    large = torch.log1p(-torch.logspace(-6, math.log10(0.5), _GRID_POINTS, dtype=torch.float64))
    return torch.cat([small, large]).sort().values.to(dtype=dtype, device=device)


def compare_kernel_with_torch(device: torch.device | str) -> CheckResult:
    """Solve the check grid on `device` with the kernel (through its custom op and launcher) and the torch solver;
    return the worst difference relative to its tolerance. Reads the results on the host."""
    from .band_kl import band_bounds_kl_triton

    device = torch.device(device)
    worst, worst_ratio = None, -1.0
    with torch.no_grad():
        for dtype in (torch.float32, torch.float64):
            logp = _grid(dtype, device)
            cycle = torch.arange(logp.numel(), device=device) % len(PER_TOKEN_RADII)
            per_token = torch.tensor(PER_TOKEN_RADII, dtype=dtype, device=device)[cycle]
            for radius in (*CHECK_RADII, per_token):
                got = band_bounds_kl_triton(logp, radius)
                want = kl_bounds(logp, radius)
                radii = radius.double().cpu() if torch.is_tensor(radius) else torch.full(logp.shape, radius)
                for side, kernel, reference in zip(("lower", "upper"), got, want):
                    kernel, reference = kernel.double().cpu().reshape(-1), reference.double().cpu().reshape(-1)
                    difference = (kernel - reference).abs() / reference.abs().clamp(min=1.0)
                    difference = difference.nan_to_num(nan=math.inf)
                    k = int(difference.argmax())
                    ratio = float(difference[k]) / TOLERANCE[dtype]
                    if ratio > worst_ratio:
                        worst_ratio = ratio
                        worst = CheckResult(
                            dtype, side, math.exp(float(logp[k])), float(radii[k]), float(kernel[k]),
                            float(reference[k]), float(difference[k]), TOLERANCE[dtype],
                        )  # fmt: skip
    return worst


_verdicts: dict[str, str | None] = {}  # device -> None (the kernel agreed) or why it is not used there
_lock = threading.Lock()


def kernel_check_verdicts() -> dict[str, str | None]:
    """The devices checked in this process: `None` where the kernel agreed, else why it is not used there."""
    return dict(_verdicts)


def kl_kernel_unavailable_reason(tensor: torch.Tensor) -> str | None:
    """Why the Triton KL kernel is not used on `tensor`'s device (`None`: it is): it cannot run there
    (`triton_unavailable_reason`), `TRL_BANDPO_KL_KERNEL=off`, or (mode "auto") it failed its one-time check."""
    reason = triton_unavailable_reason(tensor)
    if reason is not None:
        return reason
    mode = kl_kernel_mode()
    if mode == "off":
        return f"{ENV_VAR}=off turns the Triton KL kernel off"
    if mode == "trust":
        return None
    return _verdict(str(tensor.device))


def _constant_when_traced(fn):
    """`torch._dynamo.assume_constant_result`: Dynamo runs `fn` when it traces a call and keeps the result."""
    mark = getattr(getattr(torch, "_dynamo", None), "assume_constant_result", None)
    return fn if mark is None else mark(fn)


@_constant_when_traced
def _verdict(device: str) -> str | None:
    verdict = _verdicts.get(device, _verdicts)  # `_verdicts` itself: not checked yet
    if verdict is not _verdicts:
        return verdict
    if device.startswith("cuda"):
        with torch.cuda.device(device):
            if torch.cuda.is_current_stream_capturing():
                return (
                    "the Triton KL kernel has not been checked on this device yet, and its one-time check cannot run "
                    "during CUDA-graph capture: call band_bounds once on this device before capturing"
                )
    with _lock:
        if device not in _verdicts:
            _verdicts[device] = _run_check(device)
    return _verdicts[device]


def _run_check(device: str) -> str | None:
    # The one intended host read: not an error under torch.cuda.set_sync_debug_mode("error").
    sync_mode = torch.cuda.get_sync_debug_mode() if device.startswith("cuda") else 0
    try:
        if sync_mode:
            torch.cuda.set_sync_debug_mode(0)
        result = compare_kernel_with_torch(device)
    except Exception as err:  # e.g. the kernel does not compile for this GPU: the torch solver still works
        reason = f"the Triton KL kernel failed to run in its one-time check on {device} ({type(err).__name__}: {err})"
    else:
        if result.ok:
            return None
        reason = (
            f"the Triton KL kernel disagrees with the torch solver in its one-time check on {device}: "
            f"{result.describe()}"
        )
    finally:
        if sync_mode:
            torch.cuda.set_sync_debug_mode(sync_mode)
    warnings.warn(
        f"{reason}. band_bounds(solver='auto') uses the torch solver on this device for the rest of the run "
        f"(set {ENV_VAR}=trust to use the kernel unchecked, {ENV_VAR}=off to never use it).",
        KernelCheckWarning,
        stacklevel=2,
    )
    return f"{reason} ({ENV_VAR}=trust uses it unchecked)"

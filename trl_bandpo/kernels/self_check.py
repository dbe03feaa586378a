"""The Triton KL kernel's one-time check against the torch solver (docs/band-operator.md, "Solvers and speed").

Before the kernel first runs on a device, in each process, it and the torch solver solve a small fixed grid (float32
and float64, p and 1 - p log-spaced over [1e-6, 0.5], the radii `CHECK_RADII` and a per-token tensor of
`PER_TOKEN_RADII`) and must agree within `TOLERANCE[dtype] * max(1, r)`. If not, or if the kernel fails, a
`KernelCheckWarning` names the worst point and the kernel is not used on that device: "auto" solves with torch, an
explicit "triton" is an error. Later calls only look the verdict up (no host synchronisation).
`TRL_BANDPO_KL_KERNEL` (`ENV_VAR`): `auto` (default) checks, `trust` uses the kernel unchecked, `off` never uses it.
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
    small = torch.logspace(-6, math.log10(0.5), _GRID_POINTS, dtype=torch.float64)
    return torch.cat([small.log(), torch.log1p(-small)]).sort().values.to(dtype=dtype, device=device)


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


@torch._dynamo.assume_constant_result  # under torch.compile: checked when traced, a constant of the graph
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

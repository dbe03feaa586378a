"""The registry of accelerated Band solvers: `trl_bandpo.kernels` registers its Triton kernel here and
`trl_bandpo.core.band` looks it up, so the core never imports the kernels. Free of torch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

#: Values of `band_bounds(..., solver=...)`: "auto" picks a registered kernel where it can run, else "torch".
SOLVERS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class KernelSolver:
    """An accelerated Band solver: which divergences it solves, where it can run, and the solve itself.

    Attributes:
        divergences: divergence names it solves (e.g. `("kl",)`).
        unavailable_reason: `(tensor) -> str | None`, why it cannot run on that tensor's device (`None`: it can).
        bounds: `(old_logps, radius, *, upper_max, relax) -> (lower, upper)` with the semantics of `band_bounds`;
            `radius` is a float, or a tensor that passed `check_radius_tensor` (values unchecked: the solver gives
            NaN bounds where an element is not finite > 0, and clamps KL radii at `KL_SATURATION_RADIUS`).
    """

    divergences: tuple[str, ...]
    unavailable_reason: Callable
    bounds: Callable


KERNEL_SOLVERS: dict[str, KernelSolver] = {}


def register_kernel_solver(name: str, solver: KernelSolver) -> None:
    """Make `solver` available as `band_bounds(..., solver=name)` and to `solver="auto"` (called by the kernels)."""
    if name not in SOLVERS or name in ("auto", "torch"):
        raise ValueError(f"kernel solver name must be one of {[s for s in SOLVERS if s not in ('auto', 'torch')]}")
    KERNEL_SOLVERS[name] = solver

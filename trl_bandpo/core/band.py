"""The Band operator of BandPO: per-token ratio bounds from an f-divergence trust region (docs/band-operator.md).

For a token of old probability `p`, the rest of the mass rescaled uniformly, the trust region becomes

    g_f(p, r) = p * f(r) + (1 - p) * f(c(r)) = delta,     c(r) = (1 - r * p) / (1 - p)

`lower(p)` is its root in `[0, 1)`, `upper(p)` its root in `(1, 1/p]` (saturating at `0` or `1/p`). The torch solvers
are in `band_solvers`; accelerated ones (the Triton kernel) register in `kernel_registry`, so this module never
imports the kernels. `band_bounds` checks its arguments at each call; `solve_band` is the same operator without them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .band_solvers import Radius, chi2_half_width, closed_form_bounds, generic_bounds, kl_bounds
from .checks import Choice, Number
from .kernel_registry import KERNEL_SOLVERS, SOLVERS

#: Convex generators `f(u)` (with `f(1) = 0`) of the divergences `band_bounds` knows by name (`register_divergence`
#: adds more).
GENERATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "kl": lambda u: u - 1 - torch.log(u),
    "tv": lambda u: 0.5 * torch.abs(u - 1),
    "chi2": lambda u: (u - 1) ** 2,
    "reverse_kl": lambda u: torch.xlogy(u, u) - u + 1,
    "hellinger": lambda u: (torch.sqrt(u) - 1) ** 2,
    # Jensen-Shannon: f(u) = u/2 log(2u / (1 + u)) + 1/2 log(2 / (1 + u))
    "js": lambda u: 0.5 * (torch.xlogy(u, 2 * u / (1 + u)) + torch.log(2 / (1 + u))),
}
#: The built-in divergence names.
DIVERGENCES = tuple(GENERATORS)

#: The smallest radius accepted (float32's smallest normal number, so that it is representable where the bounds are
#: solved): every bound is 1 to rounding long before it (docs/band-operator.md, "Solver and error bound"). Smaller
#: per-token radii in a tensor are solved as this one.
MIN_RADIUS = torch.finfo(torch.float32).tiny
#: Beyond this KL radius every bound is at its simplex limit to float64 precision (docs/band-operator.md, "Solver and
#: error bound"); larger radii are solved with this one, so they cannot overflow the float32 solver into NaN.
KL_SATURATION_RADIUS = 1e3


def compute_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """The dtype the bounds are solved and returned in: float64 for float64 input, float32 for every other dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def solver_unavailable_reason(solver: str, divergence: str | Callable, device: torch.device | str) -> str | None:
    """Why `band_bounds(..., solver=solver, divergence=divergence)` cannot run on `device` (`None` if it can).

    `"auto"` and `"torch"` always run; a kernel solver needs the divergence it implements and a device it supports.
    """
    if solver in ("auto", "torch"):
        return None
    kernel = KERNEL_SOLVERS.get(solver)
    if kernel is None:
        return f"no {solver!r} solver is registered (import trl_bandpo.kernels)"
    if not isinstance(divergence, str) or divergence not in kernel.divergences:
        return f"solver={solver!r} supports divergence in {list(kernel.divergences)} only, got {divergence!r}"
    return kernel.unavailable_reason(torch.empty(0, device=device))


def check_floating_tensor(value, field: str) -> torch.Tensor:
    """`value` if it is a floating-point tensor, else a `ValueError` naming `field` and what it got: the dtype of a
    tensor (``got dtype torch.int64``), the type of anything else."""
    if not torch.is_tensor(value):
        raise ValueError(f"{field} must be a floating-point tensor, got {type(value).__name__}.")
    if not value.is_floating_point():
        raise ValueError(f"{field} must be floating point, got dtype {value.dtype}.")
    return value


#: The checks of `band_bounds`' scalar arguments, which the loss registry's Band hyper-parameters reuse.
RADIUS = Number(low=MIN_RADIUS)
UPPER_MAX = Number(low=1, optional=True, finite=False)
SOLVER = Choice(SOLVERS)
RELAX_LOW, RELAX_HIGH = Number(low=0, high=1, high_open=True), Number(low=0)


def broadcasts_to(shape: torch.Size, target: torch.Size) -> bool:
    """Whether a tensor of `shape` broadcasts to `target` (without growing it)."""
    try:
        return torch.broadcast_shapes(shape, target) == target
    except RuntimeError:
        return False


def check_radius_tensor(value, like: torch.Tensor, field: str = "radius") -> torch.Tensor:
    """`value` if it is a tensor of radii `band_bounds` accepts for `old_logps = like`, else a `ValueError` naming
    `field`: floating point, not requiring grad, on `like`'s device, broadcastable to `like.shape`. Metadata only (no
    GPU synchronisation): the solvers give NaN bounds where a value is NaN, infinite or <= 0."""
    if not torch.is_tensor(value):
        raise ValueError(f"{field} must be a tensor here, got {type(value).__name__}.")
    if not value.is_floating_point():
        raise ValueError(f"{field} must be a floating-point tensor, got dtype {value.dtype}.")
    if value.requires_grad:
        raise ValueError(f"{field} must not require grad (the Band bounds are not differentiated): detach it.")
    if value.device != like.device:
        raise ValueError(f"{field} must be on the device of old_logps ({like.device}), got {value.device}.")
    if not broadcasts_to(value.shape, like.shape):
        raise ValueError(
            f"{field} of shape {tuple(value.shape)} does not broadcast to the shape {tuple(like.shape)} of old_logps."
        )
    return value


def check_divergence(value, field: str = "divergence"):
    """`value` if it names a divergence of `GENERATORS` or is a generator callable with `f(1) = 0`."""
    if callable(value):
        _check_generator(value)
        return value
    return Choice(tuple(GENERATORS))(value, field)


def register_divergence(name: str, generator: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Make a convex generator `f` (elementwise on float64 tensors, `f(1) = 0`) usable by name, e.g. as the
    config's `band_divergence`. Its bounds are solved by bisection."""
    if not isinstance(name, str) or not name.isidentifier() or name in GENERATORS:
        raise ValueError(f"divergence name must be a new identifier (not one of {list(GENERATORS)}), got {name!r}.")
    if not callable(generator):
        raise ValueError(f"generator must be callable, got {generator!r}.")
    _check_generator(generator)
    GENERATORS[name] = generator


def check_relax(value, field: str = "relax") -> tuple[float, float] | None:
    """`None` or a pair `(eps_low, eps_high)` with `0 <= eps_low < 1` and `0 <= eps_high < inf`."""
    if value is None:
        return None
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"{field} must be None or a pair (eps_low, eps_high), got {value!r}.")
    return RELAX_LOW(value[0], f"{field}[0] (eps_low)"), RELAX_HIGH(value[1], f"{field}[1] (eps_high)")


def check_band_arguments(old_logps, radius, divergence, solver="auto", upper_max=None, relax=None):
    """`band_bounds`' arguments checked (a `ValueError` naming the first bad one), returns the normalised
    `(radius, upper_max, relax)`."""
    check_floating_tensor(old_logps, "old_logps")
    radius = check_radius_tensor(radius, old_logps) if torch.is_tensor(radius) else RADIUS(radius, "radius")
    check_divergence(divergence)
    SOLVER(solver, "solver")
    if isinstance(upper_max, str):  # the words "none"/"null" are for configs and command lines, not this API
        raise ValueError(f"upper_max must be {UPPER_MAX.allowed}, got {upper_max!r}.")
    return radius, UPPER_MAX(upper_max, "upper_max"), check_relax(relax)


def _check_generator(f: Callable) -> None:
    try:
        value = f(torch.ones(1, dtype=torch.float64))
        value = float(torch.as_tensor(value, dtype=torch.float64).reshape(-1)[0])
    except Exception as err:  # the user's callable must work on float64 tensors
        raise ValueError(f"divergence callable {f!r} failed on a float64 tensor: {err}") from err
    if not abs(value) <= 1e-9:
        raise ValueError(f"divergence generator must satisfy f(1) = 0, got f(1) = {value!r} for {f!r}.")


def band_bounds(
    old_logps: torch.Tensor,
    radius: Radius = 0.05,
    divergence: str | Callable[[torch.Tensor], torch.Tensor] = "kl",
    *,
    solver: str = "auto",
    upper_max: float | None = None,
    relax: tuple[float, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ratio bounds `(lower, upper)` of the Band operator for each old log-probability.

    Args:
        old_logps (`torch.Tensor`, any shape, any float dtype): `log pi_old(a|s)` of the sampled tokens. `0` (p = 1),
            `-inf` (p = 0) and positive values (treated as p = 1) give finite bounds; NaN gives NaN.
        radius (`float` or `torch.Tensor`, defaults to `0.05`): the trust-region radius `delta`: one number, or a
            floating tensor of per-token radii broadcastable to `old_logps` on its device, not requiring grad
            (docs/band-operator.md, "Per-token radius"); an element that is NaN, infinite or <= 0 gives NaN bounds
            where it applies.
        divergence (`str` or callable, defaults to `"kl"`): one of `DIVERGENCES`, or a convex generator `f` acting
            elementwise on float64 tensors with `f(1) = 0`.
        solver (`str`, defaults to `"auto"`): `"torch"`, `"triton"` (KL on CUDA tensors only) or `"auto"` (Triton
            where it can run, torch elsewhere).
        upper_max (`float`, *optional*): cap on the upper bound (the BandPO authors trained with 10). `None` keeps
            only the simplex limit `1/p`.
        relax (`tuple[float, float]`, *optional*): `(eps_low, eps_high)` for the Relaxed Band, the union with the
            clip interval after the cap: `lower = min(lower, 1 - eps_low)`, `upper = max(upper, 1 + eps_high)`.

    Returns:
        `(lower, upper)`: two tensors shaped like `old_logps`, float32 (float64 for float64 input), with
        `0 <= lower <= 1 <= upper <= 1/p`.
    """
    radius, upper_max, relax = check_band_arguments(old_logps, radius, divergence, solver, upper_max, relax)
    return solve_band(old_logps, radius, divergence, solver=solver, upper_max=upper_max, relax=relax)


def solve_band(old_logps, radius, divergence="kl", *, solver="auto", upper_max=None, relax=None):
    """`band_bounds` without its argument checks, for arguments their owner already checked (the loss registry)."""
    per_token = torch.is_tensor(radius)
    if not per_token and divergence == "kl":
        radius = min(radius, KL_SATURATION_RADIUS)  # same bounds to float precision, no overflow in float32
    compute_dtype = compute_dtype_for(old_logps.dtype)

    if solver != "torch":
        kernel_name = "triton" if solver == "auto" else solver
        kernel = KERNEL_SOLVERS.get(kernel_name)
        reason = solver_unavailable_reason(kernel_name, divergence, old_logps.device)
        if reason is None:
            return kernel.bounds(old_logps, radius, upper_max=upper_max, relax=relax)
        if solver != "auto":
            raise ValueError(f"solver={solver!r} cannot run here: {reason}. Use solver='torch' or 'auto'.")

    with torch.no_grad():
        logp = old_logps.detach().to(compute_dtype).clamp(max=0.0)  # NaN stays NaN
        valid = None
        if per_token:
            radius, valid = _solver_radius(radius, divergence, compute_dtype, logp.shape)
        if divergence == "kl":
            lower, upper = (bound.reshape(logp.shape) for bound in kl_bounds(logp, radius))
        elif divergence == "tv":
            # `radius / exp(logp)` as torch evaluates it for a float radius, so a tensor gives the same bits
            lower, upper = closed_form_bounds(logp, torch.exp(logp).reciprocal() * radius)
        elif divergence == "chi2":
            lower, upper = closed_form_bounds(logp, chi2_half_width(logp, radius))
        else:
            f = GENERATORS[divergence] if isinstance(divergence, str) else divergence
            lower, upper = generic_bounds(logp.double(), radius, f)
            lower, upper = lower.to(compute_dtype), upper.to(compute_dtype)
        if valid is not None:  # NaN where the radius is bad; the cap and the union below keep NaN
            lower, upper = torch.where(valid, lower, math.nan), torch.where(valid, upper, math.nan)
        largest = torch.finfo(upper.dtype).max  # (a cap beyond the dtype's range caps nothing)
        upper = upper.clamp(max=largest if upper_max is None else min(float(upper_max), largest))
        if relax is not None:
            lower, upper = lower.clamp(max=1.0 - float(relax[0])), upper.clamp(min=1.0 + float(relax[1]))
        return lower, upper


def _solver_radius(radius: torch.Tensor, divergence, compute_dtype: torch.dtype, shape: torch.Size):
    """`(radius, valid)`: per-token radii as the torch solvers take them (in their dtype, at least `MIN_RADIUS`, KL
    clamped at `KL_SATURATION_RADIUS`, bad elements replaced by 1), and where they are finite and > 0."""
    valid = torch.isfinite(radius) & (radius > 0)
    dtype = compute_dtype if divergence in ("kl", "tv", "chi2") else torch.float64
    radius = torch.where(valid, radius.detach().to(dtype), 1.0).clamp(min=MIN_RADIUS)
    if divergence == "kl":
        radius = radius.clamp(max=KL_SATURATION_RADIUS)
        radius = radius.reshape(()) if radius.numel() == 1 else radius.expand(shape)  # as `kl_bounds` takes it
    return radius, valid

"""The Band operator of BandPO: per-token ratio bounds from an f-divergence trust region.

BandPO (https://arxiv.org/abs/2603.04918) replaces PPO's fixed clip interval `[1 - eps_low, 1 + eps_high]` by the
interval of ratios `r = pi / pi_old` that one token can move to while the whole distribution stays inside
`D_f(pi_old || pi) <= delta`. With the rest of the mass rescaled uniformly (the worst case), the constraint for a
token with old probability `p` becomes one scalar equation in `r` (docs/band-operator.md, "The scalar constraint"):

    g_f(p, r) = p * f(r) + (1 - p) * f(c(r)) = delta,     c(r) = (1 - r * p) / (1 - p)

`lower(p)` is its root in `[0, 1)`, `upper(p)` its root in `(1, 1/p]`; where `g_f` stays below `delta` up to the
simplex limit, the bound saturates at `0` or `1/p`.

Solvers in this module (all vectorised, none synchronises with the host):
- "kl": safeguarded Newton in log space, exact to float64 precision in `KL_NEWTON_STEPS[dtype]` steps (see
  `_solve_binary_kl_lower`);
- "tv", "chi2": closed forms;
- every other generator ("reverse_kl", "hellinger", "js" or a user callable): fixed-count bracketed bisection.

Accelerated solvers (the Triton kernel) live in `trl_bandpo.kernels`, which imports this module and registers
itself with `register_kernel_solver`; this module never imports the kernels. `band_bounds(..., solver="auto")`
uses a registered kernel wherever it can run and the torch solvers elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "DIVERGENCES",
    "GENERATORS",
    "KL_NEWTON_STEPS",
    "SOLVERS",
    "KernelSolver",
    "band_bounds",
    "check_divergence",
    "check_radius",
    "check_relax",
    "check_solver",
    "check_upper_max",
    "register_kernel_solver",
    "solver_unavailable_reason",
    "validate_band_args",
]


def _kl_generator(u: torch.Tensor) -> torch.Tensor:
    return u - 1 - torch.log(u)


def _reverse_kl_generator(u: torch.Tensor) -> torch.Tensor:
    return torch.xlogy(u, u) - u + 1


def _hellinger_generator(u: torch.Tensor) -> torch.Tensor:
    return (torch.sqrt(u) - 1) ** 2


def _js_generator(u: torch.Tensor) -> torch.Tensor:
    # f(u) = u/2 log(2u / (1 + u)) + 1/2 log(2 / (1 + u)), the Jensen-Shannon generator.
    return 0.5 * (torch.xlogy(u, 2 * u / (1 + u)) + torch.log(2 / (1 + u)))


def _tv_generator(u: torch.Tensor) -> torch.Tensor:
    return 0.5 * torch.abs(u - 1)


def _chi2_generator(u: torch.Tensor) -> torch.Tensor:
    return (u - 1) ** 2


#: Convex generators `f(u)` (with `f(1) = 0`) of the divergences `band_bounds` knows by name.
GENERATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "kl": _kl_generator,
    "tv": _tv_generator,
    "chi2": _chi2_generator,
    "reverse_kl": _reverse_kl_generator,
    "hellinger": _hellinger_generator,
    "js": _js_generator,
}
DIVERGENCES = tuple(GENERATORS)
#: Values of `band_bounds(..., solver=...)`: "auto" picks a registered kernel where it can run, else "torch".
SOLVERS = ("auto", "torch", "triton")

# Newton steps of the KL solver, per compute dtype (the Triton kernels use the same counts). From its start point
# the relative error after 3 steps was at most 1e-7 (at delta = 1e-3; 1e-8 at 0.05) and at float64 round-off after
# 4, over p in [1e-12, 1 - 1e-12] and delta in [1e-3, 5]: 3 steps meet the float32 accuracy target, 4 give float64
# full precision (docs/band-operator.md, "Solver and error bound"). tests/test_band.py checks both.
KL_NEWTON_STEPS = {torch.float32: 3, torch.float64: 4}
# Bisection steps of the generic solver: 2^-60 of the bracket, far below float32 resolution and at the float64 target.
_BISECTION_STEPS = 60


def compute_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """The dtype the bounds are solved and returned in: float64 for float64 input, float32 for every other dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------------------------------------------
# Accelerated solvers, registered by `trl_bandpo.kernels` (dependency inversion: this module never imports them)
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelSolver:
    """An accelerated Band solver: which divergences it solves, where it can run, and the solve itself.

    Attributes:
        divergences: divergence names it solves (e.g. `("kl",)`).
        unavailable_reason: `(tensor) -> str | None`, why it cannot run on that tensor's device (`None`: it can).
        bounds: `(old_logps, radius, *, upper_max, relax) -> (lower, upper)` with the semantics of `band_bounds`.
    """

    divergences: tuple[str, ...]
    unavailable_reason: Callable[[torch.Tensor], str | None]
    bounds: Callable[..., tuple[torch.Tensor, torch.Tensor]]


_KERNEL_SOLVERS: dict[str, KernelSolver] = {}


def register_kernel_solver(name: str, solver: KernelSolver) -> None:
    """Make `solver` available as `band_bounds(..., solver=name)` and to `solver="auto"` (called by the kernels)."""
    if name not in SOLVERS or name in ("auto", "torch"):
        raise ValueError(f"kernel solver name must be one of {[s for s in SOLVERS if s not in ('auto', 'torch')]}")
    _KERNEL_SOLVERS[name] = solver


def solver_unavailable_reason(solver: str, divergence: str | Callable, device: torch.device | str) -> str | None:
    """Why `band_bounds(..., solver=solver, divergence=divergence)` cannot run on `device` (`None` if it can).

    `"auto"` and `"torch"` always run; a kernel solver needs the divergence it implements and a device it supports.
    """
    if solver in ("auto", "torch"):
        return None
    kernel = _KERNEL_SOLVERS.get(solver)
    if kernel is None:
        return f"no {solver!r} solver is registered (import trl_bandpo.kernels)"
    if not isinstance(divergence, str) or divergence not in kernel.divergences:
        return f"solver={solver!r} supports divergence in {list(kernel.divergences)} only, got {divergence!r}"
    return kernel.unavailable_reason(torch.empty(0, device=device))


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_radius(value, label: str = "radius") -> float:
    """`value` as a float if it is a finite number > 0, else a `ValueError` naming `label`."""
    if not _is_real(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{label} must be a finite number > 0 (the trust-region size delta), got {value!r}.")
    return float(value)


def check_divergence(value, label: str = "divergence"):
    """`value` if it names a divergence of `DIVERGENCES` or is a generator callable with `f(1) = 0`."""
    if callable(value):
        _check_generator(value)
        return value
    if not isinstance(value, str) or value not in GENERATORS:
        raise ValueError(
            f"{label} must be one of {list(DIVERGENCES)} or a convex callable f with f(1) = 0, got {value!r}."
        )
    return value


def check_solver(value, label: str = "solver") -> str:
    """`value` if it is one of `SOLVERS`."""
    if not isinstance(value, str) or value not in SOLVERS:
        raise ValueError(f"{label} must be one of {list(SOLVERS)}, got {value!r}.")
    return value


def check_upper_max(value, label: str = "upper_max") -> float | None:
    """`None` (no cap; the strings "none"/"null" from YAML or a command line count as None) or a number >= 1."""
    if isinstance(value, str) and value.strip().lower() in ("none", "null"):
        return None
    if value is not None and (not _is_real(value) or not value >= 1):
        raise ValueError(f"{label} must be None (no cap) or a number >= 1, got {value!r}.")
    return None if value is None else float(value)


def check_relax(value, label: str = "relax") -> tuple[float, float] | None:
    """`None` or a pair `(eps_low, eps_high)` with `0 <= eps_low < 1` and `0 <= eps_high < inf`."""
    if value is None:
        return None
    ok = isinstance(value, (tuple, list)) and len(value) == 2 and all(_is_real(v) for v in value)
    if ok:
        eps_low, eps_high = float(value[0]), float(value[1])
        ok = 0 <= eps_low < 1 and 0 <= eps_high < math.inf
    if not ok:
        raise ValueError(
            f"{label} must be None or a pair (eps_low, eps_high) with 0 <= eps_low < 1 and 0 <= eps_high < inf, "
            f"got {value!r}."
        )
    return eps_low, eps_high


def validate_band_args(
    radius: float,
    divergence: str | Callable,
    solver: str = "auto",
    upper_max: float | None = None,
    relax: tuple[float, float] | None = None,
) -> None:
    """Raise `ValueError` naming the argument if any Band argument is outside what is allowed."""
    check_radius(radius)
    check_divergence(divergence)
    check_solver(solver)
    if upper_max is not None:  # the strings "none"/"null" are for configs, not for this API
        if isinstance(upper_max, str):
            raise ValueError(f"upper_max must be None (no cap) or a number >= 1, got {upper_max!r}.")
        check_upper_max(upper_max)
    check_relax(relax)


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
    radius: float = 0.05,
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
        radius (`float`, defaults to `0.05`): the trust-region radius `delta`.
        divergence (`str` or callable, defaults to `"kl"`): one of `DIVERGENCES`, or a convex generator `f` acting
            elementwise on float64 tensors with `f(1) = 0`.
        solver (`str`, defaults to `"auto"`): `"torch"`, `"triton"` (KL on CUDA tensors only) or `"auto"` (Triton
            where it can run, torch elsewhere).
        upper_max (`float`, *optional*): cap on the upper bound (the BandPO authors trained with 10). `None` keeps
            only the simplex limit `1/p`.
        relax (`tuple[float, float]`, *optional*): `(eps_low, eps_high)` for the Relaxed-Band baseline, the union
            with the clip interval: `lower = min(lower, 1 - eps_low)`, `upper = max(upper, 1 + eps_high)`, applied
            after the cap.

    Returns:
        `(lower, upper)`: two tensors shaped like `old_logps`, float32 (float64 for float64 input), with
        `0 <= lower <= 1 <= upper <= 1/p`.
    """
    validate_band_args(radius, divergence, solver, upper_max, relax)
    if not torch.is_tensor(old_logps) or not old_logps.is_floating_point():
        raise ValueError(f"old_logps must be a floating-point tensor, got {type(old_logps).__name__}.")
    radius = float(radius)
    compute_dtype = compute_dtype_for(old_logps.dtype)

    if solver != "torch":
        kernel_name = "triton" if solver == "auto" else solver
        kernel = _KERNEL_SOLVERS.get(kernel_name)
        reason = solver_unavailable_reason(kernel_name, divergence, old_logps.device)
        if reason is None:
            return kernel.bounds(old_logps, radius, upper_max=upper_max, relax=relax)
        if solver != "auto":
            raise ValueError(f"solver={solver!r} cannot run here: {reason}. Use solver='torch' or 'auto'.")

    with torch.no_grad():
        logp = old_logps.detach().to(compute_dtype).clamp(max=0.0)  # NaN stays NaN
        if divergence == "kl":
            lower, upper = (bound.reshape(logp.shape) for bound in _kl_bounds(logp, radius))
        elif divergence == "tv":
            lower, upper = _closed_form_bounds(logp, radius / torch.exp(logp))
        elif divergence == "chi2":
            lower, upper = _closed_form_bounds(logp, torch.sqrt(radius * -torch.expm1(logp) / torch.exp(logp)))
        else:
            f = GENERATORS[divergence] if isinstance(divergence, str) else divergence
            lower, upper = _generic_bounds(logp.double(), radius, f)
            lower, upper = lower.to(compute_dtype), upper.to(compute_dtype)
        return _cap_and_relax(lower, upper, upper_max, relax)


def _cap_and_relax(lower, upper, upper_max, relax):
    cap = torch.finfo(upper.dtype).max if upper_max is None else float(upper_max)
    upper = upper.clamp(max=cap)
    if relax is not None:
        lower = lower.clamp(max=1.0 - float(relax[0]))
        upper = upper.clamp(min=1.0 + float(relax[1]))
    return lower, upper


def _closed_form_bounds(logp: torch.Tensor, half_width: torch.Tensor):
    """`[1 - w, 1 + w]` clamped to the simplex `[0, 1/p]` (TV: `w = delta/p`; chi2: `w = sqrt(delta (1-p)/p)`)."""
    lower = (1 - half_width).clamp(min=0.0)
    upper = torch.minimum(1 + half_width, torch.exp(-logp))
    return lower, upper


# On CPU the solver runs over chunks of this many tokens: its ~40 elementwise passes then stay in cache instead of
# streaming 8 MB temporaries through memory (measured 30% faster at 1M tokens, benchmarks/RESULTS.md).
_CPU_CHUNK = 1 << 16


def _kl_bounds(logp: torch.Tensor, radius: float):
    """KL bounds as flat tensors (see `_kl_bounds_flat`), in cache-sized chunks on CPU."""
    logp = logp.reshape(-1)
    if logp.device.type != "cpu" or logp.numel() <= _CPU_CHUNK:
        return _kl_bounds_flat(logp, radius)
    lower, upper = torch.empty_like(logp), torch.empty_like(logp)
    for start in range(0, logp.numel(), _CPU_CHUNK):  # a loop over sizes, not data: no synchronisation
        chunk = slice(start, start + _CPU_CHUNK)
        lower[chunk], upper[chunk] = _kl_bounds_flat(logp[chunk], radius)
    return lower, upper


def _kl_bounds_flat(logp: torch.Tensor, radius: float):
    """KL bounds for 1-D `logp`. Binary KL is symmetric under (p, q) -> (1-p, 1-q), so both roots are lower roots
    (docs/band-operator.md, "Both roots are lower roots"): `lower = exp(t(p))` and
    `upper = (1 - (1-p) exp(t(1-p))) / p`, `t(s)` from `_solve_binary_kl_lower`."""
    p = torch.exp(logp)
    one_minus_p = torch.expm1(logp).neg_()
    # Both sides in one batch: half the kernel launches of two separate solves.
    t_low, t_high = _solve_binary_kl_lower(torch.cat([p, one_minus_p]), torch.cat([one_minus_p, p]), radius).chunk(2)
    # upper = q/p with 1 - q = (1 - p) e^t, written without the cancellation of 1 - (1 - q) when q is small
    upper = torch.expm1(t_high).mul_(logp.neg().exp_()).neg_().add_(t_high.exp_())
    return t_low.exp(), upper


def _solve_binary_kl_lower(s: torch.Tensor, one_minus_s: torch.Tensor, radius: float) -> torch.Tensor:
    """`t = log(q/s) < 0` solving `KL(Bern(s) || Bern(q)) = radius` with `q < s`, for 1-D tensors `s`, `1 - s`.

    With `u = s expm1(t)` (so `1 - q = (1 - s) - u`) the equation reads, free of cancellation beyond the inherent
    first-order one,
        h(t) = -s t - (1 - s) log1p(-u / (1 - s)) - radius = 0,
        h'(t) = u / (1 - q) < 0,    h''(t) = s (1 - s) e^t / (1 - q)^2 > 0.
    `h` is convex and decreasing, and lies above its asymptote `-s t + (1-s) log(1-s) - radius` (t -> -inf), whose
    root `t_floor` is therefore left of the root. And `KL <= -s t <= -t` for `q < s`, so the root is `<= -radius`.
    Newton on a convex decreasing function lands left of the root after any step and then increases monotonically
    to it; clamping every iterate to `[t_floor, -radius]` keeps a poor first step bounded and away from `t = 0`,
    where `h' = 0`. Start: the chi-square estimate `log(1 - sqrt(2 radius (1-s)/s))` clamped to that bracket.
    """
    tiny = torch.finfo(s.dtype).tiny
    # Padding-safe: s = 0 gives t = -huge (q = 0), 1 - s = 0 gives t = -radius (q = e^-radius), as the limits do.
    s = s.clamp(min=tiny)
    one_minus_s = one_minus_s.clamp(min=tiny)
    neg_inv_one_minus_s = one_minus_s.reciprocal().neg_()
    # Floored at 2 log(tiny): any t below underflows exp(t) to 0 anyway, and -inf would turn Newton into NaN.
    t_floor = (one_minus_s * one_minus_s.log()).sub_(radius).div_(s).clamp_(min=2 * math.log(tiny))
    t_ceil = torch.tensor(-radius, dtype=s.dtype, device=s.device)
    t = (2 * radius * one_minus_s / s).sqrt_().neg_().add_(1).clamp_(min=tiny).log_()
    t = torch.clamp(t, t_floor, t_ceil)
    steps = KL_NEWTON_STEPS[s.dtype]
    for _ in range(steps):  # fixed count: no host synchronisation
        u = torch.expm1(t).mul_(s)
        minus_h = torch.addcmul(s * t, one_minus_s, (u * neg_inv_one_minus_s).log1p_()).add_(radius)
        # t_next = t - h / h' = t + minus_h * (1 - q) / u
        t = torch.clamp(t.addcmul_(minus_h, (one_minus_s - u).div_(u)), t_floor, t_ceil)
    return t


def _generic_bounds(logp: torch.Tensor, radius: float, f: Callable[[torch.Tensor], torch.Tensor]):
    """Bounds for any convex generator by bracketed bisection (float64): on `r` in `[0, 1]` for the lower root and
    on `log r` in `[0, -log p]` for the upper one, so both reach the accuracy target in `_BISECTION_STEPS` steps."""
    tiny = torch.finfo(logp.dtype).tiny
    underflow = logp < math.log(tiny)  # p = 0 to float precision: upper is the cap, as 1/p overflows for KL/TV/chi2
    logp = logp.clamp(min=math.log(tiny))
    p = torch.exp(logp)
    one_minus_p = -torch.expm1(logp)

    # At p = 1 the second term of g is (1 - r) * lim_{u->inf} f(u)/u, not 0 (e.g. KL: lower -> e^-delta,
    # BandPO Appendix 9.4);
    # flooring 1 - p at `tiny` evaluates that limit instead of 0 * f(0/0).
    one_minus_p = one_minus_p.clamp(min=tiny)

    def excess(r: torch.Tensor) -> torch.Tensor:  # g_f(p, r) - radius
        c = ((1 - r * p) / one_minus_p).clamp(min=0.0)
        return p * f(r) + one_minus_p * f(c) - radius

    # Lower root on r in [0, 1]: g is decreasing there; saturated (lower = 0) if g(p, 0) <= radius.
    lo, hi = torch.zeros_like(p), torch.ones_like(p)
    for _ in range(_BISECTION_STEPS):
        mid = 0.5 * (lo + hi)
        above = excess(mid) > 0  # NaN (e.g. f(0) undefined) counts as outside the region
        lo, hi = torch.where(above, mid, lo), torch.where(above, hi, mid)
    lower = torch.where(excess(torch.zeros_like(p)) <= 0, torch.zeros_like(p), hi)

    # Upper root on log r in [0, -log p]: g is increasing there; saturated (upper = 1/p) if g(p, 1/p) <= radius.
    lo, hi = torch.zeros_like(p), -logp
    for _ in range(_BISECTION_STEPS):
        mid = 0.5 * (lo + hi)
        above = excess(torch.exp(mid)) > 0
        lo, hi = torch.where(above, lo, mid), torch.where(above, mid, hi)
    upper = torch.where(excess(torch.exp(-logp)) <= 0, torch.exp(-logp), torch.exp(lo))
    upper = upper.masked_fill(underflow, math.inf)
    nan = torch.isnan(logp)  # comparisons above treat NaN as False; propagate it explicitly
    return lower.masked_fill(nan, math.nan), upper.masked_fill(nan, math.nan)

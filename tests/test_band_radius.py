"""Tests of the per-token trust-region radius of `band_bounds` (docs/band-operator.md, "Per-token radius").

`radius` may be a floating tensor broadcastable to `old_logps`. Checked here, for every divergence, on the torch
solver (CPU):
- mixed radii in one call give, element by element, exactly the bounds of a scalar call with that element's radius;
- they meet the accuracy target against the mpmath reference of tests/test_band.py, every element at its own radius;
- the broadcasting shapes `(B, T)`, `(B, 1)`, `(1, T)`, `(T,)`, 0-d;
- bad elements (NaN, +-inf, <= 0) give NaN bounds where they apply and nowhere else, without raising;
- wrong dtypes, shapes, devices and `requires_grad` are a `ValueError` naming `radius`, and nothing reads values
  on the host.
The Triton kernel's per-token path (interpreter, against mpmath and the torch solver, and the custom op's opcheck)
is tested in tests/test_kernels.py, in the one interpreter subprocess that file already runs.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_band import ALL_DIVERGENCES, GRID, MP, _tol, ref_bounds

from trl_bandpo.core.band import RADIUS, band_bounds, check_band_arguments, check_radius_tensor

DIVERGENCES = (*ALL_DIVERGENCES, "callable")
RADII = (1e-3, 0.01, 0.05, 0.3, 1.0, 3.0)
SPECIAL_LOGPS = [0.0, 0.7, -1e-30, -1e-9, -math.inf, -1e4, -700.0, -88.0, math.nan]


def _divergence(name):
    return (lambda u: u - 1 - torch.log(u)) if name == "callable" else name


def _f32_exact(values):
    """Radii exactly representable in float32: the float32 and float64 solvers then see the same radius."""
    return [float(torch.tensor(v, dtype=torch.float32)) for v in values]


def _logps(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """`(rows, cols)` float64 log-probabilities: log p uniform in [-25, 0], 1 - p down to 1e-12, special values."""
    g = torch.Generator().manual_seed(seed)
    n = rows * cols
    x = -25 * torch.rand(n, generator=g, dtype=torch.float64)
    x[::3] = torch.log1p(-(10 ** (-12 * torch.rand(x[::3].numel(), generator=g, dtype=torch.float64))))
    x[: len(SPECIAL_LOGPS)] = torch.tensor(SPECIAL_LOGPS, dtype=torch.float64)
    return x[torch.randperm(n, generator=g)].reshape(rows, cols)


def _mixed_radii(shape, seed: int = 1, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    choice = torch.randint(len(RADII), shape, generator=g)
    return torch.tensor(_f32_exact(RADII), dtype=torch.float64)[choice].to(dtype)


def _assert_same(got, want, label):
    """Same bits, NaN where NaN (the torch solver does the same arithmetic for a tensor radius as for a float)."""
    for g, w, side in zip(got, want, ("lower", "upper")):
        assert g.dtype == w.dtype and g.shape == w.shape, (label, side)
        assert torch.equal(g.isnan(), w.isnan()), f"{label} {side}: NaN positions differ"
        differ = g.nan_to_num(0.5) != w.nan_to_num(0.5)
        assert not bool(differ.any()), f"{label} {side}: {int(differ.sum())} elements differ, e.g. {g[differ][:3]}"


# --------------------------------------------------------------------------------------------------------------
# mixed radii in one call = scalar calls, elementwise
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_mixed_radii_equal_scalar_calls(divergence, dtype):
    x = _logps(24, 40).to(dtype)
    radius = _mixed_radii(x.shape)
    div = _divergence(divergence)
    for kwargs in ({}, dict(upper_max=10.0, relax=(0.2, 0.28))):
        lower, upper = band_bounds(x, radius, div, solver="torch", **kwargs)
        for r in radius.unique().tolist():
            at = radius == r
            want = band_bounds(x, r, div, solver="torch", **kwargs)
            _assert_same((lower[at], upper[at]), (want[0][at], want[1][at]), f"{divergence} radius={r} {kwargs}")


@pytest.mark.parametrize("radius_dtype", [torch.float32, torch.bfloat16])
def test_radius_dtype_is_rounded_like_a_float(radius_dtype):
    """A radius tensor in any float dtype: each element solves as the float it holds (here float32 compute)."""
    x = _logps(8, 16).float()
    radius = _mixed_radii(x.shape).to(radius_dtype)
    lower, upper = band_bounds(x, radius, "kl")
    for r in radius.unique().tolist():
        at = radius == r
        want = band_bounds(x, r, "kl")
        _assert_same((lower[at], upper[at]), (want[0][at], want[1][at]), f"radius={r}")


def test_kl_chunked_cpu_path_takes_per_token_radii():
    """More tokens than one CPU chunk (2^16): the radii are sliced with the log-probs."""
    x = _logps(7, 10_001, seed=3).float()
    radius = _mixed_radii(x.shape, seed=4, dtype=torch.float32)
    lower, upper = band_bounds(x, radius, "kl")
    for r in radius.unique().tolist():
        at = radius == r
        want = band_bounds(x, r, "kl")
        _assert_same((lower[at], upper[at]), (want[0][at], want[1][at]), f"radius={r}")


def test_kl_saturation_clamp_is_elementwise():
    """Radii beyond `KL_SATURATION_RADIUS` (1e3) solve as 1e3, each on its own, as a float radius does."""
    x = _logps(2, 30).float()
    radius = torch.tensor([[5e3], [0.05]])
    lower, upper = band_bounds(x, radius, "kl")
    _assert_same((lower[0], upper[0]), band_bounds(x[0], 5e3, "kl"), "saturated row")
    _assert_same((lower[1], upper[1]), band_bounds(x[1], 0.05, "kl"), "other row")


# --------------------------------------------------------------------------------------------------------------
# accuracy against the mpmath reference, every element at its own radius
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("divergence", ALL_DIVERGENCES)
def test_mixed_radii_match_reference(divergence, dtype):
    """p over [1e-8, 1 - 1e-7] (the grid of tests/test_band.py), radii cycling over 1e-3 ... 3 in ONE call."""
    radii = _f32_exact(RADII)
    per_element = [radii[i % len(radii)] for i in range(len(GRID))]
    lower, upper = band_bounds(torch.tensor(GRID, dtype=dtype), torch.tensor(per_element, dtype=dtype), divergence)
    tol, bad, worst = _tol(dtype), [], 0.0
    for lp, r, lo, up in zip(GRID, per_element, lower.double().tolist(), upper.double().tolist()):
        for side, got, exact in zip(("lower", "upper"), (lo, up), ref_bounds(lp, r, divergence)):
            err = abs(MP.mpf(got) - exact) / max(1, exact)
            worst = max(worst, float(err))
            if not err <= tol:
                bad.append(f"log p={lp!r} radius={r} {side}: got {got!r}, exact {MP.nstr(exact, 15)}")
    assert not bad, f"{len(bad)} bounds off by > {tol} * max(1, r) (worst {worst:.3g}):\n" + "\n".join(bad[:8])


# --------------------------------------------------------------------------------------------------------------
# broadcasting
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("divergence", DIVERGENCES)
@pytest.mark.parametrize("shape", [(6, 9), (6, 1), (1, 9), (9,), (1, 1), ()], ids=str)
def test_broadcast_shapes_equal_the_expanded_radius(divergence, shape):
    x = _logps(6, 9, seed=5)
    radius = _mixed_radii(shape, seed=6)
    div = _divergence(divergence)
    got = band_bounds(x, radius, div, upper_max=10.0)
    assert got[0].shape == x.shape and got[1].shape == x.shape
    _assert_same(got, band_bounds(x, radius.expand(x.shape).contiguous(), div, upper_max=10.0), str(shape))
    if radius.numel() == 1:  # one radius, as a tensor: the float call
        _assert_same(got, band_bounds(x, float(radius.reshape(())), div, upper_max=10.0), "scalar")


@pytest.mark.parametrize("divergence", ["kl", "tv", "js"])
def test_non_contiguous_and_empty(divergence):
    x = _logps(10, 12, seed=7)
    radius = _mixed_radii((12, 10), seed=8).t()  # non-contiguous
    want = band_bounds(x.t(), radius.t().contiguous(), divergence)
    _assert_same(band_bounds(x.t(), radius.t(), divergence), want, "x.t()")
    _assert_same(band_bounds(x, radius, divergence), band_bounds(x, radius.contiguous(), divergence), "radius.t()")
    lower, upper = band_bounds(torch.empty(3, 0), torch.empty(3, 1), divergence)
    assert lower.shape == (3, 0) and upper.shape == (3, 0)


# --------------------------------------------------------------------------------------------------------------
# bad elements: NaN bounds there, nothing raised, nothing else touched
# --------------------------------------------------------------------------------------------------------------

BAD_RADII = [math.nan, 0.0, -0.0, -0.05, math.inf, -math.inf]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_bad_elements_stay_local(divergence, dtype):
    x = _logps(4, 12, seed=9).to(dtype)
    radius = torch.full(x.shape, 0.05, dtype=dtype)
    bad = torch.zeros(x.shape, dtype=torch.bool)
    for i, value in enumerate(BAD_RADII):  # one bad radius in each of 6 columns, rows spread out
        radius[i % 4, 2 * i] = value
        bad[i % 4, 2 * i] = True
    div = _divergence(divergence)
    for kwargs in ({}, dict(upper_max=10.0, relax=(0.2, 0.28))):
        lower, upper = band_bounds(x, radius, div, **kwargs)
        assert bool(lower[bad].isnan().all()) and bool(upper[bad].isnan().all()), (lower[bad], upper[bad])
        want = band_bounds(x, float(torch.tensor(0.05, dtype=dtype)), div, **kwargs)  # the radius it holds
        _assert_same((lower[~bad], upper[~bad]), (want[0][~bad], want[1][~bad]), f"{divergence} {kwargs}")


def test_bad_row_radius_makes_only_that_row_nan():
    x = _logps(3, 20, seed=10)
    radius = torch.tensor([[0.05], [math.nan], [-1.0]], dtype=torch.float64)
    lower, upper = band_bounds(x, radius, "kl", upper_max=10.0)
    assert bool(lower[1:].isnan().all()) and bool(upper[1:].isnan().all())
    _assert_same((lower[0], upper[0]), band_bounds(x[0], 0.05, "kl", upper_max=10.0), "good row")


def test_float64_radius_that_rounds_to_inf_in_float32_is_valid():
    """Validity is judged on the radius given (float64 1e300 is a finite radius > 0), then rounded as a float is."""
    x = _logps(2, 10, seed=11).float()
    for div in ("kl", "tv", "chi2", "hellinger"):
        lower, upper = band_bounds(x, torch.tensor(1e300, dtype=torch.float64), div)
        _assert_same((lower, upper), band_bounds(x, 1e300, div), div)


# --------------------------------------------------------------------------------------------------------------
# wrong tensors: a ValueError naming `radius`, at call time
# --------------------------------------------------------------------------------------------------------------

X = torch.full((2, 4), -1.0)
WRONG_RADII = {
    "trailing-mismatch": torch.full((3,), 0.05),
    "leading-mismatch": torch.full((3, 4), 0.05),
    "expands-old-logps": torch.full((1, 2, 4), 0.05),
    "extra-dim": torch.full((2, 4, 1), 0.05),
    "int": torch.ones(2, 4, dtype=torch.int64),
    "bool": torch.ones(2, 4, dtype=torch.bool),
    "complex": torch.full((2, 4), 0.05 + 0j),
    "requires-grad": torch.full((2, 4), 0.05, requires_grad=True),
    "other-device": torch.full((2, 4), 0.05, device="meta"),
}


@pytest.mark.parametrize("solver", ["torch", "auto"])
@pytest.mark.parametrize("name", list(WRONG_RADII))
def test_wrong_radius_tensor_raises_naming_radius(name, solver):
    with pytest.raises(ValueError, match="radius"):
        band_bounds(X, WRONG_RADII[name], "kl", solver=solver)
    with pytest.raises(ValueError, match="radius"):
        check_radius_tensor(WRONG_RADII[name], X)
    with pytest.raises(ValueError, match="radius"):
        check_band_arguments(X, WRONG_RADII[name], "kl")


def test_shape_error_names_both_shapes():
    with pytest.raises(ValueError, match=r"radius of shape \(3,\) does not broadcast to the shape \(2, 4\)"):
        band_bounds(X, torch.full((3,), 0.05))


def test_float_checks_keep_working_and_reject_tensors():
    assert RADIUS(0.05, "radius") == 0.05 and RADIUS(1, "radius") == 1.0
    check_band_arguments(torch.zeros(2), 0.05, "kl", "torch", 10.0, (0.2, 0.28))
    check_band_arguments(X, torch.full((2, 1), 0.05), "kl")  # a tensor, with the log-probs it applies to
    with pytest.raises(ValueError, match="radius must be a finite number >= 1.17549e-38"):  # configs take numbers only
        RADIUS(torch.tensor(0.05), "radius")
    with pytest.raises(ValueError, match="old_logps"):
        check_band_arguments([-1.0], torch.tensor(0.05), "kl")
    with pytest.raises(ValueError, match="old_logps"):
        band_bounds([-1.0], torch.tensor(0.05))
    with pytest.raises(ValueError, match="divergence"):  # the other arguments are still checked
        band_bounds(X, torch.tensor(0.05), "kullback")
    with pytest.raises(ValueError, match="upper_max"):
        band_bounds(X, torch.tensor(0.05), upper_max=0.5)


def test_no_autograd_graph_and_inputs_untouched():
    x = _logps(3, 5, seed=12).float()
    radius = _mixed_radii(x.shape, dtype=torch.float32)
    x_before, radius_before = x.clone(), radius.clone()
    with torch.enable_grad():
        lower, upper = band_bounds(x.requires_grad_(), radius, "kl")
    assert not lower.requires_grad and not upper.requires_grad
    assert torch.equal(x.detach().nan_to_num(), x_before.nan_to_num()) and torch.equal(radius, radius_before)


# --------------------------------------------------------------------------------------------------------------
# no host synchronisation
# --------------------------------------------------------------------------------------------------------------

# `forbid_host_reads` (tests/conftest.py): every Tensor method that reads a value on the host raises.


@pytest.mark.parametrize("divergence", ["kl", "tv", "chi2", "js"])
@pytest.mark.parametrize("solver", ["torch", "auto"])
def test_no_host_reads_with_tensor_radius(divergence, solver, forbid_host_reads):
    x = torch.tensor([-20.0, -3.0, -0.5, -1e-6, 0.0, 0.3, -math.inf, math.nan]).reshape(2, 4)
    for radius in (torch.tensor([[0.05], [math.nan]]), torch.full((2, 4), -1.0), torch.tensor(0.3)):
        band_bounds(x, radius, divergence, solver=solver)
        band_bounds(x, radius, divergence, solver=solver, upper_max=10.0, relax=(0.2, 0.28))


# --------------------------------------------------------------------------------------------------------------
# CUDA (skipped without a device)
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("divergence", ["kl", "tv", "chi2", "js"])
@pytest.mark.parametrize("solver", ["torch", "auto"])
def test_cuda_tensor_radius_no_host_sync(divergence, solver):
    x = torch.linspace(-20.0, 0.0, 4096, device="cuda").reshape(64, 64)
    radii = [
        torch.rand(64, 64, device="cuda") + 0.01,
        torch.full((64, 1), 0.05, device="cuda"),
        torch.tensor(0.3, device="cuda"),
        torch.full((64, 64), math.nan, device="cuda"),
    ]
    for radius in radii:  # warm-up: lazy imports, kernel compilation of every radius mode
        band_bounds(x, radius, divergence, solver=solver, upper_max=10.0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for radius in radii:
            band_bounds(x, radius, divergence, solver=solver)
            band_bounds(x, radius, divergence, solver=solver, upper_max=10.0, relax=(0.2, 0.28))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("solver", ["torch", "auto"])
def test_cuda_mixed_radii_match_reference_and_cpu(dtype, solver):
    radii = _f32_exact(RADII)
    per_element = torch.tensor([radii[i % len(radii)] for i in range(len(GRID))], dtype=dtype)
    x = torch.tensor(GRID, dtype=dtype)
    lower, upper = band_bounds(x.cuda(), per_element.cuda(), "kl", solver=solver)
    cpu = band_bounds(x, per_element, "kl", solver="torch")
    tol = _tol(dtype)
    for got, want in zip((lower.cpu(), upper.cpu()), cpu):
        assert ((got.double() - want.double()).abs() / want.double().abs().clamp(min=1)).max().item() <= 2 * tol
    for lp, r, lo, up in zip(GRID, per_element.tolist(), lower.double().tolist(), upper.double().tolist()):
        for got, exact in zip((lo, up), ref_bounds(lp, r, "kl")):
            assert abs(MP.mpf(got) - exact) <= tol * max(1, exact), (lp, r, got, exact)
    bad = per_element.clone().cuda()
    bad[::7] = math.nan
    lower, _ = band_bounds(x.cuda(), bad, "kl", solver=solver)
    assert bool(lower[::7].isnan().all()) and not bool(lower[1::7].isnan().any())

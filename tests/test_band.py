"""Tests of the Band operator (`trl_bandpo.core.band.band_bounds`, docs/band-operator.md).

Every expected value is computed here, independently of the code under test: an mpmath reference solver of the
scalar equation `g_f(p, r) = p f(r) + (1 - p) f((1 - r p)/(1 - p)) = delta` (bracketed root finding at 50 digits,
in log space), the closed forms of TV and chi-square, and the literal numbers of the reference table in
docs/band-operator.md.
"""

from __future__ import annotations

import functools
import math

import mpmath
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trl_bandpo.core.band import band_bounds, check_band_arguments

# --------------------------------------------------------------------------------------------------------------
# mpmath reference solver
# --------------------------------------------------------------------------------------------------------------

MP = mpmath.MPContext()  # a private context: the precision set here does not leak into other tests
MP.dps = 50

_TINY_ROOT = MP.mpf("1e-400")  # below every float64 subnormal: a root this small is 0 for every comparison
_REL_WIDTH = MP.mpf("1e-15")


def _f_kl(u):
    return MP.inf if u == 0 else u - 1 - MP.log(u)


def _f_reverse_kl(u):
    return MP.mpf(1) if u == 0 else u * MP.log(u) - u + 1


def _f_hellinger(u):
    return (MP.sqrt(u) - 1) ** 2


def _f_js(u):
    if u == 0:
        return MP.log(2) / 2
    return u / 2 * MP.log(2 * u / (1 + u)) + MP.log(2 / (1 + u)) / 2


def _f_tv(u):
    return MP.fabs(u - 1) / 2


def _f_chi2(u):
    return (u - 1) ** 2


REF_GENERATORS = {
    "kl": _f_kl,
    "reverse_kl": _f_reverse_kl,
    "hellinger": _f_hellinger,
    "js": _f_js,
    "tv": _f_tv,
    "chi2": _f_chi2,
}
# lim_{u -> inf} f(u)/u: the weight of the rest of the mass in g_f as p -> 1
# (KL: lower -> e^-delta, BandPO Appendix 9.3)
REF_SLOPE_AT_INF = {
    "kl": MP.mpf(1),
    "hellinger": MP.mpf(1),
    "js": MP.log(2) / 2,
    "tv": MP.mpf(1) / 2,
    "chi2": MP.inf,
    "reverse_kl": MP.inf,
}
ALL_DIVERGENCES = tuple(REF_GENERATORS)
GENERIC_DIVERGENCES = ("reverse_kl", "hellinger", "js")


def _bisect(fn, lo, hi, done, max_iter=400):
    """Root of `fn` (fn(lo) > 0 >= fn(hi)) by plain bisection until `done(lo, hi)`."""
    for _ in range(max_iter):
        mid = (lo + hi) / 2
        if fn(mid) > 0:
            lo = mid
        else:
            hi = mid
        if done(lo, hi):
            break
    return (lo + hi) / 2


def _illinois(fn, lo, hi, done, max_iter=400):
    """Root of `fn` (fn(lo) > 0 >= fn(hi)) by false position with the Illinois modification: the bracket is kept
    at every step exactly as in bisection, but it converges superlinearly (about 6x fewer evaluations)."""
    f_lo, f_hi = fn(lo), fn(hi)
    last = 0
    for _ in range(max_iter):
        mid = (lo * f_hi - hi * f_lo) / (f_hi - f_lo)
        if not min(lo, hi) < mid < max(lo, hi):
            mid = (lo + hi) / 2
        f_mid = fn(mid)
        if f_mid == 0:
            return mid
        if f_mid > 0:
            lo, f_lo = mid, f_mid
            if last == 1:
                f_hi /= 2
            last = 1
        else:
            hi, f_hi = mid, f_mid
            if last == -1:
                f_lo /= 2
            last = -1
        if done(lo, hi):
            break
    return (lo + hi) / 2


@functools.cache
def ref_bounds(logp: float, radius: float, divergence: str, root_finder=_illinois):
    """Exact `(lower, upper)` (mpf) for the exact float `logp` (p < 1) the solver receives."""
    f = REF_GENERATORS[divergence]
    x = MP.mpf(logp)
    p = MP.exp(x)
    q1 = -MP.expm1(x)  # 1 - p, exact for p close to 1
    delta = MP.mpf(radius)
    assert 0 < p < 1

    def g(r, c):
        return p * f(r) + q1 * f(c)

    # lower root in [0, 1): bisection on y = log r (g decreasing in r there)
    if g(MP.zero, 1 / q1) <= delta:
        lower = MP.zero
    else:

        def excess_low(y):
            r = MP.exp(y)
            return g(r, (1 - r * p) / q1) - delta

        hi, lo = MP.zero, MP.mpf(-1)
        for _ in range(80):
            if excess_low(lo) > 0:
                break
            hi, lo = lo, 2 * lo
        lower = MP.exp(
            root_finder(
                excess_low,
                lo,
                hi,
                lambda a, b: MP.exp(b) - MP.exp(a) <= _REL_WIDTH * MP.exp(b) or MP.exp(b) < _TINY_ROOT,
            )
        )

    # upper root in (1, 1/p]: bisection on y = log c, c = (1 - r p)/(1 - p) in (0, 1), r = (1 - (1-p) c)/p;
    # c -> 0 is r -> 1/p, so this resolves roots that equal 1/p to any float precision
    if g(1 / p, MP.zero) <= delta:
        upper = 1 / p
    else:

        def r_of(y):
            return (1 - q1 * MP.exp(y)) / p

        def excess_up(y):
            return g(r_of(y), MP.exp(y)) - delta

        hi, lo = MP.zero, MP.mpf(-1)
        for _ in range(80):
            if excess_up(lo) > 0:
                break
            hi, lo = lo, 2 * lo
        upper = r_of(root_finder(excess_up, lo, hi, lambda a, b: r_of(a) - r_of(b) <= _REL_WIDTH * r_of(a)))
    return lower, upper


@functools.cache
def ref_lower_at_p1(radius: float, divergence: str):
    """lim_{p -> 1} lower(p): the root of f(r) + (1 - r) lim f(u)/u = delta in [0, 1]."""
    f, slope, delta = REF_GENERATORS[divergence], REF_SLOPE_AT_INF[divergence], MP.mpf(radius)
    if slope == MP.inf:
        return MP.one
    if f(MP.zero) + slope <= delta:
        return MP.zero
    return _bisect(lambda r: f(r) + (1 - r) * slope - delta, MP.zero, MP.one, lambda a, b: b - a < MP.mpf("1e-30"))


def _tol(dtype):
    """Accuracy target (docs/band-operator.md): |bound - exact| <= tol * max(1, exact)."""
    return 1e-6 if dtype == torch.float64 else 2e-6


def _mismatches(logps, lower, upper, radius, divergence, tol, limit=8):
    """Rows where a bound misses the reference by more than tol * max(1, exact); NaN/inf always miss."""
    bad = []
    for lp, lo, up in zip(logps, lower.double().tolist(), upper.double().tolist()):
        exact_lo, exact_up = ref_bounds(lp, radius, divergence)
        for name, got, exact in (("lower", lo, exact_lo), ("upper", up, exact_up)):
            err = abs(MP.mpf(got) - exact)
            if not err <= tol * max(1, exact):
                bad.append(
                    f"{divergence} radius={radius} old_logp={lp!r} (p={float(MP.exp(lp))!r}) {name}: "
                    f"expected {MP.nstr(exact, 15)}, got {got!r} (error {MP.nstr(err, 3)})"
                )
    return bad[:limit], len(bad)


def _assert_matches_reference(logps, lower, upper, radius, divergence, tol):
    bad, count = _mismatches(logps, lower, upper, radius, divergence, tol)
    assert count == 0, f"{count} bounds off the mpmath reference by > {tol}*max(1, r):\n" + "\n".join(bad)


# --------------------------------------------------------------------------------------------------------------
# grids
# --------------------------------------------------------------------------------------------------------------


def _make_grid() -> list[float]:
    """old_logp values, float32-exact (so the float64 and float32 tests share one reference), with p covering
    [1e-8, 1 - 1e-7]: log-spaced in p at the low end, log-spaced in 1 - p at the high end, linear in between."""
    p_small = torch.logspace(-8, math.log10(0.3), 100, dtype=torch.float64)
    p_mid = torch.linspace(0.3, 0.7, 32, dtype=torch.float64)[1:-1]
    one_minus_p = torch.logspace(-7, math.log10(0.3), 100, dtype=torch.float64)
    logp = torch.cat([p_small.log(), p_mid.log(), torch.log1p(-one_minus_p)])
    logp = logp.float().double().clamp(min=math.log(1e-8), max=math.log1p(-1e-7))
    logp = logp.float().double()  # clamping may have produced non-float32 values at the ends
    return sorted(set(logp.tolist()))


GRID = _make_grid()
GRID_COARSE = GRID[::4]
KL_RADII = (0.01, 0.05, 0.3, 1.0)


def test_grid_covers_spec_range():
    ps = [math.exp(lp) for lp in GRID]
    assert 200 <= len(GRID) <= 400
    assert min(ps) <= 1.001e-8 and min(ps) >= 0.999e-8
    assert 1 - max(ps) <= 1.001e-7 and 1 - max(ps) >= 0.999e-7
    for lp in GRID:
        assert float(torch.tensor(lp, dtype=torch.float32)) == lp


def test_reference_root_finders_agree():
    """The fast bracketed solver used everywhere agrees with plain bisection (sanity check of the reference)."""
    for lp in (math.log(1e-8), math.log(1.5e-5), math.log(0.3), math.log1p(-1e-7)):
        for div in ("kl", "js", "hellinger"):
            fast = ref_bounds(lp, 0.05, div)
            slow = ref_bounds(lp, 0.05, div, root_finder=_bisect)
            for a, b in zip(fast, slow):
                assert abs(a - b) <= MP.mpf("1e-13") * max(a, b) or max(a, b) < _TINY_ROOT, (lp, div, a, b)


def test_reference_reproduces_spec_table():
    """Sanity check of the reference solver itself against the table of docs/band-operator.md (KL, delta = 0.05)."""
    for p, lower, upper in KL_TABLE:
        exact_lo, exact_up = ref_bounds(math.log(p), 0.05, "kl")
        if lower is not None:
            assert abs(exact_lo - MP.mpf(lower)) <= _half_unit(lower)
        assert abs(exact_up - MP.mpf(upper)) <= _half_unit(upper)
    assert abs(ref_bounds(math.log(1e-4), 0.05, "kl")[0] - MP.mpf("2.6e-218")) <= MP.mpf("0.05e-218")


# --------------------------------------------------------------------------------------------------------------
# accuracy against the reference
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("radius", KL_RADII)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_kl_accuracy_on_grid(radius, dtype):
    lower, upper = band_bounds(torch.tensor(GRID, dtype=dtype), radius, "kl")
    assert lower.dtype == dtype and upper.dtype == dtype
    _assert_matches_reference(GRID, lower, upper, radius, "kl", _tol(dtype))


@pytest.mark.parametrize("radius", [0.05, 0.3])
@pytest.mark.parametrize("divergence", GENERIC_DIVERGENCES + ("tv", "chi2"))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_other_divergences_accuracy(divergence, radius, dtype):
    lower, upper = band_bounds(torch.tensor(GRID_COARSE, dtype=dtype), radius, divergence)
    assert lower.dtype == dtype and upper.dtype == dtype
    _assert_matches_reference(GRID_COARSE, lower, upper, radius, divergence, _tol(dtype))


@pytest.mark.parametrize("divergence", GENERIC_DIVERGENCES)
def test_generic_saturation_matches_reference(divergence):
    """Generic generators with finite f(0) do saturate: around the thresholds on both sides, against mpmath."""
    radius = 0.05
    # thresholds in closed form (derived from g_f(p, 0) and g_f(p, 1/p)):
    #   reverse KL: g(p,0) = -log(1-p), g(p,1/p) = -log p
    #   Hellinger: g(p,0) = 2 - 2 sqrt(1-p), g(p,1/p) = 2 - 2 sqrt(p)
    lower_threshold = {"reverse_kl": 1 - math.exp(-radius), "hellinger": 1 - (1 - radius / 2) ** 2}
    upper_threshold = {"reverse_kl": math.exp(-radius), "hellinger": (1 - radius / 2) ** 2}
    if divergence in lower_threshold:
        lt, ut = lower_threshold[divergence], upper_threshold[divergence]
        logps = [math.log(lt * 0.999), math.log(lt * 1.001), math.log(ut * 0.999), math.log(ut * 1.001)]
        lower, upper = band_bounds(torch.tensor(logps, dtype=torch.float64), radius, divergence)
        assert lower[0] == 0 and lower[1] > 0
        assert upper[2] < math.exp(-logps[2]) * (1 - 1e-6)
        assert upper[3] == pytest.approx(math.exp(-logps[3]), rel=1e-12)
        _assert_matches_reference(logps, lower, upper, radius, divergence, 1e-6)
    # and the reference agrees about where saturation happens, for every generic generator
    for lp in (math.log(1e-3), math.log(0.04), math.log(0.96), math.log1p(-1e-3)):
        exact_lo, exact_up = ref_bounds(lp, radius, divergence)
        lower, upper = band_bounds(torch.tensor([lp], dtype=torch.float64), radius, divergence)
        assert (float(lower) == 0) == (exact_lo == 0), (lp, exact_lo, float(lower))
        assert abs(MP.mpf(float(upper)) - exact_up) <= 1e-6 * max(1, exact_up)


# --------------------------------------------------------------------------------------------------------------
# Reference values (docs/band-operator.md)
# --------------------------------------------------------------------------------------------------------------

# (p, lower, upper) for KL, delta = 0.05, exactly the digits docs/band-operator.md shows.
# lower at p = 1e-4 is ~2.6e-218.
KL_TABLE = [
    (1e-4, None, "494.6038824"),
    (0.01, "0.002497385719", "7.809846290"),
    (0.08, "0.2616958435", "2.410553794"),
    (0.2, "0.4759413514", "1.717678517"),
    (0.5, "0.6915156698", "1.308484330"),
    (0.8, "0.8205803706", "1.131014662"),
    (0.95, "0.8957236881", "1.044104122"),
    (0.999, "0.9473993120", "1.001001001"),
]


def _half_unit(text: str) -> float:
    """Half a unit in the last digit shown."""
    decimals = len(text.split(".")[1]) if "." in text else 0
    return 0.5 * 10.0**-decimals


@pytest.mark.parametrize("p, lower, upper", KL_TABLE)
def test_spec_table_kl_float64(p, lower, upper):
    got_lo, got_up = band_bounds(torch.tensor([math.log(p)], dtype=torch.float64), 0.05, "kl")
    got_lo, got_up = float(got_lo), float(got_up)
    if lower is None:  # ~2.6e-218: representable in float64, 0 in float32
        assert abs(got_lo - 2.6e-218) <= 0.05e-218, got_lo
    else:
        assert abs(got_lo - float(lower)) <= _half_unit(lower) + 1e-9, (got_lo, lower)
    assert abs(got_up - float(upper)) <= _half_unit(upper) + 1e-9 * float(upper), (got_up, upper)
    if p == 0.999:
        assert got_up == pytest.approx(1 / 0.999, rel=1e-12)


@pytest.mark.parametrize("p, lower, upper", KL_TABLE)
def test_spec_table_kl_float32(p, lower, upper):
    x = torch.tensor([math.log(p)], dtype=torch.float32)
    got_lo, got_up = (float(b) for b in band_bounds(x, 0.05, "kl"))
    if lower is None:
        assert got_lo == 0.0
    # the float32-rounded input moves p by up to |log p| * 6e-8 relative; the bound moves by at most that times
    # |d log r / d log p| <= 1, on top of the float32 accuracy target
    slack = 2e-6 + abs(math.log(p)) * 2**-24
    if lower is not None:
        assert abs(got_lo - float(lower)) <= slack, (got_lo, lower)
    assert abs(got_up - float(upper)) <= slack * float(upper), (got_up, upper)


def test_spec_tv_and_chi2_values_at_p_008():
    x = torch.tensor([math.log(0.08)], dtype=torch.float64)
    lo, up = band_bounds(x, 0.05, "tv")
    assert float(lo) == pytest.approx(0.375, abs=1e-12) and float(up) == pytest.approx(1.625, abs=1e-12)
    lo, up = band_bounds(x, 0.05, "chi2")
    assert abs(float(lo) - 0.2417125) <= _half_unit("0.2417125") + 1e-12
    assert abs(float(up) - 1.758288) <= _half_unit("1.758288") + 1e-12


@pytest.mark.parametrize("radius", [0.01, 0.05, 0.3, 1.0])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_tv_chi2_closed_forms_on_grid(radius, dtype):
    x = torch.tensor(GRID, dtype=dtype)
    tv_lo, tv_up = band_bounds(x, radius, "tv")
    chi_lo, chi_up = band_bounds(x, radius, "chi2")
    rtol = 1e-12 if dtype == torch.float64 else 2e-6
    for i, lp in enumerate(GRID):
        p = MP.exp(MP.mpf(lp))
        inv_p = 1 / p
        d = MP.mpf(radius)
        w_tv = d / p
        w_chi = MP.sqrt(d * (1 - p) / p)
        expected = {
            "tv": (max(MP.zero, 1 - w_tv), min(inv_p, 1 + w_tv)),
            "chi2": (max(MP.zero, 1 - w_chi), min(inv_p, 1 + w_chi)),
        }
        got = {"tv": (tv_lo[i], tv_up[i]), "chi2": (chi_lo[i], chi_up[i])}
        for div in ("tv", "chi2"):
            for exact, value in zip(expected[div], got[div]):
                value = float(value)
                assert abs(MP.mpf(value) - exact) <= rtol * max(1, exact), (div, radius, lp, float(exact), value)


@pytest.mark.parametrize("radius", [0.01, 0.05, 0.3])
def test_tv_saturation_thresholds(radius):
    """TV: upper saturates iff p >= 1 - delta, lower iff p <= delta."""
    for dtype in (torch.float64, torch.float32):
        ps = [(1 - radius) * (1 - 1e-3), (1 - radius) * (1 + 1e-3), radius * (1 - 1e-3), radius * (1 + 1e-3)]
        x = torch.tensor([math.log(p) for p in ps], dtype=dtype)
        lo, up = band_bounds(x, radius, "tv")
        p = x.double().exp().tolist()
        rtol = 1e-12 if dtype == torch.float64 else 1e-6
        # below 1 - delta: 1 + delta/p, strictly under 1/p; above: exactly the simplex limit 1/p
        assert float(up[0]) == pytest.approx(1 + radius / p[0], rel=rtol) and float(up[0]) < 1 / p[0] * (1 - 1e-5)
        assert float(up[1]) == pytest.approx(1 / p[1], rel=rtol) and float(up[1]) < 1 + radius / p[1]
        # at or below delta: exactly 0; above: 1 - delta/p > 0
        assert float(lo[2]) == 0.0
        assert float(lo[3]) == pytest.approx(1 - radius / p[3], rel=1e-4) and float(lo[3]) > 0


@pytest.mark.parametrize("radius", [0.01, 0.05, 0.3])
def test_chi2_saturation_thresholds(radius):
    """chi2: upper saturates iff p >= 1/(1+delta), lower iff p <= delta/(1+delta)."""
    up_t, lo_t = 1 / (1 + radius), radius / (1 + radius)
    for dtype in (torch.float64, torch.float32):
        ps = [up_t * (1 - 1e-3), up_t * (1 + 1e-4), lo_t * (1 - 1e-3), lo_t * (1 + 1e-3)]
        x = torch.tensor([math.log(p) for p in ps], dtype=dtype)
        lo, up = band_bounds(x, radius, "chi2")
        p = x.double().exp().tolist()
        w = [math.sqrt(radius * (1 - q) / q) for q in p]
        rtol = 1e-12 if dtype == torch.float64 else 1e-6
        assert float(up[0]) == pytest.approx(1 + w[0], rel=rtol) and float(up[0]) < 1 / p[0] * (1 - 1e-5)
        assert float(up[1]) == pytest.approx(1 / p[1], rel=rtol) and float(up[1]) < 1 + w[1]
        assert float(lo[2]) == 0.0
        assert float(lo[3]) == pytest.approx(1 - w[3], rel=1e-3) and float(lo[3]) > 0


# --------------------------------------------------------------------------------------------------------------
# properties
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("radius", [0.05, 0.3])
@pytest.mark.parametrize("divergence", ALL_DIVERGENCES)
def test_monotone_in_p(divergence, radius):
    """upper strictly decreasing, lower strictly increasing in p (float64, where not saturated / underflowed)."""
    x = torch.tensor(GRID, dtype=torch.float64)  # ascending in p
    lower, upper = band_bounds(x, radius, divergence)
    assert bool((upper[1:] < upper[:-1]).all()), [
        (GRID[i], float(upper[i]), float(upper[i + 1])) for i in range(len(GRID) - 1) if not upper[i + 1] < upper[i]
    ][:5]
    # bisection-based solvers resolve r to ~1e-18 absolute, so ignore lower roots below 1e-12 for them
    floor = 0.0 if divergence in ("kl", "tv", "chi2") else 1e-12
    live = (lower[1:] > floor) & (lower[:-1] > floor)
    assert bool((lower[1:] > lower[:-1])[live].all())
    assert bool((lower[1:][~live] >= lower[:-1][~live]).all())


@pytest.mark.parametrize("divergence", ALL_DIVERGENCES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("radius", [0.001, 0.05, 1.0, 5.0])
def test_range_invariant(divergence, dtype, radius):
    """0 <= lower <= 1 <= upper <= 1/p everywhere, including far outside the accuracy range."""
    extra = [0.0, -1e-30, -1e-12, -1e-3, -20.0, -50.0, -80.0, -300.0, -700.0, -1e4]
    x = torch.tensor(GRID + extra, dtype=torch.float64).to(dtype)
    lower, upper = band_bounds(x, radius, divergence)
    inv_p = torch.exp(-x.double())  # 1/p of the exact input the solver sees
    lower, upper = lower.double(), upper.double()
    finite = torch.isfinite(lower) & torch.isfinite(upper)
    assert bool(finite.all()), [
        (lp, lo, up)
        for lp, lo, up, ok in zip(x.double().tolist(), lower.tolist(), upper.tolist(), finite.tolist())
        if not ok
    ]
    assert bool((lower >= 0).all()) and bool((lower <= 1).all())
    assert bool((upper >= 1).all())
    eps = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    over = upper > inv_p * (1 + 2 * eps)  # allow the rounding of 1/p itself
    assert not bool(over.any()), list(zip(x[over].double().tolist(), upper[over].tolist(), inv_p[over].tolist()))[:5]


@pytest.mark.parametrize("divergence", ALL_DIVERGENCES)
def test_limit_p_to_zero(divergence):
    radius = 0.05
    ks = [4, 8, 16, 32, 64, 128, 300]
    x = torch.tensor([-k * math.log(10) for k in ks], dtype=torch.float64)
    lower, upper = band_bounds(x, radius, divergence)
    assert bool((upper[1:] > upper[:-1]).all()) and float(upper[-1]) > 1e140  # -> infinity
    assert bool((lower[1:] <= lower[:-1]).all()) and float(lower[-1]) <= 1e-300  # -> 0
    capped_lo, capped_up = band_bounds(x, radius, divergence, upper_max=10.0)
    assert bool((capped_up == 10.0).all())  # -> the cap
    assert torch.equal(capped_lo, lower)
    # float32
    lower32, upper32 = band_bounds(torch.tensor([-80.0, -87.0], dtype=torch.float32), radius, divergence)
    assert bool((upper32 > 1e15).all()) and bool(torch.isfinite(upper32).all()) and float(lower32.max()) < 1e-30


@pytest.mark.parametrize("radius", [0.01, 0.05, 0.3, 1.0])
def test_limit_p_to_one(radius):
    ks = [3, 6, 9, 12]
    x = torch.tensor([math.log1p(-(10.0**-k)) for k in ks], dtype=torch.float64)
    kl_lo, kl_up = band_bounds(x, radius, "kl")
    gap = (kl_lo - math.exp(-radius)).abs()
    assert bool((gap[1:] < gap[:-1]).all()) and float(gap[-1]) < 1e-9  # lower -> e^-delta
    assert bool((kl_up[1:] < kl_up[:-1]).all()) and float(kl_up[-1]) - 1 < 2e-12  # upper -> 1
    tv_lo, tv_up = band_bounds(x, radius, "tv")
    assert float(tv_lo[-1]) == pytest.approx(1 - radius, abs=1e-11)  # lower -> 1 - delta
    assert float(tv_up[-1]) - 1 < 2e-12
    chi_lo, chi_up = band_bounds(x, radius, "chi2")
    # lower -> 1, as 1 - sqrt(delta (1 - p)/p)
    assert bool((chi_lo[1:] > chi_lo[:-1]).all()) and 1 - float(chi_lo[-1]) <= 1.001 * math.sqrt(radius * 1e-12)
    assert float(chi_up[-1]) - 1 < 2e-12


@pytest.mark.parametrize("radius", [0.01, 0.05, 0.3, 1.0])
def test_user_callable_kl_matches_builtin(radius):
    x = torch.tensor(GRID, dtype=torch.float64)
    lo, up = band_bounds(x, radius, "kl")
    lo_c, up_c = band_bounds(x, radius, lambda u: u - 1 - torch.log(u))
    assert lo_c.dtype == torch.float64
    scale = torch.clamp(up, min=1.0)
    assert bool(((lo_c - lo).abs() <= 1e-9).all()), float((lo_c - lo).abs().max())
    assert bool(((up_c - up).abs() <= 1e-9 * scale).all()), float(((up_c - up).abs() / scale).max())


@pytest.mark.parametrize(
    "divergence, generator", [("tv", lambda u: 0.5 * torch.abs(u - 1)), ("chi2", lambda u: (u - 1) ** 2)]
)
def test_user_callable_matches_closed_forms(divergence, generator):
    x = torch.tensor(GRID_COARSE, dtype=torch.float64)
    lo, up = band_bounds(x, 0.05, divergence)
    lo_c, up_c = band_bounds(x, 0.05, generator)
    torch.testing.assert_close(lo_c, lo, rtol=0, atol=1e-9)
    torch.testing.assert_close(up_c, up, rtol=1e-9, atol=0)


def test_auto_equals_torch_on_cpu():
    x = torch.tensor(GRID, dtype=torch.float32)
    for div in ALL_DIVERGENCES:
        a = band_bounds(x, 0.05, div, solver="auto")
        t = band_bounds(x, 0.05, div, solver="torch")
        assert torch.equal(a[0], t[0]) and torch.equal(a[1], t[1]), div


# --------------------------------------------------------------------------------------------------------------
# hypothesis
# --------------------------------------------------------------------------------------------------------------

LOGP_IN_RANGE = st.floats(min_value=math.log(1e-8), max_value=math.log1p(-1e-7))
RADIUS = st.floats(min_value=1e-3, max_value=2.0)


def _hyp(max_examples: int):
    return settings(
        max_examples=max_examples, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
    )


@_hyp(40)
@given(logp=LOGP_IN_RANGE, radius=RADIUS, f32=st.booleans())
def test_hypothesis_kl_matches_reference(logp, radius, f32):
    dtype = torch.float32 if f32 else torch.float64
    x = torch.tensor([logp], dtype=dtype)
    lower, upper = band_bounds(x, radius, "kl")
    exact_input = float(x.double())
    bad, count = _mismatches([exact_input], lower, upper, radius, "kl", _tol(dtype))
    assert count == 0, bad


@_hyp(15)
@given(logp=LOGP_IN_RANGE, radius=st.floats(min_value=0.01, max_value=1.0), div=st.sampled_from(GENERIC_DIVERGENCES))
def test_hypothesis_generic_matches_reference(logp, radius, div):
    lower, upper = band_bounds(torch.tensor([logp], dtype=torch.float64), radius, div)
    bad, count = _mismatches([logp], lower, upper, radius, div, 1e-6)
    assert count == 0, bad


@_hyp(60)
@given(
    logps=st.lists(st.floats(min_value=-60.0, max_value=0.0), min_size=1, max_size=16),
    radius=st.floats(min_value=1e-3, max_value=5.0),
    div=st.sampled_from(ALL_DIVERGENCES),
    f32=st.booleans(),
)
def test_hypothesis_range_invariant(logps, radius, div, f32):
    dtype = torch.float32 if f32 else torch.float64
    x = torch.tensor(logps, dtype=dtype)
    lower, upper = band_bounds(x, radius, div)
    lower, upper = lower.double(), upper.double()
    eps = torch.finfo(dtype).eps
    assert bool(torch.isfinite(lower).all() & torch.isfinite(upper).all())
    assert bool(((lower >= 0) & (lower <= 1) & (upper >= 1)).all())
    assert bool((upper <= torch.exp(-x.double()) * (1 + 2 * eps)).all())


@_hyp(60)
@given(
    a=LOGP_IN_RANGE,
    b=LOGP_IN_RANGE,
    radius=RADIUS,
    div=st.sampled_from(ALL_DIVERGENCES),
)
def test_hypothesis_monotone_in_p(a, b, radius, div):
    lo_lp, hi_lp = min(a, b), max(a, b)
    lower, upper = band_bounds(torch.tensor([lo_lp, hi_lp], dtype=torch.float64), radius, div)
    slack = 1e-12
    assert float(upper[1]) <= float(upper[0]) * (1 + slack)
    assert float(lower[1]) >= float(lower[0]) - slack


@_hyp(60)
@given(logp=LOGP_IN_RANGE, r1=RADIUS, r2=RADIUS, div=st.sampled_from(ALL_DIVERGENCES))
def test_hypothesis_monotone_in_radius(logp, r1, r2, div):
    small, big = min(r1, r2), max(r1, r2)
    x = torch.tensor([logp], dtype=torch.float64)
    lo_s, up_s = band_bounds(x, small, div)
    lo_b, up_b = band_bounds(x, big, div)
    assert float(lo_b) <= float(lo_s) + 1e-12  # a bigger trust region is a wider band
    assert float(up_b) >= float(up_s) * (1 - 1e-12)


@_hyp(60)
@given(
    logps=st.lists(st.floats(min_value=-30.0, max_value=0.0), min_size=1, max_size=8),
    radius=RADIUS,
    div=st.sampled_from(ALL_DIVERGENCES),
    cap=st.one_of(st.none(), st.floats(min_value=1.0, max_value=100.0)),
    relax=st.one_of(st.none(), st.tuples(st.floats(0.0, 0.99), st.floats(0.0, 10.0))),
    f32=st.booleans(),
)
def test_hypothesis_cap_and_relax_algebra(logps, radius, div, cap, relax, f32):
    """upper_max caps the upper bound; relax is the union with the clip interval, applied after the cap."""
    x = torch.tensor(logps, dtype=torch.float32 if f32 else torch.float64)
    lower, upper = band_bounds(x, radius, div)
    got_lo, got_up = band_bounds(x, radius, div, upper_max=cap, relax=relax)
    want_lo, want_up = lower, upper
    if cap is not None:
        want_up = want_up.clamp(max=cap)
    if relax is not None:
        want_lo = want_lo.clamp(max=1.0 - relax[0])
        want_up = want_up.clamp(min=1.0 + relax[1])
    assert torch.equal(got_lo, want_lo) and torch.equal(got_up, want_up)


# --------------------------------------------------------------------------------------------------------------
# upper_max and relax at the thresholds of docs/band-operator.md
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_upper_max_10_binds_below_p_000714(dtype):
    """Authors' cap 10 with KL, delta = 0.05: binds exactly for p < 0.00714 (the root of upper = 10 is 0.0071409)."""
    below, above = 0.00713, 0.00715
    x = torch.tensor([math.log(1e-6), math.log(below), math.log(above), math.log(0.3)], dtype=dtype)
    lo, up = band_bounds(x, 0.05, "kl", upper_max=10)
    lo_free, up_free = band_bounds(x, 0.05, "kl")
    assert float(up[0]) == 10.0 and float(up[1]) == 10.0
    assert float(up_free[1]) > 10.0  # the cap really binds there
    assert float(up[2]) < 10.0 and float(up[2]) == float(up_free[2]) and float(up[3]) == float(up_free[3])
    assert torch.equal(lo, lo_free)  # the cap never touches the lower bound
    _assert_matches_reference([float(v) for v in x.double()][2:], lo[2:], up[2:], 0.05, "kl", _tol(dtype))


def test_upper_max_one_and_cap_for_every_divergence():
    x = torch.tensor(GRID_COARSE, dtype=torch.float64)
    for div in ALL_DIVERGENCES:
        _, up = band_bounds(x, 0.05, div, upper_max=1.0)
        assert bool((up == 1.0).all()), div
        lo_free, up_free = band_bounds(x, 0.05, div)
        lo, up = band_bounds(x, 0.05, div, upper_max=3.5)
        assert torch.equal(up, up_free.clamp(max=3.5)) and torch.equal(lo, lo_free), div


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_relax_union_thresholds_kl(dtype):
    """Relaxed Band (0.2, 0.28), KL delta = 0.05: the upper changes only for p > 0.5399 (upper = 1.28 at 0.539921),
    the lower only for p > 0.7507 (lower = 0.8 at 0.750740)."""
    ps = [0.3, 0.5399, 0.5400, 0.7507, 0.7508, 0.95]
    x = torch.tensor([math.log(p) for p in ps], dtype=dtype)
    lo_free, up_free = band_bounds(x, 0.05, "kl")
    lo, up = band_bounds(x, 0.05, "kl", relax=(0.2, 0.28))
    one_plus, one_minus = torch.tensor(1.28, dtype=dtype), torch.tensor(0.8, dtype=dtype)
    # upper
    assert float(up_free[1]) > 1.28 and float(up[1]) == float(up_free[1])
    assert float(up_free[2]) < 1.28 and float(up[2]) == float(one_plus)
    assert bool((up[2:] == one_plus).all()) and float(up[0]) == float(up_free[0])
    # lower
    assert float(lo_free[3]) < 0.8 and bool((lo[:4] == lo_free[:4]).all())
    assert float(lo_free[4]) > 0.8 and bool((lo[4:] == one_minus).all())


# --------------------------------------------------------------------------------------------------------------
# edge inputs
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("divergence", ["kl", "tv", "chi2", "hellinger", "js"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("radius", [0.01, 0.05, 0.3, 1.0])
def test_logp_zero_gives_limit(divergence, dtype, radius):
    """old_logp = 0 (p = 1): [lim_{p->1} lower, 1], e.g. [e^-delta, 1] for KL, [1 - delta, 1] TV, [1, 1] chi2."""
    lo, up = band_bounds(torch.zeros(3, dtype=dtype), radius, divergence)
    expected = ref_lower_at_p1(radius, divergence)
    if divergence == "kl":
        assert abs(expected - MP.exp(-radius)) < 1e-25
    if divergence == "tv":
        assert abs(expected - (1 - MP.mpf(radius))) < 1e-25
    if divergence == "chi2":
        assert expected == 1
    assert bool((up == 1).all()), up
    assert bool(((lo.double() - float(expected)).abs() <= _tol(dtype)).all()), (lo, float(expected))


@pytest.mark.parametrize("divergence", ALL_DIVERGENCES)
def test_logp_zero_continues_the_p_to_one_trend(divergence):
    x = torch.tensor([math.log1p(-1e-3), math.log1p(-1e-12), -1e-300, 0.0], dtype=torch.float64)
    lo, up = band_bounds(x, 0.05, divergence)
    assert bool(torch.isfinite(lo).all()) and float(up[-1]) == 1.0
    assert bool((lo[1:] >= lo[:-1] - 1e-12).all()), lo  # no jump down at p = 1


@pytest.mark.parametrize("divergence", ALL_DIVERGENCES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("upper_max", [None, 10.0])
def test_minus_inf_and_huge_negative_padding(divergence, dtype, upper_max):
    """old_logp = -inf (p = 0) and any very negative finite padding value: [0, cap], finite."""
    values = [-math.inf, -1e4, -1e30, torch.finfo(dtype).min]
    x = torch.tensor(values, dtype=torch.float64).to(dtype)
    lo, up = band_bounds(x, 0.05, divergence, upper_max=upper_max)
    out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    cap = torch.finfo(out_dtype).max if upper_max is None else upper_max
    assert bool(torch.isfinite(lo).all()) and bool(torch.isfinite(up).all()), (lo, up)
    assert bool((lo == 0).all()), lo
    assert bool((up == cap).all()), (up, cap)


@pytest.mark.parametrize("divergence", ALL_DIVERGENCES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("radius", [3.0, 4.0, 5.0, 50.0])
def test_edge_inputs_finite_at_large_radius(divergence, dtype, radius):
    """p = 1, p = 0 and p below the dtype's smallest normal number stay finite for any radius > 0."""
    x = torch.tensor([0.0, 2.0, -math.inf, -1e4, -100.0, -1e-3], dtype=dtype)
    lo, up = band_bounds(x, radius, divergence)
    rows = list(zip(x.tolist(), lo.tolist(), up.tolist()))
    assert bool((torch.isfinite(lo) & torch.isfinite(up)).all()), rows
    assert bool((up[:2] == 1).all()), rows  # p = 1
    assert bool((lo[2:4] == 0).all()) and bool((up[2:4] >= 1e30).all()), rows  # p = 0 (cap: see test above)
    if divergence != "reverse_kl":  # reverse KL: lower -> 1 only like 1 - delta/log(1/(1-p)); any value near 1 is fine
        assert abs(float(lo[0]) - float(ref_lower_at_p1(radius, divergence))) <= _tol(dtype), rows


@pytest.mark.parametrize("divergence", ALL_DIVERGENCES + ("callable",))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_nan_propagates_without_raising(divergence, dtype):
    div = (lambda u: u - 1 - torch.log(u)) if divergence == "callable" else divergence
    x = torch.tensor([math.log(0.3), math.nan, -2.0, math.nan], dtype=dtype)
    lo, up = band_bounds(x, 0.05, div, upper_max=10.0, relax=(0.2, 0.28))
    assert bool(torch.isnan(lo[[1, 3]]).all()) and bool(torch.isnan(up[[1, 3]]).all()), (lo, up)
    lo_ok, up_ok = band_bounds(x[[0, 2]], 0.05, div, upper_max=10.0, relax=(0.2, 0.28))
    assert torch.equal(lo[[0, 2]], lo_ok) and torch.equal(up[[0, 2]], up_ok)  # neighbours unaffected
    lo, up = band_bounds(x, 0.05, div)
    assert bool(torch.isnan(lo[[1, 3]]).all()) and bool(torch.isnan(up[[1, 3]]).all()), (lo, up)


@pytest.mark.parametrize("divergence", ALL_DIVERGENCES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_positive_logp_treated_as_p_one(divergence, dtype):
    x = torch.tensor([1e-7, 0.5, 3.0, 1e30, math.inf], dtype=dtype)
    lo, up = band_bounds(x, 0.05, divergence)
    lo0, up0 = band_bounds(torch.zeros(5, dtype=dtype), 0.05, divergence)
    assert torch.equal(lo, lo0) and torch.equal(up, up0), (lo, lo0, up, up0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("divergence", ALL_DIVERGENCES)
def test_dtypes(dtype, divergence):
    x = torch.tensor(GRID_COARSE, dtype=torch.float64).to(dtype)
    lo, up = band_bounds(x, 0.05, divergence)
    want = torch.float64 if dtype == torch.float64 else torch.float32
    assert lo.dtype == want and up.dtype == want
    assert lo.device == x.device and up.device == x.device
    if dtype in (torch.bfloat16, torch.float16):  # solved in float32 from the same (exactly upcast) values
        lo32, up32 = band_bounds(x.float(), 0.05, divergence)
        assert torch.equal(lo, lo32) and torch.equal(up, up32)


def test_half_precision_inputs_match_reference():
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.tensor([math.log(p) for p in (1e-4, 0.01, 0.08, 0.5, 0.9, 0.99)], dtype=dtype)
        exact_inputs = [float(v) for v in x.double()]
        lo, up = band_bounds(x, 0.05, "kl")
        _assert_matches_reference(exact_inputs, lo, up, 0.05, "kl", 2e-6)


@pytest.mark.parametrize("divergence", ALL_DIVERGENCES)
@pytest.mark.parametrize("shape", [(), (0,), (2, 0, 3), (7,), (2, 3, 4), (1, 1, 5, 1)])
def test_shapes(divergence, shape):
    n = math.prod(shape)
    flat = torch.linspace(-12.0, 0.0, n, dtype=torch.float64) if n else torch.empty(0, dtype=torch.float64)
    x = flat.reshape(shape)
    lo, up = band_bounds(x, 0.05, divergence)
    assert lo.shape == x.shape and up.shape == x.shape
    if n:
        lo_flat, up_flat = band_bounds(flat, 0.05, divergence)
        assert torch.equal(lo.reshape(-1), lo_flat) and torch.equal(up.reshape(-1), up_flat)


@pytest.mark.parametrize("divergence", ALL_DIVERGENCES)
def test_non_contiguous_input(divergence):
    base = torch.linspace(-15.0, -1e-3, 24, dtype=torch.float32).reshape(4, 6)
    x = base.t()  # non-contiguous view
    lo, up = band_bounds(x, 0.05, divergence)
    lo_c, up_c = band_bounds(x.contiguous(), 0.05, divergence)
    assert torch.equal(lo, lo_c) and torch.equal(up, up_c)
    lo_s, up_s = band_bounds(base[:, ::2], 0.05, divergence)  # strided slice
    lo_sc, up_sc = band_bounds(base[:, ::2].contiguous(), 0.05, divergence)
    assert torch.equal(lo_s, lo_sc) and torch.equal(up_s, up_sc)


@pytest.mark.parametrize("divergence", ALL_DIVERGENCES + ("callable",))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_no_autograd_graph_and_no_input_mutation(divergence, dtype):
    div = (lambda u: u - 1 - torch.log(u)) if divergence == "callable" else divergence
    x = torch.tensor([-5.0, -0.5, 0.0, 0.7, -math.inf, math.nan], dtype=dtype, requires_grad=True)
    before = x.detach().clone()
    with torch.enable_grad():
        lo, up = band_bounds(x * 1.0, 0.05, div, upper_max=10.0, relax=(0.2, 0.28))
        lo2, up2 = band_bounds(x, 0.05, div)
    for t in (lo, up, lo2, up2):
        assert not t.requires_grad and t.grad_fn is None
    assert torch.equal(x.detach().nan_to_num(), before.nan_to_num())
    assert x.grad is None


@pytest.mark.parametrize("divergence", ALL_DIVERGENCES)
def test_input_not_mutated(divergence):
    for dtype in (torch.float32, torch.float64):
        x = torch.tensor([-5.0, -0.5, 0.0, 0.7, -math.inf, 2.0], dtype=dtype)
        before = x.clone()
        band_bounds(x, 0.05, divergence, upper_max=10.0)
        assert torch.equal(x, before)


# --------------------------------------------------------------------------------------------------------------
# argument validation
# --------------------------------------------------------------------------------------------------------------

BAD_ARGS = [
    ({"radius": 0.0}, "radius"),
    ({"radius": -0.05}, "radius"),
    ({"radius": math.nan}, "radius"),
    ({"radius": math.inf}, "radius"),
    ({"radius": -math.inf}, "radius"),
    ({"radius": True}, "radius"),
    ({"radius": False}, "radius"),
    ({"radius": "0.05"}, "radius"),
    ({"radius": None}, "radius"),
    ({"divergence": "kullback"}, "divergence"),
    ({"divergence": ""}, "divergence"),
    ({"divergence": None}, "divergence"),
    ({"divergence": lambda u: u}, "divergence"),  # f(1) = 1
    ({"divergence": lambda u: (u - 1) ** 2 + 0.01}, "divergence"),
    ({"upper_max": 0.5}, "upper_max"),
    ({"upper_max": 0.0}, "upper_max"),
    ({"upper_max": -10.0}, "upper_max"),
    ({"upper_max": math.nan}, "upper_max"),
    ({"upper_max": True}, "upper_max"),
    ({"upper_max": "10"}, "upper_max"),
    ({"relax": (1.0, 0.28)}, "relax"),
    ({"relax": (-0.1, 0.28)}, "relax"),
    ({"relax": (0.2, -0.01)}, "relax"),
    ({"relax": (0.2, math.inf)}, "relax"),
    ({"relax": (0.2, math.nan)}, "relax"),
    ({"relax": (math.nan, 0.28)}, "relax"),
    ({"relax": (0.2,)}, "relax"),
    ({"relax": (0.2, 0.28, 0.3)}, "relax"),
    ({"relax": ()}, "relax"),
    ({"relax": 0.2}, "relax"),
    ({"relax": (None, 0.28)}, "relax"),
    ({"relax": ("a", "b")}, "relax"),
    ({"solver": "cuda"}, "solver"),
    ({"solver": "Torch"}, "solver"),
    ({"solver": None}, "solver"),
]


def _call_with(kwargs):
    args = {"radius": 0.05, "divergence": "kl", "solver": "auto", "upper_max": None, "relax": None}
    args.update(kwargs)
    x = torch.tensor([-1.0, -0.1])
    return band_bounds(
        x, args["radius"], args["divergence"], solver=args["solver"], upper_max=args["upper_max"], relax=args["relax"]
    )


@pytest.mark.parametrize("kwargs, name", BAD_ARGS, ids=[f"{n}-{i}" for i, (_, n) in enumerate(BAD_ARGS)])
def test_bad_arguments_raise_value_error_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        _call_with(kwargs)
    args = {"radius": 0.05, "divergence": "kl", "solver": "auto", "upper_max": None, "relax": None}
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        check_band_arguments(
            torch.zeros(2), args["radius"], args["divergence"], args["solver"], args["upper_max"], args["relax"]
        )


def test_good_arguments_are_accepted():
    for radius in (1e-6, 0.05, 1, 10.0):
        for div in ALL_DIVERGENCES:
            check_band_arguments(torch.zeros(2), radius, div)
    check_band_arguments(torch.zeros(2), 0.05, lambda u: u - 1 - torch.log(u), "torch", 1.0, (0.0, 0.0))
    check_band_arguments(torch.zeros(2), 0.05, "kl", "triton", 10, [0.2, 0.28])
    check_band_arguments(torch.zeros(2), 0.05, "kl", "auto", math.inf, (0.999, 100.0))
    _call_with({"radius": 1, "upper_max": 10, "relax": [0.2, 0.28]})  # ints and lists are fine


def test_generator_that_fails_on_float64_raises_value_error():
    def broken(u):
        raise RuntimeError("boom")

    with pytest.raises(ValueError, match="divergence"):
        band_bounds(torch.tensor([-1.0]), 0.05, broken)


def test_triton_solver_on_cpu_tensor_is_a_clear_error():
    with pytest.raises(ValueError, match="(?i)triton") as info:
        band_bounds(torch.tensor([-1.0, -0.1]), 0.05, "kl", solver="triton")
    assert "cuda" in str(info.value).lower() or "cpu" in str(info.value).lower()
    with pytest.raises(ValueError, match="(?i)triton"):
        band_bounds(torch.tensor([-1.0, -0.1]), 0.05, "tv", solver="triton")


@pytest.mark.parametrize(
    "bad_input",
    [
        torch.tensor([-1, -2]),
        torch.tensor([-1, -2], dtype=torch.int32),
        torch.tensor([True, False]),
        torch.tensor([-1.0 + 0j]),
        [-1.0, -0.5],
        -1.0,
    ],
    ids=["int64", "int32", "bool", "complex", "list", "float"],
)
def test_non_float_tensor_input_raises(bad_input):
    with pytest.raises(ValueError, match="old_logps"):
        band_bounds(bad_input, 0.05, "kl")


# --------------------------------------------------------------------------------------------------------------
# no host synchronisation
# --------------------------------------------------------------------------------------------------------------

# `forbid_host_reads` is in tests/conftest.py.


def test_forbid_host_reads_fixture_is_effective(forbid_host_reads):
    t = torch.tensor([1.0])
    for call in (t.item, t.tolist, lambda: bool(t), lambda: float(t), lambda: int(t)):
        with pytest.raises(AssertionError, match="host synchronisation"):
            call()


@pytest.mark.parametrize("divergence", ["kl", "tv", "chi2", "js"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("solver", ["torch", "auto"])
def test_no_host_reads_in_solver(divergence, dtype, solver, forbid_host_reads):
    x = torch.tensor([-20.0, -3.0, -0.5, -1e-6, 0.0, 0.3, -math.inf, math.nan], dtype=dtype).reshape(2, 4)
    band_bounds(x, 0.05, divergence, solver=solver)
    band_bounds(x, 0.05, divergence, solver=solver, upper_max=10.0, relax=(0.2, 0.28))


# --------------------------------------------------------------------------------------------------------------
# CUDA (skipped without a device)
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("divergence", ["kl", "tv", "chi2", "js"])
@pytest.mark.parametrize("solver", ["torch", "auto"])
def test_cuda_no_host_sync(divergence, solver):
    x = torch.linspace(-20.0, 0.0, 4096, device="cuda").reshape(64, 64)
    band_bounds(x, 0.05, divergence, solver=solver, upper_max=10.0)  # warm-up: lazy imports, kernel compilation
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        band_bounds(x, 0.05, divergence, solver=solver)
        band_bounds(x, 0.05, divergence, solver=solver, upper_max=10.0, relax=(0.2, 0.28))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("solver", ["torch", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("radius", KL_RADII)
def test_cuda_kl_accuracy(solver, dtype, radius):
    lo, up = band_bounds(torch.tensor(GRID, dtype=dtype, device="cuda"), radius, "kl", solver=solver)
    assert lo.is_cuda and up.is_cuda and lo.dtype == dtype
    _assert_matches_reference(GRID, lo.cpu(), up.cpu(), radius, "kl", _tol(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("solver", ["torch", "auto"])
def test_cuda_edge_inputs_and_options(solver):
    x = torch.tensor([0.0, -math.inf, math.nan, 0.5, math.log(0.00713), math.log(0.6)], device="cuda")
    lo, up = band_bounds(x, 0.05, "kl", solver=solver, upper_max=10.0, relax=(0.2, 0.28))
    lo_cpu, up_cpu = band_bounds(x.cpu(), 0.05, "kl", solver="torch", upper_max=10.0, relax=(0.2, 0.28))
    torch.testing.assert_close(lo.cpu(), lo_cpu, rtol=2e-6, atol=2e-6, equal_nan=True)
    torch.testing.assert_close(up.cpu(), up_cpu, rtol=2e-6, atol=2e-6, equal_nan=True)
    for dtype in (torch.bfloat16, torch.float16):
        lo_h, _ = band_bounds(x.to(dtype), 0.05, "kl", solver=solver)
        assert lo_h.dtype == torch.float32


@pytest.mark.parametrize(
    "bad_input, dtype",
    [
        (torch.tensor([-1, -2]), "torch.int64"),
        (torch.tensor([True, False]), "torch.bool"),
        (torch.tensor([-1.0 + 0j]), "torch.complex64"),
    ],
    ids=["int64", "bool", "complex"],
)
@pytest.mark.parametrize("radius", [0.05, "tensor"])
def test_a_non_float_tensor_is_named_by_its_dtype(bad_input, dtype, radius):
    """A tensor of the wrong dtype is named by that dtype ("got Tensor" would say nothing), for a float radius and
    for a tensor of per-token radii."""
    radius = torch.full(bad_input.shape, 0.05) if radius == "tensor" else radius
    with pytest.raises(ValueError, match=rf"^old_logps must be floating point, got dtype {dtype}\.$"):
        band_bounds(bad_input, radius, "kl")
    with pytest.raises(ValueError, match=rf"old_logps must be floating point, got dtype {dtype}"):
        check_band_arguments(bad_input, radius, "kl")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("radius", [1e39, 1e300, 3e38])
@pytest.mark.parametrize("per_token", [False, True])
def test_chi2_at_p_one_with_a_huge_radius_is_one_one(dtype, radius, per_token):
    """chi2 at p = 1: w = sqrt(delta (1 - p) / p) = 0 whatever delta, so [1 - 0, min(1 + 0, 1/p)] = [1, 1]; a radius
    beyond float32 (inf after the cast) must not turn that 0 into inf * 0 = NaN. At p = 0.5, w = sqrt(delta) is
    huge: [0, 1/p] = [0, 2]."""
    logp = torch.tensor([0.0, math.log(0.5)], dtype=dtype)
    r = torch.full((2,), radius, dtype=torch.float64) if per_token else radius
    lower, upper = band_bounds(logp, r, "chi2", upper_max=None)
    assert lower.tolist() == [1.0, 0.0] and upper.tolist() == [1.0, 2.0]


def test_chi2_keeps_nan_for_a_nan_old_logp():
    lower, upper = band_bounds(torch.tensor([math.nan, 0.0]), 1e39, "chi2")
    assert math.isnan(lower[0]) and math.isnan(upper[0]) and lower[1] == upper[1] == 1.0

"""Tests of the fused Triton KL Band kernel (`trl_bandpo/kernels/band_kl.py`).

Every comparison runs on two backends (the `kernel_run` fixture):
- "interpreter": the kernel under `TRITON_INTERPRET=1` on CPU. The variable has to be set before the kernel module
  is imported and must not leak into this pytest process (other tests, and the CUDA backend below, need compiled
  kernels), so ONE subprocess (this file run as a script) computes the kernel's outputs for all cases and saves them;
  the mpmath reference is computed here meanwhile.
- "cuda" (`gpu` marker): the compiled kernel, in this process.
Outputs are checked against (a) an independent mpmath root of the binary-KL equation (docs/band-operator.md accuracy
targets: `2e-6 * max(1, r)` for float32 compute, `1e-6 * max(1, r)` for float64) and (b) the torch solver
`band_bounds(..., solver="torch")`. GPU-only tests below cover `torch.compile`, CUDA-graph capture and int64 indexing.

Per-token radii (docs/band-operator.md, "Per-token radius"): the "mixed" cases give each element its own radius in ONE
kernel call (per element, per row `(B, 1)`, 0-d, a bf16 radius tensor), checked against mpmath at each element's
radius and against the torch solver; the "bad-radius" cases put NaN / 0 / negative / infinite radii among good ones.
"""

import math
import os
import sys
import traceback

import pytest
import torch
from interpreter_subprocess import run_interpreter_subprocess

DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16, "fp16": torch.float16}
# (upper_max, relax) combinations; the authors trained with upper_max = 10, Relaxed Band uses (0.2, 0.28).
CONFIGS = {"plain": (None, None), "cap": (10.0, None), "relax": (None, (0.2, 0.28)), "cap+relax": (10.0, (0.2, 0.28))}
SPECIALS = [0.0, -0.0, 1e-3, 5.0, math.inf, -1e-45, -1e-30, -1e-12, -1e-7, -50.0, -87.0, -88.0, -100.0, -103.0]
SPECIALS += [-104.0, -200.0, -745.0, -746.0, -1e30, -math.inf, math.nan]
TOL = {torch.float32: 2e-6, torch.float64: 1e-6}  # docs/band-operator.md, relative to max(1, r), by compute dtype


def _compute_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _accuracy_logps(n_small: int, n_large: int) -> torch.Tensor:
    """Sorted log p over the accuracy domain of docs/band-operator.md: p log-spaced in [1e-8, 0.5], 1 - p
    log-spaced in [1e-7, 0.5]."""
    small_p = torch.logspace(-8, math.log10(0.5), n_small, dtype=torch.float64)
    one_minus_p = torch.logspace(-7, math.log10(0.5), n_large, dtype=torch.float64)
    return torch.cat([small_p.log(), torch.log1p(-one_minus_p)]).sort().values


def _broad_logps(seed: int) -> torch.Tensor:
    """1471 log p: SPECIALS, p log-uniform in [1e-12, 1], 1 - p log-uniform in [1e-12, 0.5], far tails."""
    g = torch.Generator().manual_seed(seed)
    u = lambda n: torch.rand(n, generator=g, dtype=torch.float64)  # noqa: E731
    parts = [
        torch.tensor(SPECIALS, dtype=torch.float64),
        (-12 + 12 * u(700)) * math.log(10),  # log p, p in [1e-12, 1]
        torch.log1p(-(10 ** (-12 + 11.7 * u(500)))),  # 1 - p in [1e-12, 0.5]
        -27 - 100 * u(250),  # p far below 1e-12
    ]
    return torch.cat(parts)


def build_cases() -> dict:
    """name -> dict(x, radius, config (a CONFIGS key), kind): the inputs every backend runs."""
    cases = {}
    grid = _accuracy_logps(100, 60).float()  # fp32 values, exact in fp64 too: one reference serves both
    for radius in (1e-3, 0.05, 1.0):
        for name in ("fp32", "fp64"):
            cases[f"acc-{name}-r{radius}"] = dict(x=grid.to(DTYPES[name]), radius=radius, config="plain", kind="acc")
    cases["acc-fp32-r0.05-cap+relax"] = dict(x=grid, radius=0.05, config="cap+relax", kind="acc")
    for name in ("bf16", "fp16"):
        half_grid = _accuracy_logps(50, 30).to(DTYPES[name])
        cases[f"acc-{name}-r0.05"] = dict(x=half_grid, radius=0.05, config="plain", kind="acc")
    for name, dtype in DTYPES.items():
        for radius in (0.05, 1.0):
            for i, config in enumerate(CONFIGS):
                x = _broad_logps(seed=i).to(dtype)
                if i == 1:  # 2-D, non-contiguous
                    x = x[:1470].reshape(30, 49).t()
                cases[f"broad-{name}-r{radius}-{config}"] = dict(x=x, radius=radius, config=config, kind="broad")
        # radius / tiny overflows for radius > ~4: the kernel must stay finite at p = 0 and p = 1
        for config in ("plain", "cap+relax"):
            x = torch.tensor(SPECIALS, dtype=torch.float64).to(dtype)
            cases[f"big-radius-{name}-{config}"] = dict(x=x, radius=5.0, config=config, kind="special")
    cases["empty"] = dict(x=torch.empty(2, 0), radius=0.05, config="plain", kind="empty")
    cases["empty-radius-tensor"] = dict(x=torch.empty(2, 0), radius=torch.empty(2, 1), config="plain", kind="empty")
    cases.update(_per_token_radius_cases(grid))
    cases.update(_monotone_cases())
    return cases


def _monotone_cases() -> dict:
    """One row per radius, log-spaced from the smallest accepted (float32's smallest normal) to 1e3, every row the
    same probabilities from 0 to 1: the bounds must tighten to 1 row after row as the radius shrinks (issue 33)."""
    from trl_bandpo.core.band import MIN_RADIUS

    radii = torch.logspace(math.log10(MIN_RADIUS), 3, 120, dtype=torch.float64).clamp(min=MIN_RADIUS)
    probs = torch.tensor([0.0, 1e-40, 1e-30, 1e-8, 1e-4, 0.01, 0.3, 0.38, 0.5, 0.9, 0.999, 1 - 1e-7, 1.0])
    x = probs.double().log().expand(len(radii), -1)
    return {
        f"monotone-{name}": dict(x=x.to(DTYPES[name]), radius=radii[:, None].to(DTYPES[name]), config="cap",
                                 kind="monotone")
        for name in ("fp32", "fp64")
    }  # fmt: skip


MIXED_RADII = (1e-3, 0.05, 1.0, 3.0)  # float32-exact below, so fp32 and fp64 compute see the same radii


def _per_token_radius_cases(grid: torch.Tensor) -> dict:
    """Cases with a tensor radius: "mixed" (checked against mpmath and torch), "bad-radius" (NaN where bad)."""
    radii = torch.tensor(MIXED_RADII, dtype=torch.float32)
    per_element = radii[torch.arange(grid.numel()) % len(MIXED_RADII)]
    cases = {}
    for name in ("fp32", "fp64"):
        x = grid.to(DTYPES[name])
        cases[f"mixed-{name}-per-token"] = dict(x=x, radius=per_element.to(x.dtype), config="plain", kind="mixed")
        rows = x.reshape(len(MIXED_RADII) * 2, -1)  # (8, 20): one radius per row
        row_radii = radii.repeat(2)[:, None].double()
        cases[f"mixed-{name}-per-row"] = dict(x=rows, radius=row_radii, config="plain", kind="mixed")
        zero_d = torch.tensor(0.3, dtype=torch.float32)
        cases[f"mixed-{name}-0d"] = dict(x=x, radius=zero_d, config="plain", kind="mixed")
    cases["mixed-fp32-cap+relax"] = dict(x=grid, radius=per_element, config="cap+relax", kind="mixed")
    cases["mixed-fp32-bf16-radius"] = dict(x=grid, radius=per_element.bfloat16(), config="plain", kind="mixed")
    bad = torch.tensor([math.nan, 0.0, -0.0, -0.05, math.inf, -math.inf, 0.05, 1.0], dtype=torch.float64)
    for name in ("fp32", "fp64", "bf16"):
        x = _broad_logps(seed=5)[:1464].to(DTYPES[name]).reshape(8, 183)
        radius = bad[torch.arange(x.numel()) % len(bad)].reshape(x.shape)
        for config in ("plain", "cap+relax"):
            cases[f"bad-radius-{name}-{config}"] = dict(x=x, radius=radius, config=config, kind="bad-radius")
    return cases


def run_kernel(cases: dict, device: str) -> dict:
    """name -> (lower, upper) on CPU, from `band_bounds(..., solver="triton")`."""
    from trl_bandpo.core.band import band_bounds

    out = {}
    for name, case in cases.items():
        upper_max, relax = CONFIGS[case["config"]]
        lower, upper = band_bounds(
            case["x"].to(device), _radius_on(case, device), solver="triton", upper_max=upper_max, relax=relax
        )
        out[name] = (lower.cpu(), upper.cpu())
    return out


def _radius_on(case: dict, device: str):
    radius = case["radius"]
    return radius.to(device) if torch.is_tensor(radius) else radius


def _interpreter_checks() -> dict:
    """Custom-op checks (schema, fake tensor, AOT dispatch) and torch.compile(fullgraph=True) on CPU."""
    from trl_bandpo.core.band import band_bounds
    from trl_bandpo.kernels import band_kl

    checks = {"interpreted": str(band_kl.INTERPRETED)}
    x = torch.linspace(-20, 0, 300).reshape(3, 100)
    per_token = torch.linspace(0.01, 2.0, 300).reshape(3, 100)
    try:
        op = torch.ops.trl_bandpo.band_bounds_kl.default
        for args in (
            (x, 0.05, 10.0, 0.2, 0.28),
            (x.double(), 0.05, None, None, None),
            (x.bfloat16(), 1.0, None, 0.1, 0.1),
            # per-token radii (the float radius is then unused): per element, per row, 0-d; no NaN (opcheck compares
            # outputs with assert_close, where NaN != NaN: the bad-radius cases check NaN)
            (x, 1.0, 10.0, 0.2, 0.28, per_token),
            (x.double(), 1.0, None, None, None, torch.tensor([[0.05], [3.0], [1.0]])),
            (x.bfloat16(), 1.0, None, 0.1, 0.1, torch.tensor(0.3, dtype=torch.float64)),
        ):
            torch.library.opcheck(op, args)
        checks["opcheck"] = "ok"
    except Exception:
        checks["opcheck"] = traceback.format_exc()
    try:
        for radius in (0.05, per_token, per_token[:, :1]):
            fn = lambda t, r=radius: band_bounds(t, r, solver="triton", upper_max=10.0, relax=(0.2, 0.28))  # noqa: E731
            compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
            if not all(torch.equal(a, b) for a, b in zip(compiled(x), fn(x))):
                raise AssertionError(f"compiled and eager outputs differ (radius {type(radius).__name__})")
        checks["compile"] = "ok"
    except Exception:
        checks["compile"] = traceback.format_exc()
    return checks


def _worker(cases_path: str, out_path: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    cases = torch.load(cases_path)
    if cases == SELF_CHECK:  # the self-check scenarios below, each run in this interpreted process
        torch.save(_self_check_worker(), out_path)
        return
    torch.save({"outputs": run_kernel(cases, "cpu"), "checks": _interpreter_checks()}, out_path)


# ---------------------------------------------------------------------------------------------------------------
# The kernel's one-time check against the torch solver (trl_bandpo/kernels/self_check.py), run under the interpreter:
# each scenario starts from an unchecked process state, with the launcher healthy or faulty.

SELF_CHECK = "self-check"
FAULT_INDEX = 10  # the grid element whose float32 upper bound at radius 0.05 the faulty launcher perturbs


def _self_check_scenarios() -> dict:
    """name -> callable(harness) raising on failure; `harness` gives the fault, a launch count and warnings."""
    import warnings

    from trl_bandpo.core.band import band_bounds
    from trl_bandpo.kernels import self_check

    x = torch.linspace(-20.0, 0.0, 300).reshape(3, 100)
    torch_bounds = band_bounds(x, 0.05, solver="torch")
    check_launches = 2 * (len(self_check.CHECK_RADII) + 1)  # float32 and float64: each float radius, one per-token

    def same(a, b):
        return all(torch.equal(u, v) for u, v in zip(a, b))

    def check_warnings(record):
        return [w for w in record if issubclass(w.category, self_check.KernelCheckWarning)]

    def healthy(h):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            first = band_bounds(x, 0.05)
        assert not check_warnings(record), [str(w.message) for w in record]
        assert self_check.kernel_check_verdicts() == {"cpu": None}
        assert h.launches == check_launches + 1, h.launches  # the check, then this call: the kernel is used
        assert not same(first, torch_bounds)  # the kernel's bits, not the torch solver's
        # once per process and device: later calls neither re-check nor read values on the host
        h.forbid_host_reads()
        h.monkeypatch.setattr(self_check, "compare_kernel_with_torch", h.fail)
        band_bounds(x, 0.05)
        band_bounds(x, torch.full((3, 1), 0.3))
        band_bounds(x.double(), 1.0, solver="triton")
        assert h.launches == check_launches + 4

    def faulty_auto_warns_once_and_falls_back(h):
        h.inject_fault()
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            first = band_bounds(x, 0.05)
            second = band_bounds(x, 0.05)
        found = check_warnings(record)
        assert len(found) == 1, [str(w.message) for w in record]
        message = str(found[0].message)
        grid = self_check._grid(torch.float32, "cpu")
        p = math.exp(float(grid[FAULT_INDEX]))
        want = band_bounds(grid, 0.05, solver="torch")[1][FAULT_INDEX].item()
        perturbed = (h.original(grid, 0.05)[1][FAULT_INDEX] * 1.001).item()  # float32 arithmetic, as the fault's
        for part in ("float32 upper bound", f"p = {p:.6g}", "radius = 0.05", f"kernel {perturbed!r}",
                     f"torch solver {want!r}", "uses the torch solver", "TRL_BANDPO_KL_KERNEL=trust"):  # fmt: skip
            assert part in message, (part, message)
        assert same(first, torch_bounds) and same(second, torch_bounds)
        assert h.launches == check_launches  # the check only: then the torch solver
        assert "disagrees with the torch solver" in self_check.kernel_check_verdicts()["cpu"]
        # an explicit request for the kernel is an error, not a silent switch
        with pytest.raises(ValueError, match="solver='triton' cannot run here: the Triton KL kernel disagrees"):
            band_bounds(x, 0.05, solver="triton")
        assert h.launches == check_launches

    def faulty_explicit_triton_raises(h):
        h.inject_fault()
        with pytest.warns(self_check.KernelCheckWarning, match=r"p = .*radius = 0\.05"):
            with pytest.raises(ValueError, match="one-time check on cpu: float32 upper bound"):
                band_bounds(x, 0.05, solver="triton")

    def faulty_first_use_under_compile(h):
        h.inject_fault()
        fn = lambda t: band_bounds(t, 0.05, upper_max=10.0)  # noqa: E731
        with pytest.warns(self_check.KernelCheckWarning):
            got = torch.compile(fn, backend="aot_eager", fullgraph=True)(x)
        assert same(got, band_bounds(x, 0.05, upper_max=10.0, solver="torch"))

    def failing_launcher_falls_back(h):
        h.monkeypatch.setattr(h.band_kl, "_band_kl_launch", h.fail)
        with pytest.warns(self_check.KernelCheckWarning, match="failed to run .* on cpu .*RuntimeError: injected"):
            assert same(band_bounds(x, 0.05), torch_bounds)

    def trust_skips_the_check(h):
        h.inject_fault()
        h.monkeypatch.setenv("TRL_BANDPO_KL_KERNEL", "trust")
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            band_bounds(x, 0.05)
        assert not check_warnings(record) and self_check.kernel_check_verdicts() == {}
        assert h.launches == 1

    def off_never_uses_the_kernel(h):
        h.monkeypatch.setenv("TRL_BANDPO_KL_KERNEL", " OFF ")
        assert same(band_bounds(x, 0.05), torch_bounds) and h.launches == 0
        with pytest.raises(ValueError, match="TRL_BANDPO_KL_KERNEL=off turns the Triton KL kernel off"):
            band_bounds(x, 0.05, solver="triton")

    def bad_value_is_a_clear_error(h):
        h.monkeypatch.setenv("TRL_BANDPO_KL_KERNEL", "sometimes")
        for solver in ("auto", "triton"):
            with pytest.raises(ValueError, match=r"TRL_BANDPO_KL_KERNEL='sometimes' is not one of \['auto', 'tr"):
                band_bounds(x, 0.05, solver=solver)
        assert same(band_bounds(x, 0.05, solver="torch"), torch_bounds) and h.launches == 0

    scenarios = (
        healthy,
        faulty_auto_warns_once_and_falls_back,
        faulty_explicit_triton_raises,
        faulty_first_use_under_compile,
        failing_launcher_falls_back,
        trust_skips_the_check,
        off_never_uses_the_kernel,
        bad_value_is_a_clear_error,
    )
    return {f.__name__: f for f in scenarios}


class _SelfCheckHarness:
    """Counts launcher calls, injects faults into the launcher, forbids host reads; undone by `monkeypatch`."""

    def __init__(self, monkeypatch):
        from trl_bandpo.kernels import band_kl

        self.monkeypatch, self.band_kl, self.launches = monkeypatch, band_kl, 0
        self.original = band_kl._band_kl_launch
        monkeypatch.setattr(band_kl, "_band_kl_launch", self._counted)

    def _counted(self, *args, **kwargs):
        self.launches += 1
        return self.original(*args, **kwargs)

    def inject_fault(self):
        """float32, float radius 0.05: the upper bound at FAULT_INDEX 0.1% high, beyond the 2e-6 tolerance."""

        def faulty(old_logps, radius, *args, **kwargs):
            lower, upper = self._counted(old_logps, radius, *args, **kwargs)
            if old_logps.dtype == torch.float32 and not torch.is_tensor(radius) and radius == 0.05:
                upper = upper.clone()
                upper.view(-1)[FAULT_INDEX] *= 1.001
            return lower, upper

        self.monkeypatch.setattr(self.band_kl, "_band_kl_launch", faulty)

    @staticmethod
    def fail(*args, **kwargs):
        raise RuntimeError("injected")

    def forbid_host_reads(self):
        for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
            self.monkeypatch.setattr(torch.Tensor, name, self.fail)


def _self_check_worker() -> dict:
    """scenario name -> "ok" or its traceback."""
    results = {}
    try:
        from trl_bandpo.kernels import self_check

        scenarios = _self_check_scenarios()
    except Exception:
        return {"import": traceback.format_exc()}
    for name, scenario in scenarios.items():
        self_check._verdicts.clear()  # a fresh process, as far as the check knows
        try:
            with pytest.MonkeyPatch.context() as monkeypatch:
                monkeypatch.delenv("TRL_BANDPO_KL_KERNEL", raising=False)
                scenario(_SelfCheckHarness(monkeypatch))
            results[name] = "ok"
        except BaseException:
            results[name] = traceback.format_exc()
    self_check._verdicts.clear()
    return results


# ---------------------------------------------------------------------------------------------------------------
# Independent reference: bracketed Newton on log r in mpmath (30 digits),
# straight from the scalar constraint in docs/band-operator.md.


def _mp_bounds(logp: float, radius: float) -> tuple[float, float]:
    """Both roots of KL(Bern(p) || Bern(r p)) = radius, as functions of log r, by bracketed Newton in mpmath."""
    import mpmath as mp

    with mp.workdps(30):
        p, delta = mp.exp(mp.mpf(logp)), mp.mpf(radius)

        def g(log_r):  # binary KL minus delta, and its derivative in log r: (q - p) / (1 - q)
            q = p * mp.exp(log_r)
            if q >= 1:  # log r rounded onto log(1/p): the simplex limit, where g is infinite
                return mp.inf, mp.inf
            return p * mp.log(p / q) + (1 - p) * mp.log((1 - p) / (1 - q)) - delta, (q - p) / (1 - q)

        def root(lo, hi):  # g(lo) and g(hi) of opposite signs; Newton, bisecting whenever it leaves the bracket
            lo_positive = g(lo)[0] > 0
            x = (lo + hi) / 2
            for _ in range(200):
                value, slope = g(x)
                if value == 0:
                    return x
                if (value > 0) == lo_positive:
                    lo = x
                else:
                    hi = x
                step = value / slope if mp.isfinite(value) and slope != 0 else mp.inf
                x_new = x - step
                if not (min(lo, hi) < x_new < max(lo, hi)):
                    x_new = (lo + hi) / 2
                if abs(x_new - x) <= mp.mpf(10) ** -25 * max(1, abs(x)):
                    return x_new
                x = x_new
            raise AssertionError(f"mpmath reference did not converge at log p = {logp!r}")

        lo = mp.mpf(-1)  # lower root: g decreases in log r < 0 and tends to +inf
        while g(lo)[0] < 0:
            lo *= 2
        lower = mp.exp(root(lo, mp.mpf(0)))
        upper = mp.exp(root(mp.mpf(0), -mp.log(p)))  # upper root: g increases on (0, log 1/p)
        return float(lower), float(upper)


def mp_reference(cases: dict) -> dict:
    """name -> (lower, upper) float64 references for the "acc" and "mixed" cases (no cap / relax applied), each
    element at its own radius."""
    cache, out = {}, {}
    for name, case in cases.items():
        if case["kind"] not in ("acc", "mixed"):
            continue
        x, radius = case["x"].double(), case["radius"]
        radii = radius.double().expand(x.shape).reshape(-1).tolist() if torch.is_tensor(radius) else None
        pairs = []
        for i, v in enumerate(x.reshape(-1).tolist()):
            key = (v, radius if radii is None else radii[i])
            if key not in cache:
                cache[key] = _mp_bounds(*key)
            pairs.append(cache[key])
        out[name] = tuple(torch.tensor(side, dtype=torch.float64).reshape(x.shape) for side in zip(*pairs))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def cases():
    return build_cases()


@pytest.fixture(scope="module")
def reference(cases):
    return mp_reference(cases)


@pytest.fixture(scope="module", params=["interpreter", pytest.param("cuda", marks=pytest.mark.gpu)])
def kernel_run(request, cases, tmp_path_factory):
    """(device the torch solver should run on, name -> kernel (lower, upper), extra checks)."""
    if request.param == "cuda":
        return "cuda", run_kernel(cases, "cuda"), {}
    pytest.importorskip("triton")
    result = run_interpreter_subprocess(
        __file__,
        cases,
        str(tmp_path_factory.mktemp("interpreter")),
        while_running=lambda: request.getfixturevalue("reference"),  # computed while the interpreter runs
    )
    return "cpu", result["outputs"], result["checks"]


def _torch_solver(case, device):
    from trl_bandpo.core.band import band_bounds

    upper_max, relax = CONFIGS[case["config"]]
    lower, upper = band_bounds(
        case["x"].to(device), _radius_on(case, device), solver="torch", upper_max=upper_max, relax=relax
    )
    return lower.cpu(), upper.cpu()


def _names(kind, cases=None):
    return [name for name, case in (cases or build_cases()).items() if case["kind"] == kind]


# ---------------------------------------------------------------------------------------------------------------
# Tests


def test_output_dtype_and_shape(kernel_run, cases):
    _, outputs, _ = kernel_run
    for name, case in cases.items():
        for bound in outputs[name]:
            assert bound.shape == case["x"].shape, name
            assert bound.dtype == _compute_dtype(case["x"].dtype), name


@pytest.mark.parametrize("name", _names("acc") + _names("mixed"))
def test_accuracy_against_mpmath(kernel_run, reference, cases, name):
    _, outputs, _ = kernel_run
    case = cases[name]
    tol = TOL[_compute_dtype(case["x"].dtype)]
    upper_max, relax = CONFIGS[case["config"]]
    ref_lower, ref_upper = reference[name]
    if upper_max is not None:
        ref_upper = ref_upper.clamp(max=upper_max)
    if relax is not None:
        ref_lower, ref_upper = ref_lower.clamp(max=1 - relax[0]), ref_upper.clamp(min=1 + relax[1])
    for got, ref, side in zip(outputs[name], (ref_lower, ref_upper), ("lower", "upper")):
        got, ref = got.double().reshape(-1), ref.reshape(-1)
        err = (got - ref).abs() / ref.clamp(min=1.0)
        worst = int(err.argmax())
        assert err.max() <= tol, (
            f"{name} {side}: relative error {err.max().item():.3g} > {tol} at log p = "
            f"{case['x'].double().reshape(-1)[worst].item()!r}: got {got[worst].item()!r}, exact {ref[worst].item()!r}"
        )


@pytest.mark.parametrize("name", _names("monotone"))
def test_bounds_are_monotone_in_the_radius(kernel_run, cases, name):
    """Before: at float32 radii below ~1e-15 Newton started at t = 0 and p = 0.5 got [0.89, 1.11]."""
    _, outputs, _ = kernel_run
    lower, upper = outputs[name]
    assert not (lower.isnan().any() or upper.isnan().any())
    assert (lower[1:] <= lower[:-1]).all() and (upper[1:] >= upper[:-1]).all()
    assert (lower <= 1).all() and (upper >= 1).all()


@pytest.mark.parametrize(
    "name", [n for k in ("acc", "broad", "special", "mixed", "bad-radius", "monotone") for n in _names(k)]
)
def test_matches_torch_solver(kernel_run, cases, name):
    device, outputs, _ = kernel_run
    case = cases[name]
    compute_dtype = _compute_dtype(case["x"].dtype)
    # Same algorithm and step count: the two differ by the rounding of exp / expm1 / log1p / division only.
    tol = 4e-6 if compute_dtype == torch.float32 else 1e-12
    for got, want, side in zip(outputs[name], _torch_solver(case, device), ("lower", "upper")):
        assert torch.equal(got.isnan(), want.isnan()), f"{name} {side}: NaN positions differ"
        assert torch.equal(got.isinf(), want.isinf()), f"{name} {side}: inf positions differ"
        finite = want.isfinite()
        got, want = got[finite].double(), want[finite].double()
        err = (got - want).abs() / want.abs().clamp(min=1.0)
        assert err.max() <= tol, f"{name} {side}: relative difference {err.max().item():.3g} > {tol}"


@pytest.mark.parametrize("name", _names("broad") + _names("special"))
def test_special_inputs(kernel_run, cases, name):
    """p = 1 (log p >= 0) -> [e^-delta, 1], p = 0 -> [0, cap], NaN -> NaN, then the cap and the relax union."""
    _, outputs, _ = kernel_run
    case = cases[name]
    lower, upper = (bound.double().reshape(-1) for bound in outputs[name])
    x = case["x"].double().reshape(-1)
    dtype = _compute_dtype(case["x"].dtype)
    upper_max, relax = CONFIGS[case["config"]]
    eps_low, eps_high = relax if relax is not None else (None, None)
    cap = torch.finfo(dtype).max if upper_max is None else upper_max

    assert lower[x.isnan()].isnan().all() and upper[x.isnan()].isnan().all()
    one = x >= 0
    want_lower = math.exp(-case["radius"]) if eps_low is None else min(math.exp(-case["radius"]), 1 - eps_low)
    assert torch.allclose(lower[one], torch.full_like(lower[one], want_lower), rtol=2e-6, atol=0)
    assert (upper[one] == (1.0 if eps_high is None else float(torch.tensor(1 + eps_high, dtype=dtype)))).all()
    zero = x == -math.inf
    assert (lower[zero] == 0).all()
    assert (upper[zero] == (cap if eps_high is None else max(cap, 1 + eps_high))).all()
    finite = ~x.isnan()
    assert (lower[finite] >= 0).all() and (lower[finite] <= 1).all()
    assert (upper[finite] >= 1).all() and (upper[finite] <= cap).all()


@pytest.mark.parametrize("name", _names("bad-radius"))
def test_bad_radius_elements_give_nan_locally(kernel_run, cases, name):
    """A radius that is NaN, +-inf or <= 0 gives NaN bounds at its element; every other element is finite unless its
    log-probability is NaN (the torch solver, compared above, agrees on the values)."""
    _, outputs, _ = kernel_run
    case = cases[name]
    radius, x = case["radius"], case["x"].double()
    bad = ~(torch.isfinite(radius) & (radius > 0))
    for bound in outputs[name]:
        assert bool(bound[bad].isnan().all())
        assert torch.equal(bound[~bad].isnan(), x[~bad].isnan())


@pytest.mark.parametrize("name", _names("acc"))
def test_monotone_in_p(kernel_run, cases, name):
    """On the sorted grid: lower non-decreasing, upper non-increasing in p (up to the last float32 bits)."""
    _, outputs, _ = kernel_run
    slack = 4 * torch.finfo(_compute_dtype(cases[name]["x"].dtype)).eps
    lower, upper = (bound.double() for bound in outputs[name])
    assert (lower.diff() >= -slack * lower[1:]).all()
    assert (upper.diff() <= slack * upper[1:]).all()


def test_reference_matches_spec_table():
    """The mpmath reference reproduces the table of docs/band-operator.md (KL, delta = 0.05): it can judge."""
    table = {0.01: (0.002497385719, 7.809846290), 0.2: (0.4759413514, 1.717678517), 0.999: (0.9473993120, 1.001001001)}
    for p, (lower, upper) in table.items():
        got = _mp_bounds(math.log(p), 0.05)
        assert got[0] == pytest.approx(lower, rel=1e-9) and got[1] == pytest.approx(upper, rel=1e-9)


def test_interpreter_custom_op_and_compile(kernel_run):
    """Only for the interpreter run: opcheck of the custom op and torch.compile(fullgraph=True, aot_eager)."""
    device, _, checks = kernel_run
    if device != "cpu":
        pytest.skip("the CUDA run checks these in the gpu tests")
    assert checks["interpreted"] == "True"
    assert checks["opcheck"] == "ok", checks["opcheck"]
    assert checks["compile"] == "ok", checks["compile"]


SELF_CHECK_SCENARIOS = [
    "healthy",
    "faulty_auto_warns_once_and_falls_back",
    "faulty_explicit_triton_raises",
    "faulty_first_use_under_compile",
    "failing_launcher_falls_back",
    "trust_skips_the_check",
    "off_never_uses_the_kernel",
    "bad_value_is_a_clear_error",
]


@pytest.fixture(scope="module")
def self_check_results(tmp_path_factory):
    pytest.importorskip("triton")
    return run_interpreter_subprocess(__file__, SELF_CHECK, str(tmp_path_factory.mktemp("self_check")))


@pytest.mark.parametrize("scenario", SELF_CHECK_SCENARIOS)
def test_kernel_self_check_under_the_interpreter(self_check_results, scenario):
    """The kernel's one-time check against the torch solver (docs/band-operator.md, "Solvers and speed"): a healthy
    kernel is used without a warning, checked once, with no host read afterwards; a perturbed upper bound warns once
    naming p, radius and both values, and "auto" then solves with torch while "triton" raises;
    TRL_BANDPO_KL_KERNEL=trust skips the check, =off never uses the kernel, any other value is an error."""
    assert "import" not in self_check_results, self_check_results["import"]
    assert sorted(self_check_results) == sorted(SELF_CHECK_SCENARIOS)
    assert self_check_results[scenario] == "ok", self_check_results[scenario]


def test_kernel_self_check_mode_and_result_without_triton(monkeypatch):
    """The switch and the report need no kernel: unset/empty is "auto", values are case-blind, others are refused."""
    from trl_bandpo.kernels.self_check import ENV_VAR, CheckResult, kl_kernel_mode

    assert ENV_VAR == "TRL_BANDPO_KL_KERNEL"
    for value, mode in (("", "auto"), ("auto", "auto"), ("Trust", "trust"), (" off ", "off")):
        monkeypatch.setenv(ENV_VAR, value)
        assert kl_kernel_mode() == mode
    monkeypatch.delenv(ENV_VAR)
    assert kl_kernel_mode() == "auto"
    monkeypatch.setenv(ENV_VAR, "torch")
    with pytest.raises(ValueError, match="TRL_BANDPO_KL_KERNEL='torch' is not one of"):
        kl_kernel_mode()
    result = CheckResult(torch.float32, "upper", 1e-6, 1.0, 1.5, 1.25, 0.2, 2e-6)
    assert not result.ok and CheckResult(torch.float64, "lower", 0.5, 0.05, 0.7, 0.7, 0.0, 1e-6).ok
    assert result.describe() == (
        "float32 upper bound at p = 1e-06, radius = 1: kernel 1.5, torch solver 1.25 "
        "(difference 0.2 x max(1, r), tolerance 2e-06)"
    )


def test_cpu_without_interpreter_is_refused():
    """Without TRITON_INTERPRET, `solver="triton"` on CPU is a clear error and "auto" falls back to torch."""
    from trl_bandpo.core.band import band_bounds

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process runs the interpreter")
    x = torch.tensor([-1.0, -0.1])
    with pytest.raises(ValueError, match="solver='triton' cannot run here"):
        band_bounds(x, 0.05, solver="triton")
    auto = band_bounds(x, 0.05, solver="auto")
    assert all(torch.equal(a, b) for a, b in zip(auto, band_bounds(x, 0.05, solver="torch")))


# ---------------------------------------------------------------------------------------------------------------
# GPU only


def _gpu_input(n=1 << 16, dtype=torch.float32):
    g = torch.Generator(device="cuda").manual_seed(0)
    return (torch.rand(n, device="cuda", generator=g, dtype=torch.float64) * -20).to(dtype)


@pytest.mark.gpu
def test_gpu_auto_uses_triton():
    import trl_bandpo.kernels.band_kl as band_kl
    from trl_bandpo.core.band import band_bounds

    x = _gpu_input()
    calls = []
    original = band_kl._band_kl_launch
    band_kl._band_kl_launch = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        band_bounds(x, 0.05)
    finally:
        band_kl._band_kl_launch = original
    assert calls, "solver='auto' did not run the Triton kernel on a CUDA tensor"


@pytest.mark.gpu
def test_gpu_self_check_passes(monkeypatch):
    """The one-time check on this GPU: the compiled kernel agrees with the torch solver within the accuracy targets,
    and `band_bounds(solver="auto")` keeps the kernel (no KernelCheckWarning)."""
    import warnings

    from trl_bandpo.core.band import band_bounds
    from trl_bandpo.kernels import self_check

    monkeypatch.delenv(self_check.ENV_VAR, raising=False)
    result = self_check.compare_kernel_with_torch("cuda")
    assert result.ok, result.describe()
    print(f"worst kernel-vs-torch difference: {result.describe()}")
    with warnings.catch_warnings():
        warnings.simplefilter("error", self_check.KernelCheckWarning)
        band_bounds(_gpu_input(), 0.05)
    assert self_check.kernel_check_verdicts()[str(torch.empty(0, device="cuda").device)] is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_gpu_large_matches_torch(dtype):
    """Many programs and a ragged tail (2^21 + 3 elements)."""
    from trl_bandpo.core.band import band_bounds

    x = _gpu_input((1 << 21) + 3, dtype)
    got = band_bounds(x, 0.05, solver="triton", upper_max=10.0)
    want = band_bounds(x, 0.05, solver="torch", upper_max=10.0)
    tol = 4e-6 if dtype != torch.float64 else 1e-12
    for a, b in zip(got, want):
        assert ((a.double() - b.double()).abs() / b.double().abs().clamp(min=1)).max().item() <= tol


@pytest.mark.gpu
def test_gpu_torch_compile_fullgraph():
    from trl_bandpo.core.band import band_bounds

    def loss(logps, old_logps, adv):
        lower, upper = band_bounds(old_logps, 0.05, upper_max=10.0)
        ratio = torch.exp(logps - old_logps)
        return -torch.minimum(ratio * adv, torch.clamp(ratio, lower, upper) * adv).mean()

    old = _gpu_input()
    logps = (old + 0.1 * torch.randn_like(old)).requires_grad_()
    adv = torch.randn_like(old)
    eager = loss(logps, old, adv)
    compiled = torch.compile(loss, fullgraph=True)(logps, old, adv)
    torch.testing.assert_close(compiled, eager)
    compiled.backward()
    assert logps.grad is not None and logps.grad.isfinite().all()


@pytest.mark.gpu
def test_gpu_cuda_graph_capture():
    from trl_bandpo.core.band import band_bounds

    x = _gpu_input()
    band_bounds(x, 0.05, solver="triton", relax=(0.2, 0.28))  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lower, upper = band_bounds(x, 0.05, solver="triton", relax=(0.2, 0.28))
    x.copy_(_gpu_input() * 0.5)
    graph.replay()
    torch.cuda.synchronize()
    want = band_bounds(x, 0.05, solver="torch", relax=(0.2, 0.28))
    torch.testing.assert_close(lower, want[0], rtol=4e-6, atol=4e-6)
    torch.testing.assert_close(upper, want[1], rtol=4e-6, atol=4e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_gpu_per_token_radius_large_matches_torch(dtype):
    """The per-token radius path (verified under the interpreter only until this runs): per element, per row, 0-d
    and bad elements, over many programs and a ragged tail."""
    from trl_bandpo.core.band import band_bounds

    x = _gpu_input((1 << 21) + 3, dtype)
    g = torch.Generator(device="cuda").manual_seed(1)
    per_token = torch.rand(x.shape, device="cuda", generator=g, dtype=torch.float64) * 3 + 1e-3
    per_token[::1001] = math.nan
    per_token[1::1001] = -1.0
    rows = x[: (1 << 21)].reshape(1024, -1)
    tol = 4e-6 if dtype != torch.float64 else 1e-12
    for old, radius in ((x, per_token), (rows, per_token[:1024, None]), (x, torch.tensor(0.3, device="cuda"))):
        got = band_bounds(old, radius, solver="triton", upper_max=10.0)
        want = band_bounds(old, radius, solver="torch", upper_max=10.0)
        for a, b in zip(got, want):
            assert torch.equal(a.isnan(), b.isnan())
            finite = b.isfinite()
            a, b = a[finite].double(), b[finite].double()
            assert ((a - b).abs() / b.abs().clamp(min=1)).max().item() <= tol


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_per_token_radius():
    """Radii updated in place between replays, as a schedule would: no host read, the graph sees the new values."""
    from trl_bandpo.core.band import band_bounds

    x = _gpu_input()
    radius = torch.full_like(x, 0.05)
    band_bounds(x, radius, solver="triton", upper_max=10.0)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lower, upper = band_bounds(x, radius, solver="triton", upper_max=10.0)
    radius.copy_(torch.linspace(0.01, 2.0, x.numel(), device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    want = band_bounds(x, radius, solver="torch", upper_max=10.0)
    torch.testing.assert_close(lower, want[0], rtol=4e-6, atol=4e-6)
    torch.testing.assert_close(upper, want[1], rtol=4e-6, atol=4e-6)


@pytest.mark.gpu
def test_gpu_int64_indexing():
    """More than 2^31 elements: the program offsets must not overflow int32."""
    from trl_bandpo.core.band import band_bounds

    n = (1 << 31) + 1000
    if torch.cuda.get_device_properties(0).total_memory < 40 * n:
        pytest.skip("needs ~30 GB of GPU memory")
    x = torch.full((n,), -2.0, device="cuda")
    tail = _gpu_input(1000)
    x[-1000:] = tail
    lower, upper = band_bounds(x, 0.05, solver="triton")
    want = band_bounds(tail, 0.05, solver="torch")
    torch.testing.assert_close(lower[-1000:], want[0], rtol=4e-6, atol=4e-6)
    torch.testing.assert_close(upper[-1000:], want[1], rtol=4e-6, atol=4e-6)


if __name__ == "__main__":  # the interpreter subprocess of `kernel_run`
    _worker(sys.argv[1], sys.argv[2])

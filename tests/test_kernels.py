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
    return cases


def run_kernel(cases: dict, device: str) -> dict:
    """name -> (lower, upper) on CPU, from `band_bounds(..., solver="triton")`."""
    from trl_bandpo.band import band_bounds

    out = {}
    for name, case in cases.items():
        upper_max, relax = CONFIGS[case["config"]]
        lower, upper = band_bounds(
            case["x"].to(device), case["radius"], solver="triton", upper_max=upper_max, relax=relax
        )
        out[name] = (lower.cpu(), upper.cpu())
    return out


def _interpreter_checks() -> dict:
    """Custom-op checks (schema, fake tensor, AOT dispatch) and torch.compile(fullgraph=True) on CPU."""
    from trl_bandpo.band import band_bounds
    from trl_bandpo.kernels import band_kl

    checks = {"interpreted": str(band_kl.INTERPRETED)}
    x = torch.linspace(-20, 0, 300).reshape(3, 100)
    try:
        op = torch.ops.trl_bandpo.band_bounds_kl.default
        for args in (
            (x, 0.05, 10.0, 0.2, 0.28),
            (x.double(), 0.05, None, None, None),
            (x.bfloat16(), 1.0, None, 0.1, 0.1),
        ):
            torch.library.opcheck(op, args)
        checks["opcheck"] = "ok"
    except Exception:
        checks["opcheck"] = traceback.format_exc()
    try:
        fn = lambda t: band_bounds(t, 0.05, solver="triton", upper_max=10.0, relax=(0.2, 0.28))  # noqa: E731
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
        same = all(torch.equal(a, b) for a, b in zip(compiled(x), fn(x)))
        checks["compile"] = "ok" if same else "compiled and eager outputs differ"
    except Exception:
        checks["compile"] = traceback.format_exc()
    return checks


def _worker(cases_path: str, out_path: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    cases = torch.load(cases_path)
    torch.save({"outputs": run_kernel(cases, "cpu"), "checks": _interpreter_checks()}, out_path)


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
    """name -> (lower, upper) float64 references for the "acc" cases (no cap / relax applied)."""
    cache, out = {}, {}
    for name, case in cases.items():
        if case["kind"] != "acc":
            continue
        pairs = []
        for v in case["x"].double().tolist():
            key = (v, case["radius"])
            if key not in cache:
                cache[key] = _mp_bounds(v, case["radius"])
            pairs.append(cache[key])
        out[name] = tuple(torch.tensor(side, dtype=torch.float64) for side in zip(*pairs))
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
    from trl_bandpo.band import band_bounds

    upper_max, relax = CONFIGS[case["config"]]
    lower, upper = band_bounds(case["x"].to(device), case["radius"], solver="torch", upper_max=upper_max, relax=relax)
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


@pytest.mark.parametrize("name", _names("acc"))
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
        err = (got.double() - ref).abs() / ref.clamp(min=1.0)
        worst = int(err.argmax())
        assert err.max() <= tol, (
            f"{name} {side}: relative error {err.max().item():.3g} > {tol} at log p = "
            f"{case['x'].double()[worst].item()!r}: got {got[worst].item()!r}, exact {ref[worst].item()!r}"
        )


@pytest.mark.parametrize("name", _names("acc") + _names("broad") + _names("special"))
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


def test_cpu_without_interpreter_is_refused():
    """Without TRITON_INTERPRET, `solver="triton"` on CPU is a clear error and "auto" falls back to torch."""
    from trl_bandpo.band import band_bounds

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
    from trl_bandpo.band import band_bounds

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
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_gpu_large_matches_torch(dtype):
    """Many programs and a ragged tail (2^21 + 3 elements)."""
    from trl_bandpo.band import band_bounds

    x = _gpu_input((1 << 21) + 3, dtype)
    got = band_bounds(x, 0.05, solver="triton", upper_max=10.0)
    want = band_bounds(x, 0.05, solver="torch", upper_max=10.0)
    tol = 4e-6 if dtype != torch.float64 else 1e-12
    for a, b in zip(got, want):
        assert ((a.double() - b.double()).abs() / b.double().abs().clamp(min=1)).max().item() <= tol


@pytest.mark.gpu
def test_gpu_torch_compile_fullgraph():
    from trl_bandpo.band import band_bounds

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
    from trl_bandpo.band import band_bounds

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
def test_gpu_int64_indexing():
    """More than 2^31 elements: the program offsets must not overflow int32."""
    from trl_bandpo.band import band_bounds

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

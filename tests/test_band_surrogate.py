"""Tests of the fused Band-clipped surrogate kernel (`trl_bandpo/kernels/band_surrogate.py`).

The reference is the torch path, `band_bounds(..., solver="torch")` + `clipped_surrogate_loss` differentiated by
autograd (`band_clipped_surrogate(..., solver="torch")`). As in tests/test_kernels.py, every comparison runs on two
backends (the `kernel_run` fixture):
- "interpreter": the kernel under `TRITON_INTERPRET=1` on CPU, in ONE subprocess (this file run as a script; the
  variable must be set before the kernel module is imported and must not leak into this process), which computes
  the kernel's loss and gradient for all cases and saves them; the references are computed here meanwhile.
- "cuda" (`gpu` marker): the compiled kernel, in this process.

Inputs: old log-probs over the accuracy domain of docs/band-operator.md (p in [1e-8, 1 - 1e-7], both ends included),
current log-probs placed relative to the float64 Band bounds so that every region is hit (inside, above the upper
bound, below the lower one, beyond the dual-clip constant), advantages of both signs per row `(B, 1)` or per token
`(B, T)` with zeros, a random upstream gradient. Tolerances (see TOL_*): float32 compute agrees to the solvers'
~4e-6 difference in the bounds and a few ulps elsewhere; half-precision inputs are compared with the torch path on
the same values upcast to float32 (the kernel's precision, docs/band-operator.md) to the output's rounding, and
loosely with the torch path in half precision.
Gradients are compared on tokens whose region cannot flip by those differences (1e-5 relative from a bound in
float32); at exact ties (`r == upper == delta`, products that round equal, infinite advantages) they must be equal.
"""

import math
import os
import sys
import traceback

import pytest
import torch
from interpreter_subprocess import run_interpreter_subprocess

F32, F64, BF16, F16 = torch.float32, torch.float64, torch.bfloat16, torch.float16
# Loss: |got - want| / max(|A|, |want|), by loss dtype. Gradient: |got - want| / |g A r|, by logps' dtype. Both
# scales are floored at the dtype's smallest normal number (fp16 results underflow to subnormals and 0). Half
# precision: twice the unit roundoff (the kernel rounds its float32 result once).
TOL_LOSS = {F64: 1e-11, F32: 1e-5, BF16: 2**-8, F16: 2**-10}
TOL_GRAD = {F64: 1e-13, F32: 1e-6, BF16: 2**-8, F16: 2**-10}
# A token's region may flip between kernel and reference when its log-ratio is this close to a bound or delta.
AMBIGUOUS = {F64: 1e-10, F32: 1e-5}
HALF_NATIVE_TOL = 2e-2  # kernel vs the torch path computed in bf16 / fp16 (|log r| <= 2, 2% from any bound)


def _compute_dtype(case):
    from trl_bandpo.kernels.band_surrogate import surrogate_dtypes

    return surrogate_dtypes(case["logps"].dtype, case["old"].dtype, case["adv"].dtype)[1]


# ---------------------------------------------------------------------------------------------------------------
# Cases


def _old_logps(n, g):
    """log p: p log-uniform in [1e-8, 0.5] or 1 - p log-uniform in [1e-7, 0.5], half each; both ends included."""
    u = torch.rand(n, generator=g, dtype=F64)
    small = (-8 + (8 - math.log10(2)) * u) * math.log(10)
    large = torch.log1p(-(10 ** (-7 + (7 - math.log10(2)) * u)))
    x = torch.where(torch.rand(n, generator=g, dtype=F64) < 0.5, small, large)
    x[:4] = torch.tensor([math.log(1e-8), math.log1p(-1e-7), math.log(0.5), math.log(1e-8)], dtype=F64)
    return x


def _region_case(seed, shape, dtype, radius, upper_max, delta, per_row, adv_dtype=None):
    """Log-ratios drawn per token in one region of the float64 bounds of the (rounded) old log-probs."""
    from trl_bandpo.band import band_bounds

    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    old = _old_logps(n, g).to(dtype).to(F64)
    lower, upper = band_bounds(old, radius, solver="torch", upper_max=upper_max)
    log_u = upper.log()
    log_l = torch.maximum(lower.log(), log_u - 25)  # lower underflows to 0 for tiny p and a large radius
    u = torch.rand(n, generator=g, dtype=F64)
    region = torch.randint(0, 4 if delta is not None else 3, (n,), generator=g)
    log_r = torch.where(region == 0, log_l + (log_u - log_l) * (0.1 + 0.8 * u), log_u + 0.01 + u)  # inside, above
    log_r = torch.where(region == 2, log_l - 0.01 - 2 * u, log_r)  # below
    if delta is not None:
        log_r = torch.where(region == 3, math.log(delta) + 0.01 + u, log_r)  # beyond the dual clip
    logps = (old + log_r).to(dtype).reshape(shape)
    if per_row:
        rows = shape[0]
        adv = torch.randn(rows, 1, generator=g, dtype=F64).abs() + 0.1
        adv[1::2] *= -1  # both signs
        adv[-1] = 0.0
    else:
        adv = torch.randn(shape, generator=g, dtype=F64)
        adv.view(-1)[::17] = 0.0
    grad_out = 0.5 + 1.5 * torch.rand(shape, generator=g, dtype=F64)
    out_dtype = torch.promote_types(dtype, adv_dtype or dtype)
    return dict(
        logps=logps,
        old=old.to(dtype).reshape(shape),
        adv=adv.to(adv_dtype or dtype),
        grad_out=grad_out.to(out_dtype),
        radius=radius,
        upper_max=upper_max,
        delta=delta,
        kind="regions",
    )


def _tie_case(dtype):
    """Exact ties of torch.minimum / torch.clamp, with upper_max = 1 (so upper == 1 exactly) and delta = 1 or None.

    Returns (delta = 1) r == 1 == upper == delta: a == b, both clamps pass -> -A r; r = 2: a == b == A with both
    clamps closed -> 0; r inside: a == b -> -A r; r below lower: -A r if A > 0, else 0; A = +-inf: ties of infinite
    products (0 * inf = NaN where autograd has it). And, float64 only, (delta = None) products of subnormal
    advantages that round equal: r = 1.2 > upper with A = 2 s (s the smallest subnormal): r A == A, so the gradient
    is split, -(A / 2) r; inside, A = 3 s: the halves -1.5 s are rounded before they are added."""
    log2, tiny = math.log(2.0), torch.finfo(dtype).tiny * torch.finfo(dtype).eps  # smallest subnormal
    rows = [  # (old, logps, advantages)
        (-1.0, -1.0, [1.5, -1.5, 0.0, math.inf, -math.inf]),
        (0.0, 0.0, [1.5, -1.5, math.inf]),
        (0.0, log2, [1.5, -1.5, 0.0, math.inf, -math.inf]),
        (0.0, -0.01, [1.5, -1.5, math.inf, -math.inf]),
        (-3.0, -3.0 - 0.01, [2.0, -2.0]),
        (0.0, -1.0, [1.5, -1.5, math.inf, -math.inf]),
        (-20.0, -20.0 + log2, [1.0, -1.0]),
    ]
    old, logps, adv = (torch.tensor(v, dtype=dtype) for v in zip(*[(o, lp, a) for o, lp, As in rows for a in As]))
    case = dict(radius=0.05, upper_max=1.0, kind="ties")
    with_delta = dict(case, logps=logps, old=old, adv=adv, grad_out=torch.ones_like(logps), delta=1.0)
    if dtype != F64:
        return [with_delta]
    sub = torch.tensor([0.0, 0.0, -2.0, -2.0], dtype=dtype)
    sub_logps = sub + torch.tensor([math.log(1.2), math.log(1.2), 0.0, -0.01], dtype=dtype)
    sub_adv = torch.tensor([2 * tiny, -2 * tiny, 2 * tiny, 3 * tiny], dtype=dtype)
    split = dict(case, logps=sub_logps, old=sub, adv=sub_adv, grad_out=torch.ones_like(sub), delta=None)
    return [with_delta, split]


def _special_case(dtype, delta):
    """NaN / infinite / positive / zero log-probs and advantages (padding and broken inputs)."""
    olds = [0.0, -0.0, 1e-3, -1e-7, -2.0, -18.42, -1e30, -math.inf, math.nan]
    news = [0.0, -1.0, -2.0, 3.0, -18.0, -math.inf, math.nan, 100.0]
    advs = [1.0, -1.0, 0.0, math.inf, math.nan]
    triples = [(o, lp, a) for o in olds for lp in news for a in advs]
    old, logps, adv = (torch.tensor(v, dtype=F64).to(dtype) for v in zip(*triples))
    return dict(
        logps=logps, old=old, adv=adv, grad_out=torch.ones_like(logps), radius=0.05, upper_max=10.0, delta=delta,
        kind="special",
    )


def build_cases() -> dict:
    cases = {
        "fp32-plain-row": _region_case(0, (8, 128), F32, 0.05, None, None, per_row=True),
        "fp32-authors-token": _region_case(1, (8, 128), F32, 0.05, 10.0, 10.0, per_row=False),
        "fp32-r1-dual3-row": _region_case(2, (8, 128), F32, 1.0, None, 3.0, per_row=True),
        "fp32-r1e-3-cap-dual3-token": _region_case(3, (8, 96), F32, 1e-3, 10.0, 3.0, per_row=False),
        "fp64-cap-dual3-token": _region_case(4, (8, 96), F64, 0.05, 10.0, 3.0, per_row=False),
        "fp64-plain-row": _region_case(5, (8, 96), F64, 0.05, None, None, per_row=True),
        "bf16-authors-row": _region_case(6, (8, 128), BF16, 0.05, 10.0, 10.0, per_row=True),
        "bf16-fp32adv-dual3-token": _region_case(7, (8, 128), BF16, 0.05, None, 3.0, per_row=False, adv_dtype=F32),
        "fp16-cap-dual3-row": _region_case(8, (8, 96), F16, 0.05, 10.0, 3.0, per_row=True),
    }
    # 3-D, non-contiguous logps; one advantage per (batch, head) row
    case = _region_case(9, (2, 4, 64), F32, 0.05, 10.0, 10.0, per_row=False)
    case["logps"] = case["logps"].transpose(0, 1).contiguous().transpose(0, 1)
    case["adv"] = case["adv"][..., :1].contiguous()
    cases["fp32-3d-noncontiguous"] = case
    for dtype, name in ((F32, "fp32"), (F64, "fp64")):
        for i, tie in enumerate(_tie_case(dtype)):
            cases[f"ties-{name}-{i}"] = tie
        for delta in (None, 10.0):
            cases[f"special-{name}-delta{delta}"] = _special_case(dtype, delta)
    cases["special-bf16"] = _special_case(BF16, 10.0)
    empty = torch.empty(3, 0)
    cases["empty"] = dict(
        logps=empty, old=empty, adv=torch.ones(3, 1), grad_out=empty, radius=0.05, upper_max=None, delta=None,
        kind="empty",
    )
    return cases


# ---------------------------------------------------------------------------------------------------------------
# Kernel and reference runs


def _run(fn, case, device):
    """(loss, d loss / d logps with the case's upstream gradient), on CPU."""
    logps = case["logps"].to(device).requires_grad_()
    loss = fn(logps, case["old"].to(device), case["adv"].to(device), case["radius"], case["upper_max"], case["delta"])
    (grad,) = torch.autograd.grad(loss, logps, case["grad_out"].to(device, loss.dtype))
    return loss.detach().cpu(), grad.cpu()


def _kernel_fn(logps, old, adv, radius, upper_max, delta):
    from trl_bandpo.kernels.band_surrogate import band_clipped_surrogate_triton

    return band_clipped_surrogate_triton(logps, old, adv, radius, upper_max=upper_max, delta=delta)


def _torch_fn(logps, old, adv, radius, upper_max, delta):
    from trl_bandpo.kernels.band_surrogate import band_clipped_surrogate

    return band_clipped_surrogate(logps, old, adv, radius, upper_max=upper_max, delta=delta, solver="torch")


def run_kernel(cases: dict, device: str) -> dict:
    """name -> (loss, grad, loss computed without grad)."""
    out = {}
    for name, case in cases.items():
        loss, grad = _run(_kernel_fn, case, device)
        with torch.no_grad():
            args = (case[k].to(device) for k in ("logps", "old", "adv"))
            no_grad_loss = _kernel_fn(*args, case["radius"], case["upper_max"], case["delta"]).cpu()
        out[name] = (loss, grad, no_grad_loss)
    return out


def _interpreter_checks() -> dict:
    """Custom op (opcheck), torch.compile(fullgraph=True, aot_eager) forward + backward, solver="auto"."""
    from trl_bandpo.kernels import band_surrogate as bs

    checks = {"interpreted": str(bs.INTERPRETED)}
    g = torch.Generator().manual_seed(0)
    old = -10 * torch.rand(4, 50, generator=g)
    logps = old + 0.3 * torch.randn(4, 50, generator=g)
    adv_row, adv_tok = torch.randn(4, 1, generator=g), torch.randn(4, 50, generator=g)
    try:
        op = torch.ops.trl_bandpo.band_clipped_surrogate_kl.default
        for args in (
            (logps, old, adv_row, 0.05, 10.0, 3.0, True),
            (logps.double(), old.double(), adv_tok.double(), 0.05, None, None, False),
            (logps.bfloat16(), old.bfloat16(), adv_tok, 1.0, None, 10.0, True),
        ):
            torch.library.opcheck(op, args)
        checks["opcheck"] = "ok"
    except Exception:
        checks["opcheck"] = traceback.format_exc()
    try:

        def loss_fn(lp, o, a):
            return bs.band_clipped_surrogate(lp, o, a, 0.05, upper_max=10.0, delta=3.0, solver="triton").mean()

        compiled = torch.compile(loss_fn, backend="aot_eager", fullgraph=True)
        results = []
        for fn in (compiled, loss_fn):
            x = logps.clone().requires_grad_()
            value = fn(x, old, adv_row)
            value.backward()
            results.append((value.detach(), x.grad))
        same = all(torch.equal(a, b) for a, b in zip(*results))
        checks["compile"] = "ok" if same else "compiled and eager loss / gradient differ"
    except Exception:
        checks["compile"] = traceback.format_exc()
    try:
        calls = []
        original = bs._band_surrogate_launch
        bs._band_surrogate_launch = lambda *a, **k: calls.append(1) or original(*a, **k)
        try:
            bs.band_clipped_surrogate(logps, old, adv_row, 0.05, solver="auto")
            auto_kernel = len(calls) == 1
            bs.band_clipped_surrogate(logps, old, adv_row.clone().requires_grad_(), 0.05, solver="auto")
            fallback = len(calls) == 1
        finally:
            bs._band_surrogate_launch = original
        checks["auto"] = "ok" if auto_kernel and fallback else f"kernel used: {auto_kernel}, fallback: {fallback}"
    except Exception:
        checks["auto"] = traceback.format_exc()
    return checks


def _worker(cases_path: str, out_path: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    cases = torch.load(cases_path)
    torch.save({"outputs": run_kernel(cases, "cpu"), "checks": _interpreter_checks()}, out_path)


def _upcast(case):
    """The case with half-precision tensors upcast to float32: the precision the kernel computes in."""
    up = lambda t: t.float() if t.dtype in (BF16, F16) else t  # noqa: E731
    return dict(case, **{k: up(case[k]) for k in ("logps", "old", "adv", "grad_out")})


def references(cases: dict) -> dict:
    """name -> dict(loss, grad) of the torch path at the kernel's precision, plus native-half results and the
    float64 log-ratio / bounds used to classify the tokens."""
    from trl_bandpo.band import band_bounds

    out = {}
    for name, case in cases.items():
        ref = dict(zip(("loss", "grad"), _run(_torch_fn, _upcast(case), "cpu")))
        if case["logps"].dtype in (BF16, F16):
            ref["native_loss"], ref["native_grad"] = _run(_torch_fn, case, "cpu")
        old = case["old"].double().expand(case["logps"].shape)
        ref["log_ratio"] = case["logps"].double() - old
        ref["lower"], ref["upper"] = band_bounds(old, case["radius"], solver="torch", upper_max=case["upper_max"])
        ref["adv"] = case["adv"].double().expand(case["logps"].shape)
        out[name] = ref
    return out


# ---------------------------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def cases():
    return build_cases()


@pytest.fixture(scope="module")
def reference(cases):
    return references(cases)


@pytest.fixture(scope="module", params=["interpreter", pytest.param("cuda", marks=pytest.mark.gpu)])
def kernel_run(request, cases, tmp_path_factory):
    """(name -> kernel (loss, grad, no-grad loss), extra checks)."""
    if request.param == "cuda":
        return run_kernel(cases, "cuda"), {}
    pytest.importorskip("triton")
    result = run_interpreter_subprocess(
        __file__,
        cases,
        str(tmp_path_factory.mktemp("interpreter")),
        while_running=lambda: request.getfixturevalue("reference"),  # computed while the interpreter runs
    )
    return result["outputs"], result["checks"]


def _names(*kinds):
    return [name for name, case in build_cases().items() if case["kind"] in kinds]


def _distance_to_boundaries(ref, delta):
    """min |log r - log b| over the bounds (and delta) in float64: how far a token is from changing region."""
    log_r = ref["log_ratio"]
    dist = torch.minimum((log_r - ref["lower"].log()).abs(), (log_r - ref["upper"].log()).abs())
    if delta is not None:
        dist = torch.minimum(dist, (log_r - math.log(delta)).abs())
    return dist


def _relative_errors(got, want, scale):
    return (got.double() - want.double()).abs() / scale


# ---------------------------------------------------------------------------------------------------------------
# Tests


def test_output_dtype_and_shape(kernel_run, cases, reference):
    """Loss in the dtype clipped_surrogate_loss returns, gradient in logps' dtype, both shaped like logps."""
    outputs, _ = kernel_run
    for name, case in cases.items():
        loss, grad, no_grad_loss = outputs[name]
        assert loss.shape == grad.shape == no_grad_loss.shape == case["logps"].shape, name
        assert grad.dtype == case["logps"].dtype, name
        want_dtype = reference[name].get("native_loss", reference[name]["loss"]).dtype
        assert loss.dtype == no_grad_loss.dtype == want_dtype, name


@pytest.mark.parametrize("name", _names("regions"))
def test_regions_all_hit(reference, cases, name):
    """The inputs cover every region of the clipped surrogate, for both advantage signs."""
    ref, case = reference[name], cases[name]
    log_r, adv = ref["log_ratio"], ref["adv"]
    above, below = log_r > ref["upper"].log(), log_r < ref["lower"].log()
    regions = {
        "inside": ~above & ~below,
        "above, A > 0 (clipped)": above & (adv > 0),
        "above, A < 0": above & (adv < 0),
        "below, A > 0": below & (adv > 0),
        "below, A < 0 (clipped)": below & (adv < 0),
    }
    if case["delta"] is not None:
        regions["beyond delta, A < 0 (dual clip)"] = (log_r > math.log(case["delta"])) & (adv < 0)
    counts = {k: int(v.sum()) for k, v in regions.items()}
    assert min(counts.values()) >= 8, counts
    assert (ref["grad"] == 0).any() and (ref["grad"] != 0).any()


@pytest.mark.parametrize("name", _names("regions"))
def test_loss_and_grad_match_torch(kernel_run, reference, cases, name):
    """Against `band_bounds(solver="torch")` + `clipped_surrogate_loss` + autograd at the kernel's precision."""
    outputs, _ = kernel_run
    ref, case = reference[name], cases[name]
    loss, grad, no_grad_loss = outputs[name]
    assert torch.equal(loss, no_grad_loss), "the loss computed without grad differs"

    loss_tol = TOL_LOSS[loss.dtype]
    scale = torch.maximum(ref["adv"].abs(), ref["loss"].double().abs()).clamp(min=torch.finfo(loss.dtype).tiny)
    err = _relative_errors(loss, ref["loss"], scale)
    assert err.max() <= loss_tol, f"loss: relative error {err.max().item():.3g} > {loss_tol}"

    compute = _compute_dtype(case)
    clear = _distance_to_boundaries(ref, case["delta"]) > AMBIGUOUS[compute]
    assert clear.float().mean() >= 0.99, f"{int((~clear).sum())} tokens within {AMBIGUOUS[compute]} of a bound"
    scale = (case["grad_out"].double() * ref["adv"] * ref["log_ratio"].exp()).abs()
    err = _relative_errors(grad, ref["grad"], scale.clamp(min=torch.finfo(grad.dtype).tiny))[clear]
    grad_tol = TOL_GRAD[grad.dtype]
    assert err.max() <= grad_tol, f"grad: relative error {err.max().item():.3g} > {grad_tol}"
    clipped = ref["grad"][clear] == 0
    assert (grad[clear][clipped] == 0).all(), "gradient not exactly 0 on clipped tokens"


@pytest.mark.parametrize("name", [n for n in _names("regions") if n.startswith(("bf16", "fp16"))])
def test_half_inputs_close_to_half_torch_path(kernel_run, reference, cases, name):
    """Loosely against the torch path run in bf16 / fp16 itself (it rounds r and the bounds to 8 / 11 bits):
    realistic ratios (|log r| <= 2), away from the region boundaries by 2%."""
    outputs, _ = kernel_run
    ref, case = reference[name], cases[name]
    loss, grad, _ = outputs[name]
    keep = (ref["log_ratio"].abs() <= 2) & (_distance_to_boundaries(ref, case["delta"]) > 0.02)
    assert keep.sum() >= 100
    loss_err = _relative_errors(loss, ref["native_loss"], ref["adv"].abs().clamp(min=1e-3) * 8)[keep]
    assert loss_err.max() <= HALF_NATIVE_TOL, f"loss: relative error {loss_err.max().item():.3g}"
    scale = (case["grad_out"].double() * ref["adv"] * ref["log_ratio"].exp()).abs().clamp(min=1e-3)
    grad_err = _relative_errors(grad, ref["native_grad"], scale)[keep]
    assert grad_err.max() <= HALF_NATIVE_TOL, f"grad: relative error {grad_err.max().item():.3g}"


@pytest.mark.parametrize("name", _names("ties"))
def test_ties_match_autograd(kernel_run, reference, name):
    """At exact ties (r == upper == delta, equal products, infinite advantages) the kernel's loss and gradient are
    autograd's: torch.minimum splits the gradient, torch.clamp passes it at the bounds. Equal up to 4 ulps (where
    r is not exactly 1 or 2 the kernel's exp and torch's may differ in the last bit), NaN and infinities alike."""
    outputs, _ = kernel_run
    loss, grad, _ = outputs[name]
    ref = reference[name]
    eps = torch.finfo(loss.dtype).eps
    for side, got, want in (("loss", loss, ref["loss"]), ("grad", grad, ref["grad"])):
        assert torch.equal(got.isnan(), want.isnan()), f"{side}: NaN positions differ: {got} vs {want}"
        assert torch.equal(got.isinf() & (got > 0), want.isinf() & (want > 0)), f"{side}: {got} vs {want}"
        assert torch.equal(got.isinf() & (got < 0), want.isinf() & (want < 0)), f"{side}: {got} vs {want}"
        finite = want.isfinite()
        assert ((got - want)[finite].abs() <= 4 * eps * want[finite].abs()).all(), f"{side}: {got} vs {want}"
    if name.endswith("-0"):
        assert (grad == 0).any() and (grad != 0).any()
    if name == "ties-fp32-0":  # r == 1 == upper == delta: both sides of the minimum pass half -> -A r = -A exactly
        assert grad[:3].tolist() == [-1.5, 1.5, 0.0] and loss[:3].tolist() == [-1.5, 1.5, 0.0]
    if name == "ties-fp64-1":  # in units of the smallest subnormal s: the split gradient really happens
        s = torch.finfo(F64).tiny * torch.finfo(F64).eps
        # r = 1.2, A = 2s: -(A / 2) r = -s (not -A r = -2s, not 0); r = 0.99 inside, A = 3s: autograd adds the two
        # halves -1.5s, each rounded to -2s, so -4s (not -3s)
        assert grad.tolist() == [-s, s, -2 * s, -4 * s]


@pytest.mark.parametrize("name", _names("special"))
def test_special_inputs_like_autograd(kernel_run, reference, cases, name):
    """NaN / inf / positive log-probs and NaN / inf / 0 advantages: NaN and inf where autograd has them,
    the same finite values elsewhere (to the bounds' tolerance)."""
    outputs, _ = kernel_run
    loss, grad, _ = outputs[name]
    ref = reference[name]
    for side, got, want, tol in (
        ("loss", loss, ref["loss"], TOL_LOSS[loss.dtype]),
        ("grad", grad, ref["grad"], TOL_GRAD[grad.dtype]),
    ):
        got, want = got.double(), want.to(got.dtype).double()  # the reference rounded as the kernel's output is
        for what in ("isnan", "isposinf", "isneginf"):
            bad = getattr(got, what)() != getattr(want, what)()
            where = bad.nonzero().flatten().tolist()
            assert not bad.any(), f"{side} {what} differs at {where}: {got[bad]} vs {want[bad]}"
        finite = want.isfinite()
        err = (got[finite] - want[finite]).abs() / want[finite].abs().clamp(min=1.0)
        assert err.max() <= tol, f"{side}: {err.max().item():.3g}"


def test_empty(kernel_run):
    outputs, _ = kernel_run
    loss, grad, _ = outputs["empty"]
    assert loss.shape == grad.shape == (3, 0)


def test_interpreter_custom_op_compile_and_auto(kernel_run):
    """Interpreter run only: opcheck, torch.compile(fullgraph, aot_eager) forward + backward, solver="auto"."""
    outputs, checks = kernel_run
    if not checks:
        pytest.skip("the CUDA run checks these in the gpu tests")
    assert checks["interpreted"] == "True"
    assert checks["opcheck"] == "ok", checks["opcheck"]
    assert checks["compile"] == "ok", checks["compile"]
    assert checks["auto"] == "ok", checks["auto"]


# ---------------------------------------------------------------------------------------------------------------
# No kernel needed


def test_loss_dtype_rule_matches_clipped_surrogate_loss():
    from trl_bandpo.kernels.band_surrogate import surrogate_dtypes
    from trl_bandpo.losses import clipped_surrogate_loss

    for lp in (F16, BF16, F32, F64):
        for old in (lp, F32):
            for adv in (F16, BF16, F32, F64):
                x, o, a = torch.zeros(2, 3, dtype=lp), torch.zeros(2, 3, dtype=old), torch.ones(2, 1, dtype=adv)
                bounds = (torch.full((2, 3), 0.8), torch.full((2, 3), 1.2))
                want = clipped_surrogate_loss(x - o, a, *bounds).dtype
                assert surrogate_dtypes(lp, old, adv)[0] == want, (lp, old, adv)


def test_argument_errors():
    from trl_bandpo.kernels.band_surrogate import band_clipped_surrogate, band_clipped_surrogate_triton

    x = torch.zeros(2, 3)
    for kwargs, match in (
        (dict(radius=0.0), "radius"),
        (dict(radius=0.05, delta=0.0), "delta"),
        (dict(radius=0.05, delta=True), "delta"),
        (dict(radius=0.05, upper_max=0.5), "upper_max"),
        (dict(radius=0.05, solver="cuda"), "solver"),
    ):
        with pytest.raises(ValueError, match=match):
            band_clipped_surrogate(x, x, torch.ones(2, 1), **kwargs)
    with pytest.raises(ValueError, match="broadcast"):
        band_clipped_surrogate(x, x, torch.ones(3, 1), 0.05)
    with pytest.raises(ValueError, match="broadcast to the shape of logps"):
        band_clipped_surrogate(x, x, torch.ones(4, 2, 3), 0.05)
    with pytest.raises(ValueError, match="floating-point"):
        band_clipped_surrogate(x.long(), x, torch.ones(2, 1), 0.05)
    with pytest.raises(ValueError, match="does not differentiate the advantages"):
        band_clipped_surrogate_triton(x, x, torch.ones(2, 1, requires_grad=True), 0.05)


def test_cpu_without_interpreter():
    """Without TRITON_INTERPRET, solver="triton" on CPU is a clear error and "auto" is the torch path."""
    from trl_bandpo.band import band_bounds
    from trl_bandpo.kernels.band_surrogate import band_clipped_surrogate
    from trl_bandpo.losses import clipped_surrogate_loss

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process runs the interpreter")
    old = torch.tensor([[-1.0, -0.1, -5.0]])
    logps = torch.tensor([[-0.5, -0.3, -4.0]], requires_grad=True)
    adv = torch.tensor([[1.0], [-2.0]])[:1]
    with pytest.raises(ValueError, match="solver='triton' cannot run here"):
        band_clipped_surrogate(logps, old, adv, 0.05, solver="triton")
    auto = band_clipped_surrogate(logps, old, adv, 0.05, upper_max=10.0, delta=3.0)
    lower, upper = band_bounds(old, 0.05, solver="torch", upper_max=10.0)
    assert torch.equal(auto, clipped_surrogate_loss(logps - old, adv, lower, upper, delta=3.0))


# ---------------------------------------------------------------------------------------------------------------
# GPU only


def _gpu_inputs(n_rows, n_cols, dtype=F32, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    old = -20 * torch.rand(n_rows, n_cols, device="cuda", generator=g, dtype=F64) ** 3
    logps = old + 0.3 * torch.randn(n_rows, n_cols, device="cuda", generator=g, dtype=F64)
    adv = torch.randn(n_rows, 1, device="cuda", generator=g, dtype=F64)
    return logps.to(dtype), old.to(dtype), adv.to(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F32, BF16, F64])
def test_gpu_large_matches_torch(dtype):
    """Many programs, a ragged tail (1025 x 1023 tokens), per-row advantages; torch path upcast to float32."""
    from trl_bandpo.kernels.band_surrogate import band_clipped_surrogate

    logps, old, adv = _gpu_inputs(1025, 1023, dtype)
    up = (lambda t: t.float()) if dtype == BF16 else (lambda t: t)  # noqa: E731
    results = []
    for solver, args in (("triton", (logps, old, adv)), ("torch", (up(logps), up(old), up(adv)))):
        x = args[0].clone().requires_grad_()
        loss = band_clipped_surrogate(x, args[1], args[2], 0.05, upper_max=10.0, delta=10.0, solver=solver)
        loss.sum().backward()
        results.append((loss.double(), x.grad.double()))
    (loss, grad), (ref_loss, ref_grad) = results
    scale = adv.double().abs().expand_as(loss).clamp(min=1e-6)
    tol = {F32: 1e-5, BF16: 2**-7, F64: 1e-11}[dtype]
    assert ((loss - ref_loss).abs() / torch.maximum(scale, ref_loss.abs())).max().item() <= tol
    # gradients: equal up to rounding, except where a token sits within the solvers' difference of a bound
    diff = (grad - ref_grad).abs() / (scale * (logps.double() - old.double()).exp()).clamp(min=1e-30)
    assert (diff > 2 * tol).float().mean().item() <= 1e-4


@pytest.mark.gpu
def test_gpu_torch_compile_fullgraph():
    from trl_bandpo.kernels.band_surrogate import band_clipped_surrogate

    def loss_fn(logps, old, adv):
        return band_clipped_surrogate(logps, old, adv, 0.05, upper_max=10.0, delta=10.0, solver="triton").mean()

    logps, old, adv = _gpu_inputs(64, 512)
    results = []
    for fn in (torch.compile(loss_fn, fullgraph=True), loss_fn):
        x = logps.clone().requires_grad_()
        value = fn(x, old, adv)
        value.backward()
        results.append((value.detach(), x.grad))
    torch.testing.assert_close(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1])


@pytest.mark.gpu
def test_gpu_cuda_graph_capture():
    from trl_bandpo.kernels.band_surrogate import band_clipped_surrogate_triton

    logps, old, adv = _gpu_inputs(64, 512)
    band_clipped_surrogate_triton(logps, old, adv, 0.05, upper_max=10.0)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = band_clipped_surrogate_triton(logps, old, adv, 0.05, upper_max=10.0)
    new = _gpu_inputs(64, 512, seed=1)
    for buf, value in zip((logps, old, adv), new):
        buf.copy_(value)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(loss, band_clipped_surrogate_triton(*new, 0.05, upper_max=10.0), rtol=0, atol=0)


if __name__ == "__main__":  # the interpreter subprocess of `kernel_run`
    _worker(sys.argv[1], sys.argv[2])

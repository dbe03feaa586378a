"""CPPO, TRM, M2PO and IcePop (`cppo`, `trm`, `m2po`, `icepop`; trl_bandpo/core/losses.py) against their
authors' code transcribed below, the worked examples computed by hand, and the asynchronous trainer's packed tokens.

- CPPO: UniRL `unirl/algorithms/cppo.py` @ 30899fcf, `_cppo_mask` and `_cppo_loss`, transcribed (packed varlen
  `[total_tokens]` tensors split by `lengths`; only `typing.List`/`Tuple`/`Dict` became the builtins).
- TRM: verl `rollout_corr_helper.py` (`rollout_rs` = seq_max_k3, seq_mean_k3, seq_mean_k1), written out from its
  formulas; `max |log r|` is our documented k1 variant (verl has no seq_max_k1).
- M2PO: AReaL `_apply_m2po_masking` with `_get_m2po_loss_mask` (areal/trainer/ppo/actor.py), transcribed.
- IcePop: the paper's closed interval `[low, high]` on the ratio.
Threshold ties are kept out of the comparisons: data are checked to sit at least 1e-4 from every CPPO budget.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from trl_bandpo import PolicyLossConfig, policy_loss
from trl_bandpo.core import losses as ml
from trl_bandpo.core.loss_registry import policy_loss_spec, registered_policy_losses
from trl_bandpo.core.losses import clipped_surrogate_loss
from trl_bandpo.training.policy_term import PolicyTerm, SampleRows

F32, F64 = torch.float32, torch.float64


# -- the authors' code -------------------------------------------------------------------------------------------


def _cppo_mask(*, new_logp, old_logp, advantages, ratio, lengths, delta, w_min, delta_b):
    """CPPO Binary-TV keep-mask over packed-varlen ``[total_tokens]`` tensors (UniRL, transcribed)."""
    prob = torch.exp(new_logp.float())
    old_prob = torch.exp(old_logp.float())
    D_all = (prob - old_prob).abs()  # Binary-TV divergence D_t
    toward_mu = (advantages * (ratio - 1.0)) <= 0.0
    keep_parts: list[torch.Tensor] = []
    for D_t, toward_t in zip(
        torch.split(D_all, lengths.tolist()),
        torch.split(toward_mu, lengths.tolist()),
    ):
        T = int(D_t.shape[0])
        if T == 0:
            keep_parts.append(D_t.new_zeros(0, dtype=torch.bool))
            continue
        pos = torch.arange(1, T + 1, device=D_t.device, dtype=D_t.dtype)
        w_t = 1.0 - (1.0 - w_min) * (pos - 1) / max(T - 1, 1)
        Z_t = w_t * D_t
        S_prev = torch.cat([Z_t.new_zeros(1), torch.cumsum(Z_t, dim=0)[:-1]])
        W_prev = torch.cat([w_t.new_zeros(1), torch.cumsum(w_t, dim=0)[:-1]])
        p90 = torch.quantile(D_t, q=0.9)
        delta_b_seq = p90.clamp(min=delta_b, max=2.0 * delta_b)
        c_t = torch.minimum(
            torch.full_like(Z_t, delta),
            delta + delta_b_seq * W_prev - S_prev,
        )
        feasible = Z_t <= c_t
        keep_parts.append(toward_t | feasible)
    keep = torch.cat(keep_parts) if keep_parts else toward_mu
    return keep.detach().to(dtype=new_logp.dtype)


def _cppo_loss(*, new_logp, old_logp, advantages, lengths, delta, w_min, delta_b):
    """CPPO per-token loss over packed-varlen ``[total_tokens]`` (UniRL, transcribed)."""
    log_diff = torch.clamp(new_logp - old_logp, min=-20.0, max=20.0)
    ratio = torch.exp(log_diff)
    adv = advantages.detach()
    with torch.no_grad():
        keep = _cppo_mask(new_logp=new_logp.detach(), old_logp=old_logp, advantages=adv, ratio=ratio.detach(),
                          lengths=lengths, delta=delta, w_min=w_min, delta_b=delta_b)  # fmt: skip
    pg_losses = -adv * ratio * keep
    metrics = {"masked_fraction": (1.0 - keep).mean().detach()}  # (ratio_mean, ratio_max, approx_kl left out)
    return pg_losses, metrics


def _apply_m2po_masking(old_logp, prox_logp, loss_mask, m2_threshold):
    """AReaL's M2PO mask over the valid tokens of one micro-batch (transcribed, both functions inlined)."""
    delta = old_logp - prox_logp
    m2 = delta * delta
    mask_flat = loss_mask.view(-1)
    m2_selected = m2.view(-1)[mask_flat]
    if m2_selected.numel() == 0:
        return loss_mask
    sorted_m2, indices = torch.sort(m2_selected, descending=True)
    restored_indices = torch.argsort(indices)
    n = sorted_m2.numel()
    suffix_sums = sorted_m2.flip(0).cumsum(0).flip(0)
    counts = torch.arange(n, 0, -1, device=sorted_m2.device, dtype=sorted_m2.dtype)
    avg_m2_suffix = suffix_sums / counts
    below_threshold_indices = torch.where(avg_m2_suffix < m2_threshold)[0]
    num_to_mask = below_threshold_indices[0].item() if len(below_threshold_indices) > 0 else n - 1
    sorted_mask = torch.ones_like(sorted_m2, dtype=torch.bool)
    if num_to_mask > 0:
        sorted_mask[:num_to_mask] = False
    m2_full_flat = torch.zeros_like(mask_flat, dtype=torch.bool)
    m2_full_flat[mask_flat] = sorted_mask[restored_indices]
    return m2_full_flat.view_as(loss_mask)


def verl_trm_keep(log_ratio, mask, divergence, reduce, threshold):
    """verl's sequence criteria: `x = clamp(log r, -20, 20)`, `k3 = exp(x) - 1 - x`, `k1 = -x`; seq_max (0 for a row
    without valid tokens) or masked_sum / (count + 1e-8); keep iff `stat <= threshold`, for seq_mean_k1 iff
    `log(lower) <= stat <= log(upper)` with `upper = e^threshold`, `lower = 1 / upper`. Our max of k1 is `max |x|`."""
    x = torch.clamp(log_ratio, min=-20.0, max=20.0)
    valid = mask.to(x.dtype)
    k = torch.exp(x) - 1 - x if divergence == "k3" else -x
    if reduce == "max":
        k = k if divergence == "k3" else k.abs()
        stat = k.masked_fill(valid == 0, -math.inf).max(-1).values
        stat = torch.where(valid.sum(-1) > 0, stat, torch.zeros_like(stat))
    else:
        stat = (k * valid).sum(-1) / (valid.sum(-1) + 1e-8)
    if divergence == "k1" and reduce == "mean":
        upper = math.exp(threshold)
        keep = (math.log(1 / upper) <= stat) & (stat <= math.log(upper))
    else:
        keep = stat <= threshold
    return keep[:, None].expand_as(x)


def clipped_reference(log_ratio, advantages, low=0.2, high=0.2):
    r = torch.exp(log_ratio)
    return -torch.minimum(r * advantages, torch.clamp(r, 1 - low, 1 + high) * advantages)


def reference(name, logps, old, adv, mask, **hp):
    """(B, T) per-token loss of the references above (0 off `mask`), differentiable in `logps`."""
    if name == "cppo":
        lengths = mask.sum(-1)
        kw = dict(delta=hp.get("radius", 0.2), w_min=hp.get("w_min", 0.8), delta_b=hp.get("rate_min", 0.02))
        flat = dict(new_logp=logps[mask], old_logp=old[mask], advantages=adv.expand_as(mask)[mask])
        pg, _ = _cppo_loss(**flat, lengths=lengths, **kw)
        return torch.zeros_like(logps).masked_scatter(mask, pg)
    clean = torch.where(mask, logps - old, torch.zeros_like(logps))  # the references see no padding
    if name == "trm":
        keep = verl_trm_keep(clean.detach(), mask, hp["divergence"], hp["reduce"], hp["threshold"])
    else:
        keep = _apply_m2po_masking(clean.detach(), torch.zeros_like(clean), mask, hp["threshold"])
    eps = (hp.get("epsilon_low", 0.2), hp.get("epsilon_high", 0.2))
    return torch.where(keep & mask, clipped_reference(clean, adv, *eps), torch.zeros_like(clean))


def run(fn, logps, mask=None):
    """(loss, gradient of the sum of its counted tokens with respect to `logps`)."""
    logps = logps.detach().clone().requires_grad_(True)
    loss = fn(logps)
    (loss if mask is None else loss[mask]).sum().backward()
    return loss.detach(), logps.grad


def layout(lengths, width, holes=False, seed=0):
    """(B, T) mask holding `lengths[i]` counted tokens in row i: a prefix (right padding) or scattered (holes)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(len(lengths), width, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, torch.randperm(width, generator=g)[:n] if holes else torch.arange(n)] = True
    return mask


def padded(flat, mask, garbage):
    """The packed tokens at `mask` (row-major), `garbage` elsewhere."""
    out = garbage.to(flat.dtype).clone()
    out[mask] = flat
    return out


def garbage(shape, seed=1, nan=False):
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(shape, generator=g, dtype=F64) * 8
    if nan:
        out.view(-1)[::3], out.view(-1)[1::3] = math.nan, -math.inf
    return out


# -- CPPO ----------------------------------------------------------------------------------------------------------

LENGTHS = [n for _ in range(3) for n in (0, 1, 2, 3, 5, 8, 13)]
SIGNS = [a for a in (1.3, -0.7, 0.0) for _ in range(7)]
CPPO_HP = [dict(radius=r, w_min=w, rate_min=b) for r, w, b in ((0.2, 0.8, 0.02), (0.15, 0.5, 0.05), (0.3, 1.0, 0.0))]


def cppo_tokens(seed=0, grid=False):
    """Packed (new, old) log-probs: 30% large moves, the rest small. `grid`: multiples of 1/32, exact in bf16/fp16
    (and their differences too)."""
    g = torch.Generator().manual_seed(seed)
    n = sum(LENGTHS)
    if grid:
        old_k = torch.randint(2, 96, (n,), generator=g)
        new_k = (old_k + torch.randint(-12, 13, (n,), generator=g)).clamp(min=1)
        return -new_k.to(F64) / 32, -old_k.to(F64) / 32
    p = torch.rand(n, generator=g, dtype=F64) * 0.9 + 0.05
    size = torch.where(torch.rand(n, generator=g, dtype=F64) < 0.3, 0.35, 0.05)
    q = (p + size * (2 * torch.rand(n, generator=g, dtype=F64) - 1)).clamp(1e-3, 1 - 1e-3)
    return torch.log(q), torch.log(p)


def authors_keep(new, old, adv, lengths, radius, w_min, rate_min):
    ratio = torch.exp(torch.clamp(new - old, -20.0, 20.0))
    kw = dict(w_min=w_min, delta_b=rate_min, lengths=lengths, ratio=ratio)
    return _cppo_mask(new_logp=new, old_logp=old, advantages=adv, delta=radius, **kw).bool()


def check_cppo(new, old, hp, dtype, holes=False, nan=False, ref_dtype=None):
    mask = layout(LENGTHS, 16, holes)
    adv = torch.tensor(SIGNS, dtype=F64)[:, None]
    adv_flat, lengths = adv.expand_as(mask)[mask], mask.sum(-1)
    lp, old_p = (padded(x, mask, garbage(mask.shape, seed, nan)).to(dtype) for seed, x in ((1, new), (2, old)))
    ours, grad = run(
        lambda x: policy_loss("cppo", x, old_p, adv.to(F32 if ref_dtype else dtype), mask, **hp), lp, mask
    )
    ref_dtype = ref_dtype or dtype
    new_r, old_r = new.to(dtype).to(ref_dtype), old.to(dtype).to(ref_dtype)
    kw = dict(delta=hp["radius"], w_min=hp["w_min"], delta_b=hp["rate_min"])

    def authors(x):
        return _cppo_loss(new_logp=x, old_logp=old_r, advantages=adv_flat.to(ref_dtype), lengths=lengths, **kw)[0]

    ref, ref_grad = run(authors, new_r)
    # no token within 1e-4 of its budget (shifting delta shifts every budget by as much)
    keeps = [
        authors_keep(new_r, old_r, adv_flat, lengths, **{**hp, "radius": hp["radius"] + s}) for s in (0, -1e-4, 1e-4)
    ]
    assert torch.equal(keeps[0], keeps[1]) and torch.equal(keeps[0], keeps[2])
    pushed = adv_flat * (new - old) > 0  # the tokens the budget tests: some kept, some masked
    assert (pushed & keeps[0]).any() and (pushed & ~keeps[0]).any()
    keep = ml.cppo_keep(lp - old_p, adv.to(lp.dtype), mask, old_p, **hp)  # A = 0 tokens too (loss 0 either way)
    assert torch.equal(keep[mask], keeps[0])
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == F64 else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours[mask], ref.to(ours.dtype), **tol)
    torch.testing.assert_close(grad[mask], ref_grad.to(grad.dtype), **(tol if dtype in (F32, F64) else {}))
    masked, counted = ml.cppo_metrics(lp - old_p, adv, None, None, mask, old_logps=old_p, **hp)["cppo/masked_share"]
    fraction = _cppo_loss(new_logp=new_r, old_logp=old_r, advantages=adv_flat, lengths=lengths, **kw)[1]
    assert counted == len(new) and math.isclose(masked / counted, fraction["masked_fraction"], rel_tol=1e-6)
    return grad, mask


@pytest.mark.parametrize("hp", CPPO_HP)
@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("holes", [False, True])
def test_cppo_matches_the_authors_packed_function(hp, dtype, holes):
    """Our (B, T) batch with `mask` (right padding, or counted tokens scattered among masked ones; lengths 0 to 13;
    A > 0, < 0, = 0) against the authors' packed computation on the counted tokens: loss and gradient; the gradient
    is 0 off the mask."""
    new, old = cppo_tokens()
    grad, mask = check_cppo(new, old, hp, dtype, holes)
    assert (grad[~mask] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cppo_half_precision_inputs_match_the_reference_in_float32(dtype):
    check_cppo(*cppo_tokens(grid=True), CPPO_HP[0], dtype, ref_dtype=F32)


@pytest.mark.parametrize("holes", [False, True])
def test_cppo_ignores_nan_and_inf_at_padded_positions(holes):
    """NaN and -inf log-probs off the mask change neither the loss nor the gradient of the counted tokens."""
    check_cppo(*cppo_tokens(), CPPO_HP[0], F64, holes, nan=True)


@pytest.mark.parametrize("a", [1.0, -1.0])
def test_cppo_clamps_the_log_ratio_at_20_as_the_authors(a):
    """Ratios beyond e^(+-20): the authors' clamped ratio (value e^(+-20), gradient 0)."""
    old = torch.tensor([[-30.0, -1.0, -25.0, -0.7, -2.0]], dtype=F64)
    new = torch.tensor([[-5.0, -30.0, -0.5, -0.9, -1.2]], dtype=F64)  # log r = 25, -29, 24.5, -0.2, 0.8
    adv, every = torch.full((1, 1), a, dtype=F64), torch.ones_like(new, dtype=torch.bool)
    ours, ref = (
        run(lambda x: policy_loss("cppo", x, old, adv), new),
        run(lambda x: reference("cppo", x, old, adv, every), new),
    )
    assert (ref[0].abs() > 1e8).any()
    for x, y in zip(ours, ref):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


# The spec's worked examples 1.9 (delta 0.2, w_min 0.8, delta_b 0.02), keep masks by hand.
EXAMPLE_A = ([0.5, 0.4, 0.3, 0.6, 0.2], [0.6, 0.55, 0.45, 0.7, 0.45])
CPPO_EXAMPLES = {
    "A": ([EXAMPLE_A], [1.0], [[1, 0, 0, 0, 0]]),  # token 2: Z = 0.1425 > c = 0.14
    "A, A < 0": ([EXAMPLE_A], [-1.0], [[1, 1, 1, 1, 1]]),  # every token moves toward mu
    "B": ([([0.2] + [0.5] * 9, [0.5] + [0.51] * 9)], [1.0], [[0, 0, 0, 0, 1, 1, 1, 1, 1, 1]]),  # re-admitted
    "C": (
        [(EXAMPLE_A[0][:3], EXAMPLE_A[1][:3]), ([], []), (EXAMPLE_A[0][3:], EXAMPLE_A[1][3:])],
        [1.0] * 3,
        [[1, 1, 0], [], [1, 0]],
    ),
    "D": ([([0.5] * 6, [0.55, 0.55, 0.62, 0.56, 0.53, 0.51])], [1.0], [[1] * 6]),
}


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("example", CPPO_EXAMPLES)
def test_cppo_worked_examples(example, dtype):
    seqs, signs, expected = CPPO_EXAMPLES[example]
    mask = layout([len(p) for p, _ in seqs], 12)
    old, new = (torch.tensor([x for seq in seqs for x in seq[i]], dtype=F64).log() for i in (0, 1))
    old, new = padded(old, mask, torch.full(mask.shape, 0.3)), padded(new, mask, torch.full(mask.shape, 5.0))
    adv = torch.tensor(signs, dtype=dtype)[:, None]
    keep = ml.cppo_keep((new - old).to(dtype), adv, mask, old.to(dtype))
    expected_flat = torch.tensor([k for row in expected for k in row], dtype=torch.bool)
    assert torch.equal(keep[mask], expected_flat)
    lengths, adv_flat = mask.sum(-1), adv.expand_as(mask)[mask]
    kw = dict(radius=0.2, w_min=0.8, rate_min=0.02)
    assert torch.equal(authors_keep(new[mask], old[mask], adv_flat.double(), lengths, **kw), expected_flat)
    masked, counted = ml.cppo_metrics(new - old, adv, None, None, mask, old_logps=old)["cppo/masked_share"]
    assert (int(masked), int(counted)) == ((~expected_flat).sum(), mask.sum())  # padding (ratio e^4.7) not counted


@pytest.mark.parametrize("radius", [0.05, 0.2, 0.5])
def test_cppo_with_flat_weights_and_a_large_rate_is_dppo_tv(radius):
    """With w_min = 1 and delta_b = 1 (a rate above every D) every budget is delta: CPPO keeps `toward or |q - p| <=
    delta`, DPPO-TV's rule, with the same weight r on a kept token. Gradients only: on a masked token DPPO's forward
    value still holds -A r (its weight is 0) where CPPO's is 0."""
    g = torch.Generator().manual_seed(3)
    p = torch.rand(4, 64, generator=g, dtype=F64) * 0.998 + 1e-3
    q = (p + 0.4 * torch.randn(4, 64, generator=g, dtype=F64)).clamp(1e-3, 1 - 1e-3)
    adv = torch.randn(4, 64, generator=g, dtype=F64)
    adv[:, ::7] = 0.0
    assert (((q - p).abs() - radius).abs() > 1e-9).all()
    keep = ml.cppo_keep(
        torch.log(q / p), adv, torch.ones_like(p), torch.log(p), radius=radius, w_min=1.0, rate_min=1.0
    )
    assert torch.equal(keep, (adv * (q / p - 1) <= 0) | ((q - p).abs() <= radius))
    assert not keep.all()
    cppo = run(lambda x: policy_loss("cppo", x, torch.log(p), adv, radius=radius, w_min=1.0, rate_min=1.0), q.log())
    dppo = run(lambda x: policy_loss("dppo_tv", x, torch.log(p), adv, radius=radius, ratio_cap=None), q.log())
    torch.testing.assert_close(cppo[1], dppo[1], rtol=1e-12, atol=1e-12)


# -- TRM -----------------------------------------------------------------------------------------------------------

TRM = [("k3", "mean", 0.01), ("k3", "max", 0.05), ("k1", "mean", 0.05), ("k1", "max", 0.3)]


@pytest.mark.parametrize("divergence,reduce,threshold", TRM)
@pytest.mark.parametrize("nan", [False, True])
def test_trm_matches_verl(divergence, reduce, threshold, nan):
    """Rows of lengths 0 to 12 at log-ratio scales from 0.01 to 1, garbage off the mask: keep rule, loss (TRL's
    clipped surrogate on kept rows) and gradient against verl's formulas."""
    mask = layout([0, 1, 2, 5, 8, 12, 12, 7, 9, 3], 12)
    g = torch.Generator().manual_seed(4)
    scale = torch.logspace(-2, 0, 10, dtype=F64)[:, None]
    old = torch.log(torch.rand(mask.shape, generator=g, dtype=F64) * 0.5 + 0.25)
    lr = scale.expand_as(mask)[mask] * torch.randn(int(mask.sum()), generator=g, dtype=F64)
    lr = padded(lr, mask, garbage(mask.shape, nan=nan))
    adv = torch.linspace(-1, 1, 10, dtype=F64)[:, None]
    hp = dict(divergence=divergence, reduce=reduce, threshold=threshold, epsilon_low=0.2, epsilon_high=0.28)
    keep_ref = verl_trm_keep(torch.where(mask, lr, 0.0), mask, divergence, reduce, threshold)
    rows = mask.any(-1)
    assert keep_ref[rows, 0].any() and not keep_ref[rows, 0].all()
    assert torch.equal(
        ml.trm_keep(lr, mask, divergence=divergence, reduce=reduce, threshold=threshold)[mask], keep_ref[mask]
    )
    ours = run(lambda x: policy_loss("trm", x, old, adv, mask, **hp), old + lr, mask)
    ref = run(lambda x: reference("trm", x, old, adv, mask, **hp), old + lr, mask)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a[mask], b[mask], rtol=1e-12, atol=1e-12)


# Example 2.7: valid [[1,1,1],[1,1,0]] (+ an all-padding row), log r [[0.1,-0.2,0],[0.5,0,(pad)]]; per-row statistics.
TRM_STATS = {
    ("k3", "max"): (0.018731, 0.148721),
    ("k3", "mean"): (0.007967, 0.074361),
    ("k1", "mean"): (0.1 / 3, 0.25),
    ("k1", "max"): (0.2, 0.5),
}


@pytest.mark.parametrize("divergence,reduce", TRM_STATS)
def test_trm_worked_example(divergence, reduce):
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    lr = torch.tensor([[0.1, -0.2, 0.0], [0.5, 0.0, 7.0], [math.nan, 9.0, -9.0]], dtype=F64)
    for row, stat in enumerate(TRM_STATS[divergence, reduce]):  # kept just above the statistic, dropped just below
        for factor, kept in ((1 + 1e-3, True), (1 - 1e-3, False)):
            keep = ml.trm_keep(lr, mask, divergence=divergence, reduce=reduce, threshold=stat * factor)
            assert bool(keep[row, 0]) is kept
            assert torch.equal(
                keep[row], verl_trm_keep(lr.nan_to_num(0) * mask, mask, divergence, reduce, stat * factor)[row]
            )
    if (divergence, reduce) == ("k3", "max"):  # threshold 0.1: the max drops sequence 2, the mean keeps both
        assert ml.trm_keep(lr, mask, threshold=0.1, reduce="max")[:2, 0].tolist() == [True, False]
        assert ml.trm_keep(lr, mask, threshold=0.1, reduce="mean")[:2, 0].tolist() == [True, True]
        counts = ml.trm_metrics(lr, None, 0.8, 1.2, mask, reduce="max", threshold=0.1)
        assert [(float(n), float(d)) for n, d in counts.values()] == [(2, 5), (1, 2)]  # padding and row 3 not counted


# -- M2PO ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("threshold", [0.01, 0.04, 0.07])
@pytest.mark.parametrize("seed", [0, 1])
def test_m2po_matches_areal(threshold, seed):
    """The whole (B, T) batch is one AReaL micro-batch: keep rule, loss and gradient; NaN/inf padding ignored."""
    mask = layout([7, 0, 12, 3, 9], 12, holes=bool(seed), seed=seed)
    g = torch.Generator().manual_seed(seed)
    old = torch.log(torch.rand(mask.shape, generator=g, dtype=F64) * 0.5 + 0.25)
    lr = padded(0.3 * torch.randn(int(mask.sum()), generator=g, dtype=F64), mask, garbage(mask.shape, nan=True))
    adv = torch.randn(5, 1, generator=g, dtype=F64)
    keep_ref = _apply_m2po_masking(torch.where(mask, lr, 0.0), torch.zeros_like(lr), mask, threshold)
    assert keep_ref[mask].any() and not keep_ref[mask].all()
    assert torch.equal(ml.m2po_keep(lr, mask, threshold=threshold), keep_ref)
    ours = run(lambda x: policy_loss("m2po", x, old, adv, mask, threshold=threshold), old + lr, mask)
    ref = run(lambda x: reference("m2po", x, old, adv, mask, threshold=threshold), old + lr, mask)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a[mask], b[mask], rtol=1e-12, atol=1e-12)


def test_m2po_pools_the_micro_batch_not_each_row():
    lr = torch.tensor([[0.5, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=F64)
    mask = torch.ones_like(lr, dtype=torch.bool)
    pooled = _apply_m2po_masking(lr, torch.zeros_like(lr), mask, 0.04)  # mean 0.25 / 8 < 0.04: keep all
    per_row = torch.cat(
        [_apply_m2po_masking(lr[i : i + 1], torch.zeros(1, 4, dtype=F64), mask[i : i + 1], 0.04) for i in (0, 1)]
    )
    assert pooled.all() and not per_row[0, 0]
    assert torch.equal(ml.m2po_keep(lr, mask, threshold=0.04), pooled)


@pytest.mark.parametrize(
    "deltas,threshold,kept",
    [
        ([0.5, 0.3, 0.1, 0.0, 0.2], 0.04, [0, 1, 1, 1, 1]),  # example 3.6: suffix means 0.078, 0.035: mask 1
        ([0.3, 0.3, 0.3], 0.04, 1),  # every suffix mean 0.09: keep one
        ([0.2, 0.2], 0.04, 1),  # suffix means 0.04 (rounded above): keep one
        ([1.0, 0.5, 0.5], 0.25, 1),  # suffix means 0.5, 0.25, 0.25, exact: strict '<' keeps one ('<=' two)
        ([0.3, -0.3, 0.1, 0.3, 0.1, 0.0, -0.2, 0.2], 0.04, None),  # ties: the count (and kept values) as AReaL
    ],
)
def test_m2po_worked_examples(deltas, threshold, kept):
    n = len(deltas)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask.view(-1)[torch.arange(n) * 12 // n] = True  # spread over both rows, padding between
    lr = padded(torch.tensor(deltas, dtype=F64), mask, torch.full(mask.shape, 3.0))
    keep = ml.m2po_keep(lr, mask, threshold=threshold)
    assert not keep[~mask].any()
    ref = _apply_m2po_masking(torch.where(mask, lr, 0.0), torch.zeros_like(lr), mask, threshold)
    assert torch.equal(lr[keep].square().sort().values, lr[ref].square().sort().values)
    if isinstance(kept, list):
        assert keep[mask].tolist() == [bool(k) for k in kept]
        counts = ml.m2po_metrics(lr, None, 0.8, 1.2, mask, threshold=threshold)
        got = {name: (round(float(a), 12), float(b)) for name, (a, b) in counts.items()}
        assert got == {"m2po/masked_share": (1, 5), "m2po/m2": (0.39, 5), "m2po/m2_kept": (0.14, 4)}
    elif kept is not None:
        assert int(keep.sum()) == kept


# -- IcePop --------------------------------------------------------------------------------------------------------


def test_icepop_closed_interval_and_clipped_surrogate():
    ratios = torch.tensor([0.3, 0.5, 0.7, 1.0, 1.15, 1.9, 2.0, 2.5], dtype=F64)
    lr = torch.log(ratios).expand(3, -1).clone()
    assert torch.equal(torch.exp(lr[0, [1, 6]]), ratios[[1, 6]])  # the interval's ends are hit exactly
    kept = torch.tensor([0, 1, 1, 1, 1, 1, 1, 0], dtype=torch.bool).expand(3, -1)
    adv = torch.tensor([[1.0], [-1.5], [0.0]], dtype=F64)
    loss, grad = run(lambda x: ml.icepop_loss(x, adv, 0.8, 1.3, low=0.5, high=2.0), lr)
    base, base_grad = run(lambda x: clipped_surrogate_loss(x, adv, 0.8, 1.3), lr)
    assert torch.equal(loss, torch.where(kept, base, 0.0)) and torch.equal(grad, torch.where(kept, base_grad, 0.0))
    assert (base[~kept][:4] != 0).all() and (base_grad[kept][:6] != 0).any()
    ours = policy_loss("icepop", torch.zeros(3, 8, dtype=F64), -lr, adv, low=0.5, high=2.0, epsilon_high=0.3)
    assert torch.equal(ours, torch.where(kept, clipped_reference(lr, adv, 0.2, 0.3), 0.0))
    mask = torch.ones(3, 8, dtype=torch.bool)
    mask[:2, -1] = mask[2, 0] = False  # padding: ratio 2.5 (above) in rows 1 and 2, 0.3 (below) in row 3
    counts = ml.icepop_metrics(lr, adv, 0.8, 1.2, mask, low=0.5, high=2.0)
    assert {name: (int(a), int(b)) for name, (a, b) in counts.items()} == {
        "icepop/masked_share": (3, 21),
        "icepop/masked_low_share": (2, 21),
        "icepop/masked_high_share": (1, 21),
    }


def test_icepop_config_refuses_low_at_or_above_high(tmp_path):
    cpu = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", policy_loss="icepop")
    with pytest.raises(ValueError, match=r"icepop_low.*icepop_high"):
        PolicyLossConfig(**cpu, icepop_low=1.0, icepop_high=1.0)
    assert PolicyLossConfig(**cpu, icepop_low=0.2, icepop_high=8.0).icepop_high == 8.0


# -- the asynchronous trainer's packed tokens, and the pure API ----------------------------------------------------

PACKED = [
    ("cppo", dict(radius=0.2, w_min=0.8, rate_min=0.02)),
    ("trm", dict(divergence="k3", reduce="mean", threshold=0.01)),
    ("m2po", dict(threshold=0.04)),
]


@pytest.mark.parametrize("name,hp", PACKED)
def test_packed_tokens_through_the_trainers_path(name, hp):
    """`SampleRows(segment_id).unpack` rebuilds the right-padded batch; `PolicyTerm._with_context` (the trainer's
    call, on a stand-in object) gives the reference's per-token loss and gradient with respect to the flat
    log-probs."""
    lengths = torch.tensor([3, 0, 2, 9, 1, 6])
    segment_id = torch.repeat_interleave(torch.arange(6), lengths)
    g = torch.Generator().manual_seed(5)
    old = torch.log(torch.rand(len(segment_id), generator=g, dtype=F64) * 0.5 + 0.25)
    scale = torch.tensor([0.5, 0.0, 0.02, 1.0, 0.05, 0.3], dtype=F64)[segment_id]  # some rows kept, some masked
    new = (old + scale * torch.randn(len(segment_id), generator=g, dtype=F64)).clamp(max=math.log(0.999))
    adv_rows = torch.tensor([1.0, 2.0, -1.0, 0.5, -2.0, 1.5], dtype=F64)[:, None]
    mask = layout(lengths.tolist(), 9)
    rows = SampleRows(segment_id)
    assert torch.equal(rows.mask, mask) and torch.equal(rows.row, segment_id)
    assert rows.column.tolist() == [c for n in lengths.tolist() for c in range(n)]
    assert torch.equal(rows.unpack(new)[mask], padded(new, mask, torch.zeros(mask.shape))[mask])
    spec = policy_loss_spec(name)
    bound_kw, loss_kw = spec.split(hp)
    term = types.SimpleNamespace(_policy=spec, _policy_loss_kwargs=loss_kw, _all_reduce=lambda t: t)
    lower, upper = spec.bounds(old, **bound_kw)
    adv_flat = adv_rows.expand_as(mask)[mask]

    def trainers_path(x):
        return PolicyTerm._with_context(term, spec.loss, x - old, adv_flat, lower, upper, None, old, segment_id)

    flat = run(trainers_path, new)
    old_p = padded(old, mask, garbage(mask.shape, 2))
    ref = run(lambda x: reference(name, x, old_p, adv_rows, mask, **hp), padded(new, mask, garbage(mask.shape)), mask)
    assert flat[0].shape == new.shape
    masked = ref[0][mask] == 0
    assert masked.any() and not masked.all()
    for a, b in zip(flat, ref):
        torch.testing.assert_close(a, b[mask], rtol=1e-12, atol=1e-12)


def test_mask_is_checked_and_ignored_by_losses_that_do_not_declare_it():
    g = torch.Generator().manual_seed(6)
    old = torch.log(torch.rand(3, 5, generator=g, dtype=F64))
    logps = old + 0.3 * torch.randn(3, 5, generator=g, dtype=F64)
    adv = torch.tensor([1.0, -1.0, 0.5], dtype=F64)
    for bad in (torch.ones(3, 6, dtype=torch.bool), torch.ones(5, dtype=torch.bool), [[1] * 5] * 3):
        with pytest.raises(ValueError, match="mask"):
            policy_loss("cppo", logps, old, adv, mask=bad)
    mask = torch.rand(3, 5, generator=g) < 0.6
    undeclared = [name for name, spec in registered_policy_losses().items() if "mask" not in spec.context]
    assert {"clip", "icepop", "dppo_tv"} <= set(undeclared)
    for name in undeclared:
        assert torch.equal(policy_loss(name, logps, old, adv, mask=mask), policy_loss(name, logps, old, adv)), name

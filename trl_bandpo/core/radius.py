"""The adaptive per-token Band radius (docs/extensions.md, "Adaptive per-token radius") from the old policy's
entropy at each token, `delta_t = clip(delta * (H_t / H_mean) ** alpha, delta_min, delta_max)`, and the statistics
the trainer logs of it."""

from __future__ import annotations

import torch


def entropy_radius(
    entropies: torch.Tensor,
    mask: torch.Tensor,
    delta: float,
    *,
    exponent: float = 1.0,
    radius_min: float = 0.005,
    radius_max: float = 0.5,
    mean_entropy: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token radii `(B, T)` from entropies `(B, T)` (nats) and the completion mask `(B, T)`.

    `mean_entropy` is `H_mean` (default: the masked mean of `entropies`; the trainer passes the mean over the whole
    generation batch of every process). Where `H_mean` is 0 (a batch of certain tokens) every token gets `delta`.
    Padding positions get `delta` too (they are masked out of the loss anyway), and whatever they hold (NaN, inf)
    enters no reduction.
    """
    keep = mask > 0
    entropies = entropies.detach().float()
    if mean_entropy is None:
        mean_entropy = masked_sum(entropies, keep) / keep.sum().clamp(min=1).float()
    relative = entropies.clamp(min=0.0) / mean_entropy.clamp(min=torch.finfo(torch.float32).tiny)
    radius = (delta * relative.pow(exponent)).clamp(min=radius_min, max=radius_max)
    certain = mean_entropy <= 0
    return torch.where(keep & ~certain, radius, torch.full_like(radius, delta))


def masked_sum(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Sum of `values` where `keep` is true. `torch.where`, not `values * mask`: a NaN or inf at a masked-out
    position (NaN * 0 = NaN) must not enter the sum."""
    return torch.where(keep, values, torch.zeros_like(values)).sum()


def check_radius_fn_output(radius, entropies: torch.Tensor, mask: torch.Tensor, delta: float) -> torch.Tensor:
    """The radii a user's `radius_fn(entropies, mask, delta)` returned, checked: a floating tensor shaped like
    `entropies` whose values at completion tokens are finite and > 0, else a `ValueError` naming `radius_fn`, the
    shape expected and the bad values. Padding positions get `delta`, whatever `radius_fn` put there. One host
    read per call (to raise at once, never to train unclipped)."""
    shape = tuple(entropies.shape)
    if not torch.is_tensor(radius) or tuple(radius.shape) != shape:
        got = f"shape {tuple(radius.shape)}" if torch.is_tensor(radius) else type(radius).__name__
        raise ValueError(
            f"radius_fn must return a tensor of shape {shape} (one radius per token, like its entropies), got {got}."
        )
    if not radius.is_floating_point():
        raise ValueError(f"radius_fn must return a floating-point tensor of shape {shape}, got dtype {radius.dtype}.")
    keep = (mask > 0).to(radius.device)
    radius = radius.detach()
    bad = keep & ~(torch.isfinite(radius) & (radius > 0))
    if bool(bad.any()):
        values = radius[bad]
        shown = ", ".join(f"{v:.6g}" for v in values[:3].tolist())
        raise ValueError(
            f"radius_fn returned {values.numel()} radii at completion tokens that are not finite numbers > 0 "
            f"({shown}{', ...' if values.numel() > 3 else ''}): every radius of a completion token must be finite "
            "and > 0 (training on NaN bounds would not clip)."
        )
    return torch.where(keep, radius, torch.full_like(radius, delta))


def radius_statistics(radius: torch.Tensor, entropies: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Local sums `[n, sum r, sum h, sum r^2, sum h^2, sum r h, min r, max r]` over the masked tokens, in float64:
    summed over processes they give the radius mean/min/max and its Pearson correlation with the entropy."""
    keep = mask > 0
    r, h = radius[keep].double(), entropies.detach()[keep].double()
    if r.numel() == 0:
        return torch.tensor([0.0] * 6 + [float("inf"), float("-inf")], dtype=torch.float64, device=radius.device)
    moments = (r, h, r * r, h * h, r * h)
    sums = torch.stack([r.new_tensor(float(r.numel())), *(x.sum() for x in moments)])
    return torch.cat([sums, r.min().reshape(1), r.max().reshape(1)])


def correlation(totals: list[float]) -> float:
    """Pearson correlation from `radius_statistics` totals (NaN when either side is constant)."""
    n, sr, sh, srr, shh, srh = totals[:6]
    if n < 2:
        return float("nan")
    cov = srh / n - (sr / n) * (sh / n)
    var_r, var_h = srr / n - (sr / n) ** 2, shh / n - (sh / n) ** 2
    if var_r <= 0 or var_h <= 0:
        return float("nan")
    return cov / (var_r * var_h) ** 0.5

"""The adaptive per-token Band radius: `delta_t` from the old policy's entropy at each token (docs/extensions.md,
"Adaptive per-token radius"; BandPO §7 names it as future work).

    delta_t = clip(delta * (H_t / H_mean) ** alpha, delta_min, delta_max)

`entropy_radius` is that formula on tensors. `OldPolicyEntropies` is a trainer mixin that takes the old policy's
entropies from the pass that computes the old log-probs (no extra forward pass) and attaches them to the generation
output as `old_per_token_entropies`.
"""

from __future__ import annotations

import torch

__all__ = [
    "AdaptiveRadius",
    "OldPolicyEntropies",
    "check_radius_fn_output",
    "correlation",
    "entropy_radius",
    "masked_sum",
    "radius_statistics",
]

#: Key of the old policy's per-token entropies in a generation output (popped once the bounds are computed).
OLD_ENTROPIES_KEY = "old_per_token_entropies"


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
    sums = torch.stack([torch.tensor(float(r.numel()), device=r.device, dtype=torch.float64), r.sum(), h.sum(),
                        (r * r).sum(), (h * h).sum(), (r * h).sum()])  # fmt: skip
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


class OldPolicyEntropies:
    """Mixin for `GRPOTrainer` subclasses: when `self._wants_old_entropies()` is true, the old policy's entropies
    come from the forward pass whose log-probs GRPOTrainer stores as `old_per_token_logps`, attached to the
    generation output under `OLD_ENTROPIES_KEY`.

    During generation every forward pass of the policy (`self.model`) is asked for entropies too; afterwards the one
    whose log-prob tensor *is* the output's `old_per_token_logps` gives them (a reference pass through the same
    model with its adapter disabled is not mistaken for it). If none matches, an error says so: entropies are never
    taken from another pass by position.
    """

    def _wants_old_entropies(self) -> bool:
        return False

    def _generate_and_score_completions(self, inputs):
        capture = self._wants_old_entropies() and self.model.training
        self._policy_passes = [] if capture else None
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            passes, self._policy_passes = self._policy_passes, None
        old_logps = output.get("old_per_token_logps")
        if capture and old_logps is not None:
            matches = [entropies for logps, entropies in passes if logps is old_logps]
            if len(matches) != 1:
                raise RuntimeError(
                    f"the adaptive Band radius needs the entropies of the pass that computed old_per_token_logps, but "
                    f"{len(matches)} of this generation's {len(passes)} policy passes returned that tensor (a TRL "
                    "version this package was not tested with?)."
                )
            output[OLD_ENTROPIES_KEY] = matches[0]
        return output

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        passes = getattr(self, "_policy_passes", None)
        if passes is None or model is not self.model:
            return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        kwargs["compute_entropy"] = True  # the same forward, asked for entropies as well
        logps, entropies, aux = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        passes.append((logps, entropies.detach()))
        return logps, entropies, aux


class AdaptiveRadius(OldPolicyEntropies):
    """Mixin for `PolicyLossTrainer`: the per-token radius of losses whose bounds read `radius` (Band family).

    `band_radius_by="entropy"` uses `entropy_radius`; a `radius_fn(entropies, mask, delta) -> radii` set on the
    trainer (class or instance attribute) replaces it, for researchers: it must return a floating `(B, T)` tensor,
    finite and > 0 at every completion token (checked at each call, `check_radius_fn_output`); what it returns at
    padding positions is replaced by `delta`.
    """

    radius_fn = None

    def _adaptive_radius_enabled(self) -> bool:
        uses_radius = "radius" in self._policy.bound_names
        return uses_radius and (self.radius_fn is not None or self.args.band_radius_by is not None)

    def _wants_old_entropies(self) -> bool:
        # Only where GRPOTrainer computes old log-probs (off-policy updates, or vLLM's correction): otherwise every
        # ratio is 1 and the loss computes bounds from the current (= old) policy, whose entropies it has.
        generate_every = self.args.steps_per_generation * self.num_iterations
        off_policy = self.args.gradient_accumulation_steps % generate_every != 0
        vllm_corrected = self.use_vllm and self.vllm_importance_sampling_correction
        return self._adaptive_radius_enabled() and (off_policy or vllm_corrected)

    def _token_radius(self, entropies, mask, mean_entropy=None):
        """`(B, T)` radii for these entropies; `mean_entropy` defaults to the masked mean of `entropies`."""
        delta = self._policy_bound_kwargs["radius"]
        if self.radius_fn is not None:
            return check_radius_fn_output(self.radius_fn(entropies.detach(), mask, delta), entropies, mask, delta)
        args = self.args
        return entropy_radius(
            entropies, mask, delta, exponent=args.band_radius_exponent, radius_min=args.band_radius_min,
            radius_max=args.band_radius_max, mean_entropy=mean_entropy,
        )  # fmt: skip

    def _generation_radius(self, entropies, mask):
        """Radii for a whole generation batch: `H_mean` over every process's tokens; logs the radius metrics."""
        keep = mask > 0
        local = torch.stack([masked_sum(entropies.detach().float(), keep), keep.sum().float()])
        totals = self.accelerator.reduce(local, reduction="sum")
        radius = self._token_radius(entropies, mask, mean_entropy=totals[0] / totals[1].clamp(min=1.0))
        stats = radius_statistics(radius, entropies, mask)
        sums = self.accelerator.reduce(stats[:6], reduction="sum").tolist()
        extremes = self.accelerator.gather(stats[6:].reshape(1, 2))
        metrics = self._metrics["train"]
        metrics["bounds/radius_mean"].append(sums[1] / sums[0] if sums[0] else float("nan"))
        metrics["bounds/radius_min"].append(extremes[:, 0].min().item())
        metrics["bounds/radius_max"].append(extremes[:, 1].max().item())
        metrics["bounds/radius_entropy_corr"].append(correlation(sums))
        return radius

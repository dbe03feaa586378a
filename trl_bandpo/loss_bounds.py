"""Ratio bounds of the policy losses, `(old_logps, **hyperparameters) -> (lower, upper)`: the fixed clip interval,
BandPO's Band (and Relaxed Band), DCPO's dynamic bounds (docs/policy-losses.md, "The losses").

Fixed bounds are floats; probability-aware ones are tensors shaped like `old_logps`, computed without gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .band import band_bounds

__all__ = ["band_policy_bounds", "clip_bounds", "dcpo_bounds", "relaxed_band_bounds"]


def clip_bounds(old_logps: torch.Tensor, *, epsilon_low: float = 0.2, epsilon_high: float = 0.2):
    """GRPO / PPO bounds `[1 - epsilon_low, 1 + epsilon_high]` (Clip-Higher: `epsilon_high = 0.28`)."""
    return 1.0 - epsilon_low, 1.0 + epsilon_high


def band_policy_bounds(
    old_logps: torch.Tensor,
    *,
    radius: float = 0.05,
    divergence: str | Callable = "kl",
    upper_max: float | None = 10.0,
    solver: str = "auto",
):
    """BandPO bounds (see `trl_bandpo.band.band_bounds`); `upper_max=10` as the BandPO authors trained."""
    return band_bounds(old_logps, radius, divergence, solver=solver, upper_max=upper_max)


def relaxed_band_bounds(
    old_logps: torch.Tensor,
    *,
    radius: float = 0.05,
    divergence: str | Callable = "kl",
    upper_max: float | None = 10.0,
    solver: str = "auto",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.28,
):
    """Relaxed Band (BandPO paper's ablation): the union of the Band and Clip-Higher intervals at every p."""
    return band_bounds(
        old_logps, radius, divergence, solver=solver, upper_max=upper_max, relax=(epsilon_low, epsilon_high)
    )


def dcpo_bounds(
    old_logps: torch.Tensor, *, epsilon_low: float = 0.16, epsilon_high: float = 0.2, upper_max: float = 10.0
):
    """DCPO's dynamic bounds: `lower = 1/2 + 1/2 sqrt(max(1 - 4 eps_low / p, 0))`,
    `upper = min(1/2 + 1/2 sqrt(1 + 4 eps_high / p), upper_max)` (docs/policy-losses.md, "DCPO")."""
    with torch.no_grad():
        dtype = torch.float64 if old_logps.dtype == torch.float64 else torch.float32
        inv_p = torch.exp(-old_logps.detach().to(dtype).clamp(max=0.0))
        lower = 0.5 + 0.5 * torch.sqrt((1 - 4 * epsilon_low * inv_p).clamp(min=0.0))
        upper = (0.5 + 0.5 * torch.sqrt(1 + 4 * epsilon_high * inv_p)).clamp(max=upper_max)
    return lower, upper

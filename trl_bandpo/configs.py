"""Configurations of the BandPO and DGPO trainers: `GRPOConfig` plus the fields of our policy losses."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trl import GRPOConfig

from .band import DIVERGENCES, validate_band_args
from .losses import POLICY_LOSSES, policy_loss_fn

# TRL loss types whose per-token policy term is TRL's own (not a clipped ratio); they only combine with "clip".
TRL_PER_TOKEN_LOSS_TYPES = ("cispo", "sapo", "vespo", "luspo")


@dataclass
class PolicyLossConfig(GRPOConfig):
    r"""
    Configuration shared by [`BandPOTrainer`] and [`DGPOTrainer`]: every parameter of [`trl.GRPOConfig`], plus the
    choice of per-token policy loss and the hyper-parameters of each. Any trainer runs any policy loss, so one tool
    reruns both papers' comparisons; `BandPOConfig` and `DGPOConfig` differ only in their defaults.

    Parameters:
        policy_loss (`str`, defaults to `"clip"`):
            Per-token policy term: `"clip"` (GRPO/PPO; Clip-Higher with `epsilon_high=0.28`), `"band"` (BandPO,
            [paper](https://arxiv.org/abs/2603.04918)), `"relaxed_band"` (Band united with the Clip-Higher
            interval, BandPO's ablation), `"dcpo"` (DCPO's dynamic bounds), `"dgpo"`
            ([paper](https://arxiv.org/abs/2603.14389)), `"gppo"`, `"ce_gppo"`, `"aspo"` (the DGPO paper's
            baselines). Everything but `"clip"` requires `loss_type` in `grpo`, `bnpo`, `dr_grpo`, `dapo`.
        band_divergence (`str`, defaults to `"kl"`):
            f-divergence of the Band trust region: `"kl"`, `"tv"`, `"chi2"`, `"reverse_kl"`, `"hellinger"`, `"js"`.
        band_radius (`float`, defaults to `0.05`):
            Trust-region radius δ (BandPO: 0.05, ablation 0.03 and 0.1).
        band_solver (`str`, defaults to `"auto"`):
            `"auto"` (Triton kernel on CUDA when installed, torch elsewhere), `"torch"` or `"triton"`.
        band_upper_max (`float` or `None`, defaults to `10.0`):
            Cap on the Band upper bound, as the BandPO authors trained. `None` keeps only the simplex limit `1/p`.
        band_relax (`bool`, defaults to `False`):
            Relaxed Band: unite the Band interval with `[1 - epsilon, 1 + epsilon_high]` at every p. Setting it
            with `policy_loss="band"` is the same as `policy_loss="relaxed_band"`.
        dgpo_n (`int`, defaults to `1`):
            DGPO left-boundary decay power n ≥ 1 (weight on ∇π ∝ π^n for r < 1-ε, A < 0). Paper: 2 at 1.5B, 1 at
            7B/14B.
        dgpo_m (`float`, defaults to `2.0`):
            DGPO right-boundary decay root m ≥ 1 (weight on ∇π ∝ π^(-1/m) for r > 1+ε_high, A > 0).
        ce_gppo_beta1 (`float`, defaults to `0.75`):
            CE-GPPO weight scale on the left boundary (DGPO paper's setting).
        ce_gppo_beta2 (`float`, defaults to `1.0`):
            CE-GPPO weight scale on the right boundary.
        aspo_c_pos (`float`, defaults to `3.0`):
            ASPO cap on the flipped weight 1/r of positive-advantage tokens.
        aspo_c_neg (`float`, defaults to `3.0`):
            ASPO cap on the weight r of negative-advantage tokens.
    """

    policy_loss: str = field(
        default="clip",
        metadata={"help": f"Per-token policy loss, one of {list(POLICY_LOSSES)}.", "choices": list(POLICY_LOSSES)},
    )
    band_divergence: str = field(
        default="kl", metadata={"help": "Band f-divergence.", "choices": list(DIVERGENCES)}
    )
    band_radius: float = field(default=0.05, metadata={"help": "Band trust-region radius delta."})
    band_solver: str = field(
        default="auto", metadata={"help": "Band bound solver.", "choices": ["auto", "torch", "triton"]}
    )
    band_upper_max: float | None = field(
        default=10.0, metadata={"help": "Cap on the Band upper bound (authors: 10); None for no cap."}
    )
    band_relax: bool = field(default=False, metadata={"help": "Unite the Band and clip intervals (Relaxed Band)."})
    dgpo_n: int = field(default=1, metadata={"help": "DGPO left-boundary decay power n >= 1."})
    dgpo_m: float = field(default=2.0, metadata={"help": "DGPO right-boundary decay root m >= 1."})
    ce_gppo_beta1: float = field(default=0.75, metadata={"help": "CE-GPPO left-boundary weight scale."})
    ce_gppo_beta2: float = field(default=1.0, metadata={"help": "CE-GPPO right-boundary weight scale."})
    aspo_c_pos: float = field(default=3.0, metadata={"help": "ASPO cap on 1/r for positive advantages."})
    aspo_c_neg: float = field(default=3.0, metadata={"help": "ASPO cap on r for negative advantages."})

    def __post_init__(self):
        super().__post_init__()
        policy_loss_fn(self.policy_loss)  # raises ValueError naming the allowed values
        if self.band_relax and self.policy_loss == "band":
            self.policy_loss = "relaxed_band"
        if self.policy_loss != "clip" and self.loss_type in TRL_PER_TOKEN_LOSS_TYPES:
            raise ValueError(
                f"policy_loss={self.policy_loss!r} cannot be combined with loss_type={self.loss_type!r}: that loss "
                f"type has its own per-token policy term. Use policy_loss='clip' with it, or a loss_type among "
                f"'grpo', 'bnpo', 'dr_grpo', 'dapo'."
            )
        if self.band_upper_max is not None and isinstance(self.band_upper_max, str):  # YAML/CLI "None"
            self.band_upper_max = None if self.band_upper_max.lower() in ("none", "null") else float(self.band_upper_max)
        try:
            validate_band_args(self.band_radius, self.band_divergence, self.band_solver, self.band_upper_max)
        except ValueError as err:
            raise ValueError(f"Invalid Band configuration (band_* fields): {err}") from None
        if self.band_solver == "triton" and self.policy_loss in ("band", "relaxed_band"):
            self._check_triton_solver()
        epsilon_high = self.epsilon_high if self.epsilon_high is not None else self.epsilon
        if not (0 <= self.epsilon < 1 and 0 <= epsilon_high < math.inf):
            raise ValueError(
                f"epsilon must be in [0, 1) and epsilon_high in [0, inf), got epsilon={self.epsilon!r}, "
                f"epsilon_high={self.epsilon_high!r}."
            )
        if isinstance(self.dgpo_n, bool) or not float(self.dgpo_n).is_integer() or self.dgpo_n < 1:
            raise ValueError(f"dgpo_n must be an integer >= 1, got {self.dgpo_n!r}.")
        self.dgpo_n = int(self.dgpo_n)
        if not (math.isfinite(self.dgpo_m) and self.dgpo_m >= 1):
            raise ValueError(f"dgpo_m must be a finite number >= 1, got {self.dgpo_m!r}.")
        for name in ("ce_gppo_beta1", "ce_gppo_beta2"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}.")
        for name in ("aspo_c_pos", "aspo_c_neg"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 1):
                raise ValueError(f"{name} must be a finite number >= 1, got {value!r}.")
        if self.delta is not None and not policy_loss_fn(self.policy_loss).clipped:
            raise ValueError(
                f"delta (dual clip) applies to the clipped losses only; policy_loss={self.policy_loss!r} sets its "
                f"own weights outside the clip range. Set delta=None."
            )


    def _check_triton_solver(self):
        """`band_solver="triton"` fails here rather than at the first training step where it cannot run."""
        import torch

        from .kernels import triton_unavailable_reason

        if self.band_divergence != "kl":
            raise ValueError(
                f"band_solver='triton' supports band_divergence='kl' only, got {self.band_divergence!r}; "
                "use band_solver='auto' or 'torch'."
            )
        device = "cpu" if self.use_cpu or not torch.cuda.is_available() else "cuda"
        reason = triton_unavailable_reason(torch.empty(0, device=device))
        if reason is not None:
            raise ValueError(f"band_solver='triton' cannot run here: {reason}. Use band_solver='auto' or 'torch'.")


@dataclass
class BandPOConfig(PolicyLossConfig):
    r"""
    Configuration of [`BandPOTrainer`]: [`PolicyLossConfig`] with `policy_loss="band"`, i.e. BandPO's
    probability-aware bounds from a KL trust region of radius `band_radius` in place of GRPO's fixed clip
    ([BandPO](https://arxiv.org/abs/2603.04918)). The authors also trained with `delta=10` (dual clip),
    `loss_type="grpo"`, `beta=0.001`; the recipes in `recipes/` set those.

    Parameters:
        policy_loss (`str`, defaults to `"band"`):
            Per-token policy loss; see [`PolicyLossConfig`].
    """

    policy_loss: str = field(
        default="band",
        metadata={"help": f"Per-token policy loss, one of {list(POLICY_LOSSES)}.", "choices": list(POLICY_LOSSES)},
    )


@dataclass
class DGPOConfig(PolicyLossConfig):
    r"""
    Configuration of [`DGPOTrainer`]: [`PolicyLossConfig`] with `policy_loss="dgpo"`, i.e. tokens outside the clip
    range keep a gradient whose weight decays continuously as π^n (left) and π^(-1/m) (right)
    ([DGPO](https://arxiv.org/abs/2603.14389)). The paper uses ε = 0.2/0.2, token-mean aggregation (`loss_type`
    `"dapo"`, TRL's default) and no KL penalty.

    Parameters:
        policy_loss (`str`, defaults to `"dgpo"`):
            Per-token policy loss; see [`PolicyLossConfig`].
    """

    policy_loss: str = field(
        default="dgpo",
        metadata={"help": f"Per-token policy loss, one of {list(POLICY_LOSSES)}.", "choices": list(POLICY_LOSSES)},
    )

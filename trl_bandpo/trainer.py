"""BandPOTrainer and DGPOTrainer: GRPOTrainer with the per-token policy term swapped for one of `POLICY_LOSSES`.

TRL's `GRPOTrainer._compute_loss` has no smaller hook (SPEC §6), so `PolicyLossTrainer` overrides it once and keeps
every other part of it: the fused log-prob/entropy forward, entropy mask, off-policy mask, KL term, vLLM
importance-sampling correction, token/sequence importance sampling, the normaliser of each `loss_type`, entropy
bonus (static and adaptive), aux loss and TRL's metrics. `tests/test_trl_parity.py` checks that with
`policy_loss="clip"` the loss, gradients and metrics equal GRPOTrainer's, so a TRL upgrade that changes
`_compute_loss` fails loudly. Loss types whose policy term is TRL's own (`cispo`, `sapo`, `vespo`, `luspo`) are
delegated to GRPOTrainer unchanged (the config only allows them with `policy_loss="clip"`).
"""

from __future__ import annotations

from collections import defaultdict

import torch
from trl import GRPOTrainer
from trl.trainer.utils import nanmax, nanmin

from .configs import TRL_PER_TOKEN_LOSS_TYPES, BandPOConfig, DGPOConfig, PolicyLossConfig
from .losses import clip_regions, dgpo_log_weights, policy_loss_fn

__all__ = ["PolicyLossTrainer", "BandPOTrainer", "DGPOTrainer", "PROB_BUCKET_EDGES"]

#: Old-token-probability bucket edges for the clip-rate-by-probability metrics (SPEC §4).
PROB_BUCKET_EDGES = (0.2, 0.4, 0.6, 0.8)
#: Tokens with p below this are "tail" tokens (BandPO Figure 3(b)).
TAIL_PROBABILITY = 0.2
_BOUND_KEYS = ("policy_lower_bound", "policy_upper_bound")


class PolicyLossTrainer(GRPOTrainer):
    """GRPOTrainer whose per-token policy term is `args.policy_loss` (see [`PolicyLossConfig`]).

    Everything else is GRPOTrainer's: pass the same arguments (`model`, `reward_funcs`, `train_dataset`,
    `peft_config`, ...). Bounds that depend only on the old log-probs (Band, DCPO) are computed once per generation
    batch, stored next to `old_per_token_logps`, and reused for every micro-step and iteration over that batch.
    """

    config_class = PolicyLossConfig
    _tag_names = ["trl", "grpo", "trl-bandpo"]

    def __init__(self, model, reward_funcs, args: PolicyLossConfig | None = None, **kwargs):
        if args is None:
            model_name = model if isinstance(model, str) else model.config._name_or_path
            args = self.config_class(f"{model_name.split('/')[-1]}-{self.config_class.__name__.removesuffix('Config')}")
        if not isinstance(args, PolicyLossConfig):
            raise TypeError(
                f"{type(self).__name__} needs a PolicyLossConfig (BandPOConfig or DGPOConfig), got "
                f"{type(args).__name__}; use BandPOConfig or DGPOConfig in place of GRPOConfig (they take its fields)."
            )
        super().__init__(model, reward_funcs, args=args, **kwargs)
        self.policy_loss = args.policy_loss
        self._policy = policy_loss_fn(args.policy_loss)
        self._count_metrics = {"train": defaultdict(lambda: [0.0, 0.0]), "eval": defaultdict(lambda: [0.0, 0.0])}

    # -- hyper-parameters ------------------------------------------------------------------------------------------

    def _bound_kwargs(self) -> dict:
        args = self.args
        clip = {"epsilon_low": self.epsilon_low, "epsilon_high": self.epsilon_high}
        band = {
            "radius": args.band_radius,
            "divergence": args.band_divergence,
            "upper_max": args.band_upper_max,
            "solver": args.band_solver,
        }
        return {"band": band, "relaxed_band": {**band, **clip}}.get(self.policy_loss, clip)

    def _loss_kwargs(self) -> dict:
        args = self.args
        return {
            "clip": {"delta": args.delta},
            "band": {"delta": args.delta},
            "relaxed_band": {"delta": args.delta},
            "dcpo": {"delta": args.delta},
            "dgpo": {"n": args.dgpo_n, "m": args.dgpo_m},
            "gppo": {},
            "ce_gppo": {"beta1": args.ce_gppo_beta1, "beta2": args.ce_gppo_beta2},
            "aspo": {"c_pos": args.aspo_c_pos, "c_neg": args.aspo_c_neg},
        }[self.policy_loss]

    def _bounds(self, old_logps: torch.Tensor):
        return self._policy.bounds(old_logps, **self._bound_kwargs())

    # -- bounds once per generation batch --------------------------------------------------------------------------

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        old_logps = output.get("old_per_token_logps")
        if old_logps is not None and self.loss_type not in TRL_PER_TOKEN_LOSS_TYPES:
            lower, upper = self._bounds(old_logps)
            if torch.is_tensor(lower):  # per-token bounds travel with the batch through TRL's split and shuffle
                output[_BOUND_KEYS[0]], output[_BOUND_KEYS[1]] = lower, upper
        return output

    # -- the loss --------------------------------------------------------------------------------------------------

    def _compute_loss(self, model, inputs):
        if self.loss_type in TRL_PER_TOKEN_LOSS_TYPES:
            return super()._compute_loss(model, inputs)

        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        multimodal = (
            "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
            "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids",
        )  # fmt: skip
        per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            completion_ids.size(1),
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
            **{key: inputs.get(key) for key in multimodal},
        )
        entropy_mask = (
            self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
            if self.top_entropy_quantile < 1.0
            else None
        )
        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        # Without `old_per_token_logps` TRL is on-policy: the old log-probs are the current ones, detached.
        old_per_token_logps = inputs.get("old_per_token_logps")
        if old_per_token_logps is None:
            old_per_token_logps = per_token_logps.detach()
        else:  # a non-finite old log-prob (a padded or unscored token) would make that token's loss NaN
            old_per_token_logps = torch.where(
                torch.isfinite(old_per_token_logps), old_per_token_logps, per_token_logps.detach()
            )

        log_ratio = per_token_logps - old_per_token_logps
        if self.importance_sampling_level == "token":
            log_importance_weights = log_ratio
        elif self.importance_sampling_level == "sequence":
            log_importance_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        else:
            raise ValueError(f"Unknown importance sampling level: {self.importance_sampling_level}.")

        # The policy term: the only part that differs from GRPOTrainer.
        if _BOUND_KEYS[0] in inputs:
            lower, upper = inputs[_BOUND_KEYS[0]], inputs[_BOUND_KEYS[1]]
        else:
            lower, upper = self._bounds(old_per_token_logps)
        per_token_loss = self._policy.loss(log_importance_weights, advantages, lower, upper, **self._loss_kwargs())

        if self.beta != 0.0:
            ref_logps = inputs["ref_per_token_logps"]
            per_token_kl = torch.exp(ref_logps - per_token_logps) - (ref_logps - per_token_logps) - 1
            if self.args.use_bias_correction_kl:
                per_token_kl = per_token_kl * torch.exp(log_importance_weights)
        if self.off_policy_mask_threshold is not None:
            per_token_loss = per_token_loss * self.get_off_policy_mask(
                advantages=advantages,
                per_token_logps=per_token_logps,
                sampling_per_token_logps=inputs.get("sampling_per_token_logps", old_per_token_logps),
                mask=mask,
                off_policy_threshold=self.off_policy_mask_threshold,
            )
        if entropy_mask is not None:
            per_token_loss = per_token_loss * entropy_mask
        if self.use_vllm and self.vllm_importance_sampling_correction:
            per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]
        if self.beta != 0.0:
            per_token_loss = per_token_loss + self.beta * per_token_kl

        mode = "train" if self.model.training else "eval"
        loss, policy_loss = self._aggregate(per_token_loss, mask, inputs, mode)
        if self._entropy_bonus_enabled:
            loss = loss - self._entropy_bonus(entropies, mask, entropy_mask, policy_loss, mode)
        if self.aux_loss_enabled:
            normalizer = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            loss = loss + self.router_aux_loss_coef * aux_loss / normalizer
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())

        self._log_trl_metrics(mode, mask, entropies, per_token_kl if self.beta != 0.0 else None)
        with torch.no_grad():
            self._log_policy_metrics(
                mode, mask, old_per_token_logps, log_importance_weights.detach(), advantages, lower, upper
            )
        return loss

    def _aggregate(self, per_token_loss, mask, inputs, mode):
        """TRL's normaliser for each `loss_type`; returns the scaled loss and the unscaled (detached) one."""
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        if self.loss_type == "grpo":
            loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
        elif self.loss_type == "bnpo":
            loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
        elif self.loss_type == "dr_grpo":
            loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * self.max_completion_length)
        elif self.loss_type == "dapo":
            # `num_items_in_batch` spans the generation batch: rescale it to one accumulation window
            normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
            loss = (per_token_loss * mask).sum() / normalizer
            return loss, loss.detach()
        else:
            raise ValueError(f"Unknown loss type: {self.loss_type}")
        return loss / accumulation, loss.detach()

    def _entropy_bonus(self, entropies, mask, entropy_mask, policy_loss, mode):
        """TRL's entropy bonus (mean entropy of the tokens the policy term acts on) and its adaptive controller."""
        effective_mask = mask if entropy_mask is None else mask * entropy_mask
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        entropy_loss = (entropies * effective_mask).sum() / effective_mask.sum().clamp(min=1.0) / accumulation
        if self.use_adaptive_entropy:
            coef = self.entropy_coef if self._last_world_entropy <= self.args.entropy_target else 0.0
        else:
            coef = self.entropy_coef
        self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())
        if self.use_adaptive_entropy and mode == "train":
            stats = torch.stack([(entropies * effective_mask).sum(), effective_mask.sum()]).detach()
            window = stats if self._entropy_window_stats is None else self._entropy_window_stats + stats
            self._entropy_window_stats = window
            if self.accelerator.sync_gradients:
                totals = self.accelerator.reduce(window, reduction="sum")
                world_entropy = (totals[0] / totals[1].clamp(min=1.0)).item()
                step = self.args.entropy_coef_delta
                if world_entropy <= self.args.entropy_target:
                    self.entropy_coef = min(self.entropy_coef + step, self.args.entropy_coef_max)
                else:
                    self.entropy_coef = max(self.entropy_coef - step, self.args.entropy_coef_min)
                self._last_world_entropy = world_entropy
                self._entropy_window_stats = None
        if mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        return coef * entropy_loss

    # -- metrics ---------------------------------------------------------------------------------------------------

    def _global_masked_mean(self, x, mask):
        if x.shape[1] == 1:  # sequence-level importance sampling: one value per sequence
            local = torch.stack([x.sum(), torch.tensor(float(x.shape[0]), device=x.device)])
        else:
            local = torch.stack([(x * mask).sum(), mask.sum().float()])
        totals = self.accelerator.reduce(local, reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    def _log_trl_metrics(self, mode, mask, entropies, per_token_kl):
        if per_token_kl is not None:
            self._metrics[mode]["kl"].append(self._global_masked_mean(per_token_kl, mask))
        self._metrics[mode]["entropy"].append(self._global_masked_mean(entropies, mask))

    def _log_policy_metrics(self, mode, mask, old_logps, log_ratio, advantages, lower, upper):
        """TRL's clip-ratio metrics against the bounds actually used, and the count metrics of SPEC §4."""
        ratio = torch.exp(log_ratio)
        as_tensor = lambda b: b if torch.is_tensor(b) else torch.tensor(b, device=ratio.device)  # noqa: E731
        lower, upper = as_tensor(lower), as_tensor(upper)
        is_low = (ratio < lower) & (advantages < 0)
        is_high = (ratio > upper) & (advantages > 0)
        is_region = is_low | is_high

        def masked_seq_mean(x):
            return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)

        metrics = self._metrics[mode]
        metrics["clip_ratio/low_mean"].append(self._global_masked_mean(is_low.float(), mask))
        metrics["clip_ratio/high_mean"].append(self._global_masked_mean(is_high.float(), mask))
        metrics["clip_ratio/region_mean"].append(self._global_masked_mean(is_region.float(), mask))
        metrics["clip_ratio/low_min"].append(nanmin(self.accelerator.gather(masked_seq_mean(is_low.float()))).item())
        metrics["clip_ratio/high_max"].append(nanmax(self.accelerator.gather(masked_seq_mean(is_high.float()))).item())

        # Count metrics: numerators and denominators summed over processes and accumulation steps, divided at log.
        m = mask.float()
        p = torch.exp(old_logps.float())
        is_low, is_high = (is_low.float() * m), (is_high.float() * m)  # broadcast (B, 1) -> (B, T)
        counts = {
            "bounds/lower_mean": ((lower.float() * m).sum(), m.sum()),
            "bounds/upper_mean": ((upper.float() * m).sum(), m.sum()),
            "clip_ratio/high_tail_share": ((is_high * (p < TAIL_PROBABILITY)).sum(), is_high.sum()),
        }
        edges = (0.0, *PROB_BUCKET_EDGES, 1.0)
        for left, right in zip(edges[:-1], edges[1:]):
            in_bucket = ((p >= left) & ((p < right) if right < 1.0 else (p <= right))).float() * m
            name = f"p{left:.1f}-{right:.1f}"
            counts[f"clip_ratio_by_prob/low/{name}"] = ((is_low * in_bucket).sum(), in_bucket.sum())
            counts[f"clip_ratio_by_prob/high/{name}"] = ((is_high * in_bucket).sum(), in_bucket.sum())
        if self.policy_loss == "dgpo":
            regions = clip_regions(log_ratio, advantages, lower, upper)
            weights = torch.exp(dgpo_log_weights(log_ratio, advantages, lower, upper, n=self.args.dgpo_n, m=self.args.dgpo_m))
            for name, region in regions.items():
                region = region.float() * m
                counts[f"dgpo/frac_{name}"] = (region.sum(), m.sum())
                if name in ("LN", "HP"):
                    counts[f"dgpo/weight_{name}_mean"] = ((weights * region).sum(), region.sum())
        self._add_counts(mode, counts)

    def _add_counts(self, mode, counts: dict):
        stacked = torch.stack([torch.stack([num.double(), den.double()]) for num, den in counts.values()])
        totals = self.accelerator.reduce(stacked, reduction="sum").tolist()  # one collective for all of them
        accumulated = self._count_metrics[mode]
        for name, (num, den) in zip(counts, totals):
            accumulated[name][0] += num
            accumulated[name][1] += den

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        for name, (num, den) in self._count_metrics[mode].items():
            self._metrics[mode][name] = [num / den if den > 0 else float("nan")]
        self._count_metrics[mode].clear()
        super().log(logs, start_time)


class BandPOTrainer(PolicyLossTrainer):
    """[BandPO](https://arxiv.org/abs/2603.04918) trainer: GRPOTrainer with probability-aware Band bounds.

    A drop-in replacement for `GRPOTrainer`: same arguments, `args` a [`BandPOConfig`].
    """

    config_class = BandPOConfig
    _tag_names = ["trl", "grpo", "trl-bandpo", "bandpo"]
    _name = "BandPO"
    _paper = {  # for the model card TRL writes on save
        "title": "BandPO: Bridging Trust Regions and Ratio Clipping via Probability-Aware Bounds for LLM "
        "Reinforcement Learning",
        "id": "2603.04918",
        "citation": "@article{li2026bandpo,\n  title   = {{BandPO: Bridging Trust Regions and Ratio Clipping via "
        "Probability-Aware Bounds for LLM Reinforcement Learning}},\n  author  = {Li, Yuan and others},\n  "
        "year    = 2026,\n  eprint  = {arXiv:2603.04918}\n}",
    }


class DGPOTrainer(PolicyLossTrainer):
    """[DGPO](https://arxiv.org/abs/2603.14389) trainer: GRPOTrainer with decoupled decay outside the clip range.

    A drop-in replacement for `GRPOTrainer`: same arguments, `args` a [`DGPOConfig`].
    """

    config_class = DGPOConfig
    _tag_names = ["trl", "grpo", "trl-bandpo", "dgpo"]
    _name = "DGPO"
    _paper = {  # for the model card TRL writes on save
        "title": "From log pi to pi: Taming Divergence in Soft Clipping via Bilateral Decoupled Decay of Probability "
        "Gradient Weight",
        "id": "2603.14389",
        "citation": "@article{fu2026dgpo,\n  title   = {{From log pi to pi: Taming Divergence in Soft Clipping via "
        "Bilateral Decoupled Decay of Probability Gradient Weight}},\n  author  = {Fu, Xiaoliang and Lin, Jiaye and "
        "others},\n  year    = 2026,\n  eprint  = {arXiv:2603.14389}\n}",
    }

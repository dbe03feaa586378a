"""BandPOTrainer and DGPOTrainer: GRPOTrainer with the per-token policy term swapped for a registered policy loss.

TRL's `GRPOTrainer._compute_loss` has no smaller hook, so `PolicyLossTrainer._compute_loss` is TRL 1.16's method,
statements and comments verbatim, with our changes in fenced blocks (`# trl-bandpo: <why>` ... `# trl-bandpo end`):
loss types with their own policy term go to TRL unchanged, non-finite old log-probs are replaced, the policy term is
one call to the registered loss (`self._per_token_policy_loss`), the clip ratios use the bounds in force, and our
count metrics are added. Everything else is TRL's: the fused log-prob/entropy forward, entropy mask, off-policy
mask, KL term, vLLM importance-sampling correction, token/sequence importance sampling, the normaliser of each
`loss_type`, entropy bonus, aux loss and TRL's metrics. Two tests keep it so: `tests/test_trl_mirror.py` diffs the
method against the installed TRL's outside the fences, and `tests/test_trl_parity.py` checks that with
`policy_loss="clip"` the loss, gradients and metrics equal GRPOTrainer's (docs/upgrading-trl.md).
"""

from __future__ import annotations

import warnings

import torch
from transformers.utils import logging
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import nanmax, nanmin

from ..core.losses import policy_loss_spec
from ..core.metrics import CountMetrics, clip_counts
from .checkpointing import GenerationBufferCheckpointing
from .configs import (
    TRL_PER_TOKEN_LOSS_TYPES,
    BandPOConfig,
    DGPOConfig,
    PolicyLossConfig,
    is_library_file,
    user_frame,
    with_policy_loss_fields,
)
from .dynamic_sampling import DynamicSampling
from .old_policy import OLD_ENTROPIES_KEY, AdaptiveRadius

__all__ = ["BandPOTrainer", "DGPOTrainer", "PolicyLossTrainer"]

_BOUND_KEYS = ("policy_lower_bound", "policy_upper_bound")

logger = logging.get_logger(__name__)


class PolicyLossTrainer(CountMetrics, GenerationBufferCheckpointing, DynamicSampling, AdaptiveRadius, GRPOTrainer):
    """GRPOTrainer whose per-token policy term is `args.policy_loss` (see [`PolicyLossConfig`]).

    Everything else is GRPOTrainer's: pass the same arguments (`model`, `reward_funcs`, `train_dataset`,
    `peft_config`, ...). Bounds that depend only on the old log-probs (Band, DCPO) are computed once per generation
    batch, stored next to `old_per_token_logps`, and reused for every micro-step and iteration over that batch.
    """

    config_class = PolicyLossConfig
    _tag_names = ["trl", "grpo", "trl-bandpo"]

    # The same parameters, in the same order, with the same defaults as GRPOTrainer.__init__ (TRL 1.16):
    # tests/test_trainers.py compares the two signatures, so a TRL upgrade that adds one fails loudly.
    def __init__(
        self,
        model,
        reward_funcs=None,
        args: PolicyLossConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
    ):
        if args is None:
            model_name = model if isinstance(model, str) else model.config._name_or_path
            method = self.config_class.__name__.removesuffix("Config")
            args = self.config_class(f"{model_name.split('/')[-1]}-{method}")
        if not isinstance(args, PolicyLossConfig):
            if not isinstance(args, GRPOConfig):
                raise TypeError(
                    f"{type(self).__name__} needs a GRPOConfig ({self.config_class.__name__}, or any GRPOConfig "
                    f"subclass), got {type(args).__name__}."
                )
            given = type(args).__name__
            args = with_policy_loss_fields(args, self.config_class)
            logger.warning_once(
                f"{type(self).__name__} got a {given}: it keeps its fields and values and "
                f"adds {self.config_class.__name__}'s with their defaults (policy_loss={args.policy_loss!r}). To "
                f"set them, derive your config from {self.config_class.__name__} instead of GRPOConfig."
            )
        # TRL's own warnings (e.g. experimental features) are attributed to the user's line, not to ours.
        caught = []
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                super().__init__(
                    model,
                    reward_funcs,
                    args=args,
                    train_dataset=train_dataset,
                    eval_dataset=eval_dataset,
                    processing_class=processing_class,
                    reward_processing_classes=reward_processing_classes,
                    callbacks=callbacks,
                    optimizers=optimizers,
                    quantization_config=quantization_config,
                    peft_config=peft_config,
                    tools=tools,
                    rollout_func=rollout_func,
                    environment_factory=environment_factory,
                )
        finally:
            _warn_again_at_the_callers_line(caught)
        self.policy_loss = args.policy_loss
        self._policy = policy_loss_spec(args.policy_loss)
        # Read from the config through the loss's registry entry: the fields it reads, checked, as keywords.
        self._policy_bound_kwargs, self._policy_loss_kwargs = self._policy.kwargs_from_config(args)

    # -- the policy term -------------------------------------------------------------------------------------------

    def _policy_bounds(self, old_per_token_logps: torch.Tensor, radius=None):
        """`(lower, upper)` of the selected loss for these old log-probs (floats for fixed bounds); `radius`, when
        given, replaces the configured Band radius (per-token radii of the adaptive radius)."""
        kwargs = self._policy_bound_kwargs if radius is None else {**self._policy_bound_kwargs, "radius": radius}
        return self._policy.bounds(old_per_token_logps, **kwargs)

    def _per_token_policy_loss(self, log_importance_weights, advantages, lower, upper) -> torch.Tensor:
        """The one place the policy term differs from GRPOTrainer's: the registered loss on TRL's tensors."""
        return self._policy.loss(log_importance_weights, advantages, lower, upper, **self._policy_loss_kwargs)

    # -- bounds once per generation batch --------------------------------------------------------------------------

    def _generate_and_score_completions(self, inputs):
        if self.args.old_logps_source == "rollout":
            output = self._generate_with_rollout_old_logps(inputs)
        else:
            output = super()._generate_and_score_completions(inputs)
        old_entropies = output.pop(OLD_ENTROPIES_KEY, None)
        old_logps = output.get("old_per_token_logps")
        if old_logps is not None and self.loss_type not in TRL_PER_TOKEN_LOSS_TYPES:
            radius = None
            if old_entropies is not None and self._adaptive_radius_enabled():
                mask = output["completion_mask"] * output.get("tool_mask", 1)
                radius = self._generation_radius(old_entropies, mask)
            lower, upper = self._policy_bounds(old_logps, radius)
            if torch.is_tensor(lower):  # per-token bounds travel with the batch through TRL's split and shuffle
                output[_BOUND_KEYS[0]], output[_BOUND_KEYS[1]] = lower, upper
        return output

    # -- the engine's sampling log-probs as the old policy (`old_logps_source="rollout"`) ---------------------------
    # docs/off-policy-and-async.md. GRPOTrainer's generation calls `_generate`, then its old-policy pass through
    # `self.model` (when `gradient_accumulation_steps` is no multiple of `steps_per_generation * num_iterations`; its
    # other trigger, vLLM's importance-sampling correction, is refused with "rollout"), then the reference pass. So
    # the first policy pass after `_generate` is the old-policy one: it is skipped, and the engine's log-probs replace
    # its result once generation is done.

    def _generate_with_rollout_old_logps(self, inputs):
        if self._adaptive_radius_enabled():
            raise ValueError(
                "a radius_fn (adaptive Band radius) cannot be used with old_logps_source='rollout': it reads the old "
                "policy's entropies, which vLLM does not return. Use old_logps_source='trainer'."
            )
        if self.vllm_mode == "server" and self.accelerator.is_main_process and not self._logprobs_mode_checked:
            self._logprobs_mode_checked = True
            logprobs_mode = self.vllm_generation.vllm_client.get_server_info()["model_config"]["logprobs_mode"]
            if logprobs_mode != "processed_logprobs":
                logger.warning(
                    f"old_logps_source='rollout' takes the vLLM server's log-probs as the old policy, but the server "
                    f"runs with `--logprobs-mode {logprobs_mode}`: unless sampling leaves the logits as they are "
                    "(temperature 1, no top-p, top-k, min-p or repetition penalty), these are not the probabilities "
                    "the tokens were sampled with. Restart it with `--logprobs-mode processed_logprobs` (the default "
                    "of `trl vllm-serve`)."
                )
        self._skipped_old_policy_passes = 0
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._skip_old_policy_pass = False
        sampling = output.get("sampling_per_token_logps")
        if sampling is None:
            raise RuntimeError(
                "old_logps_source='rollout' needs the log-probs vLLM sampled each token with, but this generation "
                "returned none (a rollout_func that returns no 'logprobs'?)."
            )
        completion_mask = output["completion_mask"]
        if self._skipped_old_policy_passes:  # the passes skipped returned NaN: they must be what TRL stored as old
            stored = output.get("old_per_token_logps")
            if stored is None or not bool(torch.isnan(stored[completion_mask > 0]).all()):
                raise RuntimeError(
                    "old_logps_source='rollout' skipped a policy pass during generation that was not GRPOTrainer's "
                    "old-policy pass (a TRL version this package was not tested with?)."
                )
        # A token vLLM could not score (NaN log-prob) has no old probability: it leaves the loss (through
        # `tool_mask`, which masks the loss but not attention) and the normaliser, and is counted.
        mask = completion_mask if "tool_mask" not in output else completion_mask * output["tool_mask"]
        scored = torch.isfinite(sampling)
        output["old_per_token_logps"] = torch.where(scored, sampling, torch.zeros_like(sampling))
        output["tool_mask"] = scored.to(mask.dtype) if "tool_mask" not in output else output["tool_mask"] * scored
        output["num_items_in_batch"] = self.accelerator.gather((completion_mask * output["tool_mask"]).sum()).sum()
        unscored = (~scored & (mask > 0)).sum().float(), (mask > 0).sum().float()
        self._add_counts("train" if self.model.training else "eval", {"sampling/unscored_token_share": unscored})
        return output

    _logprobs_mode_checked = False

    def _generate(self, prompts):
        result = super()._generate(prompts)
        if self.args.old_logps_source == "rollout":
            generate_every = self.args.steps_per_generation * self.num_iterations
            self._skip_old_policy_pass = self.args.gradient_accumulation_steps % generate_every != 0
        return result

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        if getattr(self, "_skip_old_policy_pass", False) and model is self.model:
            self._skip_old_policy_pass = False
            self._skipped_old_policy_passes += 1
            skipped = torch.full((input_ids.size(0), logits_to_keep), float("nan"), device=input_ids.device)
            return skipped, None, None
        return super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
        )

    # -- the loss: TRL 1.16's GRPOTrainer._compute_loss, verbatim but for the fenced blocks ----------------------
    # Copyright 2020-2026 The HuggingFace Team (Apache-2.0). Each change of ours sits between a
    # `# trl-bandpo: <why>` line and a `# trl-bandpo end` line; tests/test_trl_mirror.py diffs the rest against the
    # installed TRL (docs/upgrading-trl.md).

    def _compute_loss(self, model, inputs):
        # trl-bandpo: loss types whose policy term is TRL's own run TRL's method unchanged
        if self.loss_type in TRL_PER_TOKEN_LOSS_TYPES:
            return super()._compute_loss(model, inputs)
        # trl-bandpo end
        # Compute the per-token log probabilities for the model
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        logits_to_keep = completion_ids.size(1)  # we only need to compute the logits for the completion tokens
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]

        # Compute the per_token_logps and the entropy at each position in the completion
        per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            logits_to_keep,
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
            pixel_values=inputs.get("pixel_values"),
            image_grid_thw=inputs.get("image_grid_thw"),
            num_images=inputs.get("num_images"),
            pixel_attention_mask=inputs.get("pixel_attention_mask"),
            spatial_shapes=inputs.get("spatial_shapes"),
            num_tiles=inputs.get("num_tiles"),
            image_sizes=inputs.get("image_sizes"),
            token_type_ids=inputs.get("token_type_ids"),
            mm_token_type_ids=inputs.get("mm_token_type_ids"),
            image_position_ids=inputs.get("image_position_ids"),
        )

        if self.top_entropy_quantile < 1.0:
            entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
        else:
            entropy_mask = None

        # Compute the loss
        advantages = inputs["advantages"]
        # In the base GRPO implementation, advantages are expected to have shape (B,). To support subclasses that
        # provide advantages with shape (B, T), we *conditionally* unsqueeze the tensor.
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        # When num_iterations == 1 and steps_per_generation <= gradient_accumulation_steps,
        # old_per_token_logps == per_token_logps. In this case we can skip its computation
        # (see _generate_and_score_completions) and instead use per_token_logps.detach().
        # The exception is when using vLLM, where we always compute old_per_token_logps
        # for importance sampling
        old_per_token_logps = inputs.get("old_per_token_logps")
        old_per_token_logps = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
        # trl-bandpo: a non-finite old log-prob (a padded or unscored token) would make that token's loss NaN
        old_per_token_logps = torch.where(
            torch.isfinite(old_per_token_logps), old_per_token_logps, per_token_logps.detach()
        )
        # trl-bandpo end

        if self.off_policy_mask_threshold is not None:
            # OPSM should use inference-time logprobs to detect both sources of off-policyness:
            # 1. Drift from gradient updates (always present)
            # 2. Drift from training-inference mismatch (when using vLLM)
            # When using vLLM, prioritize sampling_per_token_logps, otherwise use old_per_token_logps
            sampling_per_token_logps = inputs.get("sampling_per_token_logps", old_per_token_logps)

            off_policy_mask = self.get_off_policy_mask(
                advantages=advantages,
                per_token_logps=per_token_logps,
                sampling_per_token_logps=sampling_per_token_logps,
                mask=mask,
                off_policy_threshold=self.off_policy_mask_threshold,
            )

        log_ratio = per_token_logps - old_per_token_logps
        if self.importance_sampling_level == "token":
            log_importance_weights = log_ratio
        elif self.importance_sampling_level == "sequence":
            log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
            log_importance_weights = log_importance_weights.unsqueeze(-1)
        else:
            raise ValueError(
                f"Unknown importance sampling level: {self.importance_sampling_level}. Possible values are 'token' "
                "and 'sequence'."
            )

        coef_1 = torch.exp(log_importance_weights)

        # Compute the KL divergence between the model and the reference model
        if self.beta != 0.0:
            ref_per_token_logps = inputs["ref_per_token_logps"]
            per_token_kl = (
                torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
            )
            # Importance sampling correction for the KL divergence
            if self.args.use_bias_correction_kl:
                per_token_kl = per_token_kl * coef_1

        # From here, log_importance_weights (and all subsequent tensors, coef_1, coef_2, etc.) shape depends on
        # importance_sampling_level: "token" level: (B, T); "sequence" level: (B, 1)
        # trl-bandpo: the registered policy loss in place of TRL's per-`loss_type` policy terms; per-token bounds come
        # with the generation batch (computed once from the old log-probs)
        if _BOUND_KEYS[0] in inputs:
            lower, upper = inputs[_BOUND_KEYS[0]], inputs[_BOUND_KEYS[1]]
        else:  # on-policy (every ratio is 1): the current entropies are the old policy's
            radius = self._token_radius(entropies, mask) if self._adaptive_radius_enabled() else None
            lower, upper = self._policy_bounds(old_per_token_logps, radius)
        per_token_loss = self._per_token_policy_loss(log_importance_weights, advantages, lower, upper)
        # trl-bandpo end

        if self.off_policy_mask_threshold is not None:
            per_token_loss = per_token_loss * off_policy_mask

        if entropy_mask is not None:
            per_token_loss = per_token_loss * entropy_mask

        if self.use_vllm and self.vllm_importance_sampling_correction and self.loss_type != "vespo":
            per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]

        if self.beta != 0.0:
            per_token_loss = per_token_loss + self.beta * per_token_kl

        mode = "train" if self.model.training else "eval"
        if self.loss_type in ["grpo", "sapo"]:
            loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
            normalizer = self.current_gradient_accumulation_steps if mode == "train" else 1.0  # no accum in eval
            policy_loss = loss.detach()
            loss = loss / normalizer
        elif self.loss_type == "bnpo":
            loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
            normalizer = self.current_gradient_accumulation_steps if mode == "train" else 1.0  # no accum in eval
            policy_loss = loss.detach()
            loss = loss / normalizer
        elif self.loss_type == "dr_grpo":
            loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * self.max_completion_length)
            normalizer = self.current_gradient_accumulation_steps if mode == "train" else 1.0  # no accum in eval
            policy_loss = loss.detach()
            loss = loss / normalizer
        elif self.loss_type in ["cispo", "dapo", "vespo"]:
            # `num_items_in_batch` spans the generation batch, so rescale it to one accumulation window
            normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":  # in eval, the batch is neither split across steps nor accumulated
                normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
            loss = (per_token_loss * mask).sum() / normalizer
            policy_loss = loss.detach()
        elif self.loss_type == "luspo":
            # `per_token_loss` is (B, 1) only in the recommended sequence-level setup; importance_sampling_level=
            # "token" (the config default), the KL term, token-level vLLM IS ratios, and the entropy mask all
            # broadcast it to (B, T), so mask before aggregating.
            loss = (per_token_loss * mask).sum(-1).mean()
            normalizer = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            policy_loss = loss.detach()
            loss = loss / normalizer
        else:
            raise ValueError(f"Unknown loss type: {self.loss_type}")

        # Entropy bonus: add entropy regularization to encourage exploration. _entropy_bonus_enabled is set
        # whenever a non-zero static coef is set OR adaptive mode is enabled (adaptive stays enabled even when
        # entropy_coef has been decremented to entropy_coef_min so it can recover once entropy drops again).
        if self._entropy_bonus_enabled:
            # When top_entropy_quantile < 1.0, entropy_mask restricts policy gradients to high-entropy
            # tokens. Use the same effective mask for the entropy bonus so it acts on the same tokens.
            effective_mask = mask if entropy_mask is None else mask * entropy_mask
            # Entropy bonus = mean per-token entropy H (the documented objective L = L_policy - coef * H), so
            # H does not depend on how each loss type normalizes its policy term. The bonus is a mean over the
            # tokens it acts on (effective_mask), scaled only for gradient accumulation, never by a loss-type-
            # specific policy normalizer. (The adaptive controller below tracks a window-global token-weighted mean,
            # which can differ from this per-micro-batch mean when token counts vary across micro-batches.)
            accumulation_factor = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            entropy_loss = (
                (entropies * effective_mask).sum() / effective_mask.sum().clamp(min=1.0) / accumulation_factor
            )

            # Apply the coefficient and gating from the end of the previous optimizer step, so that every
            # micro-batch in the current accumulation window applies the same entropy bonus. The adaptive
            # update below only takes effect on the next step.
            if self.use_adaptive_entropy:
                apply_coef = self.entropy_coef if self._last_world_entropy <= self.args.entropy_target else 0.0
            else:
                apply_coef = self.entropy_coef

            loss = loss - apply_coef * entropy_loss

            self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())

            # Adaptive update. Gated on train mode so evaluation cannot mutate the entropy controller state.
            if self.use_adaptive_entropy and mode == "train":
                # Accumulate the entropy sum and active-token count of every micro-batch into a running window
                # buffer, so the controller measures the exact window-global entropy rather than just the last
                # micro-batch (which would be a 1 / gradient_accumulation_steps subsample).
                stats = torch.stack([(entropies * effective_mask).sum(), effective_mask.sum()]).detach()
                if self._entropy_window_stats is None:
                    self._entropy_window_stats = stats
                else:
                    self._entropy_window_stats = self._entropy_window_stats + stats
                # At the optimizer-step boundary, reduce the window totals across ranks (sum and token count
                # jointly, for a true global mean unbiased when ranks have different completion lengths),
                # update the coefficient for the next step, then reset the window buffer.
                if self.accelerator.sync_gradients:
                    window_stats = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
                    world_entropy = (window_stats[0] / window_stats[1].clamp(min=1.0)).item()
                    if world_entropy <= self.args.entropy_target:
                        self.entropy_coef = min(
                            self.entropy_coef + self.args.entropy_coef_delta, self.args.entropy_coef_max
                        )
                    else:
                        self.entropy_coef = max(
                            self.entropy_coef - self.args.entropy_coef_delta, self.args.entropy_coef_min
                        )
                    self._last_world_entropy = world_entropy
                    self._entropy_window_stats = None

            # Log entropy_coef on train optimizer-step boundaries (constant for static control; updated just
            # above for adaptive control). sync_gradients is always True in eval (no accumulation context).
            if mode == "train" and self.accelerator.sync_gradients:
                self._metrics[mode]["entropy_coef"].append(self.entropy_coef)

        # The policy loss above is scaled for gradient accumulation (HF auto-scaling is off here), so scale aux too
        if self.aux_loss_enabled:
            normalizer = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            loss = loss + self.router_aux_loss_coef * aux_loss / normalizer
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())

        # Log the metrics
        def masked_seq_mean(x):
            if x.shape[1] == 1:  # when importance_sampling_level == "sequence": already one value per sequence
                return x.squeeze(1)
            return (x * mask).sum(-1) / mask.sum(-1)

        def global_masked_mean(x):
            if x.shape[1] == 1:  # when importance_sampling_level == "sequence": one value per sequence
                local_sum, local_count = x.sum(), torch.tensor(float(x.shape[0]), device=x.device)
            else:
                local_sum, local_count = (x * mask).sum(), mask.sum().float()
            totals = self.accelerator.reduce(torch.stack([local_sum, local_count]), reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        if self.beta != 0.0:
            self._metrics[mode]["kl"].append(global_masked_mean(per_token_kl))

        self._metrics[mode]["entropy"].append(global_masked_mean(entropies))

        if self.loss_type in ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"]:
            # Compute the clipped probability ratios
            # trl-bandpo: clipped against the bounds in force, not 1 -/+ epsilon
            lower_t, upper_t = (torch.as_tensor(bound, device=coef_1.device) for bound in (lower, upper))
            is_low_clipped = (coef_1 < lower_t) & (advantages < 0)
            is_high_clipped = (coef_1 > upper_t) & (advantages > 0)
            # trl-bandpo end
            is_region_clipped = is_low_clipped | is_high_clipped
            self._metrics[mode]["clip_ratio/low_mean"].append(global_masked_mean(is_low_clipped.float()))
            self._metrics[mode]["clip_ratio/high_mean"].append(global_masked_mean(is_high_clipped.float()))
            self._metrics[mode]["clip_ratio/region_mean"].append(global_masked_mean(is_region_clipped.float()))
            gathered_low_clip = self.accelerator.gather(masked_seq_mean(is_low_clipped.float()))
            self._metrics[mode]["clip_ratio/low_min"].append(nanmin(gathered_low_clip).item())
            gathered_high_clip = self.accelerator.gather(masked_seq_mean(is_high_clipped.float()))
            self._metrics[mode]["clip_ratio/high_max"].append(nanmax(gathered_high_clip).item())
        elif self.loss_type == "cispo":
            is_cispo_clipped = (coef_1 > self.epsilon_high) & (advantages > 0)
            self._metrics[mode]["cispo_clip_ratio"].append(global_masked_mean(is_cispo_clipped.float()))
        elif self.loss_type == "vespo":
            self._metrics[mode]["vespo/phi_seq_mean"].append(global_masked_mean(phi_seq))  # noqa: F821

        # trl-bandpo: count metrics (docs/metrics.md), summed over processes and accumulation steps, divided at logging
        with torch.no_grad():
            counts = clip_counts(old_per_token_logps, coef_1, advantages, lower_t, upper_t, mask)
            if self._policy.metrics is not None:
                counts.update(
                    self._policy.metrics(
                        log_importance_weights.detach(), advantages, lower, upper, mask, **self._policy_loss_kwargs
                    )
                )
            self._add_counts(mode, counts)
        # trl-bandpo end
        return loss


def _warn_again_at_the_callers_line(caught) -> None:
    """Emit recorded warnings again, those raised by library code attributed to the first frame outside it."""
    frame, _ = user_frame()
    for record in caught:
        if is_library_file(record.filename):
            registry = frame.f_globals.setdefault("__warningregistry__", {})
            where = dict(
                filename=frame.f_code.co_filename, lineno=frame.f_lineno, module=frame.f_globals.get("__name__")
            )
            warnings.warn_explicit(record.message, record.category, registry=registry, **where)
        else:
            warnings.warn_explicit(record.message, record.category, record.filename, record.lineno)


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

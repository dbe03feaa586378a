"""The old policy of the ratio: one hook on GRPOTrainer's old-policy pass (docs/extensions.md, "Adaptive per-token
radius"; docs/off-policy-and-async.md). When TRL will make that pass, the first policy pass after `_generate` is
marked as it, and in it the same forward also returns the old policy's entropies (the adaptive radius), or, with
`old_logps_source="rollout"`, the forward is skipped and the engine's sampling log-probs take its place. What TRL
stored as `old_per_token_logps` must be that pass's very tensor: a TRL version that moved the pass is an error.
"""

from __future__ import annotations

import torch
from transformers.utils import logging

from ..core.radius import check_radius_fn_output, correlation, entropy_radius, masked_sum, radius_statistics
from .policy_term import check_engine_logprobs

logger = logging.get_logger(__name__)

#: Key of the old policy's per-token entropies in a generation output (popped once the bounds are computed).
OLD_ENTROPIES_KEY = "old_per_token_entropies"


class OldPolicyPass:
    """Mixin for `PolicyLossTrainer`: the old-policy pass (above) and the per-token radius built from it.

    A `radius_fn(entropies, mask, delta) -> radii` set on the trainer replaces `entropy_radius`: a floating `(B, T)`
    tensor, finite and > 0 at completion tokens (`check_radius_fn_output`); padding positions get `delta`.
    """

    radius_fn = None
    _old_pass: dict | None = None  # during one generation: what to do in the old-policy pass, and its result
    _logprobs_mode_checked = False

    def _adaptive_radius_enabled(self) -> bool:
        uses_radius = "radius" in self._policy.bound_names
        return uses_radius and (self.radius_fn is not None or self.policy_args.band_radius_by is not None)

    def _trl_makes_old_policy_pass(self) -> bool:
        """GRPOTrainer's condition for its old-policy pass (otherwise every ratio is 1)."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        off_policy = self.args.gradient_accumulation_steps % generate_every != 0
        return off_policy or (self.use_vllm and self.vllm_importance_sampling_correction)

    def _generate(self, prompts):
        result = super()._generate(prompts)
        rollout = self.policy_args.old_logps_source == "rollout"
        entropies = self._adaptive_radius_enabled() and self.model.training
        if (rollout or entropies) and self._trl_makes_old_policy_pass():
            self._old_pass = {"skip": rollout, "result": None}
        return result

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        state = self._old_pass
        if state is None or state["result"] is not None or model is not self.model:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )
        if state["skip"]:
            skipped = torch.full((input_ids.size(0), logits_to_keep), float("nan"), device=input_ids.device)
            state["result"] = (skipped, None, None)
        else:  # the same forward, asked for the entropies as well
            kwargs["compute_entropy"] = True
            state["result"] = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )
        return state["result"]

    def _generate_once(self, inputs):
        """One GRPOTrainer generation with the old-policy pass handled as above."""
        rollout = self.policy_args.old_logps_source == "rollout"
        if rollout:
            self._check_rollout_logprobs()
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            state, self._old_pass = self._old_pass, None
        if state is not None:
            if state["result"] is None or output.get("old_per_token_logps") is not state["result"][0]:
                raise RuntimeError(
                    "trl-bandpo hooks GRPOTrainer's old-policy pass (the first pass of the policy after `_generate`, "
                    "whose log-probs become old_per_token_logps), but this TRL version computed them elsewhere: see "
                    "docs/upgrading-trl.md."
                )
            if not state["skip"]:
                output[OLD_ENTROPIES_KEY] = state["result"][1].detach()
        return self._with_rollout_old_logps(output) if rollout else output

    # -- the engine's sampling log-probs as the old policy (`old_logps_source="rollout"`) ---------------------------

    def _check_rollout_logprobs(self):
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
                    "the tokens were sampled with. Restart it with `--logprobs-mode processed_logprobs`."
                )

    def _with_rollout_old_logps(self, output):
        sampling = output.get("sampling_per_token_logps")
        if sampling is None:
            raise RuntimeError(
                "old_logps_source='rollout' needs the log-probs vLLM sampled each token with, but this generation "
                "returned none (a rollout_func that returns no 'logprobs'?)."
            )
        # A token vLLM could not score (NaN log-prob) has no old probability: it leaves the loss (through
        # `tool_mask`, which masks the loss but not attention) and the normaliser, and is counted.
        completion_mask = output["completion_mask"]
        mask = completion_mask if "tool_mask" not in output else completion_mask * output["tool_mask"]
        check_engine_logprobs(sampling, mask, "old_logps_source='rollout'")
        scored = torch.isfinite(sampling)
        output["old_per_token_logps"] = torch.where(scored, sampling, torch.zeros_like(sampling))
        output["tool_mask"] = scored.to(mask.dtype) if "tool_mask" not in output else output["tool_mask"] * scored
        output["num_items_in_batch"] = self.accelerator.gather((completion_mask * output["tool_mask"]).sum()).sum()
        unscored = (~scored & (mask > 0)).sum().float(), (mask > 0).sum().float()
        self._add_counts("train" if self.model.training else "eval", {"sampling/unscored_token_share": unscored})
        return output

    # -- the adaptive radius ---------------------------------------------------------------------------------------

    def _token_radius(self, entropies, mask, mean_entropy=None):
        """`(B, T)` radii for these entropies; `mean_entropy` defaults to the masked mean of `entropies`."""
        delta = self._policy_bound_kwargs["radius"]
        if self.radius_fn is not None:
            return check_radius_fn_output(self.radius_fn(entropies.detach(), mask, delta), entropies, mask, delta)
        args = self.policy_args
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

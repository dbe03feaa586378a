"""BandPOTrainer and DGPOTrainer: GRPOTrainer with the per-token policy term swapped for a registered policy loss.

`GRPOTrainer._compute_loss` has no smaller hook, so ours is TRL's method with the `COMPUTE_LOSS_PATCHES` applied at
import (`trl_patches`, docs/upgrading-trl.md); everything else is TRL's. Loss types with their own policy term
(`TRL_PER_TOKEN_LOSS_TYPES`) run TRL's method unchanged.
"""

from __future__ import annotations

import torch
from trl import GRPOConfig, GRPOTrainer

from .checkpointing import GenerationBufferCheckpointing
from .configs import BANDPO_PAPER, DGPO_PAPER, TRL_PER_TOKEN_LOSS_TYPES, BandPOConfig, DGPOConfig, PolicyLossConfig
from .dataset_rows import check_dataset
from .dynamic_sampling import DynamicSampling
from .nonfinite import NonFiniteGuard
from .old_policy import OLD_ENTROPIES_KEY, OldPolicyPass
from .policy_term import PolicyTerm
from .trl_patches import CLIP_RATIO_PATCHES, Patch, patch_method
from .vllm_cpu import vllm_generation_for

_BOUND_KEYS = ("policy_lower_bound", "policy_upper_bound")

#: Our changes to `GRPOTrainer._compute_loss` (TRL 1.16), applied to the installed TRL's source at import.
COMPUTE_LOSS_PATCHES = (
    Patch(
        "finite old log-probs",
        "a non-finite old log-prob (a padded or unscored token) would make that token's loss NaN",
        target="old_per_token_logps = per_token_logps.detach()",
        code="old_per_token_logps = self._finite_old_logps(old_per_token_logps, per_token_logps)",
        where="after",
    ),
    Patch(
        "policy term",
        "the registered policy loss replaces TRL's per-`loss_type` policy terms, with the bounds of the old log-probs",
        target='if self.loss_type == "cispo":',
        code="lower, upper = self._loss_bounds(inputs, old_per_token_logps, entropies, mask)\n"
        "per_token_loss = self._per_token_policy_loss(\n"
        "    log_importance_weights, advantages, lower, upper, mask, old_per_token_logps\n)",
    ),
    *CLIP_RATIO_PATCHES,
    Patch(
        "count metrics",
        "our count metrics (docs/metrics.md), summed over processes and accumulation steps, divided at logging",
        target="return loss",
        code="self._add_counts(mode, self._policy_counts("
        "old_per_token_logps, coef_1, log_importance_weights, advantages, lower, upper, mask))",
        where="before",
    ),
    Patch(
        "finite loss",
        "a NaN or infinite loss stops the run or skips the update, naming what went non-finite (`on_nonfinite`)",
        target="return loss",
        code="self._check_finite_loss(\n    loss, mask, per_token_logps=per_token_logps, "
        "old_per_token_logps=old_per_token_logps, advantages=advantages,\n    lower=lower, upper=upper, "
        "per_token_loss=per_token_loss,\n)",
        where="before",
    ),
)
_compute_loss = patch_method(GRPOTrainer, "_compute_loss", COMPUTE_LOSS_PATCHES)


class PolicyLossTrainer(
    PolicyTerm, NonFiniteGuard, OldPolicyPass, DynamicSampling, GenerationBufferCheckpointing, GRPOTrainer
):
    """GRPOTrainer whose per-token policy term is `args.policy_loss` (see [`PolicyLossConfig`]), with GRPOTrainer's
    arguments; `args` may be any `GRPOConfig` (our settings then take `config_class`'s defaults). Bounds that depend
    only on the old log-probs (Band, DCPO) are computed once per generation batch and travel with it."""

    config_class = PolicyLossConfig
    trl_config_class = GRPOConfig
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
        args = self._setup_policy_term(model, args)
        for name, dataset in {"train_dataset": train_dataset, "eval_dataset": eval_dataset}.items():
            check_dataset(dataset, name, reward_funcs if rollout_func is None else [], environment_factory is None)
        with vllm_generation_for(args):  # on CPU, vLLM generation with a weight push that runs there
            self._call_with_warnings_at_the_callers_line(
                super().__init__, model, reward_funcs, args=args, train_dataset=train_dataset,
                eval_dataset=eval_dataset, processing_class=processing_class,
                reward_processing_classes=reward_processing_classes, callbacks=callbacks, optimizers=optimizers,
                quantization_config=quantization_config, peft_config=peft_config, tools=tools,
                rollout_func=rollout_func, environment_factory=environment_factory,
            )  # fmt: skip

    def _generate_and_score_completions(self, inputs):
        """GRPOTrainer's generation (with dynamic sampling's extra rounds when on), then the bounds of the selected
        loss, computed once per generation batch from the old log-probs (and per-token radii)."""
        if self.policy_args.dynamic_sampling and self.model.training:
            output = self._generate_with_dynamic_sampling(inputs)
        else:
            output = self._generate_once(inputs)
            if self._dropped_rows is not None:  # groups dropped for their rewards (`on_nonfinite="skip"`)
                output = self._mask_rows(output, self._dropped_rows)
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

    def _compute_loss(self, model, inputs):
        if self.loss_type in TRL_PER_TOKEN_LOSS_TYPES:  # their policy term is TRL's own: TRL's method, unchanged
            loss = super()._compute_loss(model, inputs)
            self._check_finite_loss(loss)
            return loss
        return _compute_loss(self, model, inputs)

    # -- what the patches call -------------------------------------------------------------------------------------

    @staticmethod
    def _finite_old_logps(old_logps, logps):
        return torch.where(torch.isfinite(old_logps), old_logps, logps.detach())

    def _loss_bounds(self, inputs, old_logps, entropies, mask):
        """The bounds of this micro-batch: those of its generation batch, or, on-policy (every ratio is 1, TRL made no
        old-policy pass), from the current log-probs, whose entropies are the old policy's."""
        if _BOUND_KEYS[0] in inputs:
            return inputs[_BOUND_KEYS[0]], inputs[_BOUND_KEYS[1]]
        radius = self._token_radius(entropies, mask) if self._adaptive_radius_enabled() else None
        return self._policy_bounds(old_logps, radius)


class BandPOTrainer(PolicyLossTrainer):
    """[BandPO](https://arxiv.org/abs/2603.04918) trainer: GRPOTrainer with probability-aware Band bounds.

    A drop-in replacement for `GRPOTrainer`: same arguments, `args` a [`BandPOConfig`].
    """

    config_class = BandPOConfig
    _tag_names = ["trl", "grpo", "trl-bandpo", "bandpo"]
    _name = "BandPO"
    _paper = BANDPO_PAPER  # for the model card TRL writes on save


class DGPOTrainer(PolicyLossTrainer):
    """[DGPO](https://arxiv.org/abs/2603.14389) trainer: GRPOTrainer with decoupled decay outside the clip range.

    A drop-in replacement for `GRPOTrainer`: same arguments, `args` a [`DGPOConfig`].
    """

    config_class = DGPOConfig
    _tag_names = ["trl", "grpo", "trl-bandpo", "dgpo"]
    _name = "DGPO"
    _paper = DGPO_PAPER  # for the model card TRL writes on save

"""Every registered policy loss with TRL's experimental asynchronous GRPO trainer (docs/off-policy-and-async.md).

The old policy of the ratio is each rollout sample's `old_log_probs`, and the bounds are computed from them per
micro-batch. `compute_loss` is TRL's with the `COMPUTE_LOSS_PATCHES` applied at import (`trl_patches`). For the
staleness metrics each sample's model version rides through TRL's pipeline in its per-sample metrics
(`_VersionTaggingQueue`), and the collator adds each sample's lag to the batch. The configs copy our fields from
`PolicyLossConfig` and run the same checks (`check_fields`, `check_settings`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from dataclasses import dataclass, field

import torch
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout
from trl.trainer.utils import pad

from ..core.metrics import lag_buckets
from .configs import (
    BANDPO_PAPER,
    DGPO_PAPER,
    BandPOConfig,
    DGPOConfig,
    PolicyLossConfig,
    _loss_fields,
    checked_post_init,
)
from .dataset_rows import check_dataset
from .nonfinite import NonFiniteGuard, unusable_rewards
from .policy_term import PolicyTerm, check_engine_logprobs
from .trl_patches import CLIP_RATIO_PATCHES, Patch, patch_method

# Per-sample metrics key that carries a sample's model version from the rollout queue to the collator.
_VERSION_KEY = "trl_bandpo/model_version"
# Batch keys: each sample's lag when its micro-batch was packed (`(rows, samples)`, NaN padding), and the optimizer
# step at that moment (`(rows,)`), from which the loss counts the weight syncs since.
_LAG_KEY = "trl_bandpo/sample_lag"
_LAG_STEP_KEY = "trl_bandpo/lag_step"


# -- configs ----------------------------------------------------------------------------------------------------------


def _copy_field(config_class, name: str):
    """`config_class`'s field `name` (default, help, choices, check) for another dataclass."""
    source = {f.name: f for f in dataclasses.fields(config_class)}[name]
    return field(default=source.default, metadata=source.metadata)


def _policy_loss_fields():
    """A dataclass holding our fields, in `PolicyLossConfig`'s order: `policy_loss` and every field a registered loss
    reads that `AsyncGRPOConfig` lacks (the Band, DGPO, ... hyper-parameters, and TRL's dual clip `delta`)."""
    present = {f.name for f in dataclasses.fields(AsyncGRPOConfig)}
    wanted = ({"policy_loss", "on_nonfinite"} | _loss_fields()) - present
    specs = [
        (f.name, f.type, _copy_field(PolicyLossConfig, f.name))
        for f in dataclasses.fields(PolicyLossConfig)
        if f.name in wanted
    ]
    return dataclasses.make_dataclass("PolicyLossFields", specs, namespace={"__module__": __name__})


PolicyLossFields = _policy_loss_fields()


@dataclass
class AsyncPolicyLossConfig(PolicyLossFields, AsyncGRPOConfig):
    r"""
    Configuration of [`AsyncPolicyLossTrainer`]: every parameter of `trl.experimental.async_grpo.AsyncGRPOConfig`,
    plus `policy_loss`, `on_nonfinite` and the fields of the registered losses, with [`PolicyLossConfig`]'s defaults
    and checks. It lacks `loss_type`, `importance_sampling_level`, `beta`, `band_radius_by`, dynamic sampling and
    `old_logps_source` (the old log-probs are always the rollout's): docs/off-policy-and-async.md.
    """

    def __post_init__(self):
        checked_post_init(self, super().__post_init__)


@dataclass
class AsyncBandPOConfig(AsyncPolicyLossConfig):
    r"""
    Configuration of [`AsyncBandPOTrainer`]: [`AsyncPolicyLossConfig`] with `policy_loss="band"` ([`BandPOConfig`]'s
    default).
    """

    policy_loss: str = _copy_field(BandPOConfig, "policy_loss")


@dataclass
class AsyncDGPOConfig(AsyncPolicyLossConfig):
    r"""
    Configuration of [`AsyncDGPOTrainer`]: [`AsyncPolicyLossConfig`] with `policy_loss="dgpo"` ([`DGPOConfig`]'s
    default).
    """

    policy_loss: str = _copy_field(DGPOConfig, "policy_loss")


# -- the model version of each sample, from the rollout queue to the loss ---------------------------------------------


class _VersionTaggingQueue:
    """The rollout queue as the trainer reads it: each sample comes out as a shallow copy whose per-sample metrics hold
    its `model_version` under `_VERSION_KEY` (TRL's dataset passes the metrics on to the collator, and the version
    otherwise not), and one without a usable reward (`usable` false) does not come out. Everything else is the
    queue's."""

    def __init__(self, queue, usable):
        self._queue, self._usable = queue, usable

    def get(self, *args, **kwargs):
        while not self._usable(sample := self._queue.get(*args, **kwargs)):
            continue
        check_engine_logprobs(sample.old_log_probs, sample.completion_mask, "a rollout sample's old_log_probs")
        tagged = copy.copy(sample)
        tagged.metrics = {**sample.metrics, _VERSION_KEY: float(sample.model_version)}
        return tagged

    def __getattr__(self, name):
        return getattr(self._queue, name)


# -- the trainers -----------------------------------------------------------------------------------------------------


#: Our changes to `AsyncGRPOTrainer.compute_loss` (TRL 1.16), applied to the installed TRL's source at import.
COMPUTE_LOSS_PATCHES = (
    Patch(
        "bounds",
        "the registered policy loss replaces TRL's clip: its bounds, from the rollout's old log-probs",
        target="coef_2 = torch.clamp(coef_1,",
        code="lower, upper = self._policy_bounds(old_log_probs)",
    ),
    Patch("clipped term", "replaced by the registered loss", target="per_token_loss1 =", code=""),
    Patch("unclipped term", "replaced by the registered loss", target="per_token_loss2 =", code=""),
    Patch(
        "policy term",
        "the registered policy loss in place of TRL's clip",
        target="per_token_loss = -torch.min(",
        code="per_token_loss = self._per_token_policy_loss(\n"
        "    log_ratio, advantages, lower, upper, None, old_log_probs, segment_id\n)",
    ),
    *CLIP_RATIO_PATCHES,
    Patch(
        "count and staleness metrics",
        "our count metrics (docs/metrics.md) and staleness metrics (docs/off-policy-and-async.md)",
        target='self._metrics["train"]["clip_ratio/high_max"]',
        code="self._add_policy_metrics(\n"
        "    inputs, segment_id, old_log_probs, log_ratio, coef_1, advantages, lower, upper\n)",
        where="after",
    ),
    Patch(
        "finite loss",
        "a NaN or infinite loss stops the run or skips the update, naming what went non-finite (`on_nonfinite`)",
        target="return loss",
        code="self._check_finite_loss(\n    loss, log_probs=log_probs, old_log_probs=old_log_probs, "
        "advantages=advantages, lower=lower, upper=upper,\n    per_token_loss=per_token_loss,\n)",
        where="before",
    ),
)
_compute_loss = patch_method(AsyncGRPOTrainer, "compute_loss", COMPUTE_LOSS_PATCHES)


class AsyncPolicyLossTrainer(PolicyTerm, NonFiniteGuard, AsyncGRPOTrainer):
    """`AsyncGRPOTrainer` whose per-token policy term is `args.policy_loss` (see [`AsyncPolicyLossConfig`]), with
    AsyncGRPOTrainer's arguments; `args` may be any `AsyncGRPOConfig` (our settings then take `config_class`'s
    defaults). The bounds come from each sample's rollout log-probs."""

    config_class = AsyncPolicyLossConfig
    trl_config_class = AsyncGRPOConfig
    _tag_names = ["trl", "async-grpo", "trl-bandpo"]

    # The same parameters, in the same order, with the same defaults as AsyncGRPOTrainer.__init__ (TRL 1.16).
    def __init__(
        self,
        model,
        reward_funcs=None,
        args: AsyncPolicyLossConfig | None = None,
        train_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        tools=None,
        environment_factory=None,
        rollout_worker=None,
        weight_transfer=None,
    ):
        if not isinstance(model, (str, os.PathLike)):
            raise TypeError(
                f"{type(self).__name__} takes the model as a hub id or a local folder (TRL's asynchronous trainer "
                f"loads it itself, with its tree attention), got a {type(model).__name__}: save it with "
                "model.save_pretrained(folder) and pass the folder."
            )
        model = os.fspath(model)
        args = self._setup_policy_term(model, args)
        check_dataset(train_dataset, "train_dataset", reward_funcs, environment_factory is None)
        self._call_with_warnings_at_the_callers_line(
            super().__init__, model, reward_funcs, args=args, train_dataset=train_dataset,
            processing_class=processing_class, callbacks=callbacks, optimizers=optimizers, peft_config=peft_config,
            tools=tools, environment_factory=environment_factory, rollout_worker=rollout_worker,
            weight_transfer=weight_transfer,
        )  # fmt: skip
        if self.rollout_queue is not None:  # the main process reads the rollout samples
            self.rollout_queue = _VersionTaggingQueue(self.rollout_queue, self._usable_sample)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return _compute_loss(self, model, inputs, return_outputs, num_items_in_batch)

    def _usable_sample(self, sample) -> bool:
        """Whether a rollout sample's reward (the worker's `nansum` of its functions') and advantage are finite; an
        unusable reward stops the run or is dropped (`on_nonfinite`), the rest of its group (NaN advantages) too."""
        if not math.isfinite(sample.metrics["reward"]):
            rewards = {key[8:]: value for key, value in sample.metrics.items() if key.startswith("rewards/")}
            where = f"a rollout sample of group {sample.group_id} ({sample.completion!r:.200}) at optimizer step"
            self._nonfinite(
                unusable_rewards(rewards, f"{where} {self.state.global_step}"),
                "it is dropped, and so are the samples of its group without a finite advantage",
            )
        return math.isfinite(sample.metrics["reward"]) and math.isfinite(sample.advantage)

    # -- staleness: the lag of each sample, packed with the micro-batch --------------------------------------------

    def get_train_dataloader(self):
        dataloader = super().get_train_dataloader()
        collator = dataloader.collate_fn
        if isinstance(collator, DataCollatorForRollout):  # runs on the main process, which packs every micro-batch
            pack = collator.torch_call
            collator.torch_call = lambda examples: self._pack_with_lags(pack, examples)
        return dataloader

    def _pack_with_lags(self, pack, examples):
        """TRL's packing of one micro-batch, plus each sample's lag now (`(rows, samples)`, in the order of the
        samples' `segment_id`, NaN padding) and the optimizer step now."""
        (rows,) = examples
        lags = []
        for row in rows:
            row_lags = []
            for sample in row.samples:
                metrics = sample["metrics"]
                row_lags.append(self.model_version - metrics.get(_VERSION_KEY, math.nan))
                sample["metrics"] = {key: value for key, value in metrics.items() if key != _VERSION_KEY}
            lags.append(torch.tensor(row_lags, dtype=torch.float32))
        batch = pack(examples)
        batch[_LAG_KEY] = pad(lags, padding_value=math.nan)
        batch[_LAG_STEP_KEY] = torch.full((len(rows),), float(self.state.global_step))
        return batch

    def _sample_lags(self, inputs) -> torch.Tensor | None:
        """This process's samples' model-version lag when their loss is taken: the lag when the micro-batch was
        packed, plus the weight syncs since (the data loader packs one micro-batch ahead). None without the lags
        (a batch not packed by `get_train_dataloader`)."""
        if _LAG_KEY not in inputs:
            return None
        every = self.args.weight_sync_steps
        packed_at = torch.div(inputs[_LAG_STEP_KEY][0], every, rounding_mode="floor")
        return inputs[_LAG_KEY][0] + (self.state.global_step // every - packed_at)

    def _add_policy_metrics(self, inputs, segment_id, old_log_probs, log_ratio, coef_1, advantages, lower, upper):
        """Count metrics (docs/metrics.md) and staleness metrics (docs/off-policy-and-async.md) of this micro-batch,
        summed over processes and the logging window."""
        mask = torch.ones_like(old_log_probs)
        counts = self._policy_counts(old_log_probs, coef_1, log_ratio, advantages, lower, upper, mask, segment_id)
        lags = self._sample_lags(inputs)
        if lags is not None:
            known = ~torch.isnan(lags)
            counts["staleness/lag_mean"] = (torch.where(known, lags, 0.0).sum(), known.sum())
            lower_t, upper_t = (torch.as_tensor(bound, device=coef_1.device) for bound in (lower, upper))
            clipped = ((coef_1 < lower_t) & (advantages < 0)) | ((coef_1 > upper_t) & (advantages > 0))
            for name, in_bucket in lag_buckets(lags[segment_id]).items():
                counts[f"clip_ratio_by_lag/{name}"] = ((clipped & in_bucket).sum(), in_bucket.sum())
            local_max = torch.where(known, lags, -math.inf).max().reshape(1)
            self._metrics["train"]["staleness/lag_max"].append(self.accelerator.gather(local_max).max().item())
        self._add_counts("train", counts)


class AsyncBandPOTrainer(AsyncPolicyLossTrainer):
    """[BandPO](https://arxiv.org/abs/2603.04918) with TRL's asynchronous GRPO trainer: `args` an
    [`AsyncBandPOConfig`]."""

    config_class = AsyncBandPOConfig
    _tag_names = ["trl", "async-grpo", "trl-bandpo", "bandpo"]
    _name = "AsyncBandPO"
    _paper = BANDPO_PAPER


class AsyncDGPOTrainer(AsyncPolicyLossTrainer):
    """[DGPO](https://arxiv.org/abs/2603.14389) with TRL's asynchronous GRPO trainer: `args` an [`AsyncDGPOConfig`]."""

    config_class = AsyncDGPOConfig
    _tag_names = ["trl", "async-grpo", "trl-bandpo", "dgpo"]
    _name = "AsyncDGPO"
    _paper = DGPO_PAPER

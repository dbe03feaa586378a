"""Every registered policy loss with TRL's asynchronous GRPO trainer: `AsyncPolicyLossTrainer`, `AsyncBandPOTrainer`
and `AsyncDGPOTrainer`, with their configs (docs/off-policy-and-async.md).

`trl.experimental.async_grpo.AsyncGRPOTrainer` (experimental in TRL 1.16: its API may change in any release) trains
on rollout samples that a vLLM server generated with an earlier version of the policy. Each sample carries the
log-probs it was sampled with (`old_log_probs`): they are the old policy of the ratio, and the bounds of the selected
loss are computed from them, per micro-batch.

`AsyncPolicyLossTrainer.compute_loss` is TRL 1.16's `AsyncGRPOTrainer.compute_loss`, statements and comments verbatim,
with our changes in fenced blocks (`# trl-bandpo: <why>` ... `# trl-bandpo end`), as in `trainer.py`: the policy term
is the registered loss, the clip ratios use the bounds in force, and our count and staleness metrics are added.
`tests/test_async_trainer.py` diffs the method against the installed TRL's outside the fences, and checks that with
`policy_loss="clip"` the loss, gradients and metrics equal AsyncGRPOTrainer's.

Staleness. TRL tags each rollout sample with the model version that generated it, and drops the tag when it packs
samples into a micro-batch. Two thin wrappers carry it to the loss, unchanged otherwise: the trainer reads the rollout
queue through `_VersionTaggingQueue` (each sample's version rides in its per-sample metrics), and TRL's collator is
followed by a step that takes the version back out and adds each sample's lag to the batch.

The configs add our fields to `AsyncGRPOConfig`, each copied from `PolicyLossConfig` (default, help, choices): the
policy loss and every field a registered loss reads that `AsyncGRPOConfig` lacks. They are checked by
`PolicyLossConfig`'s own checks and the loss registry.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from dataclasses import dataclass, field

import torch
from transformers.utils import logging
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout
from trl.trainer.utils import nanmax, nanmin, pad

from ..core.losses import policy_loss_spec
from ..core.metrics import clip_counts
from .configs import (
    BandPOConfig,
    DGPOConfig,
    PolicyLossConfig,
    _loss_fields,
    with_policy_loss_fields,
)
from .trainer import BandPOTrainer, DGPOTrainer, PolicyLossTrainer

__all__ = [
    "LAG_BUCKETS",
    "AsyncBandPOConfig",
    "AsyncBandPOTrainer",
    "AsyncDGPOConfig",
    "AsyncDGPOTrainer",
    "AsyncPolicyLossConfig",
    "AsyncPolicyLossTrainer",
    "lag_buckets",
]

logger = logging.get_logger(__name__)

#: Model-version lag buckets of the `clip_ratio_by_lag/*` metrics: lag 0, 1, 2, and 3 or more.
LAG_BUCKETS = ("0", "1", "2", "3+")

# Per-sample metrics key that carries a sample's model version from the rollout queue to the collator.
_VERSION_KEY = "trl_bandpo/model_version"
# Batch keys: each sample's lag when its micro-batch was packed (`(rows, samples)`, NaN padding), and the optimizer
# step at that moment (`(rows,)`), from which the loss counts the weight syncs since.
_LAG_KEY = "trl_bandpo/sample_lag"
_LAG_STEP_KEY = "trl_bandpo/lag_step"


def lag_buckets(lag: torch.Tensor) -> dict[str, torch.Tensor]:
    """Boolean masks of the `LAG_BUCKETS` of `lag` (NaN, an unknown lag, is in none)."""
    return {"0": lag == 0, "1": lag == 1, "2": lag == 2, "3+": lag >= 3}


# -- configs ----------------------------------------------------------------------------------------------------------


def _copy_field(config_class, name: str):
    """`config_class`'s field `name` (default, help, choices) for another dataclass."""
    source = {f.name: f for f in dataclasses.fields(config_class)}[name]
    return field(default=source.default, metadata=source.metadata)


def _policy_loss_fields():
    """A dataclass holding our fields, in `PolicyLossConfig`'s order: `policy_loss` and every field a registered loss
    reads that `AsyncGRPOConfig` lacks (the Band, DGPO, ... hyper-parameters, and TRL's dual clip `delta`)."""
    present = {f.name for f in dataclasses.fields(AsyncGRPOConfig)}
    wanted = ({"policy_loss"} | _loss_fields()) - present
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
    plus `policy_loss` and the fields of the registered losses, with [`PolicyLossConfig`]'s defaults and checks
    (`band_divergence`, `band_radius`, `band_solver`, `band_upper_max`, `dgpo_n`, `dgpo_m`, `ce_gppo_beta1`,
    `ce_gppo_beta2`, `aspo_c_pos`, `aspo_c_neg`, `dppo_*`, and TRL's dual clip `delta`).

    What the synchronous config has and this one has not: `loss_type` (the async trainer's loss is the token sum over
    the micro-batch divided by its token count per process), `importance_sampling_level` (token level only), `beta`
    (no reference model), the adaptive radius (`band_radius_by`: the old policy's entropies are not in a rollout
    sample), dynamic sampling and `old_logps_source` (the old log-probs are always the rollout's). See
    docs/off-policy-and-async.md.
    """

    def __post_init__(self):
        # Our checks first: a bad value of ours must not hide behind a TRL error.
        spec = policy_loss_spec(self.policy_loss)  # raises ValueError naming the allowed values
        PolicyLossConfig._check_hyperparameters(self)  # every field a registered loss reads, as PolicyLossConfig
        super().__post_init__()
        PolicyLossConfig._check_selected_loss(self, spec)
        PolicyLossConfig._warn_unused_fields(self, spec)


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
    otherwise not). Everything else is the queue's."""

    def __init__(self, queue):
        self._queue = queue

    def get(self, *args, **kwargs):
        sample = self._queue.get(*args, **kwargs)
        tagged = copy.copy(sample)
        tagged.metrics = {**sample.metrics, _VERSION_KEY: float(sample.model_version)}
        return tagged

    def __getattr__(self, name):
        return getattr(self._queue, name)


# -- the trainers -----------------------------------------------------------------------------------------------------


class AsyncPolicyLossTrainer(AsyncGRPOTrainer):
    """`AsyncGRPOTrainer` whose per-token policy term is `args.policy_loss` (see [`AsyncPolicyLossConfig`]).

    Everything else is AsyncGRPOTrainer's: pass the same arguments (`model`, `reward_funcs`, `train_dataset`,
    `rollout_worker`, `weight_transfer`, ...). The bounds come from each sample's rollout log-probs.
    """

    config_class = AsyncPolicyLossConfig
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
        if args is None:
            method = self.config_class.__name__.removesuffix("Config")
            args = self.config_class(f"{model.split('/')[-1]}-{method}")
        if not isinstance(args, AsyncPolicyLossConfig):
            if not isinstance(args, AsyncGRPOConfig):
                raise TypeError(
                    f"{type(self).__name__} needs an AsyncGRPOConfig ({self.config_class.__name__}, or any "
                    f"AsyncGRPOConfig subclass), got {type(args).__name__}."
                )
            given = type(args).__name__
            args = with_policy_loss_fields(args, self.config_class)
            logger.warning_once(
                f"{type(self).__name__} got a {given}: it keeps its fields and values and adds "
                f"{self.config_class.__name__}'s with their defaults (policy_loss={args.policy_loss!r}). To set them, "
                f"derive your config from {self.config_class.__name__} instead of AsyncGRPOConfig."
            )
        super().__init__(
            model,
            reward_funcs,
            args=args,
            train_dataset=train_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
            tools=tools,
            environment_factory=environment_factory,
            rollout_worker=rollout_worker,
            weight_transfer=weight_transfer,
        )
        self.policy_loss = args.policy_loss
        self._policy = policy_loss_spec(args.policy_loss)
        self._policy_bound_kwargs, self._policy_loss_kwargs = self._policy.kwargs_from_config(args)
        if self.rollout_queue is not None:  # the main process reads the rollout samples
            self.rollout_queue = _VersionTaggingQueue(self.rollout_queue)

    # The policy term and its bounds: PolicyLossTrainer's (one source for both trainers).
    _policy_bounds = PolicyLossTrainer._policy_bounds
    _per_token_policy_loss = PolicyLossTrainer._per_token_policy_loss

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

    # -- our metrics -------------------------------------------------------------------------------------------------

    def _add_policy_metrics(self, inputs, segment_id, old_log_probs, log_ratio, coef_1, advantages, lower, upper):
        """Count metrics (docs/metrics.md) and staleness metrics (docs/off-policy-and-async.md), as `(numerator,
        denominator)` pairs summed over processes: the trainer's log divides their sums over the logging window."""
        lower_t, upper_t = (torch.as_tensor(bound, device=coef_1.device) for bound in (lower, upper))
        mask = torch.ones_like(old_log_probs)
        counts = clip_counts(old_log_probs, coef_1, advantages, lower_t, upper_t, mask)
        if self._policy.metrics is not None:
            counts.update(
                self._policy.metrics(log_ratio.detach(), advantages, lower, upper, mask, **self._policy_loss_kwargs)
            )
        lags = self._sample_lags(inputs)
        if lags is not None:
            known = ~torch.isnan(lags)
            counts["staleness/lag_mean"] = (torch.where(known, lags, 0.0).sum(), known.sum())
            clipped = ((coef_1 < lower_t) & (advantages < 0)) | ((coef_1 > upper_t) & (advantages > 0))
            for name, in_bucket in lag_buckets(lags[segment_id]).items():
                counts[f"clip_ratio_by_lag/{name}"] = ((clipped & in_bucket).sum(), in_bucket.sum())
        stacked = torch.stack([torch.stack([num.double(), den.double()]) for num, den in counts.values()])
        totals = self.accelerator.reduce(stacked, reduction="sum").tolist()  # one collective for all of them
        for name, (num, den) in zip(counts, totals):
            self._metrics["train"][name].append((num, den))
        if lags is not None:
            local_max = torch.where(known, lags, -math.inf).max().reshape(1)
            self._metrics["train"]["staleness/lag_max"].append(self.accelerator.gather(local_max).max().item())

    # -- the loss: TRL 1.16's AsyncGRPOTrainer.compute_loss, verbatim but for the fenced blocks -------------------
    # Copyright 2020-2026 The HuggingFace Team (Apache-2.0). Each change of ours sits between a
    # `# trl-bandpo: <why>` line and a `# trl-bandpo end` line; tests/test_async_trainer.py diffs the rest against
    # the installed TRL (docs/upgrading-trl.md).

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mask_bool = inputs["attention_mask"].bool()
        selected = inputs["token_index"] >= 0
        input_ids = inputs["input_ids"][mask_bool].unsqueeze(0)
        position_ids = inputs["position_ids"][mask_bool].unsqueeze(0)
        shift_labels = inputs["shift_labels"][mask_bool].unsqueeze(0)
        token_index = inputs["token_index"][selected]
        old_log_probs = inputs["old_log_probs"][selected]
        advantages = inputs["advantages"][selected]
        segment_id = inputs["segment_id"][selected]
        tree_kwargs = {
            key: inputs[key][inputs[key] >= 0] for key in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")
        }
        tree_kwargs["tree_max_seqlen_q"], tree_kwargs["tree_max_seqlen_k"] = inputs["tree_max_seqlens"][0].tolist()

        forward_start = time.time()
        # MoE models: request router logits so the forward returns the load-balancing loss
        router_kwargs = {"output_router_logits": True} if self.aux_loss_enabled else {}
        outputs = model(
            input_ids=input_ids,
            position_ids=position_ids,
            shift_labels=shift_labels,
            fused_lm_head=True,
            **router_kwargs,
            **tree_kwargs,
        )
        log_probs = outputs.log_probs.flatten()[token_index]
        entropy = outputs.entropy.flatten()[token_index]
        self._last_forward_time_s = time.time() - forward_start

        log_ratio = log_probs - old_log_probs
        coef_1 = torch.exp(log_ratio)
        # trl-bandpo: the registered policy loss in place of TRL's clip; its bounds from the rollout's old log-probs
        lower, upper = self._policy_bounds(old_log_probs)
        per_token_loss = self._per_token_policy_loss(log_ratio, advantages, lower, upper)
        # trl-bandpo end

        # DDP/FSDP averages gradients across ranks (world_size).
        # To get correct per-token normalization we scale by 1/tokens_per_rank
        # = world_size / global_n_tokens, so after DDP averaging the effective
        loss = per_token_loss.sum()
        global_n_tokens = inputs["global_n_tokens"][0]
        world_size = self.accelerator.num_processes
        tokens_per_rank = (global_n_tokens / world_size).clamp(min=1.0)
        loss = loss / tokens_per_rank.to(torch.float32)
        # For DAPO, we would scale like this instead:
        # loss = loss / max(per_token_loss.size(0), 1)
        loss = loss / self.current_gradient_accumulation_steps

        # The policy loss above is scaled for gradient accumulation (HF auto-scaling is off here), so scale aux too
        if self.aux_loss_enabled:
            aux_loss = outputs.aux_loss
            loss = loss + self.router_aux_loss_coef * aux_loss / self.current_gradient_accumulation_steps

        with torch.no_grad():
            local_ratio_sum = coef_1.sum()
            local_count = torch.full_like(local_ratio_sum, float(log_probs.numel()))
            # Approx KL: http://joschu.net/blog/kl-approx.html
            local_kl_sum = ((coef_1 - 1) - log_ratio).sum()
            local_entropy_sum = entropy.sum()

            # Compute the clipped probability ratios
            # trl-bandpo: clipped against the bounds in force, not 1 -/+ epsilon
            lower_t, upper_t = (torch.as_tensor(bound, device=coef_1.device) for bound in (lower, upper))
            is_low_clipped = (coef_1 < lower_t) & (advantages < 0)
            is_high_clipped = (coef_1 > upper_t) & (advantages > 0)
            # trl-bandpo end
            is_region_clipped = is_low_clipped | is_high_clipped
            local_low_clip_sum = is_low_clipped.float().sum()
            local_high_clip_sum = is_high_clipped.float().sum()
            local_region_clip_sum = is_region_clipped.float().sum()

            # Batch all-reduce: [ratio_sum, kl_sum, entropy_sum, low_clip_sum, high_clip_sum, region_clip_sum, count]
            stats = torch.stack(
                [
                    local_ratio_sum,
                    local_kl_sum,
                    local_entropy_sum,
                    local_low_clip_sum,
                    local_high_clip_sum,
                    local_region_clip_sum,
                    local_count,
                ]
            )
            stats = self.accelerator.reduce(stats, reduction="sum")
            (
                global_ratio_sum,
                global_kl_sum,
                global_entropy_sum,
                global_low_clip_sum,
                global_high_clip_sum,
                global_region_clip_sum,
                global_count,
            ) = stats.unbind(0)
            self._metrics["train"]["ratio"].append((global_ratio_sum / global_count).item())
            self._metrics["train"]["kl"].append((global_kl_sum / global_count).item())
            self._metrics["train"]["entropy"].append((global_entropy_sum / global_count).item())
            self._metrics["train"]["clip_ratio/low_mean"].append((global_low_clip_sum / global_count).item())
            self._metrics["train"]["clip_ratio/high_mean"].append((global_high_clip_sum / global_count).item())
            self._metrics["train"]["clip_ratio/region_mean"].append((global_region_clip_sum / global_count).item())

            num_seq = int(segment_id.max()) + 1  # completions in this rank's row

            def seg_sum(vals):  # per-completion segment sum over the flat selection
                return torch.zeros(num_seq, device=vals.device).index_add_(0, segment_id, vals)

            seq_tokens = seg_sum(torch.ones_like(coef_1, dtype=torch.float32))
            seq_low = seg_sum(is_low_clipped.float())
            seq_high = seg_sum(is_high_clipped.float())
            per_seq_low = seq_low / seq_tokens  # NaN for a completion with no valid tokens; ignored by nan-aware min
            per_seq_high = seq_high / seq_tokens
            gathered_low_min = self.accelerator.gather(nanmin(per_seq_low))
            gathered_high_max = self.accelerator.gather(nanmax(per_seq_high))
            self._metrics["train"]["clip_ratio/low_min"].append(nanmin(gathered_low_min).item())
            self._metrics["train"]["clip_ratio/high_max"].append(nanmax(gathered_high_max).item())
            # trl-bandpo: count metrics (docs/metrics.md) and staleness metrics (docs/off-policy-and-async.md)
            self._add_policy_metrics(inputs, segment_id, old_log_probs, log_ratio, coef_1, advantages, lower, upper)
            # trl-bandpo end

            if self.aux_loss_enabled:
                gathered_aux = self.accelerator.reduce(aux_loss.detach().to(torch.float32), reduction="sum")
                self._metrics["train"]["aux_loss"].append((gathered_aux / world_size).item())

        # Per-step accounting, accumulated across the micro-batches of one optimizer step and flushed in
        # `training_step`. The counts are batch-wide (the collator broadcasts one value per rank), so they are read off
        # rank-local inputs without a collective. Sample rewards and packing metrics are NOT gathered here — rank 0
        # already logged them in the collator.
        n_forward_tokens = float(inputs["global_n_forward_tokens"][0])
        mean_seq_len = float(inputs["mean_seq_len"][0])
        self._step_forward_tokens += n_forward_tokens
        self._step_trained_tokens += float(global_n_tokens)
        self._step_seq_len_weighted += mean_seq_len * n_forward_tokens
        self._step_samples += n_forward_tokens / mean_seq_len
        self._step_forward_s += self._last_forward_time_s
        return loss


class AsyncBandPOTrainer(AsyncPolicyLossTrainer):
    """[BandPO](https://arxiv.org/abs/2603.04918) with TRL's asynchronous GRPO trainer: `args` an
    [`AsyncBandPOConfig`]."""

    config_class = AsyncBandPOConfig
    _tag_names = ["trl", "async-grpo", "trl-bandpo", "bandpo"]
    _name = "AsyncBandPO"
    _paper = BandPOTrainer._paper


class AsyncDGPOTrainer(AsyncPolicyLossTrainer):
    """[DGPO](https://arxiv.org/abs/2603.14389) with TRL's asynchronous GRPO trainer: `args` an [`AsyncDGPOConfig`]."""

    config_class = AsyncDGPOConfig
    _tag_names = ["trl", "async-grpo", "trl-bandpo", "dgpo"]
    _name = "AsyncDGPO"
    _paper = DGPOTrainer._paper

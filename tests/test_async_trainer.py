"""The policy losses with TRL's asynchronous GRPO trainer (`trl_bandpo.training.async_trainer`,
docs/off-policy-and-async.md).

`AsyncPolicyLossTrainer.compute_loss` (the installed `AsyncGRPOTrainer.compute_loss` with our patches,
tests/test_trl_patches.py) equals it in loss, gradients and metrics with `policy_loss="clip"`, and runs every
registered loss with its bounds from the rollout's old log-probs.

No vLLM server, no GPU: the trainers are built with a rollout worker that only holds a queue and a weight transfer that
does nothing (both passed the way TRL's API allows), and three CPU stand-ins are patched into TRL's module for the
whole file: the tree-attention kernel (FlashAttention-3 from the Hub) by a plain-torch equivalent
(tests/async_cpu_stand_ins.py) checked below against an unpacked forward, the peak-FLOPs lookup (it asks CUDA for the
device name), and the HTTP client (it needs `requests`, which this environment lacks; nothing here talks to a
server)."""

from __future__ import annotations

import inspect
import math
import queue

import numpy as np
import pytest
import torch
from async_cpu_stand_ins import patch_for_cpu

pytest.importorskip("trl.experimental.async_grpo")

B_SAMPLES = 6  # samples in the synthetic micro-batch: 3 groups of 2


# ------------------------------------------------------------------------------------------------------------------
# CPU stand-ins and stubs
# ------------------------------------------------------------------------------------------------------------------


class _Worker:
    """`RolloutWorkerProtocol` with nothing behind it: a queue the test fills, and no process."""

    def __init__(self, samples=()):
        self.rollout_buffer, self.metrics_queue = queue.Queue(), queue.Queue()
        for sample in samples:
            self.rollout_buffer.put(sample)
        self.versions = []

    def start(self):
        pass

    def stop(self):
        pass

    def update_model_version(self, model_version):
        self.versions.append(model_version)

    def check_health(self, stale_after_s):
        raise AssertionError("the rollout queue ran dry: the test queued too few samples")


class _NoTransfer:
    """`WeightTransferProtocol` that sends nothing (the stream is still consumed, as TRL's collectives require)."""

    def init_weight_transfer(self):
        pass

    def pause(self):
        pass

    def send_weights(self, iterator):
        for _ in iterator:
            pass

    def resume(self):
        pass

    def destroy(self):
        pass


@pytest.fixture(scope="module", autouse=True)
def cpu_stand_ins():
    import trl.experimental.async_grpo.async_grpo_trainer as async_module

    with pytest.MonkeyPatch.context() as patch:
        patch_for_cpu(patch)
        patch.setattr(async_module, "VLLMClient", lambda *args, **kwargs: None)
        yield


def _config(config_class, tmp_path, **overrides):
    settings = dict(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", gradient_checkpointing=False,
        per_device_train_batch_size=4, token_budget=0, save_strategy="no", seed=0,
    )  # fmt: skip
    settings.update(overrides)
    return config_class(**settings)


def _build(trainer_class, config_class, tiny_model_dir, tmp_path, samples=(), **overrides):
    trainer = trainer_class(
        model=tiny_model_dir,
        args=_config(config_class, tmp_path, **overrides),
        train_dataset=_prompts(),
        rollout_worker=_Worker(samples),
        weight_transfer=_NoTransfer(),
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    return trainer


def _prompts():
    from datasets import Dataset

    return Dataset.from_list([{"prompt": "1+1="}] * 4)


def test_init_takes_async_grpo_trainers_parameters():
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    from trl_bandpo.training.async_trainer import AsyncPolicyLossTrainer

    theirs = inspect.signature(AsyncGRPOTrainer.__init__).parameters
    ours = inspect.signature(AsyncPolicyLossTrainer.__init__).parameters
    assert list(ours) == list(theirs)
    assert [p.default for p in ours.values()] == [p.default for p in theirs.values()]


# ------------------------------------------------------------------------------------------------------------------
# A micro-batch as TRL's collator packs it
# ------------------------------------------------------------------------------------------------------------------


def _samples(seed=0, vocab=60):
    """Rollout samples as `RolloutQueueDataset` yields them: 3 groups of 2 sharing their prompt, completions of
    varying length, advantages of both signs, old log-probs 0 at prompt positions."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(B_SAMPLES):
        prompt = [5, 6, 7 + i // 2]
        completion = torch.randint(10, vocab, (4 + i,), generator=generator).tolist()
        mask = [0] * len(prompt) + [1] * len(completion)
        samples.append({
            "input_ids": np.array(prompt + completion, dtype=np.int64),
            "completion_mask": np.array(mask, dtype=np.int64),
            "old_log_probs": np.zeros(len(mask), dtype=np.float32),
            "advantage": [1.3, -0.7, 0.4, -1.1, 0.9, -0.2][i],
            "group_id": i // 2,
            "metrics": {"reward": float(i % 2)},
        })  # fmt: skip
    return samples


def _pack(samples, pad_token_id=0):
    from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout
    from trl.experimental.async_grpo.packing import TreeRow

    row = TreeRow()
    for sample in samples:
        row.add(sample)
    return DataCollatorForRollout(pad_token_id=pad_token_id, num_processes=1)([[row]])


def _forward_log_probs(trainer, batch) -> torch.Tensor:
    """The log-probs of the loss terms of `batch` (the forward of TRL's compute_loss, without the loss)."""
    keep = batch["attention_mask"].bool()
    selected = batch["token_index"] >= 0
    tree = {key: batch[key][batch[key] >= 0] for key in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")}
    tree["tree_max_seqlen_q"], tree["tree_max_seqlen_k"] = batch["tree_max_seqlens"][0].tolist()
    with torch.no_grad():
        outputs = trainer.model(
            input_ids=batch["input_ids"][keep].unsqueeze(0),
            position_ids=batch["position_ids"][keep].unsqueeze(0),
            shift_labels=batch["shift_labels"][keep].unsqueeze(0),
            fused_lm_head=True,
            **tree,
        )
    return outputs.log_probs.flatten()[batch["token_index"][selected]]


def _with_old_log_probs(trainer, samples, noise=0.4, seed=1):
    """`samples` with old log-probs = the model's own plus noise (ratios spread around 1, so every clip region is
    hit), and the packed micro-batch."""
    logps = _forward_log_probs(trainer, _pack(samples)).tolist()
    generator = torch.Generator().manual_seed(seed)
    for sample in samples:  # the loss terms come sample by sample, position by position (TreeRow.pack)
        for p in np.flatnonzero(sample["completion_mask"][1:]) + 1:
            sample["old_log_probs"][p] = logps.pop(0) + noise * torch.randn(1, generator=generator).item()
    assert not logps
    return samples, _pack(samples)


def test_cpu_tree_attention_matches_an_unpacked_forward(tiny_model_dir, tmp_path):
    """The stand-in kernel is right: the packed forward (shared prompts folded into a trie) scores every completion
    token as a plain forward of its sample alone does."""
    from transformers import AutoModelForCausalLM

    from trl_bandpo.training.async_trainer import AsyncPolicyLossConfig, AsyncPolicyLossTrainer

    trainer = _build(AsyncPolicyLossTrainer, AsyncPolicyLossConfig, tiny_model_dir, tmp_path)
    samples = _samples(vocab=trainer.model.config.vocab_size)
    packed = _forward_log_probs(trainer, _pack(samples))
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager").eval()
    expected = []
    with torch.no_grad():
        for sample in samples:
            ids = torch.as_tensor(sample["input_ids"]).unsqueeze(0)
            logps = plain(ids).logits.log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
            expected += logps[sample["completion_mask"][1:] > 0].tolist()
    torch.testing.assert_close(packed, torch.tensor(expected), rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------------------------------
# Parity with AsyncGRPOTrainer for policy_loss="clip"
# ------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def parity_trainers(tiny_model_dir, tmp_path_factory):
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from trl_bandpo.training.async_trainer import AsyncPolicyLossConfig, AsyncPolicyLossTrainer

    tmp = tmp_path_factory.mktemp("async_parity")
    ours = _build(AsyncPolicyLossTrainer, AsyncPolicyLossConfig, tiny_model_dir, tmp / "ours", policy_loss="clip")
    theirs = _build(AsyncGRPOTrainer, AsyncGRPOConfig, tiny_model_dir, tmp / "theirs")
    return ours, theirs


def _run(trainer, batch):
    trainer._metrics["train"].clear()
    counts = trainer._count_window("train") if hasattr(trainer, "_count_window") else {}
    counts.clear()
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, dict(batch))
    loss.backward()
    grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    metrics = {key: list(values) for key, values in trainer._metrics["train"].items()}
    metrics.update({key: [tuple(value)] for key, value in counts.items()})  # our counts: (numerator, denominator)
    return loss.detach(), grads, metrics


@pytest.mark.parametrize("epsilon,epsilon_high", [(0.2, None), (0.2, 0.28), (0.1, 0.05)])
def test_clip_equals_async_grpo(parity_trainers, epsilon, epsilon_high):
    ours, theirs = parity_trainers
    for trainer in parity_trainers:  # both read epsilon from the trainer attributes TRL sets in __init__
        trainer.epsilon_low, trainer.epsilon_high = epsilon, epsilon if epsilon_high is None else epsilon_high
        trainer.args.epsilon, trainer.args.epsilon_high = epsilon, epsilon_high
    ours._policy_bound_kwargs, ours._policy_loss_kwargs = ours._policy.kwargs_from_config(ours.args)
    _, batch = _with_old_log_probs(theirs, _samples(vocab=theirs.model.config.vocab_size))
    (loss_a, grads_a, metrics_a), (loss_b, grads_b, metrics_b) = _run(ours, batch), _run(theirs, batch)
    assert torch.isfinite(loss_b)
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-6, atol=1e-7)
    assert grads_a.keys() == grads_b.keys() and grads_b
    for name in grads_b:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-5, atol=1e-7, msg=name)
    missing = set(metrics_b) - set(metrics_a)
    assert not missing, f"metrics TRL logs and we do not: {missing}"
    for key in metrics_b:
        assert metrics_a[key] == pytest.approx(metrics_b[key], rel=1e-6, abs=1e-7, nan_ok=True), key
    clipped = metrics_b["clip_ratio/low_mean"][0] + metrics_b["clip_ratio/high_mean"][0]
    assert 0 < clipped < 1  # the batch exercises clipping, not only the interior
    for name in ("_step_forward_tokens", "_step_trained_tokens", "_step_samples"):
        assert getattr(ours, name) == getattr(theirs, name)


# ------------------------------------------------------------------------------------------------------------------
# Every registered loss, with its bounds from the rollout's old log-probs
# ------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def band_trainer(tiny_model_dir, tmp_path_factory):
    from trl_bandpo.training.async_trainer import AsyncBandPOConfig, AsyncBandPOTrainer

    return _build(AsyncBandPOTrainer, AsyncBandPOConfig, tiny_model_dir, tmp_path_factory.mktemp("async_band"))


def test_band_bounds_come_from_the_rollouts_old_log_probs(band_trainer):
    """Loss, clip shares and bound means recomputed by hand from the Band of the samples' old log-probs."""
    from trl_bandpo.core.band import band_bounds
    from trl_bandpo.core.losses import clipped_surrogate_loss

    trainer = band_trainer
    samples, batch = _with_old_log_probs(trainer, _samples(vocab=trainer.model.config.vocab_size), noise=1.0)
    old = batch["old_log_probs"][0]
    advantages = batch["advantages"][0]
    current = _forward_log_probs(trainer, batch)
    lower, upper = band_bounds(old, 0.05, "kl", upper_max=10.0)
    per_token = clipped_surrogate_loss(current - old, advantages, lower, upper)
    expected_loss = per_token.sum() / old.numel() / trainer.current_gradient_accumulation_steps
    loss, _, metrics = _run(trainer, batch)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-7)
    ratio = torch.exp(current - old)
    low = ((ratio < lower) & (advantages < 0)).float().mean().item()
    high = ((ratio > upper) & (advantages > 0)).float().mean().item()
    assert metrics["clip_ratio/low_mean"] == pytest.approx([low], abs=1e-6)
    assert metrics["clip_ratio/high_mean"] == pytest.approx([high], abs=1e-6)
    assert low + high > 0
    ((num, den),) = metrics["bounds/upper_mean"]
    assert num / den == pytest.approx(upper.mean().item(), rel=1e-5) and den == old.numel()
    assert not any(key.startswith(("staleness/", "clip_ratio_by_lag/")) for key in metrics)  # no lags packed


@pytest.mark.parametrize("name", ["clip", "band", "relaxed_band", "dcpo", "dgpo", "band_dgpo", "gppo", "cispo",
                                  "ce_gppo", "aspo", "dppo_tv", "dppo_kl", "spo", "drpo", "ipo", "cppo", "trm",
                                  "m2po", "icepop"])  # fmt: skip
def test_every_registered_loss_trains(band_trainer, name):
    from trl_bandpo.core.losses import POLICY_LOSSES, policy_loss_spec

    assert name in POLICY_LOSSES
    trainer = band_trainer
    spec = policy_loss_spec(name)
    trainer._policy = spec  # the config's fields, read by this loss (a new config would reset accelerate's state)
    trainer._policy_bound_kwargs, trainer._policy_loss_kwargs = spec.kwargs_from_config(trainer.args)
    try:
        _, batch = _with_old_log_probs(trainer, _samples(vocab=trainer.model.config.vocab_size), noise=1.0)
        loss, grads, metrics = _run(trainer, batch)
    finally:
        trainer._policy = band = policy_loss_spec("band")
        trainer._policy_bound_kwargs, trainer._policy_loss_kwargs = band.kwargs_from_config(trainer.args)
    assert torch.isfinite(loss) and grads and all(torch.isfinite(g).all() for g in grads.values())
    assert {"bounds/lower_mean", "clip_ratio/any_sign_mean", "clip_ratio_by_prob/high/p0.0-0.2"} <= set(metrics)
    if spec.metrics is not None:  # the loss's own metrics (DGPO regions, DPPO masks)
        prefix = name.split("_")[-1] if name.startswith("band_") else name.split("_")[0]
        assert any(key.startswith(f"{prefix}/") for key in metrics), sorted(metrics)


# the tiny model's probabilities of random tokens are small: CPPO's budget on |q - p| is made as small here
@pytest.mark.parametrize(
    "name,noise,hp", [("cppo", 1.0, dict(radius=0.01, rate_min=0.001)), ("trm", 0.15, {}), ("m2po", 0.4, {})]
)
def test_sequence_aware_losses_see_each_sample_as_one_sequence(band_trainer, name, noise, hp):
    """TRL packs the loss tokens of all samples into one flat row: CPPO and TRM still judge each sample's tokens as
    one sequence (the loss is `policy_loss` on each sample alone) and M2PO the micro-batch's tokens together."""
    from trl_bandpo.core.losses import policy_loss, policy_loss_spec

    trainer = band_trainer
    spec = policy_loss_spec(name)
    trainer._policy = spec
    bound_kwargs, loss_kwargs = spec.kwargs_from_config(trainer.args)
    hp = {**bound_kwargs, **loss_kwargs, **hp}
    trainer._policy_bound_kwargs, trainer._policy_loss_kwargs = spec.split(hp)
    try:
        _, batch = _with_old_log_probs(trainer, _samples(vocab=trainer.model.config.vocab_size), noise=noise)
        loss, _, metrics = _run(trainer, batch)
    finally:
        trainer._policy = band = policy_loss_spec("band")
        trainer._policy_bound_kwargs, trainer._policy_loss_kwargs = band.kwargs_from_config(trainer.args)
    old, advantages, segment = batch["old_log_probs"][0], batch["advantages"][0], batch["segment_id"][0]
    current = _forward_log_probs(trainer, batch)
    rows = [segment == sample for sample in segment.unique()] if name != "m2po" else [segment >= 0]
    per_token = torch.zeros_like(old)
    for row in rows:
        args = (current[row][None], old[row][None], advantages[row][None])
        per_token[row] = policy_loss(name, *args, **hp)[0]
    expected = per_token.sum() / old.numel() / trainer.current_gradient_accumulation_steps
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-7)
    ((num, den),) = metrics[f"{name}/masked_share"]
    assert 0 < num < den and den == old.numel()  # the rule kept some tokens and masked others
    if name == "trm":
        ((num, den),) = metrics["trm/sequence_masked_share"]
        assert 0 < num < den == B_SAMPLES


def test_a_non_finite_loss_stops_the_async_trainer_naming_the_quantity(band_trainer):
    """Before: a NaN rollout log-prob trained NaN weights with rc 0 (issue 33: `on_nonfinite`)."""
    from trl_bandpo.training.nonfinite import NonFiniteTrainingError

    _, batch = _with_old_log_probs(band_trainer, _samples(vocab=band_trainer.model.config.vocab_size))
    first = (batch["token_index"] >= 0).nonzero()[0].tolist()
    batch["old_log_probs"][tuple(first)] = math.nan
    needle = r"policy_loss='band' .*first non-finite quantity: old_log_probs \(1 "
    with pytest.raises(NonFiniteTrainingError, match=needle):
        _run(band_trainer, batch)


# ------------------------------------------------------------------------------------------------------------------
# Staleness: the model-version lag of each trained sample
# ------------------------------------------------------------------------------------------------------------------


def _rollout_samples(count, versions, vocab):
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    generator = torch.Generator().manual_seed(3)
    samples = []
    for i in range(count):
        completion = torch.randint(10, vocab, (3 + i % 4,), generator=generator).tolist()
        ids = [5, 6, 7 + i // 2] + completion
        mask = np.array([0, 0, 0] + [1] * len(completion), dtype=np.int64)
        old = (-4.0 + 2.0 * torch.rand(len(ids), generator=generator)).numpy().astype(np.float32) * mask
        samples.append(
            RolloutSample(
                prompt=[], completion=[], input_ids=np.array(ids, dtype=np.int64), completion_mask=mask,
                old_log_probs=old, advantage=[1.0, -1.0][i % 2], model_version=versions[i], group_id=i // 2,
                metrics={"reward": float(i % 2)},
            )
        )  # fmt: skip
    return samples


def test_lag_of_each_sample_reaches_the_loss(tiny_model_dir, tmp_path, monkeypatch):
    """A short `train()` on queued samples: every weight sync bumps the model version, and the lag each micro-batch's
    loss sees is the version being trained minus the version that generated the sample, although the data loader
    packs each micro-batch one ahead (before the sync that precedes its training)."""
    from trl_bandpo.training.async_trainer import AsyncBandPOConfig, AsyncBandPOTrainer

    # 4 samples per micro-batch and step; versions chosen so that lags 0 to 3 all occur over 3 steps
    versions = [1, 0, 1, 1] + [2, 1, 0, 2] + [3, 0, 2, 1] + [3, 3, 3, 3] * 2
    trainer = _build(AsyncBandPOTrainer, AsyncBandPOConfig, tiny_model_dir, tmp_path,
                     samples=_rollout_samples(len(versions), versions, 60), max_steps=3, logging_steps=1,
                     learning_rate=1e-3, max_staleness=4)  # fmt: skip
    seen = []
    original = AsyncBandPOTrainer._sample_lags

    def spy(self, inputs):
        lags = original(self, inputs)
        seen.append((self.model_version, lags.tolist()))
        return lags

    monkeypatch.setattr(AsyncBandPOTrainer, "_sample_lags", spy)
    trainer.train()
    assert [version for version, _ in seen] == [1, 2, 3]  # the sync at train begin, then one per step
    for step, (version, lags) in enumerate(seen):  # each micro-batch: the next 4 samples of the queue (TRL's
        # planner may reorder them within the micro-batch, by group)
        assert sorted(lags) == sorted(version - v for v in versions[4 * step : 4 * step + 4])
    logs = [entry for entry in trainer.state.log_history if "staleness/lag_mean" in entry]
    assert len(logs) == 3
    for entry, (_, lags) in zip(logs, seen):
        assert entry["staleness/lag_mean"] == pytest.approx(sum(lags) / len(lags))
        assert entry["staleness/lag_max"] == max(lags)
        assert "trl_bandpo/model_version" not in entry  # the carrier key is not logged as a sample metric
        assert "reward" in entry  # TRL's per-sample metrics still are
    buckets = {
        bucket
        for entry in logs
        for bucket in ("0", "1", "2", "3+")
        if entry[f"clip_ratio_by_lag/{bucket}"] is not None
    }  # None: no token of that lag
    assert buckets == {"0", "1", "2", "3+"}
    shares = [entry[f"clip_ratio_by_lag/{bucket}"] for entry in logs for bucket in ("0", "1", "2", "3+")]
    assert all(0 <= share <= 1 for share in shares if share is not None)
    assert {"bounds/upper_mean", "clip_ratio/high_tail_share", "sample/staleness_mean"} <= set(logs[0])


def test_clip_share_by_lag_counts_by_hand(band_trainer):
    """`clip_ratio_by_lag/<bucket>`: tokens clipped (low with A < 0, high with A > 0, against the bounds in force)
    among the tokens of samples with that lag; `staleness/lag_mean` over samples."""
    from trl_bandpo.core.band import band_bounds
    from trl_bandpo.training.async_trainer import _LAG_KEY, _LAG_STEP_KEY

    trainer = band_trainer
    samples, batch = _with_old_log_probs(trainer, _samples(vocab=trainer.model.config.vocab_size), noise=1.0)
    sample_lags = torch.tensor([0.0, 1.0, 1.0, 2.0, 5.0, math.nan])  # the last: a sample without a version
    batch = dict(batch)
    batch[_LAG_KEY] = sample_lags.unsqueeze(0)
    batch[_LAG_STEP_KEY] = torch.tensor([float(trainer.state.global_step)])
    old, advantages = batch["old_log_probs"][0], batch["advantages"][0]
    ratio = torch.exp(_forward_log_probs(trainer, batch) - old)
    lower, upper = band_bounds(old, 0.05, "kl", upper_max=10.0)
    clipped = ((ratio < lower) & (advantages < 0)) | ((ratio > upper) & (advantages > 0))
    token_lag = sample_lags[batch["segment_id"][0]]
    _, _, metrics = _run(trainer, batch)
    for bucket, in_bucket in (("0", token_lag == 0), ("1", token_lag == 1), ("2", token_lag == 2),
                              ("3+", token_lag >= 3)):  # fmt: skip
        ((num, den),) = metrics[f"clip_ratio_by_lag/{bucket}"]
        assert (num, den) == ((clipped & in_bucket).sum().item(), in_bucket.sum().item())
    assert metrics["staleness/lag_mean"] == [(9.0, 5)]
    assert metrics["staleness/lag_max"] == [5.0]


# ------------------------------------------------------------------------------------------------------------------
# Configs and construction
# ------------------------------------------------------------------------------------------------------------------


def test_config_fields_are_policy_loss_configs(tmp_path):
    import dataclasses

    from trl.experimental.async_grpo import AsyncGRPOConfig

    from trl_bandpo import PolicyLossConfig
    from trl_bandpo.training.async_trainer import AsyncBandPOConfig, AsyncDGPOConfig, AsyncPolicyLossConfig
    from trl_bandpo.training.configs import _loss_fields

    ours = {f.name: f for f in dataclasses.fields(PolicyLossConfig)}
    added = {f.name: f for f in dataclasses.fields(AsyncPolicyLossConfig)}.keys() - {
        f.name for f in dataclasses.fields(AsyncGRPOConfig)
    }
    shared = {"policy_loss", "on_nonfinite"}
    assert added == (shared | _loss_fields()) - {f.name for f in dataclasses.fields(AsyncGRPOConfig)}
    for name in added:
        field = {f.name: f for f in dataclasses.fields(AsyncPolicyLossConfig)}[name]
        assert (field.default, field.metadata) == (ours[name].default, ours[name].metadata), name
    assert AsyncBandPOConfig(str(tmp_path), use_cpu=True).policy_loss == "band"
    assert AsyncDGPOConfig(str(tmp_path), use_cpu=True).policy_loss == "dgpo"
    assert AsyncPolicyLossConfig(str(tmp_path), use_cpu=True).accelerator_config.dispatch_batches  # TRL's post-init


@pytest.mark.parametrize(
    "settings,names",
    [
        (dict(band_radius=-0.1), ["band_radius"]),
        (dict(policy_loss="no_such_loss"), ["policy_loss"]),
        (dict(policy_loss="dgpo", delta=2.0), ["delta", "policy_loss"]),
        (dict(policy_loss="band", band_solver="triton"), ["band_solver"]),
        (dict(dgpo_n=0), ["dgpo_n"]),
    ],
)
def test_config_checks_are_policy_loss_configs(tmp_path, settings, names):
    from trl_bandpo.training.async_trainer import AsyncPolicyLossConfig

    with pytest.raises(ValueError) as error:
        AsyncPolicyLossConfig(str(tmp_path), use_cpu=True, **settings)
    for name in names:
        assert name in str(error.value)


def test_unused_field_warns(tmp_path):
    from trl_bandpo.training.async_trainer import AsyncBandPOConfig

    with pytest.warns(UserWarning, match="dgpo_m=3.0 has no effect with policy_loss='band'"):
        AsyncBandPOConfig(str(tmp_path), use_cpu=True, dgpo_m=3.0)


def test_a_plain_async_grpo_config_is_used_as_it_is(tiny_model_dir, tmp_path):
    from trl.experimental.async_grpo import AsyncGRPOConfig

    from trl_bandpo.training.async_trainer import AsyncDGPOConfig, AsyncDGPOTrainer

    trainer = _build(AsyncDGPOTrainer, AsyncGRPOConfig, tiny_model_dir, tmp_path, max_staleness=2)
    assert type(trainer.args) is AsyncGRPOConfig and not isinstance(trainer.args, AsyncDGPOConfig)
    assert trainer.args.max_staleness == 2 and trainer.policy_loss == "dgpo" and trainer.policy_args.dgpo_m == 2.0
    with pytest.raises(TypeError, match="needs an AsyncGRPOConfig"):
        from trl import GRPOConfig

        AsyncDGPOTrainer(model=tiny_model_dir, args=GRPOConfig(str(tmp_path), use_cpu=True))


def test_lazy_exports():
    import trl_bandpo
    from trl_bandpo.training import async_trainer

    for name in ("AsyncPolicyLossTrainer", "AsyncBandPOTrainer", "AsyncDGPOTrainer", "AsyncPolicyLossConfig",
                 "AsyncBandPOConfig", "AsyncDGPOConfig"):  # fmt: skip
        assert getattr(trl_bandpo, name) is getattr(async_trainer, name)


# ------------------------------------------------------------------------------------------------------------------
# The old policy is the rollout's: sampling settings that make its log-probs differ from the model's are refused
# ------------------------------------------------------------------------------------------------------------------

# (setting, the name=value the error must give): AsyncGRPOConfig's sampling fields (it has no generation_kwargs).
_ASYNC_DISTORTING = [
    (dict(top_p=0.8), "top_p=0.8"),
    (dict(top_k=20), "top_k=20"),
    (dict(min_p=0.05), "min_p=0.05"),
    (dict(repetition_penalty=1.2), "repetition_penalty=1.2"),
]


@pytest.mark.parametrize("settings,named", _ASYNC_DISTORTING, ids=[named for _, named in _ASYNC_DISTORTING])
def test_async_config_refuses_sampling_that_distorts_the_rollout_logps(tmp_path, settings, named):
    """The rollout worker sends these to vLLM, whose sampling log-probs are then renormalised over the kept tokens
    (or shifted): every ratio would start away from 1, and the async trainer has no trainer-side pass instead."""
    from trl_bandpo.training.async_trainer import AsyncBandPOConfig, AsyncDGPOConfig, AsyncPolicyLossConfig

    for config_class in (AsyncPolicyLossConfig, AsyncBandPOConfig, AsyncDGPOConfig):
        with pytest.raises(ValueError) as error:
            config_class(str(tmp_path), use_cpu=True, **settings)
        assert named in str(error.value) and "sample without them" in str(error.value)


def test_async_config_accepts_sampling_without_distortion(tmp_path):
    from trl_bandpo.training.async_trainer import AsyncBandPOConfig

    config = AsyncBandPOConfig(str(tmp_path), use_cpu=True, top_p=1.0, top_k=0, min_p=0.0, temperature=0.7)
    assert (config.top_p, config.top_k, config.min_p, config.temperature) == (1.0, 0, 0.0, 0.7)


def test_a_plain_async_grpo_config_with_top_p_is_refused_by_the_trainer(tiny_model_dir, tmp_path):
    """A project's own AsyncGRPOConfig (no fields of ours) goes through the same check when the trainer takes it."""
    from trl.experimental.async_grpo import AsyncGRPOConfig

    from trl_bandpo.training.async_trainer import AsyncBandPOTrainer

    with pytest.raises(ValueError, match=r"top_p=0\.8"):
        _build(AsyncBandPOTrainer, AsyncGRPOConfig, tiny_model_dir, tmp_path, top_p=0.8)


@pytest.mark.parametrize(
    "flags,named",
    [(["--top_p", "0.8"], "top_p=0.8"), (["--top_k", "20"], "top_k=20"), (["--min_p", "0.05"], "min_p=0.05")],
    ids=["top_p", "top_k", "min_p"],
)
def test_the_async_recipe_refuses_truncated_sampling(flags, named):
    from pathlib import Path

    from trl_bandpo.cli.recipe import ConfigError, parse_args

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "async" / "qwen2.5-3b-instruct_band-kl-0.05_async.yaml"
    argv = ["--config", str(recipe), "--use_cpu", "true"]
    assert parse_args(argv)[1].top_p == 1.0  # valid as it is
    with pytest.raises(ConfigError) as error:
        parse_args([*argv, *flags])
    assert named in str(error.value)

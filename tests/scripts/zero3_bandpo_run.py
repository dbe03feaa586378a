"""Run by tests/test_trainers.py and tests/test_multi_node.py under `accelerate launch` (2 CPU processes, DeepSpeed
ZeRO-3): a few BandPO steps; each rank writes its logged metrics to `<output_dir>/log_history_rank<k>.json`.
fsdp2_bandpo_run.py runs the same training (`train`) under FSDP2."""

import json
import os
import sys

from datasets import Dataset

from trl_bandpo import BandPOConfig, BandPOTrainer


def reward(completions, answer, **kwargs):
    return [float(c.strip().startswith(a)) + 0.05 * len(c) for c, a in zip(completions, answer)]


def train(model_dir, output_dir, callbacks=(), **overrides):
    """Two BandPO steps on a 16-prompt addition set (this run's settings, `overrides` on top, `callbacks` added to
    the trainer's); the trainer."""
    dataset = Dataset.from_list([{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(4) for b in range(4)])
    settings = dict(
        output_dir=output_dir, per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
        num_iterations=2, max_steps=2, learning_rate=5e-2, epsilon=0.05, logging_steps=1, report_to="none",
        save_strategy="no", seed=0, use_cpu=True,
    )  # fmt: skip
    args = BandPOConfig(**{**settings, **overrides})  # an override may replace a setting (save_strategy, ...)
    trainer = BandPOTrainer(
        model=model_dir, reward_funcs=reward, args=args, train_dataset=dataset, callbacks=list(callbacks) or None
    )
    trainer.train()
    return trainer


def main(model_dir, output_dir):
    trainer = train(model_dir, output_dir)
    rank = trainer.accelerator.process_index
    with open(os.path.join(output_dir, f"log_history_rank{rank}.json"), "w") as f:
        json.dump(
            {
                "log_history": trainer.state.log_history,
                "world": trainer.accelerator.num_processes,
                "deepspeed": trainer.is_deepspeed_enabled,
            },
            f,
        )
    # Destroy the process group, then leave without the interpreter's teardown: a torch/DeepSpeed thread destroyed at
    # exit can abort a rank ("terminate called without an active exception") after all its work is done and written.
    trainer.end()
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:3])

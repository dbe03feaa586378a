"""Run by tests/test_extensions.py under `accelerate launch` (2 CPU processes): BandPO with dynamic sampling, where
every prompt whose first operand is even gets the same reward for all its completions (a group with no signal).
Each rank writes what its training batches held to `<output_dir>/dynamic_sampling_rank<k>.json`."""

import json
import os
import sys

from datasets import Dataset

from trl_bandpo import BandPOConfig, BandPOTrainer
from trl_bandpo.training.dynamic_sampling import group_has_signal


def reward(completions, prompts, **kwargs):
    # even first operand: constant reward (zero spread); odd: varies with the completion's text
    return [1.0 if int(p.split("+")[0]) % 2 == 0 else sum(map(ord, c)) % 7 / 7 for c, p in zip(completions, prompts)]


class RecordingTrainer(BandPOTrainer):
    batches, outputs = [], []

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.model.training:
            signal = group_has_signal(output["advantages"], self.num_generations).tolist()
            RecordingTrainer.batches.append(
                {
                    "signal": signal,
                    "rows": int(output["completion_ids"].shape[0]),
                    "items": float(output["num_items_in_batch"]),
                    "tokens": float(output["completion_mask"].sum()),
                }
            )
            RecordingTrainer.outputs.append(output)
        return output


def main(model_dir, output_dir):
    dataset = Dataset.from_list([{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(8) for b in range(4)])
    args = BandPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_generations=4,
        max_completion_length=6,
        num_iterations=1,
        max_steps=4,
        learning_rate=5e-2,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
        use_cpu=True,
        dynamic_sampling=True,
        dynamic_sampling_max_rounds=6,
    )
    trainer = RecordingTrainer(model=model_dir, reward_funcs=reward, args=args, train_dataset=dataset)
    trainer.train()
    rank = trainer.accelerator.process_index
    with open(os.path.join(output_dir, f"dynamic_sampling_rank{rank}.json"), "w") as f:
        json.dump(
            {
                "batches": RecordingTrainer.batches,
                "log_history": trainer.state.log_history,
                "world": trainer.accelerator.num_processes,
            },
            f,
        )
    # Destroy the process group, then leave without the interpreter's teardown: a torch/DeepSpeed thread destroyed at
    # exit can abort a rank ("terminate called without an active exception") after all its work is done and written.
    trainer.end()
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:3])

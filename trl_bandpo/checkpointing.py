"""Resuming inside a generation batch: the buffered batch is part of a checkpoint (docs/training.md, "Resuming").

GRPOTrainer generates a batch once and trains on it for `steps_per_generation x num_iterations` micro-steps, from a
buffer that checkpoints do not hold: a run resumed between two of those updates regenerates at once and skips the
remaining passes over the old batch. `GenerationBufferCheckpointing` saves the buffer and the micro-step counter that
indexes it with every checkpoint, one file per process, and restores both on resume, so a resumed run equals the
uninterrupted one.
"""

from __future__ import annotations

import os
import warnings

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

__all__ = ["BUFFER_FILE", "GenerationBufferCheckpointing"]

#: Per-process file of a checkpoint holding the generation batch still being trained on.
BUFFER_FILE = "generation_buffer_rank{rank}.pt"


class GenerationBufferCheckpointing:
    """Mixin for `GRPOTrainer` subclasses (it uses TRL's `_step` and `_buffered_inputs`)."""

    def _save_checkpoint(self, model, trial):
        # The buffered generation batch (and the micro-step counter that indexes it) is part of the training state:
        # without it a run resumed between two updates on the same batch would regenerate at once and skip the
        # remaining passes over the old one (GRPOTrainer does). Written before the rest of the checkpoint, so a
        # checkpoint with a trainer_state.json has its buffer; atomically, so a killed process leaves no half file.
        folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        output_dir = os.path.join(self._get_output_dir(trial=trial), folder)
        os.makedirs(output_dir, exist_ok=True)
        path = os.path.join(output_dir, BUFFER_FILE.format(rank=self.accelerator.process_index))
        torch.save({"step": self._step, "buffered_inputs": self._buffered_inputs}, path + ".tmp")
        os.replace(path + ".tmp", path)
        super()._save_checkpoint(model, trial)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, BUFFER_FILE.format(rank=self.accelerator.process_index))
        generate_every = self.args.steps_per_generation * self.num_iterations
        step = self.state.global_step * self.args.gradient_accumulation_steps
        if os.path.exists(path):
            # Our own file, written by _save_checkpoint above: tensors and Python containers (not weights only).
            state = torch.load(path, map_location=self.accelerator.device, weights_only=False)
            self._step, self._buffered_inputs = state["step"], state["buffered_inputs"]
        elif step % generate_every != 0:
            warnings.warn(
                f"{checkpoint} was saved inside a generation batch but holds no {BUFFER_FILE.format(rank='<k>')} "
                "(a GRPOTrainer checkpoint, or another number of processes): the resumed run regenerates at once and "
                "skips the remaining updates on the old batch, so it will not match an uninterrupted run.",
                UserWarning,
                stacklevel=2,
            )

"""Resuming inside a generation batch (docs/training.md, "Resuming"): every checkpoint holds, one file per process,
GRPOTrainer's buffered generation batch, the micro-step counter that indexes it, dynamic sampling's random state and
the settings the batch was made under, so a resumed run equals the uninterrupted one. The file holds only tensors and
plain containers (read with `weights_only=True`); under other settings the batch is not replayed, with a warning.
"""

from __future__ import annotations

import os
import pickle
import warnings

import torch
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..core.checks import shown

#: Per-process file of a checkpoint holding the generation batch still being trained on.
BUFFER_FILE = "generation_buffer_rank{rank}.pt"


def last_complete_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The newest `checkpoint-N` folder of `output_dir` that holds a `trainer_state.json` (None if there is none);
    newer folders without one (interrupted saves) are skipped with a warning naming each."""
    steps = {}
    for name in os.listdir(output_dir) if os.path.isdir(output_dir) else ():
        prefix, _, step = name.partition("-")
        if prefix == PREFIX_CHECKPOINT_DIR and step.isdigit() and os.path.isdir(os.path.join(output_dir, name)):
            steps[int(step)] = os.path.join(output_dir, name)
    for step in sorted(steps, reverse=True):
        if os.path.isfile(os.path.join(steps[step], TRAINER_STATE_NAME)):
            return steps[step]
        warnings.warn(
            f"skipping {steps[step]}: it has no {TRAINER_STATE_NAME} (its save was interrupted); resuming from the "
            "newest complete checkpoint instead.",
            UserWarning,
            stacklevel=3,
        )
    return None


def check_checkpoint(path: str | os.PathLike) -> None:
    """ValueError naming `resume_from_checkpoint` unless `path` is a checkpoint folder whose save completed (its
    `trainer_state.json`, written last, is there)."""
    if not os.path.isfile(os.path.join(path, TRAINER_STATE_NAME)):
        why = f"has no {TRAINER_STATE_NAME}: its save was interrupted" if os.path.isdir(path) else "is no folder"
        raise ValueError(
            f"resume_from_checkpoint: {os.fspath(path)!r} {why}, so it is no checkpoint folder to resume from. Resume "
            "from a complete checkpoint (resume_from_checkpoint=True: the newest one of output_dir)."
        )


#: The TRL settings a buffered generation batch depends on: how it is split into micro-batches and reused; how its
#: completions were sampled and its old log-probs computed (the trainer divides the logits by the temperature); how
#: its advantages were computed from the rewards; the reference log-probs and vLLM's correction.
_TRL_SETTINGS = ("per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
                 "num_iterations", "num_generations", "generation_batch_size", "max_completion_length",
                 "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "generation_kwargs",
                 "vllm_structured_outputs_regex", "chat_template_kwargs", "mask_truncated_completions",
                 "max_tool_calling_iterations", "cast_lm_head_to_fp32",
                 "reward_weights", "multi_objective_aggregation", "scale_rewards",
                 "beta", "use_vllm", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
                 "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max", "loss_type")  # fmt: skip
#: Ours: the policy loss whose bounds are buffered, and what they are computed from.
_OWN_SETTINGS = ("policy_loss", "band_radius_by", "band_radius_exponent", "band_radius_min", "band_radius_max",
                 "old_logps_source", "dynamic_sampling")  # fmt: skip


def buffer_settings(trainer) -> dict:
    """The settings a trainer's buffered generation batch depends on, as plain values (saved with it)."""
    settings = {name: getattr(trainer.args, name, None) for name in _TRL_SETTINGS}
    settings.update({name: getattr(trainer.policy_args, name, None) for name in _OWN_SETTINGS})
    kwargs = {**trainer._policy_bound_kwargs, **trainer._policy_loss_kwargs}
    settings.update({f"{trainer.policy_loss}.{key}": value for key, value in kwargs.items() if not callable(value)})
    return {key: value if isinstance(value, (bool, int, float, str, type(None))) else repr(value)
            for key, value in settings.items()}  # fmt: skip


class GenerationBufferCheckpointing:
    """Mixin for `GRPOTrainer` subclasses (it uses TRL's `_step` and `_buffered_inputs`)."""

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if resume_from_checkpoint is True:
            checkpoint = last_complete_checkpoint(self.args.output_dir)
            if checkpoint is None:
                raise ValueError(
                    f"resume_from_checkpoint=True, but {self.args.output_dir} holds no complete checkpoint (a "
                    f"{PREFIX_CHECKPOINT_DIR}-N folder with a {TRAINER_STATE_NAME})."
                )
            resume_from_checkpoint = checkpoint
        elif resume_from_checkpoint:  # before Trainer reads the weights, then fails on the missing state
            check_checkpoint(resume_from_checkpoint)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _buffer_path(self, folder) -> str:
        return os.path.join(folder, BUFFER_FILE.format(rank=self.accelerator.process_index))

    def _save_rng_state(self, output_dir):
        # Called by `Trainer._save_checkpoint` after the model and optimizer, before trainer_state.json: our file is
        # never the first thing in a checkpoint folder, and a checkpoint with a trainer_state.json has it.
        super()._save_rng_state(output_dir)
        generator = getattr(self, "_extra_prompt_generator", None)  # dynamic sampling's extra prompts
        state = {
            "step": self._step,
            "buffered_inputs": self._buffered_inputs,
            "extra_prompt_rng": None if generator is None else generator.get_state(),
            "settings": buffer_settings(self),
        }
        path = self._buffer_path(output_dir)
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = self._buffer_path(checkpoint)
        generate_every = self.args.steps_per_generation * self.num_iterations
        step = self.state.global_step * self.args.gradient_accumulation_steps
        if os.path.exists(path):
            state, current = _load_buffer(path, self.accelerator.device), buffer_settings(self)
            changed = {
                key: (value, now)
                for key, value in state["settings"].items()
                if (now := current.get(key, "<absent>")) != value
            }
            if changed:  # before the micro-step: a changed gradient_accumulation_steps moves it
                warnings.warn(
                    f"{checkpoint} holds a generation batch made under other settings ("
                    + ", ".join(f"{key}: {old!r} then, {new!r} now" for key, (old, new) in changed.items())
                    + "): it is not replayed; the resumed run generates a new batch at once, so it will not match an "
                    "uninterrupted run. Resume with the saved settings to replay it.",
                    UserWarning,
                    stacklevel=2,
                )
                return
            if state["step"] != step:
                raise _damaged(path, f"its micro-step {state['step']!r} is not the checkpoint's {step}")
            batches, expected = state["buffered_inputs"], self.args.steps_per_generation  # TRL indexes them by step
            if len(batches) != expected:
                raise _damaged(path, f"it holds {len(batches)} buffered batches, not steps_per_generation={expected}")
            vocabulary = self.model.get_input_embeddings().num_embeddings  # the rows of the embedding ids index
            for index, batch in enumerate(batches):
                problem = _batch_problem(batch, vocabulary)
                if problem is not None:
                    raise _damaged(path, f"its buffered batch {index} {problem}")
            self._step, self._buffered_inputs = state["step"], batches
            if state["extra_prompt_rng"] is not None:  # loaded onto the device; a Generator's state lives on the CPU
                self._extra_prompt_generator = torch.Generator()
                self._extra_prompt_generator.set_state(state["extra_prompt_rng"].cpu())
        elif step % generate_every != 0:
            warnings.warn(
                f"{checkpoint} was saved inside a generation batch but holds no {BUFFER_FILE.format(rank='<k>')} "
                "(a GRPOTrainer checkpoint, or another number of processes): the resumed run regenerates at once and "
                "skips the remaining updates on the old batch, so it will not match an uninterrupted run.",
                UserWarning,
                stacklevel=2,
            )


def _damaged(path: str, why: str) -> ValueError:
    return ValueError(
        f"cannot read {path}: the file is truncated or damaged, or is no generation-buffer file of this checkpoint "
        f"({why}). Resume from an earlier checkpoint, or delete this file to resume without the buffered batch (the "
        "run then regenerates at once)."
    )


def _load_buffer(path: str, device) -> dict:
    """The saved state, read without executing anything (tensors and plain containers only) and checked to be a
    generation-buffer file: its keys and their types."""
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as error:
        raise ValueError(
            f"refusing to load {path}: it holds objects other than tensors and plain containers, so it was not "
            f"written by trl-bandpo and loading it could run code ({error})."
        ) from None
    except (RuntimeError, EOFError, OSError) as error:
        raise _damaged(path, f"{type(error).__name__}: {error}") from None
    keys = {"step", "buffered_inputs", "extra_prompt_rng", "settings"}
    if not isinstance(state, dict) or set(state) != keys:
        found = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise _damaged(path, f"it holds {found}, not the keys {sorted(keys)}")
    if not isinstance(state["settings"], dict) or not isinstance(state["step"], int):
        raise _damaged(path, "its settings or micro-step are of the wrong type")
    batches, rng = state["buffered_inputs"], state["extra_prompt_rng"]
    if not isinstance(batches, list) or not all(isinstance(batch, dict) for batch in batches):
        raise _damaged(path, "its buffered batch is not a list of batches")
    want = torch.Generator().get_state()  # a CPU generator's state: uint8, of one length
    got = (rng.dtype, tuple(rng.shape)) if torch.is_tensor(rng) else rng
    if rng is not None and got != (want.dtype, tuple(want.shape)):
        raise _damaged(
            path, f"its extra_prompt_rng is no generator state ({want.dtype}, {tuple(want.shape)}; got {got})"
        )
    return state


#: The per-token tensors a buffered batch may hold, each shaped like its `completion_ids`.
_PER_TOKEN_KEYS = ("completion_mask", "old_per_token_logps", "ref_per_token_logps", "sampling_per_token_logps",
                   "tool_mask", "policy_lower_bound", "policy_upper_bound")  # fmt: skip


def _batch_problem(batch: dict, vocabulary: int) -> str | None:
    """What makes a buffered batch unusable, or None: tensors of the wrong shape or type, token ids outside
    [0, `vocabulary`), advantages that are not all finite, old log-probs that are not finite at every completion
    token (the first step would train on them)."""
    ids = batch.get("completion_ids")
    if not torch.is_tensor(ids) or ids.dim() != 2:
        return f"has no completion_ids of shape (B, T) (got {shown(ids)})"
    for key in ("prompt_ids", "prompt_mask"):
        if not torch.is_tensor(batch.get(key)) or batch[key].dim() != 2 or len(batch[key]) != len(ids):
            return f"has a {key} that is no (B, P) tensor with B = {len(ids)} (got {shown(batch.get(key))})"
    for key in ("prompt_ids", "completion_ids"):  # an id past the embedding fails inside it (on CUDA: device assert)
        if batch[key].dtype != torch.long or bool(((batch[key] < 0) | (batch[key] >= vocabulary)).any()):
            return f"has {key} that are no token ids of the model (int64 in [0, {vocabulary}))"
    for key in _PER_TOKEN_KEYS:
        if key in batch and (not torch.is_tensor(batch[key]) or batch[key].shape != ids.shape):
            return f"has a {key} not shaped like completion_ids {tuple(ids.shape)} (got {shown(batch[key])})"
    advantages = batch.get("advantages")
    if not torch.is_tensor(advantages) or not advantages.is_floating_point() or advantages.shape[:1] != ids.shape[:1]:
        return f"has no floating advantages with one row per completion (got {shown(advantages)})"
    if not bool(torch.isfinite(advantages).all()):
        return "has advantages that are not all finite"
    old = batch.get("old_per_token_logps")
    if old is not None:
        counted = batch["completion_mask"] * batch.get("tool_mask", 1) > 0 if "completion_mask" in batch else True
        if not old.is_floating_point() or not bool(torch.isfinite(old)[counted].all()):
            return "has old_per_token_logps that are not finite at every completion token"
    return None

"""Checkpoints of our trainers (docs/training.md, "Resuming"): a run resumed inside a generation batch, with or without
dynamic sampling, ends bitwise where the uninterrupted run ends; the generation-buffer file is read without executing
anything, a damaged one is a clear error, and an interrupted save is skipped when resuming."""

from __future__ import annotations

import os
import re
import shutil

import pytest
import torch
from test_trainers import addition_dataset, shaped_reward, train_args
from transformers import TrainerCallback
from transformers.trainer_callback import TrainerState

import trl_bandpo.training.checkpointing
from trl_bandpo import BandPOConfig, BandPOTrainer

BUFFER = "generation_buffer_rank0.pt"


class _StopAfterFirstStep(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            control.should_save = True
            control.should_training_stop = True


def _resume_run(model, output_dir, **overrides):
    args = train_args(BandPOConfig, output_dir, max_steps=6, save_strategy="steps", save_steps=1000, **overrides)
    return BandPOTrainer(model=model, reward_funcs=shaped_reward, args=args, train_dataset=addition_dataset())


def test_resume_inside_a_generation_batch_equals_the_uninterrupted_run(tiny_model_dir, tmp_path):
    """num_iterations=2: the checkpoint after step 1 lies inside a generation batch (one more update on it is due).
    Resumed from it, the run ends on exactly (bitwise) the parameters of the uninterrupted run; without the saved
    buffer it regenerates at once, warns, and ends elsewhere."""
    full = _resume_run(tiny_model_dir, tmp_path / "full")
    full.train()
    want = {name: p.detach().clone() for name, p in full.model.named_parameters()}

    first = _resume_run(tiny_model_dir, tmp_path / "split")
    first.add_callback(_StopAfterFirstStep())
    first.train()
    checkpoint = tmp_path / "split" / "checkpoint-1"
    assert (checkpoint / "generation_buffer_rank0.pt").exists()
    resumed = _resume_run(tiny_model_dir, tmp_path / "split")
    resumed.train(resume_from_checkpoint=str(checkpoint))
    got = dict(resumed.model.named_parameters())
    assert all(torch.equal(want[name], got[name].detach()) for name in want)

    (checkpoint / "generation_buffer_rank0.pt").unlink()
    blind = _resume_run(tiny_model_dir, tmp_path / "split")
    with pytest.warns(UserWarning, match="inside a generation batch"):
        blind.train(resume_from_checkpoint=str(checkpoint))
    moved = dict(blind.model.named_parameters())
    assert any(not torch.equal(want[name], moved[name].detach()) for name in want)


# --- dynamic sampling: the random state that draws extra prompts is part of the checkpoint -----------------------


def _signal_only_for_odd_operands(completions, prompts, **kwargs):
    # even first operand: the same reward for every completion (a group dynamic sampling drops); odd: varies
    return [1.0 if int(p.split("+")[0]) % 2 == 0 else 0.05 * len(c) for c, p in zip(completions, prompts)]


def _dynamic_run(model, output_dir, **overrides):
    args = train_args(
        BandPOConfig, output_dir, max_steps=6, save_strategy="steps", save_steps=1000, dynamic_sampling=True,
        dynamic_sampling_max_rounds=2, **overrides,
    )  # fmt: skip
    return BandPOTrainer(
        model=model, reward_funcs=_signal_only_for_odd_operands, args=args, train_dataset=addition_dataset()
    )


def test_resume_with_dynamic_sampling_equals_the_uninterrupted_run(tiny_model_dir, tmp_path):
    full = _dynamic_run(tiny_model_dir, tmp_path / "full")
    full.train()
    assert any(e.get("dynamic_sampling/rounds", 1) > 1 for e in full.state.log_history)  # extra prompts were drawn
    want = {name: p.detach().clone() for name, p in full.model.named_parameters()}

    first = _dynamic_run(tiny_model_dir, tmp_path / "split")
    first.add_callback(_StopAfterFirstStep())
    first.train()
    resumed = _dynamic_run(tiny_model_dir, tmp_path / "split")
    resumed.train(resume_from_checkpoint=str(tmp_path / "split" / "checkpoint-1"))
    got = dict(resumed.model.named_parameters())
    assert all(torch.equal(want[name], got[name].detach()) for name in want)


@pytest.mark.gpu
def test_resume_with_dynamic_sampling_on_cuda(tiny_model_dir, tmp_path):
    """The buffer file is loaded onto the trainer's device, and a generator's state must be a CPU tensor: before,
    resuming on CUDA failed with TypeError "RNG state must be a torch.ByteTensor"."""
    first = _dynamic_run(tiny_model_dir, tmp_path, use_cpu=False)
    first.add_callback(_StopAfterFirstStep())
    first.train()
    resumed = _dynamic_run(tiny_model_dir, tmp_path, use_cpu=False)
    assert resumed.accelerator.device.type == "cuda"
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    assert resumed.state.global_step == 6


# --- the buffer file: never executed, damage named, interrupted saves skipped ------------------------------------


@pytest.fixture(scope="module")
def saved_checkpoint(tiny_model_dir, tmp_path_factory):
    """A run stopped after step 1 (inside a generation batch), and the uninterrupted run's final parameters."""
    root = tmp_path_factory.mktemp("saved")
    full = _resume_run(tiny_model_dir, root / "full")
    full.train()
    want = {name: p.detach().clone() for name, p in full.model.named_parameters()}
    first = _resume_run(tiny_model_dir, root / "split")
    first.add_callback(_StopAfterFirstStep())
    first.train()
    return root / "split", want


def _copy(saved_checkpoint, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(saved_checkpoint[0], run_dir)
    return run_dir


class _RunsCode:
    """Unpickling this calls `open(path, "w")`: a stand-in for any code a crafted file could run."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_buffer_file_that_would_run_code_is_refused(tiny_model_dir, saved_checkpoint, tmp_path):
    run_dir = _copy(saved_checkpoint, tmp_path)
    marker = tmp_path / "code_ran"
    torch.save({"step": 1, "buffered_inputs": [_RunsCode(str(marker))]}, run_dir / "checkpoint-1" / BUFFER)
    resumed = _resume_run(tiny_model_dir, run_dir)
    with pytest.raises(ValueError, match="refusing to load .*" + BUFFER):
        resumed.train(resume_from_checkpoint=str(run_dir / "checkpoint-1"))
    assert not marker.exists()


def test_a_truncated_buffer_file_is_a_clear_error(tiny_model_dir, saved_checkpoint, tmp_path):
    run_dir = _copy(saved_checkpoint, tmp_path)
    path = run_dir / "checkpoint-1" / BUFFER
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    resumed = _resume_run(tiny_model_dir, run_dir)
    with pytest.raises(ValueError, match="truncated or damaged"):
        resumed.train(resume_from_checkpoint=str(run_dir / "checkpoint-1"))


def test_an_interrupted_save_is_skipped_on_resume(tiny_model_dir, saved_checkpoint, tmp_path, monkeypatch):
    """Ctrl-C while checkpoint-2 is saved: our file is written after the model, the folder has no trainer_state.json,
    and `resume_from_checkpoint=True` warns that it skips checkpoint-2 and resumes from checkpoint-1, ending on the
    uninterrupted run's parameters."""
    run_dir = _copy(saved_checkpoint, tmp_path)
    contents_when_written = []
    real_save, real_state_save = torch.save, TrainerState.save_to_json

    def recording_save(obj, path, *args, **kwargs):
        contents_when_written.append(sorted(os.listdir(os.path.dirname(path))))
        return real_save(obj, path, *args, **kwargs)

    def interrupted(self, path):
        if "checkpoint-2" in str(path):
            raise KeyboardInterrupt
        return real_state_save(self, path)

    monkeypatch.setattr(trl_bandpo.training.checkpointing.torch, "save", recording_save)
    monkeypatch.setattr(TrainerState, "save_to_json", interrupted)
    interrupted_run = _resume_run(tiny_model_dir, run_dir)
    interrupted_run.add_callback(_SaveAtStep(2))
    with pytest.raises(KeyboardInterrupt):
        interrupted_run.train(resume_from_checkpoint=str(run_dir / "checkpoint-1"))
    monkeypatch.undo()
    interrupted_folder = run_dir / "checkpoint-2"
    assert (interrupted_folder / BUFFER).exists() and not (interrupted_folder / "trainer_state.json").exists()
    assert contents_when_written and all("model.safetensors" in names for names in contents_when_written)

    resumed = _resume_run(tiny_model_dir, run_dir)
    with pytest.warns(UserWarning, match="skipping .*checkpoint-2"):
        resumed.train(resume_from_checkpoint=True)
    got = dict(resumed.model.named_parameters())
    want = saved_checkpoint[1]
    assert all(torch.equal(want[name], got[name].detach()) for name in want)


class _SaveAtStep(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_save = True


def test_resume_true_without_a_complete_checkpoint_says_so(tiny_model_dir, tmp_path):
    (tmp_path / "checkpoint-3").mkdir()
    trainer = _resume_run(tiny_model_dir, tmp_path)
    with pytest.warns(UserWarning, match="checkpoint-3"), pytest.raises(ValueError, match="no complete checkpoint"):
        trainer.train(resume_from_checkpoint=True)


# --- resuming under other settings: the buffer is not replayed; a foreign file is refused -------------------------


@pytest.mark.parametrize(
    "changed, named",
    [
        (dict(policy_loss="dgpo"), "policy_loss: 'band' then, 'dgpo' now"),
        (dict(steps_per_generation=4), "steps_per_generation: 2 then, 4 now"),
        (dict(band_radius=0.1), "band.radius: 0.05 then, 0.1 now"),
    ],
)
def test_a_buffer_made_under_other_settings_is_not_replayed(
    tiny_model_dir, saved_checkpoint, tmp_path, changed, named
):
    """band -> dgpo would feed the buffered Band bounds to the DGPO loss; 2 -> 4 steps per generation indexed past the
    buffered micro-batches (an IndexError after the model loaded). Both now regenerate, naming what changed."""
    run_dir = _copy(saved_checkpoint, tmp_path)
    resumed = _resume_run(tiny_model_dir, run_dir, **changed)
    with pytest.warns(UserWarning, match="made under other settings.*" + named.replace("(", r"\(")):
        resumed.train(resume_from_checkpoint=str(run_dir / "checkpoint-1"))
    assert resumed.state.global_step == resumed.args.max_steps


@pytest.mark.parametrize(
    "content, needle",
    [
        (lambda state: {**state, "extra": 1}, "not the keys"),
        (lambda state: {key: value for key, value in state.items() if key != "settings"}, "not the keys"),
        (lambda state: {**state, "step": state["step"] + 3}, "micro-step 5 is not the checkpoint's 2"),
        (lambda state: {**state, "buffered_inputs": "batch"}, "not a list of batches"),
        (lambda state: [state], "it holds list"),
    ],
    ids=["extra-key", "missing-key", "other-step", "not-batches", "not-a-dict"],
)
def test_a_foreign_buffer_file_is_a_named_error(tiny_model_dir, saved_checkpoint, tmp_path, content, needle):
    run_dir = _copy(saved_checkpoint, tmp_path)
    path = run_dir / "checkpoint-1" / BUFFER
    torch.save(content(torch.load(path, weights_only=True)), path)
    resumed = _resume_run(tiny_model_dir, run_dir)
    with pytest.raises(ValueError, match=f"cannot read .*{BUFFER}.*{needle}"):
        resumed.train(resume_from_checkpoint=str(run_dir / "checkpoint-1"))


# --- buffers that no run writes, and a checkpoint whose save was interrupted: named before any step ---------------


def _vocabulary(model_dir) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir).vocab_size  # the tiny model's embedding has one row per token


def _set_id(state, batch, key, value):
    state["buffered_inputs"][batch][key][0, 0] = value


@pytest.mark.parametrize(
    "edit, needle",
    [
        # before: an IndexError at the first step (TRL indexes the list by micro-step)
        (lambda state, vocab: state.update(buffered_inputs=[]), "it holds 0 buffered batches, not "
         "steps_per_generation=2"),
        # before: read as two batches, then a TypeError inside TRL's step
        (lambda state, vocab: state.update(buffered_inputs=[None, None]), "not a list of batches"),
        # before: an IndexError inside the embedding (on CUDA a device-side assert)
        (lambda state, vocab: _set_id(state, 1, "completion_ids", vocab), "batch 1 has completion_ids that are no "
         "token ids of the model (int64 in [0, {vocab}))"),
        (lambda state, vocab: _set_id(state, 0, "prompt_ids", -1), "batch 0 has prompt_ids that are no token ids"),
        # before: torch's RuntimeError "Expected a CPUGeneratorImplState of size 5056" from set_state
        (lambda state, vocab: state.update(extra_prompt_rng=torch.zeros(10, dtype=torch.uint8)),
         "extra_prompt_rng is no generator state (torch.uint8, (5056,); got (torch.uint8, (10,)))"),
    ],
    ids=["no-batches", "none-batches", "id-past-vocabulary", "negative-id", "rng-length"],
)  # fmt: skip
def test_a_buffer_no_run_writes_is_a_named_error(tiny_model_dir, saved_checkpoint, tmp_path, edit, needle):
    run_dir = _copy(saved_checkpoint, tmp_path)
    path = run_dir / "checkpoint-1" / BUFFER
    state = torch.load(path, weights_only=True)
    edit(state, _vocabulary(tiny_model_dir))
    torch.save(state, path)
    resumed = _resume_run(tiny_model_dir, run_dir)
    needle = needle.replace("{vocab}", str(_vocabulary(tiny_model_dir)))
    with pytest.raises(ValueError, match=f"cannot read .*{BUFFER}.*{re.escape(needle)}"):
        resumed.train(resume_from_checkpoint=str(run_dir / "checkpoint-1"))
    assert resumed.state.global_step == 1  # refused at load: no step ran


def test_resuming_from_an_interrupted_checkpoint_is_refused_before_its_weights_load(
    tiny_model_dir, saved_checkpoint, tmp_path
):
    """A checkpoint folder without trainer_state.json (written last: its save was interrupted). Before: Trainer
    loaded its weights into the model, then failed with FileNotFoundError on the missing state."""
    run_dir = _copy(saved_checkpoint, tmp_path)
    (run_dir / "checkpoint-1" / "trainer_state.json").unlink()
    resumed = _resume_run(tiny_model_dir, run_dir)
    before = {name: p.detach().clone() for name, p in resumed.model.named_parameters()}
    with pytest.raises(ValueError, match=r"^resume_from_checkpoint: '.*checkpoint-1' has no trainer_state.json: its "
                       r"save was interrupted, so it is no checkpoint folder to resume from\."):  # fmt: skip
        resumed.train(resume_from_checkpoint=str(run_dir / "checkpoint-1"))
    assert all(torch.equal(before[name], p.detach()) for name, p in resumed.model.named_parameters())

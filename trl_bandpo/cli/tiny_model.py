"""`trl-bandpo tiny-model PATH`: a tiny local model and a few problems, and the command that runs any recipe with
them on a CPU, offline, in about a minute (docs/training.md, "Run a recipe on CPU").

The model is `trl_bandpo.demo.tiny_model.save_tiny_model`'s (a randomly initialised Qwen2 of 512 positions with a
byte-level tokenizer): it tests the plumbing of a recipe (data, reward, policy loss, logging, saving), not what the
recipe learns. `CPU_OVERRIDES` turn any recipe into a two-step CPU run: no GPU, bf16, vLLM or validation
benchmarks, and batch sizes and a completion length that the tiny model handles in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
from collections.abc import Sequence
from pathlib import Path

__all__ = ["CPU_OVERRIDES", "PROBLEMS_FILE", "cpu_train_command", "tiny_model_main", "write_problems"]

#: The problems file written next to the model.
PROBLEMS_FILE = "problems.jsonl"
#: Overrides that run any recipe on a CPU with the tiny model: 4 prompts x 4 samples per generation batch, 2
#: optimizer steps of 8 completions (the second off-policy, so the bounds act), 32-token completions.
CPU_OVERRIDES = (
    "--use_cpu", "true", "--bf16", "false", "--dtype", "float32", "--use_vllm", "false",
    "--gradient_checkpointing", "false", "--num_generations", "4", "--per_device_train_batch_size", "4",
    "--gradient_accumulation_steps", "2", "--generation_batch_size", "16", "--max_completion_length", "32",
    "--max_steps", "2", "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none",
    "--val_preset", "none",
)  # fmt: skip


def cpu_train_command(path: str | os.PathLike, recipe: str = "RECIPE") -> str:
    """The shell command that trains `recipe` on a CPU, offline, with the tiny model and problems in `path`."""
    path = os.fspath(path).rstrip("/") or "/"
    args = [
        "--config", recipe, "--model_name_or_path", path, "--dataset_name", os.path.join(path, PROBLEMS_FILE),
        "--output_dir", os.path.join(path, "run"), *CPU_OVERRIDES,
    ]  # fmt: skip
    return "HF_HUB_OFFLINE=1 trl-bandpo train " + " ".join(shlex.quote(arg) for arg in args)


def write_problems(path: str | os.PathLike, count: int = 16) -> Path:
    """Write `count` addition problems (``problem``, ``answer``) as JSON Lines to `path`; returns it."""
    path = Path(path)
    rows = [{"problem": f"What is {a} + {a + 1}?", "answer": 2 * a + 1} for a in range(count)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def build_parser() -> argparse.ArgumentParser:
    """The `trl-bandpo tiny-model` argument parser."""
    parser = argparse.ArgumentParser(
        prog="trl-bandpo tiny-model",
        description=(
            "Save a tiny Qwen2 (random weights, 512 positions) and 16 addition problems to PATH, and print the "
            "command that runs any recipe with them on a CPU, offline, in about a minute."
        ),
    )
    parser.add_argument("path", metavar="PATH", help="folder for the model, its tokenizer and problems.jsonl")
    return parser


def tiny_model_main(argv: Sequence[str] | None = None) -> None:
    """Build the tiny model and problems in PATH and print the CPU training command; exits 2 on a bad PATH."""
    parser = build_parser()
    args = parser.parse_args(argv)
    target = Path(args.path).expanduser()
    if not str(args.path).strip():
        parser.error("PATH is empty: give the folder to write the tiny model to.")
    if target.exists() and not target.is_dir():
        parser.error(f"PATH {args.path!r} exists and is not a folder.")

    from transformers.utils import logging as transformers_logging

    from ..demo.tiny_model import save_tiny_model
    from ..training.library_noise import library_noise_filtered

    bars = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()  # a bar for writing a 1 MB file is noise
    try:
        with library_noise_filtered():
            save_tiny_model(target)
    finally:
        if bars:
            transformers_logging.enable_progress_bar()
    write_problems(target / PROBLEMS_FILE)
    print(
        f"Saved a tiny Qwen2 (random weights, 512 positions) and 16 addition problems ({PROBLEMS_FILE}) to "
        f"{args.path}.\nRun any recipe with them on this CPU, offline, in about a minute (2 optimizer steps, "
        "32-token completions; RECIPE is e.g. recipes/lora/qwen2.5-0.5b-instruct_band-kl-0.05.yaml):\n\n"
        f"{cpu_train_command(args.path)}"
    )

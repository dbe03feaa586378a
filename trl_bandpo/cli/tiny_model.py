"""`trl-bandpo tiny-model PATH`: a tiny local model warm-started to answer a few problems about half the time, and
the command that trains any synchronous recipe with them on a CPU, offline (docs/training.md, "Run a recipe on
CPU")."""

from __future__ import annotations

import argparse
import json
import os
import shlex
from collections.abc import Sequence
from pathlib import Path

#: The problems file written next to the model.
PROBLEMS_FILE = "problems.jsonl"
#: What a model save writes (weights, shard indexes, configs, tokenizer files): `--overwrite` removes them from PATH
#: first, so that no shard or index of an earlier, larger save outlives it; other files are left.
MODEL_FILES = tuple(
    "*.safetensors *.safetensors.index.json pytorch_model*.bin *.bin.index.json config.json "
    "generation_config.json adapter_config.json tokenizer* special_tokens_map.json added_tokens.json "
    "vocab.* merges.txt chat_template.*".split()
)
#: Overrides that run a synchronous recipe on a CPU with the tiny model: 2 optimizer steps, each over the whole
#: generation batch of 4 prompts x 4 completions (the second a second iteration over it, off-policy, so the bounds act;
#: over all 4 prompts, a step has a gradient unless every group's rewards agree) at a learning rate that moves the
#: ratios past the bounds within them.
CPU_OVERRIDES = tuple(
    "--use_cpu true --bf16 false --dtype float32 --use_vllm false --gradient_checkpointing false --num_generations 4 "
    "--per_device_train_batch_size 4 --gradient_accumulation_steps 4 --num_iterations 2 --generation_batch_size 16 "
    "--max_completion_length 32 --learning_rate 0.01 --max_steps 2 --logging_steps 1 --save_strategy no "
    "--report_to none --val_preset none".split()
)


def cpu_train_command(path: str | os.PathLike, recipe: str = "RECIPE") -> str:
    """The shell command that trains `recipe` on a CPU, offline, with the tiny model and problems in `path`."""
    path = os.fspath(path).rstrip("/") or "/"
    args = [
        "--config", recipe, "--model_name_or_path", path, "--dataset_name", os.path.join(path, PROBLEMS_FILE),
        "--output_dir", os.path.join(path, "run"), *CPU_OVERRIDES,
    ]  # fmt: skip
    return "HF_HUB_OFFLINE=1 trl-bandpo train " + " ".join(shlex.quote(arg) for arg in args)


def _problems(count: int = 16) -> list[dict]:
    return [{"problem": f"What is {a} + {a + 1}?", "answer": 2 * a + 1} for a in range(count)]


def write_problems(path: str | os.PathLike, count: int = 16) -> Path:
    """Write `count` addition problems (``problem``, ``answer``) as JSON Lines to `path`; returns it."""
    path = Path(path)
    path.write_text("".join(json.dumps(row) + "\n" for row in _problems(count)))
    return path


def save_answering_model(path: str | os.PathLike, seed: int = 0, quiet: bool = False) -> dict:
    r"""Save to `path` a tiny model warm-started (`fine_tune`) on `write_problems`' problems, under the prompts the
    recipes build, to answer ``\boxed{N}\nAnswer: N`` right about half the time at temperature 1: first without
    DAPO's preamble (~190 tokens, the same for every problem; three times cheaper per step) until it reads the
    problem, then on the full prompts. Returns ``{"steps": SFT steps, "accuracy": sampled accuracy at the end}``."""
    import torch

    from ..data.prompts import DAPO_PROMPT_PREFIX, format_prompt
    from ..demo.sft import fine_tune
    from ..demo.tiny_model import build_tiny_model, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    # one layer of hidden size 128 learns to read the problems in about a hundred steps, faster than two of 64
    model = build_tiny_model(tokenizer, hidden_size=128, num_layers=1, seed=seed)

    def rows(without_preamble: bool) -> list[dict]:
        out = []
        for template in ("boxed", "dapo"):
            for row in _problems():
                text = format_prompt(row["problem"], template)
                text = text.removeprefix(DAPO_PROMPT_PREFIX) if without_preamble else text
                message = [{"role": "user", "content": text}]
                prompt = tokenizer.apply_chat_template(message, tokenize=False, add_generation_prompt=True)
                out.append({"prompt": prompt, "answer": f"\\boxed{{{row['answer']}}}\nAnswer: {row['answer']}"})
        return out

    steps, threads = 0, torch.get_num_threads()
    # a model this small runs no faster on more threads, and much slower on a busy machine
    torch.set_num_threads(1)
    try:
        for phase, (without_preamble, most) in enumerate(((True, 400), (False, 200)), start=1):
            done, _, accuracy = fine_tune(
                model, tokenizer, rows(without_preamble), steps=most, lr=3e-3, batch_size=32, seed=seed + phase,
                target=0.5, max_new_tokens=24, desc=f"tiny model: warm start {phase}/2", quiet=quiet,
            )  # fmt: skip
            steps += done
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return {"steps": steps, "accuracy": accuracy}


def build_parser() -> argparse.ArgumentParser:
    """The `trl-bandpo tiny-model` argument parser."""
    parser = argparse.ArgumentParser(
        prog="trl-bandpo tiny-model",
        description="Save a tiny Qwen2 (512 positions), warm-started to answer 16 addition problems about half the "
        "time, and the problems to PATH, and print the command that trains any synchronous recipe with them on a "
        "CPU, offline, in about a minute (the warm start takes about half of it).",
    )
    parser.add_argument("path", metavar="PATH", help="folder for the model, its tokenizer and problems.jsonl")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the model files (weights, shard indexes, configs, tokenizer) and problems PATH holds; other "
        "files stay (a PATH that is not empty is refused by default)",
    )
    return parser


def tiny_model_main(argv: Sequence[str] | None = None) -> None:
    """Build the tiny model and problems in PATH and print the CPU training command; a bad PATH exits with 2."""
    from ..evaluation.settings import check_output_dir

    parser = build_parser()
    args = parser.parse_args(argv)
    target = Path(args.path).expanduser()

    def fail(message: str):
        parser.exit(2, f"{parser.prog}: error: {message}\n")

    if not str(args.path).strip():
        fail("PATH is empty: give the folder to write the tiny model to.")
    if target.exists() and not target.is_dir():
        fail(f"PATH {args.path!r} exists and is not a folder.")
    try:
        held = sorted(entry.name for entry in target.iterdir()) if target.is_dir() else []
    except OSError:
        held = []  # an unreadable folder: check_output_dir says why
    if held and not args.overwrite:
        shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
        fail(f"PATH {args.path!r} is not empty ({shown}): pass --overwrite to replace its model and problems.")
    try:
        check_output_dir(target, "PATH")
    except ValueError as err:
        fail(str(err))

    try:
        for stale in (path for pattern in MODEL_FILES for path in target.glob(pattern) if path.is_file()):
            stale.unlink()  # an earlier save's shards and index would be loaded with the new model
    except OSError as err:
        fail(f"cannot remove {str(err.filename)!r} of the model PATH holds: {err.strerror or err}")

    from ..demo.cli import quiet_libraries

    with quiet_libraries():
        warm = save_answering_model(target)
    write_problems(target / PROBLEMS_FILE)
    print(
        f"Saved to {args.path} a tiny Qwen2 (one layer, 512 positions) and 16 addition problems ({PROBLEMS_FILE}); "
        f"after {warm['steps']} supervised steps it answers them as \\boxed{{N}} and 'Answer: N', right "
        f"{warm['accuracy']:.0%} of the time at temperature 1.\nTrain any synchronous recipe with them on this CPU, "
        "offline, in about a minute (2 optimizer steps, the second off-policy; 32-token completions; RECIPE is e.g. "
        "recipes/lora/qwen2.5-0.5b-instruct_band-kl-0.05.yaml; the asynchronous recipes need a GPU):\n\n"
        f"{cpu_train_command(args.path)}"
    )

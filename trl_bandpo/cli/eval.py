r"""`trl-bandpo eval`: mean@n and pass@k of a model on math benchmarks (`trl_bandpo.evaluation.evaluate`).

Every argument is checked, and the benchmarks are loaded, before the model is: a bad value exits at once with
status 2 and an argparse message naming the flag, the value and what is allowed, instead of failing after hours of
generation. Samples are written to ``samples_<benchmark>.jsonl`` batch by batch as they are scored.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
from collections.abc import Callable, Sequence
from pathlib import Path

from ..evaluation import DTYPES, check_device, check_output_dir, evaluate, load_benchmarks, write_markdown

__all__ = ["build_parser", "eval_main"]


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trl-bandpo eval",
        description="Sample completions on math benchmarks and report mean@n and pass@k (math_verify on \\boxed{}).",
    )
    parser.add_argument("--model", required=True, help="model folder or hub id")
    parser.add_argument(
        "--benchmarks",
        nargs="+",
        default=["aime2024", "aime2025", "amc2023"],
        help="registry names (aime2024 aime2025 amc2023 math500 minerva olympiadbench), local files, or name=path",
    )
    parser.add_argument("--num-samples", type=_integer(1), default=32, help="completions per problem (n)")
    parser.add_argument(
        "--ks", type=_integer(1), nargs="+", default=None, help="pass@k values (default: powers of 2 up to n)"
    )
    parser.add_argument("--max-new-tokens", type=_integer(1), default=4096)
    parser.add_argument("--temperature", type=_number(0.0), default=0.6, help="0: greedy decoding")
    parser.add_argument("--top-p", type=_number(0.0, 1.0, low_open=True, high_open=False), default=0.95)
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
        "--timeout-s", type=_number(0.0, low_open=True), default=2.0, help="math_verify time limit per answer"
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


def _check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What argparse cannot check one flag at a time; exits with status 2 (``parser.error``) naming the flag."""
    too_large = [k for k in args.ks or () if k > args.num_samples]
    if too_large:
        parser.error(
            f"argument --ks: invalid value {too_large[0]}: every k must be in [1, --num-samples={args.num_samples}]"
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


def eval_main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (``trl-bandpo eval ...``); prints the Markdown table and returns 0.

    Bad arguments, and benchmarks that cannot be loaded, exit with status 2 before the model is loaded.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_arguments(parser, args)
    try:
        benchmarks = load_benchmarks(args.benchmarks, max_problems=args.max_problems)
    except (ValueError, ConnectionError) as err:
        parser.error(f"argument --benchmarks: {err}")
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
        num_samples=args.num_samples,
        ks=args.ks,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
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
    print(write_markdown(results["benchmarks"], results["settings"]["ks"], args.num_samples), end="")
    print(f"Wrote {Path(args.output_dir) / 'results.json'} and results.md")
    return 0

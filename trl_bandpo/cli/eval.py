r"""`trl-bandpo eval`: mean@n and pass@k of a model on math benchmarks (`trl_bandpo.evaluation.evaluate`)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from ..evaluation import evaluate, write_markdown

__all__ = ["build_parser", "eval_main"]


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
    parser.add_argument("--num-samples", type=int, default=32, help="completions per problem (n)")
    parser.add_argument("--ks", type=int, nargs="+", default=None, help="pass@k values (default: powers of 2 up to n)")
    parser.add_argument("--max-new-tokens", type=int, default=4096)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--backend", choices=("auto", "vllm", "transformers"), default="auto")
    parser.add_argument("--output-dir", default="eval_results")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto", help="model dtype: auto, bfloat16, float16, float32")
    parser.add_argument("--batch-size", type=int, default=64, help="sequences per generate call (transformers)")
    parser.add_argument("--device", default=None, help="torch device for the transformers backend")
    parser.add_argument("--max-problems", type=int, default=None, help="only the first problems of each benchmark")
    parser.add_argument("--timeout-s", type=float, default=2.0, help="math_verify time limit per answer")
    parser.add_argument("--no-samples", action="store_true", help="do not write samples_<benchmark>.jsonl")
    parser.add_argument("--tensor-parallel-size", type=int, default=None, help="vLLM tensor parallelism")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None, help="vLLM GPU memory fraction")
    parser.add_argument("--max-model-len", type=int, default=None, help="vLLM context length")
    return parser


def eval_main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (``trl-bandpo eval ...``); prints the Markdown table and returns 0."""
    args = build_parser().parse_args(argv)
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
        args.benchmarks,
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

r"""Sampling evaluation of math models: mean@k and unbiased pass@k on boxed-answer benchmarks.

`evaluate` draws `num_samples` completions per problem (vLLM when installed, else ``transformers.generate``;
`trl_bandpo.evaluation.generation`), scores each with the 1/0 math_verify reward on its last ``\boxed{}``
(`trl_bandpo.rewards`), and reports per benchmark (`trl_bandpo.evaluation.summary`):

* ``mean@n``: mean accuracy over all n samples of all problems (the papers' "Avg@32" / "mean@32"),
* ``pass@k``: the unbiased estimator ``1 - C(n-c, k) / C(n, k)`` averaged over problems, for each k in `ks`
  (c = correct samples of the problem). pass@1 equals mean@n.

Every setting, and the output folder, is checked before the model is loaded. Results go to ``results.json``
(settings, metrics, per-problem correct counts), ``results.md`` (a Markdown table) and, optionally,
``samples_<benchmark>.jsonl`` (every completion with its score), written batch by batch as the samples are scored,
so that a failure late in a run keeps what was generated. The command line is ``trl-bandpo eval``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..rewards import score_completions
from . import generation
from .generation import resolve_backend
from .summary import _check_count, default_ks, mean_accuracy, pass_at_k, summarize_correctness, write_markdown

__all__ = [
    "DTYPES",
    "check_device",
    "check_output_dir",
    "default_ks",
    "evaluate",
    "load_benchmarks",
    "mean_accuracy",
    "pass_at_k",
    "summarize_correctness",
    "write_markdown",
]

# Model dtypes that both backends accept ("auto": the checkpoint's own).
DTYPES = ("auto", "bfloat16", "float16", "float32")


def check_output_dir(output_dir: str | os.PathLike) -> Path:
    """Create `output_dir` if needed and make sure a file can be written in it; ValueError saying why not."""
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{str(out)!r} is an existing file, not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as err:
        raise ValueError(f"{str(out)!r} is not a writable folder ({err.strerror or err})") from None
    return out


def check_device(device: str) -> str:
    """`device` if torch parses it and such a device is present here ("cpu", "cuda", "cuda:1", "mps", ...)."""
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{device!r} is not a torch device (such as 'cpu', 'cuda', 'cuda:1' or 'mps')") from None
    if parsed.type == "cpu":
        return device
    module = getattr(torch, parsed.type, None)
    is_available = getattr(module, "is_available", None) or getattr(
        getattr(torch.backends, parsed.type, None), "is_available", None
    )
    if is_available is None or not is_available():
        raise ValueError(f"{device!r}: no {parsed.type} device is available here")
    count = getattr(module, "device_count", None)
    if parsed.index is not None and count is not None and parsed.index >= count():
        raise ValueError(f"{device!r}: there are only {count()} {parsed.type} device(s) (indices from 0)")
    return device


def _check_settings(
    num_samples, ks, max_new_tokens, temperature, top_p, seed, dtype, batch_size, timeout_s, device, max_problems
) -> tuple[int, ...]:
    """The sorted pass@k values; ValueError naming the first bad setting (before any model or data is loaded)."""
    _check_count("num_samples", num_samples, 1)
    if max_problems is not None:
        _check_count("max_problems", max_problems, 1)
    _check_count("max_new_tokens", max_new_tokens, 1)
    _check_count("batch_size", batch_size, 1)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature < math.inf:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
        raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")
    if _check_count("seed", seed, 0) >= 2**32:
        raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if device is not None:
        try:
            check_device(device)
        except ValueError as err:
            raise ValueError(f"device: {err}") from None
    ks = tuple(default_ks(num_samples) if ks is None else sorted(set(ks)))
    if not ks:
        raise ValueError("ks must hold at least one k")
    for k in ks:
        _check_count("k", k, 1)
        if k > num_samples:
            raise ValueError(f"every k in ks must be <= num_samples={num_samples}, got k={k}")
    return ks


def load_benchmarks(benchmarks: Mapping[str, Any] | Sequence[str], max_problems: int | None = None) -> dict[str, Any]:
    """The benchmarks `evaluate` runs, loaded by `trl_bandpo.data.load_eval_benchmarks` and checked.

    Args:
        benchmarks: as for `evaluate`.
        max_problems: keep only the first problems of each benchmark.

    Returns:
        dict name -> `datasets.Dataset` with ``prompt`` and ``solution`` and at least one problem.

    Raises:
        ValueError: a file or folder that is missing, unreadable or without a usable row, a bad column.
        ConnectionError: a registry benchmark that cannot be loaded from the Hub.
    """
    from ..data import load_eval_benchmarks

    if max_problems is not None:
        _check_count("max_problems", max_problems, 1)
    datasets_by_name = load_eval_benchmarks(benchmarks, max_problems=max_problems)
    if not datasets_by_name:
        raise ValueError("benchmarks must name at least one benchmark")
    for name, dataset in datasets_by_name.items():
        for column in ("prompt", "solution"):
            if column not in dataset.column_names:
                raise ValueError(f"benchmark {name!r} has no {column!r} column (columns: {dataset.column_names})")
        if len(dataset) == 0:
            raise ValueError(f"benchmark {name!r} has no problems")
    return datasets_by_name


def _sample_and_score(
    dataset, generate: generation.Generator, prompts_per_call: int | None, num_samples: int, timeout_s: float, samples
) -> tuple[list[list[bool]], float]:
    """Per-problem correctness of one benchmark, and the seconds spent generating. Each batch is scored as soon as
    it is generated and, when `samples` is a file, appended to it (one line per problem) and flushed."""
    prompts, solutions = dataset["prompt"], dataset["solution"]
    step = prompts_per_call or len(prompts)
    correct: list[list[bool]] = []
    seconds = 0.0
    for start in range(0, len(prompts), step):
        started = time.time()
        groups = generate(prompts[start : start + step])  # problems x num_samples strings
        seconds += time.time() - started
        golds = solutions[start : start + step]
        flat = [text for group in groups for text in group]
        flat_golds = [gold for gold, group in zip(golds, groups, strict=True) for _ in group]
        flags = score_completions(flat, flat_golds, timeout_s=timeout_s)
        marks = [flags[i * num_samples : (i + 1) * num_samples] for i in range(len(groups))]
        correct.extend(marks)
        if samples is not None:
            for row in zip(prompts[start : start + step], golds, groups, marks, strict=True):
                record = dict(zip(("prompt", "solution", "completions", "correct"), row))
                samples.write(json.dumps(record, ensure_ascii=False) + "\n")
            samples.flush()
    return correct, seconds


def evaluate(
    model_name_or_path: str | os.PathLike,
    benchmarks: Mapping[str, Any] | Sequence[str],
    num_samples: int = 32,
    ks: Sequence[int] | None = None,
    max_new_tokens: int = 4096,
    temperature: float = 0.6,
    top_p: float = 0.95,
    backend: str = "auto",
    output_dir: str | os.PathLike | None = None,
    *,
    seed: int = 0,
    dtype: str = "auto",
    batch_size: int = 64,
    device: str | None = None,
    max_problems: int | None = None,
    timeout_s: float = 2.0,
    save_samples: bool = True,
    vllm_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Sample `num_samples` completions per problem, score them (1/0 on the last boxed answer), report metrics.

    Args:
        model_name_or_path: a local model folder or hub id.
        benchmarks: mapping name -> `datasets.Dataset` (with ``prompt`` and ``solution``) or path/registry name,
            or a list of registry names / local files (see `trl_bandpo.data.load_eval_benchmarks`).
        num_samples: completions per problem (n). The papers use 32.
        ks: pass@k values to report (default `default_ks(num_samples)`); each must be <= num_samples.
        max_new_tokens: generation budget per completion.
        temperature / top_p: sampling settings (defaults 0.6 / 0.95, DeepSeek-R1's evaluation settings; 1.0 / 1.0
            reproduces the training sampler). temperature 0 decodes greedily once and repeats the completion.
        backend: "vllm", "transformers", or "auto" (vLLM when importable).
        output_dir: where ``results.json``, ``results.md`` and samples go (None: nothing is written). Created, and
            checked to be writable, before the model is loaded.
        seed: sampling seed, in [0, 2**32). dtype: model dtype, one of `DTYPES`.
        batch_size: sequences per ``generate`` call (transformers backend).
        device: torch device for the transformers backend (default: cuda if available, else cpu).
        max_problems: evaluate only the first problems of each benchmark (quick checks).
        timeout_s: math_verify wall-clock limit per answer (> 0).
        save_samples: also write ``samples_<benchmark>.jsonl`` with every completion and its score, one line per
            problem, appended and flushed as each batch is scored (what was generated survives a later failure).
        vllm_kwargs: extra ``vllm.LLM`` arguments (``tensor_parallel_size``, ``gpu_memory_utilization``, ...).

    Returns:
        ``{"model", "settings", "benchmarks": {name: summarize_correctness(...)}}`` (also ``results.json``).

    Raises:
        ValueError: a bad setting, output folder or benchmark, found before the model is loaded.
        ConnectionError: a registry benchmark that cannot be loaded from the Hub (before the model is loaded).
    """
    ks = _check_settings(
        num_samples, ks, max_new_tokens, temperature, top_p, seed, dtype, batch_size, timeout_s, device, max_problems
    )
    backend = resolve_backend(backend)
    model = os.fspath(model_name_or_path)
    out = None
    if output_dir is not None:
        try:
            out = check_output_dir(output_dir)
        except ValueError as err:
            raise ValueError(f"output_dir: {err}") from None

    datasets_by_name = load_benchmarks(benchmarks, max_problems=max_problems)

    settings = dict(
        num_samples=num_samples, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
        dtype=dtype, batch_size=batch_size, device=device, vllm_kwargs=vllm_kwargs or {},
    )  # fmt: skip
    started = time.time()
    generate, prompts_per_call = generation.load_generator(backend, model, settings)
    generation_s = time.time() - started  # model loading and generation, without scoring
    metrics: dict[str, Any] = {}
    for name, dataset in datasets_by_name.items():  # one model load; each benchmark's samples saved as they come
        path = out / f"samples_{name}.jsonl" if out is not None and save_samples else None
        with open(path, "w", encoding="utf-8") if path else contextlib.nullcontext() as samples:
            correct, seconds = _sample_and_score(dataset, generate, prompts_per_call, num_samples, timeout_s, samples)
        generation_s += seconds
        metrics[name] = summarize_correctness(correct, ks)

    results = {
        "model": model,
        "settings": {
            "num_samples": num_samples,
            "ks": list(ks),
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "backend": backend,
            "seed": seed,
            "max_problems": max_problems,
            "generation_seconds": round(generation_s, 3),
        },
        "benchmarks": metrics,
    }
    if out is not None:
        (out / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
        table = write_markdown(metrics, ks, num_samples)
        header = (
            f"# Evaluation of `{model}`\n\n{num_samples} samples per problem, temperature {temperature}, "
            f"top-p {top_p}, max {max_new_tokens} new tokens, backend {backend}. Values in %.\n\n"
        )
        (out / "results.md").write_text(header + table, encoding="utf-8")
    return results

r"""Sampling evaluation of math models: mean@k and unbiased pass@k on boxed-answer benchmarks.

`evaluate` draws `num_samples` completions per problem (vLLM when installed, else ``transformers.generate``),
scores each with the 1/0 math_verify reward on its last ``\boxed{}`` (`trl_bandpo.rewards`), and reports per
benchmark:

* ``mean@n``: mean accuracy over all n samples of all problems (the papers' "Avg@32" / "mean@32"),
* ``pass@k``: the unbiased estimator ``1 - C(n-c, k) / C(n, k)`` averaged over problems, for each k in `ks`
  (c = correct samples of the problem). pass@1 equals mean@n.

Results go to ``results.json`` (settings, metrics, per-problem correct counts), ``results.md`` (a Markdown table)
and, optionally, ``samples_<benchmark>.jsonl`` (every completion with its score). The command line is
``trl-bandpo eval``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .rewards import score_completions

__all__ = [
    "default_ks",
    "evaluate",
    "mean_accuracy",
    "pass_at_k",
    "summarize_correctness",
    "write_markdown",
]


def _check_count(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from `n` samples of which `c` are correct: ``1 - C(n-c, k) / C(n, k)``.

    Computed as ``1 - prod_{i=n-c+1}^{n} (1 - k/i)`` (no large binomials, stable for n in the thousands).
    Requires ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    _check_count("n", n, 1)
    _check_count("c", c, 0)
    _check_count("k", k, 1)
    if c > n:
        raise ValueError(f"c must be <= n, got c={c}, n={n}")
    if k > n:
        raise ValueError(f"k must be <= n (pass@k needs at least k samples), got k={k}, n={n}")
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    # C(n-c, k)/C(n, k) = prod_{j=0}^{k-1} (n-c-j)/(n-j) = prod_{i=n-c+1}^{n} (i-k)/i
    failure = 1.0
    for i in range(n - c + 1, n + 1):
        failure *= 1.0 - k / i
    return 1.0 - failure


def mean_accuracy(n: int, c: int) -> float:
    """Fraction of correct samples, ``c / n`` (one problem's mean@n)."""
    _check_count("n", n, 1)
    _check_count("c", c, 0)
    if c > n:
        raise ValueError(f"c must be <= n, got c={c}, n={n}")
    return c / n


def default_ks(num_samples: int) -> tuple[int, ...]:
    """Powers of two up to `num_samples`, plus `num_samples` itself: 32 -> (1, 2, 4, 8, 16, 32)."""
    _check_count("num_samples", num_samples, 1)
    ks = [1 << p for p in range(num_samples.bit_length()) if (1 << p) <= num_samples]
    if ks[-1] != num_samples:
        ks.append(num_samples)
    return tuple(ks)


def summarize_correctness(correct: Sequence[Sequence[bool]], ks: Sequence[int]) -> dict[str, Any]:
    """Metrics of one benchmark from per-problem sample correctness.

    Args:
        correct: P problems x n samples of booleans (every problem must have the same n).
        ks: the k of each pass@k (each <= n).

    Returns:
        ``{"problems": P, "samples_per_problem": n, "mean@n": float, "pass@k": float for k in ks,
        "correct_per_problem": [c_1, ..., c_P]}``; metrics are averaged over problems and lie in [0, 1].
    """
    if len(correct) == 0:
        raise ValueError("correct must hold at least one problem")
    n = len(correct[0])
    if any(len(samples) != n for samples in correct):
        raise ValueError(f"every problem needs the same number of samples, got {sorted({len(s) for s in correct})}")
    _check_count("samples per problem", n, 1)
    for k in ks:
        _check_count("k", k, 1)
        if k > n:
            raise ValueError(f"ks must be <= the number of samples per problem ({n}), got k={k}")
    counts = [sum(bool(x) for x in samples) for samples in correct]
    summary: dict[str, Any] = {"problems": len(correct), "samples_per_problem": n}
    summary[f"mean@{n}"] = sum(mean_accuracy(n, c) for c in counts) / len(counts)
    for k in ks:
        summary[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in counts) / len(counts)
    summary["correct_per_problem"] = counts
    return summary


def write_markdown(results: Mapping[str, Mapping[str, Any]], ks: Sequence[int], num_samples: int) -> str:
    """A Markdown table (percentages): benchmark, problems, mean@n, pass@k for each k; an average row if > 1."""
    mean_key = f"mean@{num_samples}"
    columns = [mean_key] + [f"pass@{k}" for k in ks]
    lines = [
        "| Benchmark | Problems | " + " | ".join(columns) + " |",
        "|---|---:|" + "---:|" * len(columns),
    ]
    for name, metrics in results.items():
        cells = [f"{100 * metrics[c]:.1f}" for c in columns]
        lines.append(f"| {name} | {metrics['problems']} | " + " | ".join(cells) + " |")
    if len(results) > 1:
        averages = [sum(m[c] for m in results.values()) / len(results) for c in columns]
        total = sum(m["problems"] for m in results.values())
        lines.append(f"| **Average** | {total} | " + " | ".join(f"{100 * a:.1f}" for a in averages) + " |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------------------------
# Generation backends
# ----------------------------------------------------------------------------------------------------------------


def _render_prompt(tokenizer, prompt: Any) -> str:
    """Chat-template text for a conversational prompt (plain text is used as is)."""
    if isinstance(prompt, str):
        return prompt
    messages = [dict(m) for m in prompt]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return "\n".join(m["content"] for m in messages) + "\n"


def _generate_vllm(
    model: str,
    prompts: list[Any],
    num_samples: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
    dtype: str,
    vllm_kwargs: Mapping[str, Any],
) -> list[list[str]]:
    """`num_samples` completions per prompt with vLLM (``SamplingParams(n=num_samples)``)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, seed=seed, dtype=dtype, **dict(vllm_kwargs))
    tokenizer = llm.get_tokenizer()
    # The chat template already writes any BOS token: hand vLLM token ids so it adds none of its own.
    token_prompts = [
        {"prompt_token_ids": tokenizer(_render_prompt(tokenizer, p), add_special_tokens=False)["input_ids"]}
        for p in prompts
    ]
    params = SamplingParams(n=num_samples, temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, seed=seed)
    outputs = llm.generate(token_prompts, params)
    return [[choice.text for choice in output.outputs] for output in outputs]


def _generate_transformers(
    model_name_or_path: str,
    prompts: list[Any],
    num_samples: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
    dtype: str,
    batch_size: int,
    device: str | None,
) -> list[list[str]]:
    """`num_samples` completions per prompt with ``model.generate`` (left padding, ``num_return_sequences``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(model_name_or_path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_name_or_path, dtype=dtype).to(device).eval()
    greedy = temperature == 0
    samples_per_call = 1 if greedy else num_samples  # greedy decoding is deterministic: decode once, repeat
    prompts_per_call = max(1, batch_size // samples_per_call)
    texts = [_render_prompt(tokenizer, p) for p in prompts]
    torch.manual_seed(seed)
    completions: list[list[str]] = []
    for start in range(0, len(texts), prompts_per_call):
        batch = tokenizer(
            texts[start : start + prompts_per_call], return_tensors="pt", padding=True, add_special_tokens=False
        ).to(device)
        # Plain temperature / top-p sampling, as vLLM does: override top_k / repetition_penalty that a model's
        # generation_config.json may set (Qwen instruct models ship top_k=20, repetition_penalty=1.05).
        sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": temperature, "top_p": top_p}
        sampling.update(top_k=0, repetition_penalty=1.0)
        with torch.inference_mode():
            output = model.generate(
                **batch,
                max_new_tokens=max_new_tokens,
                num_return_sequences=samples_per_call,
                pad_token_id=tokenizer.pad_token_id,
                **sampling,
            )
        new_tokens = output[:, batch["input_ids"].shape[1] :]  # (prompts * samples_per_call, new tokens)
        decoded = tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
        for i in range(0, len(decoded), samples_per_call):
            group = decoded[i : i + samples_per_call]
            completions.append(group * num_samples if greedy else group)
    return completions


def _resolve_backend(backend: str) -> str:
    allowed = ("auto", "vllm", "transformers")
    if backend not in allowed:
        raise ValueError(f"backend must be one of {allowed}, got {backend!r}")
    if backend == "auto":
        return "vllm" if importlib.util.find_spec("vllm") is not None else "transformers"
    if backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ValueError("backend='vllm' but vllm is not installed (pip install 'trl-bandpo[vllm]')")
    return backend


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
        output_dir: where ``results.json``, ``results.md`` and samples go (None: nothing is written).
        seed: sampling seed. dtype: model dtype ("auto", "bfloat16", ...).
        batch_size: sequences per ``generate`` call (transformers backend).
        device: torch device for the transformers backend (default: cuda if available, else cpu).
        max_problems: evaluate only the first problems of each benchmark (quick checks).
        timeout_s: math_verify wall-clock limit per answer.
        save_samples: also write ``samples_<benchmark>.jsonl`` with every completion and its score.
        vllm_kwargs: extra ``vllm.LLM`` arguments (``tensor_parallel_size``, ``gpu_memory_utilization``, ...).

    Returns:
        ``{"model", "settings", "benchmarks": {name: summarize_correctness(...)}}`` (also ``results.json``).
    """
    from .data import load_eval_benchmarks

    _check_count("num_samples", num_samples, 1)
    _check_count("max_new_tokens", max_new_tokens, 1)
    _check_count("batch_size", batch_size, 1)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature < math.inf:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    ks = tuple(default_ks(num_samples) if ks is None else sorted(set(ks)))
    if not ks:
        raise ValueError("ks must hold at least one k")
    for k in ks:
        _check_count("k", k, 1)
        if k > num_samples:
            raise ValueError(f"every k in ks must be <= num_samples={num_samples}, got k={k}")
    backend = _resolve_backend(backend)
    model = os.fspath(model_name_or_path)

    datasets_by_name = load_eval_benchmarks(benchmarks, max_problems=max_problems)
    if not datasets_by_name:
        raise ValueError("benchmarks must name at least one benchmark")
    # One generation pass over all benchmarks (one vLLM engine / one model load).
    all_prompts: list[Any] = []
    spans: dict[str, tuple[int, int]] = {}
    for name, dataset in datasets_by_name.items():
        for column in ("prompt", "solution"):
            if column not in dataset.column_names:
                raise ValueError(f"benchmark {name!r} has no {column!r} column (columns: {dataset.column_names})")
        if len(dataset) == 0:
            raise ValueError(f"benchmark {name!r} has no problems")
        spans[name] = (len(all_prompts), len(all_prompts) + len(dataset))
        all_prompts.extend(dataset["prompt"])

    started = time.time()
    if backend == "vllm":
        completions = _generate_vllm(
            model, all_prompts, num_samples, max_new_tokens, temperature, top_p, seed, dtype, vllm_kwargs or {}
        )
    else:
        completions = _generate_transformers(
            model, all_prompts, num_samples, max_new_tokens, temperature, top_p, seed, dtype, batch_size, device
        )
    generation_s = time.time() - started

    metrics: dict[str, Any] = {}
    out = Path(output_dir) if output_dir is not None else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    for name, dataset in datasets_by_name.items():
        start, stop = spans[name]
        groups = completions[start:stop]  # problems x num_samples strings
        solutions = dataset["solution"]
        flat = [text for group in groups for text in group]
        flat_solutions = [solution for solution, group in zip(solutions, groups, strict=True) for _ in group]
        flags = score_completions(flat, flat_solutions, timeout_s=timeout_s)
        correct = [flags[i * num_samples : (i + 1) * num_samples] for i in range(len(groups))]
        metrics[name] = summarize_correctness(correct, ks)
        if out is not None and save_samples:
            with open(out / f"samples_{name}.jsonl", "w", encoding="utf-8") as handle:
                for prompt, solution, group, marks in zip(dataset["prompt"], solutions, groups, correct, strict=True):
                    record = {"prompt": prompt, "solution": solution, "completions": group, "correct": marks}
                    handle.write(json.dumps(record, ensure_ascii=False) + "\n")

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

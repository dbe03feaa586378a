r"""Sampling evaluation of math models: mean@k, the unbiased pass@k and verl's bootstrap best@k (docs/evaluation.md).

`evaluate` draws `num_samples` completions per problem (vLLM when installed, else ``transformers.generate``;
`trl_bandpo.evaluation.generation`), scores each with a named checker (`trl_bandpo.evaluation.scorers`) and reports
per benchmark (`trl_bandpo.evaluation.summary`) ``mean@n``, ``pass@k`` (unbiased: ``1 - C(n-c, k) / C(n, k)``) and
``best@k`` (verl's bootstrap: ``1 - (1 - c/n)^k``). The DGPO paper's Pass@32 is best@k (checked against its values);
the BandPO paper's pass@32 is inferred to be: with a preset, results show it first (`estimator_labels`).

`EVAL_PRESETS` holds the two papers' protocols (``"bandpo"``, ``"dgpo"``); the settings are an `EvalSettings`, checked
before the model is loaded. Results go to ``results.json``, ``results.md`` and, optionally,
``samples_<benchmark>.jsonl``, written batch by batch as the samples are scored. The command is ``trl-bandpo eval``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ..core.checks import Integer
from . import generation
from .presets import EVAL_PRESETS, estimator_labels, merge_scorer, preset_settings
from .scorers import DEFAULT_TIMEOUTS, SCORERS, check_scorer, score, scorers_for
from .settings import DTYPES, EvalSettings, ValidationSettings, check_output_dir
from .summary import (
    BEST_LABEL,
    PASS_LABEL,
    best_at_k,
    bootstrap_best_at_k,
    default_ks,
    mean_accuracy,
    pass_at_k,
    summarize_correctness,
    write_markdown,
)

__all__ = [
    "BEST_LABEL",
    "DTYPES",
    "EVAL_PRESETS",
    "PASS_LABEL",
    "EvalSettings",
    "ValidationSettings",
    "SCORERS",
    "best_at_k",
    "bootstrap_best_at_k",
    "check_output_dir",
    "check_scorer",
    "default_ks",
    "estimator_labels",
    "evaluate",
    "load_benchmarks",
    "mean_accuracy",
    "merge_scorer",
    "pass_at_k",
    "preset_settings",
    "scorers_for",
    "summarize_correctness",
    "write_markdown",
    "write_results_markdown",
]


def load_benchmarks(
    benchmarks: Mapping[str, Any] | Sequence[str], max_problems: int | None = None, prompt_template: str = "boxed"
) -> dict[str, Any]:
    """The benchmarks `evaluate` runs (`trl_bandpo.data.load_eval_benchmarks`; `prompt_template` is not applied to
    Datasets passed in a mapping), each checked to have ``prompt``, ``solution`` and a problem: dict name -> Dataset.
    ValueError for a bad file, folder or column, ConnectionError for a registry benchmark the Hub does not give."""
    from ..data import load_eval_benchmarks

    Integer(low=1, optional=True)(max_problems, "max_problems")
    datasets_by_name = load_eval_benchmarks(benchmarks, max_problems=max_problems, prompt_template=prompt_template)
    if not datasets_by_name:
        raise ValueError("benchmarks must name at least one benchmark")
    for name, dataset in datasets_by_name.items():
        for column in ("prompt", "solution"):
            if column not in dataset.column_names:
                raise ValueError(f"benchmark {name!r} has no {column!r} column (columns: {dataset.column_names})")
        if len(dataset) == 0:
            raise ValueError(f"benchmark {name!r} has no problems")
    return datasets_by_name


def _sample_and_score(dataset, generate, prompts_per_call, settings, scorer: str, samples) -> tuple[list, float]:
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
        flags = score(scorer, flat, flat_golds, timeout_s=settings.timeout_s)
        marks = generation.regroup(flags, settings.num_samples, settings.num_samples)
        correct.extend(marks)
        if samples is not None:
            for row in zip(prompts[start : start + step], golds, groups, marks, strict=True):
                record = dict(zip(("prompt", "solution", "completions", "correct"), row))
                samples.write(json.dumps(record, ensure_ascii=False) + "\n")
            samples.flush()
    return correct, seconds


def write_results_markdown(results: Mapping[str, Any]) -> str:
    """``results.md`` of an `evaluate` result: the settings, then one table per estimator, each labelled, in the order
    of ``results["estimators"]`` (a preset's paper estimator first, `estimator_labels`)."""
    settings, metrics = results["settings"], results["benchmarks"]
    ks, n = settings["ks"], settings["num_samples"]
    top_k = "no top-k" if settings.get("top_k") is None else f"top-k {settings['top_k']}"
    scorers = ", ".join(f"{name}: {scorer}" for name, scorer in settings.get("scorer", {}).items())
    preset = f" Preset `{settings['preset']}`." if settings.get("preset") else ""
    labels = results.get("estimators") or estimator_labels(settings.get("preset"))
    formulas = {
        "pass@k": "`pass@k` = 1 - C(n-c, k)/C(n, k): k of the n samples drawn without replacement.",
        "best@k": "`best@k` = 1 - (1 - c/n)^k: k samples drawn with replacement (verl's `best@k/mean`).",
    }
    tables = "".join(
        f"\n## {label}\n\n{formulas[key]} Values in %.\n\n"
        + write_markdown(metrics, ks, n, estimator=key.partition("@")[0])
        for key, label in labels.items()
    )
    return (
        f"# Evaluation of `{results['model']}`\n\n{n} samples per problem, temperature {settings['temperature']}, "
        f"top-p {settings['top_p']}, {top_k}, max {settings['max_new_tokens']} new tokens, "
        f"prompt template {settings.get('prompt_template', 'boxed')}, backend {settings['backend']}.{preset} "
        f"Scorers: {scorers}. Values in %.\n" + tables
    )


def evaluate(
    model_name_or_path: str | os.PathLike,
    benchmarks: Mapping[str, Any] | Sequence[str] | None = None,
    *,
    settings: EvalSettings | None = None,
    output_dir: str | os.PathLike | None = None,
    save_samples: bool = True,
    vllm_kwargs: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """Sample `num_samples` completions per problem, score them with `scorer`, report mean@n, pass@k and best@k.

    Args:
        model_name_or_path: a local model folder or hub id.
        benchmarks: mapping name -> `datasets.Dataset` (with ``prompt`` and ``solution``) or path/registry name,
            or a list of registry names / local files; default `EvalSettings`'s (AIME 2024, AIME 2025, AMC 2023).
        settings, **kwargs: an `EvalSettings`, and/or its fields as keywords (overriding it). `preset` sets no
            setting itself (``EvalSettings.from_preset`` does) but is recorded and orders the estimators.
        output_dir: where ``results.json``, ``results.md`` and samples go (None: nothing is written); created, and
            checked to be writable, before the model is loaded.
        save_samples: also write ``samples_<benchmark>.jsonl`` (one line per problem, flushed batch by batch).
        vllm_kwargs: extra ``vllm.LLM`` arguments (``tensor_parallel_size``, ``gpu_memory_utilization``, ...).

    Returns:
        ``{"model", "settings", "estimators", "benchmarks": {name: summarize_correctness(...)}}`` (also
        ``results.json``); ``settings["scorer"]`` is the scorer of each benchmark.

    Raises:
        ValueError, ConnectionError: a bad setting, output folder or benchmark, found before the model is loaded.
    """
    if benchmarks is not None:
        kwargs["benchmarks"] = benchmarks
    if settings is None:
        settings = EvalSettings(**kwargs)
    elif kwargs:
        settings = dataclasses.replace(settings, **kwargs)
    backend = generation.resolve_backend(settings.backend)
    model = os.fspath(model_name_or_path)
    out = None if output_dir is None else check_output_dir(output_dir)
    datasets_by_name = load_benchmarks(
        settings.benchmarks, max_problems=settings.max_problems, prompt_template=settings.prompt_template
    )
    chosen = scorers_for(settings.scorer, list(datasets_by_name))
    prompts = [prompt for dataset in datasets_by_name.values() for prompt in dataset["prompt"]]
    truncate = (settings.name("truncate_prompt_tokens"), settings.truncate_prompt_tokens)
    generation.check_positions(model, settings.max_new_tokens, prompts, model, None, settings.name("max_new_tokens"),
                               truncate)  # fmt: skip

    started = time.time()
    generate, prompts_per_call = generation.load_generator(
        backend, model, dict(vars(settings), vllm_kwargs=dict(vllm_kwargs or {}))
    )
    generation_s = time.time() - started  # model loading and generation, without scoring
    metrics: dict[str, Any] = {}
    for name, dataset in datasets_by_name.items():  # one model load; each benchmark's samples saved as they come
        path = out / f"samples_{name}.jsonl" if out is not None and save_samples else None
        with open(path, "w", encoding="utf-8") if path else contextlib.nullcontext() as samples:
            correct, seconds = _sample_and_score(dataset, generate, prompts_per_call, settings, chosen[name], samples)
        generation_s += seconds
        metrics[name] = summarize_correctness(correct, settings.ks)

    keys = "preset num_samples ks max_new_tokens temperature top_p top_k prompt_template truncate_prompt_tokens"
    results = {
        "model": model,
        "settings": {key: getattr(settings, key) for key in keys.split()}
        | {
            "scorer": chosen,
            "timeout_s": {  # the limit per answer each scorer applies (None for those that take none)
                name: None if DEFAULT_TIMEOUTS[s] is None else settings.timeout_s or DEFAULT_TIMEOUTS[s]
                for name, s in chosen.items()
            },
            "backend": backend,
            "seed": settings.seed,
            "max_problems": settings.max_problems,
            "generation_seconds": round(generation_s, 3),
        },
        "estimators": estimator_labels(settings.preset),
        "benchmarks": metrics,
    }
    if out is not None:
        (out / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
        (out / "results.md").write_text(write_results_markdown(results), encoding="utf-8")
    return results

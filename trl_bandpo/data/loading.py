r"""Loaders that turn registered or local math datasets into TRL prompt datasets (``prompt``, ``solution``).

`load_math_dataset` reads one dataset (a registry name from `trl_bandpo.data.registry`, or a local file or
``save_to_disk`` folder) and normalises its rows: the problem (DAPO's "Answer:" template removed) followed by
`BOXED_INSTRUCTION` as a one-message conversation, and the final answer as a string. `load_training_mix` and
`load_eval_benchmarks` load several at once.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..answers import extract_boxed_answer
from .registry import DATASETS, EVAL_BENCHMARKS, TRAINING_MIXES, DatasetSpec, resolve_dataset_name

__all__ = [
    "ANSWER_FIELD_CANDIDATES",
    "BOXED_INSTRUCTION",
    "PROBLEM_FIELD_CANDIDATES",
    "get_field",
    "load_eval_benchmarks",
    "load_math_dataset",
    "load_training_mix",
]

BOXED_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."

# Column names tried, in order, when a local file's problem/answer columns are not given.
PROBLEM_FIELD_CANDIDATES = ("problem", "question", "Problem", "Question", "prompt", "input")
ANSWER_FIELD_CANDIDATES = (
    "answer",
    "final_answer",
    "Answer",
    "ground_truth",
    "reward_model.ground_truth",
    "target",
    "solution",
    "Solution",
)

# DAPO-Math-17k wraps each problem in this template (its reward reads "Answer: ..."); we swap it for ours.
_DAPO_PREFIX = re.compile(r"^\s*Solve the following math problem step by step\.[^\n]*\n\s*\n", re.DOTALL)
_DAPO_SUFFIX = re.compile(r"\s*Remember to put your answer on its own line after \"Answer:\"\.?\s*$")

_LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def get_field(row: Mapping[str, Any], field: str) -> Any:
    """``row[field]``, where a dotted `field` such as ``"reward_model.ground_truth"`` reaches into nested dicts.

    A column whose name literally contains the dot wins. Raises KeyError naming the missing part.
    """
    if field in row:
        return row[field]
    value: Any = row
    for part in field.split("."):
        if not isinstance(value, Mapping) or part not in value:
            found = sorted(value) if isinstance(value, Mapping) else value
            raise KeyError(f"field {field!r}: no {part!r} in {found!r}")
        value = value[part]
    return value


def _has_field(row: Mapping[str, Any], field: str) -> bool:
    try:
        get_field(row, field)
    except KeyError:
        return False
    return True


def _problem_text(value: Any) -> str:
    """Problem text from a string or a conversation (last user message), without DAPO's answer template."""
    if isinstance(value, (list, tuple)):
        messages = [m for m in value if isinstance(m, Mapping)]
        users = [m for m in messages if m.get("role") == "user"] or messages
        value = users[-1].get("content", "") if users else ""
    if not isinstance(value, str):
        return ""
    text = _DAPO_SUFFIX.sub("", _DAPO_PREFIX.sub("", value, count=1))
    return text.strip()


def _answer_text(value: Any) -> str:
    r"""Ground truth as a string: numbers formatted, lists of answers joined by ", ", a worked solution reduced to
    its last ``\boxed{}``. Empty when missing."""
    if value is None:
        return ""
    if isinstance(value, (list, tuple)):
        return ", ".join(part for part in (_answer_text(v) for v in value) if part)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    text = str(value).strip()
    if "\\boxed" in text or "\\fbox" in text:
        text = (extract_boxed_answer(text) or "").strip()
    return text


def _level_number(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = re.search(r"\d+", str(value)) if value is not None else None
    return int(match.group(0)) if match else None


def _build_prompt(problem: str, instruction: str | None) -> list[dict[str, str]]:
    content = f"{problem} {instruction}" if instruction else problem
    return [{"role": "user", "content": content}]


def _pick_field(given: str | None, default: str | None, candidates: Sequence[str], row: Mapping, what: str) -> str:
    if given is not None:
        return given
    if default is not None:
        return default
    for candidate in candidates:
        if _has_field(row, candidate):
            return candidate
    raise ValueError(
        f"could not find the {what} column among {sorted(row)}; pass {what}_field=... (tried {list(candidates)})"
    )


def _load_local(path: Path, split: str | None):
    """A `datasets.Dataset` from a local file or a ``save_to_disk`` folder."""
    import datasets

    if path.is_dir():
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            split = split or ("train" if "train" in loaded else next(iter(loaded)))
            if split not in loaded:
                raise ValueError(f"split={split!r} is not in {path} (has {list(loaded)})")
            return loaded[split]
        return loaded
    builder = _LOCAL_FORMATS.get(path.suffix.lower())
    if builder is None:
        raise ValueError(
            f"name_or_path={str(path)!r}: unsupported file type {path.suffix!r}; use one of {sorted(_LOCAL_FORMATS)}"
        )
    # A single local file is one "train" split; `split` may still slice it, e.g. "train[:100]".
    return datasets.load_dataset(builder, data_files=str(path), split=split or "train")


def _load_hub(spec: DatasetSpec, split: str | None):
    import datasets

    split = split or spec.split
    if not spec.configs:
        return datasets.load_dataset(spec.hub_id, split=split)
    parts = [datasets.load_dataset(spec.hub_id, config, split=split) for config in spec.configs]
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def load_math_dataset(
    name_or_path: str | os.PathLike,
    split: str | None = None,
    *,
    problem_field: str | None = None,
    answer_field: str | None = None,
    instruction: str | None = BOXED_INSTRUCTION,
    levels: Iterable[int] | None = None,
    level_field: str | None = None,
    deduplicate: bool | None = None,
    max_samples: int | None = None,
    data_source: str | None = None,
):
    r"""Load a math dataset as a TRL prompt dataset with ``prompt``, ``solution`` and ``data_source`` columns.

    Args:
        name_or_path: a registry name (`DATASETS`, aliases such as ``"aime24"`` accepted) or a local file
            (.jsonl/.json/.parquet/.csv) or ``save_to_disk`` folder. An existing path wins over a registry name.
        split: split to load (registry default; ``"train"`` for a local file; slices like ``"train[:50]"`` work).
        problem_field / answer_field: columns holding the problem and the final answer; dotted names reach nested
            fields (``"reward_model.ground_truth"``). Registry defaults, else guessed for local files.
        instruction: appended to each problem after a space (None or "" for none).
        levels / level_field: keep rows whose level is in `levels` (e.g. ``(3, 4, 5)`` with ``"level"``).
        deduplicate: drop repeated problems (registry default; False for local files).
        max_samples: keep at most this many rows (after filtering), for quick runs.
        data_source: value of the ``data_source`` column (default: registry name or file name).

    Returns:
        `datasets.Dataset` with ``prompt`` (list of one user message), ``solution`` (str), ``data_source`` (str).
        Rows with an empty problem or answer are dropped.
    """
    if max_samples is not None and (
        isinstance(max_samples, bool) or not isinstance(max_samples, int) or max_samples < 1
    ):
        raise ValueError(f"max_samples must be None or an integer >= 1, got {max_samples!r}")
    if instruction is not None and not isinstance(instruction, str):
        raise ValueError(f"instruction must be a string or None, got {instruction!r}")

    path = Path(os.fspath(name_or_path)).expanduser()
    registry_name = None if path.exists() else resolve_dataset_name(os.fspath(name_or_path))
    if registry_name is not None:
        spec = DATASETS[registry_name]
        raw = _load_hub(spec, split)
        source = data_source or registry_name
        default_problem, default_answer = spec.problem_field, spec.answer_field
        if levels is None and spec.levels is not None:
            levels, level_field = spec.levels, level_field or spec.level_field
        deduplicate = spec.deduplicate if deduplicate is None else deduplicate
    elif path.exists():
        raw = _load_local(path, split)
        source = data_source or path.stem
        default_problem = default_answer = None
        deduplicate = bool(deduplicate)
    else:
        known = ", ".join(DATASETS)
        raise ValueError(f"name_or_path={os.fspath(name_or_path)!r} is neither an existing file nor one of: {known}")

    if len(raw) == 0:
        raise ValueError(f"{os.fspath(name_or_path)!r} (split {split!r}) has no rows")
    first = raw[0]
    problem_key = _pick_field(problem_field, default_problem, PROBLEM_FIELD_CANDIDATES, first, "problem")
    answer_key = _pick_field(answer_field, default_answer, ANSWER_FIELD_CANDIDATES, first, "answer")
    for what, key in (("problem_field", problem_key), ("answer_field", answer_key)):
        if not _has_field(first, key):
            raise ValueError(
                f"{what}={key!r} is not a column of {os.fspath(name_or_path)!r} (columns: {sorted(first)})"
            )

    level_set = None
    if levels is not None:
        level_set = {int(level) for level in levels}
        level_field = level_field or "level"
        if not _has_field(first, level_field):
            raise ValueError(f"level_field={level_field!r} is not a column (columns: {sorted(first)})")

    def to_row(row: Mapping[str, Any]) -> dict[str, Any]:
        problem = _problem_text(get_field(row, problem_key))
        keep = bool(problem)
        if level_set is not None:
            keep = keep and _level_number(get_field(row, level_field)) in level_set
        return {
            "prompt": _build_prompt(problem, instruction),
            "solution": _answer_text(get_field(row, answer_key)),
            "data_source": source,
            "_problem": problem,
            "_keep": keep,
        }

    mapped = raw.map(to_row, remove_columns=raw.column_names, desc=f"Formatting {source}")
    problems = mapped["_problem"]
    keeps = mapped["_keep"]
    solutions = mapped["solution"]
    seen: set[str] = set()
    indices = []
    for index, (problem, keep, solution) in enumerate(zip(problems, keeps, solutions, strict=True)):
        if not keep or not solution:
            continue
        if deduplicate:
            if problem in seen:
                continue
            seen.add(problem)
        indices.append(index)
        if max_samples is not None and len(indices) >= max_samples:
            break
    if len(indices) != len(mapped):
        mapped = mapped.select(indices)
    return mapped.remove_columns(["_problem", "_keep"])


def load_training_mix(
    names: str | Sequence[str | os.PathLike] = "bandpo",
    *,
    seed: int | None = None,
    max_samples_per_dataset: int | None = None,
    instruction: str | None = BOXED_INSTRUCTION,
):
    """Concatenate several math datasets into one training set (as BandPO merges DAPO-Math-17k and MATH L3-5).

    Args:
        names: a mix name from `TRAINING_MIXES` ("bandpo", "dgpo"), a comma-separated string, or a list of registry
            names / local files.
        seed: shuffle the merged rows with this seed (None keeps dataset order; GRPOTrainer shuffles anyway).
        max_samples_per_dataset: cap on rows taken from each dataset.
        instruction: appended to every problem.

    Returns:
        `datasets.Dataset` with ``prompt``, ``solution``, ``data_source``.
    """
    import datasets

    if isinstance(names, (str, os.PathLike)):
        text = os.fspath(names)
        names = list(TRAINING_MIXES.get(text.strip().lower(), [part for part in text.split(",") if part.strip()]))
    names = [os.fspath(name).strip() for name in names]
    if not names:
        raise ValueError("names must name at least one dataset (or a mix: " + ", ".join(TRAINING_MIXES) + ")")
    parts = [load_math_dataset(name, max_samples=max_samples_per_dataset, instruction=instruction) for name in names]
    merged = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    return merged.shuffle(seed=seed) if seed is not None else merged


def load_eval_benchmarks(
    benchmarks: Sequence[str] | Mapping[str, Any] | None = None,
    *,
    max_problems: int | None = None,
    instruction: str | None = BOXED_INSTRUCTION,
    problem_field: str | None = None,
    answer_field: str | None = None,
) -> dict[str, Any]:
    """Load evaluation benchmarks by name, local path or ``"name=path"``; Datasets given in a mapping pass through.

    Args:
        benchmarks: names/paths (default: the six of `EVAL_BENCHMARKS`) or a mapping name -> Dataset or path.
        max_problems: keep at most this many problems per benchmark.
        problem_field / answer_field: columns for local files.

    Returns:
        dict benchmark name -> `datasets.Dataset` with ``prompt`` and ``solution``.
    """
    if benchmarks is None:
        benchmarks = list(EVAL_BENCHMARKS)
    if isinstance(benchmarks, str):
        benchmarks = [part for part in benchmarks.split(",") if part.strip()]
    if isinstance(benchmarks, Mapping):
        items = list(benchmarks.items())
    else:
        items = []
        for entry in benchmarks:
            entry = os.fspath(entry).strip()
            if "=" in entry and not Path(entry).exists():
                name, _, source = entry.partition("=")
                items.append((name.strip(), source.strip()))
            elif Path(entry).exists():
                items.append((Path(entry).stem, entry))
            else:
                items.append((resolve_dataset_name(entry) or entry, entry))
    loaded = {}
    for name, source in items:
        if hasattr(source, "column_names"):  # already a Dataset
            if max_problems is not None and len(source) > max_problems:
                source = source.select(range(max_problems))
            loaded[name] = source
        else:
            loaded[name] = load_math_dataset(
                source,
                max_samples=max_problems,
                instruction=instruction,
                problem_field=problem_field,
                answer_field=answer_field,
                data_source=name,
            )
    return loaded

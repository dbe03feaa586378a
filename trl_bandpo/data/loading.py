r"""Loaders that turn registered or local math datasets into TRL prompt datasets (``prompt``, ``solution``).

`load_math_dataset` reads one dataset (`trl_bandpo.data.registry`, or a local file read by `trl_bandpo.data.files`),
normalises its rows (`trl_bandpo.data.rows`) and puts each problem in a prompt template (`trl_bandpo.data.prompts`).
`load_training_mix` and `load_eval_benchmarks` load several at once.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..core.checks import Integer
from .files import LOCAL_FORMATS, read_local
from .prompts import BOXED_INSTRUCTION, CHECK_TEMPLATE, format_prompt
from .registry import DATASETS, EVAL_BENCHMARKS, TRAINING_MIXES, DatasetSpec, resolve_dataset_name
from .rows import FILTERS, Selection, has_field, select_rows

logger = logging.getLogger(__name__)

# Column names tried, in order, when a local file's problem/answer columns are not given.
PROBLEM_FIELD_CANDIDATES = ("problem", "question", "Problem", "Question", "prompt", "input")
ANSWER_FIELD_CANDIDATES = tuple(
    "answer final_answer Answer ground_truth reward_model.ground_truth target solution Solution".split()
)


def _check_template_arguments(prompt_template: str, instruction: str | None) -> str | None:
    """Check the template and the instruction; return the instruction the template uses (None for "dapo")."""
    CHECK_TEMPLATE(prompt_template, "prompt_template")
    if instruction is not None and not isinstance(instruction, str):
        raise ValueError(f"instruction must be a string or None, got {instruction!r}")
    if prompt_template == "dapo" and instruction not in (None, "", BOXED_INSTRUCTION):
        logger.warning(
            "prompt_template='dapo' ignores instruction=%r: DAPO's template has its own instruction", instruction
        )
    return instruction if prompt_template == "boxed" else None


def _pick_field(given: str | None, candidates: Sequence[str], row: Mapping, what: str) -> str:
    """`given`, else the first of `candidates` that `row` has."""
    if given is not None:
        return given
    for candidate in candidates:
        if has_field(row, candidate):
            return candidate
    raise ValueError(
        f"could not find the {what} column among {sorted(row)}; pass {what}_field=... (tried {list(candidates)})"
    )


def _load_hub(name: str, spec: DatasetSpec, split: str | None):
    """The registered dataset from the Hub (or the local cache); one clear error when it cannot be reached."""
    import datasets

    split = split or spec.split
    try:  # each configuration (None: the default one)
        parts = [datasets.load_dataset(spec.hub_id, config, split=split) for config in spec.configs or (None,)]
    except OSError as err:  # ConnectionError (offline, no network), DatasetNotFoundError (gated), HTTP errors
        reason = f"{type(err).__name__}: {err}".splitlines()[0]
        raise ConnectionError(
            f"dataset {name!r} (Hub id {spec.hub_id!r}, split {split!r}) could not be loaded from the Hugging Face "
            f"Hub ({reason}). To use a local copy instead, pass its file: `dataset_name: path/to/file.jsonl` with "
            "`problem_field`/`answer_field` in a training recipe, or `--benchmarks "
            f"{name}=path/to/file.jsonl` for `trl-bandpo eval`."
        ) from None
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def load_math_dataset(
    name_or_path: str | os.PathLike,
    split: str | None = None,
    *,
    problem_field: str | None = None,
    answer_field: str | None = None,
    instruction: str | None = BOXED_INSTRUCTION,
    prompt_template: str = "boxed",
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
        instruction: appended to each problem after a space by the "boxed" template (None or "" for none);
            ignored by "dapo" (a warning says so when it is neither None nor the default).
        prompt_template: "boxed" (problem + " " + instruction, the default) or "dapo" (DAPO's "Answer:" template, as
            the BandPO authors prompt every training and validation problem); see `trl_bandpo.data.prompts`.
        levels / level_field: keep rows whose level is in `levels` (e.g. ``(3, 4, 5)`` with ``"level"``).
        deduplicate: drop repeated problems (registry default; False for local files).
        max_samples: keep at most this many rows (after filtering), for quick runs.
        data_source: value of the ``data_source`` column (default: registry name or file name).

    Returns:
        `datasets.Dataset` with ``prompt``, ``solution`` and ``data_source``. Unusable rows (`trl_bandpo.data.rows`)
        are dropped; the count per reason is logged (a warning unless only `levels` or `deduplicate` dropped rows).

    Raises:
        ValueError: no usable row (the message counts the dropped rows per reason), an empty or unreadable file
            (invalid JSON: with its line), a missing column, an unknown `prompt_template`.
        ConnectionError: a registry dataset that cannot be loaded from the Hub (the message says how to pass a
            local file instead).
    """
    max_samples = Integer(low=1, optional=True)(max_samples, "max_samples")
    instruction = _check_template_arguments(prompt_template, instruction)
    if not os.fspath(name_or_path).strip():  # Path("") is the current folder: never read it as a dataset
        raise ValueError(
            f"name_or_path is empty (got {os.fspath(name_or_path)!r}): give a registry name ({', '.join(DATASETS)}) "
            f"or the path of a local file ({', '.join(sorted(LOCAL_FORMATS))}) or save_to_disk folder."
        )

    path = Path(os.fspath(name_or_path)).expanduser()
    registry_name = None if path.exists() else resolve_dataset_name(os.fspath(name_or_path))
    if registry_name is not None:
        spec = DATASETS[registry_name]
        raw = _load_hub(registry_name, spec, split)
        source = data_source or registry_name
        label = f"dataset {registry_name!r} (Hub id {spec.hub_id!r})"
        problem_field = spec.problem_field if problem_field is None else problem_field
        answer_field = spec.answer_field if answer_field is None else answer_field
        if levels is None and spec.levels is not None:
            levels, level_field = spec.levels, level_field or spec.level_field
        deduplicate = spec.deduplicate if deduplicate is None else deduplicate
    elif path.exists():
        raw = read_local(path, split)
        source, label = data_source or path.stem, str(path)
        deduplicate = bool(deduplicate)
    else:
        known = ", ".join(DATASETS)
        raise ValueError(f"name_or_path={os.fspath(name_or_path)!r} is neither an existing file nor one of: {known}")

    if len(raw) == 0:
        raise ValueError(f"{label} (split {split!r}) has no rows")
    first = _schema_row(raw)
    problem_key = _pick_field(problem_field, PROBLEM_FIELD_CANDIDATES, first, "problem")
    answer_key = _pick_field(answer_field, ANSWER_FIELD_CANDIDATES, first, "answer")
    level_set = None if levels is None else {int(level) for level in levels}
    level_field = level_field or "level"
    keys = [("problem_field", problem_key), ("answer_field", answer_key)]
    for what, key in keys + ([("level_field", level_field)] if level_set is not None else []):
        if not has_field(first, key):
            raise ValueError(f"{what}={key!r} is not a column of {label} (columns: {sorted(first)})")

    selection = select_rows(
        raw, problem_key, answer_key, level_field=level_field, levels=level_set, deduplicate=deduplicate,
        max_samples=max_samples,
    )  # fmt: skip
    _report_drops(selection, label, problem_key, answer_key, level_set)
    import datasets

    prompts = [format_prompt(problem, prompt_template, instruction) for problem in selection.problems]
    return datasets.Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": prompt}] for prompt in prompts],
            "solution": selection.solutions,
            "data_source": [source] * len(prompts),
        }
    )


def _schema_row(raw: Any) -> Mapping[str, Any]:
    """A row to detect columns on: a Dataset's first row, or for JSON/CSV rows (whose keys may differ from row to
    row) each key with its first non-null value."""
    if not isinstance(raw, list):
        return raw[0]
    merged: dict[str, Any] = {}
    for row in raw:
        for key, value in row.items():
            if merged.get(key) is None:
                merged[key] = value
    return merged


def _report_drops(
    selection: Selection, label: str, problem_key: str, answer_key: str, levels: set[int] | None
) -> None:
    """Raise when no row is usable; log how many rows were dropped and why (a warning for defects of the data,
    info when only the requested level filter / de-duplication dropped rows)."""
    if not selection.dropped:
        return
    drops = selection.describe_drops()
    fields = f"problem_field={problem_key!r}, answer_field={answer_key!r}"
    if levels is not None:
        fields += f", levels={sorted(levels)}"
    if not selection.problems:
        raise ValueError(
            f"{label}: none of its {selection.examined} rows is usable ({fields}): {drops}. Check problem_field / "
            "answer_field (and levels) against the data."
        )
    level = logging.INFO if set(selection.dropped) <= set(FILTERS) else logging.WARNING
    dropped = sum(selection.dropped.values())
    logger.log(level, "%s: dropped %d of %d rows read (%s): %s", label, dropped, selection.examined, fields, drops)


def load_training_mix(
    names: str | Sequence[str | os.PathLike] = "bandpo",
    *,
    seed: int | None = None,
    max_samples_per_dataset: int | None = None,
    instruction: str | None = BOXED_INSTRUCTION,
    prompt_template: str = "boxed",
):
    """Concatenate several math datasets into one training set (as BandPO merges DAPO-Math-17k and MATH L3-5).

    Args:
        names: a mix name from `TRAINING_MIXES` ("bandpo", "dgpo"), a comma-separated string, or a list of registry
            names / local files.
        seed: shuffle the merged rows with this seed (None keeps dataset order; GRPOTrainer shuffles anyway).
        max_samples_per_dataset: cap on rows taken from each dataset.
        instruction: appended to every problem by the "boxed" template (ignored by "dapo").
        prompt_template: "boxed" (default) or "dapo" (DAPO's template, as the BandPO authors use).

    Returns:
        `datasets.Dataset` with ``prompt``, ``solution``, ``data_source``.
    """
    import datasets

    instruction = _check_template_arguments(prompt_template, instruction)

    if isinstance(names, (str, os.PathLike)):
        text = os.fspath(names)
        names = list(TRAINING_MIXES.get(text.strip().lower(), [part for part in text.split(",") if part.strip()]))
    names = [os.fspath(name).strip() for name in names]
    if not names:
        raise ValueError("names must name at least one dataset (or a mix: " + ", ".join(TRAINING_MIXES) + ")")
    parts = [
        load_math_dataset(
            name, max_samples=max_samples_per_dataset, instruction=instruction, prompt_template=prompt_template
        )
        for name in names
    ]
    merged = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    return merged.shuffle(seed=seed) if seed is not None else merged


def load_eval_benchmarks(
    benchmarks: Sequence[str] | Mapping[str, Any] | None = None,
    *,
    max_problems: int | None = None,
    instruction: str | None = BOXED_INSTRUCTION,
    problem_field: str | None = None,
    answer_field: str | None = None,
    prompt_template: str = "boxed",
) -> dict[str, Any]:
    """Load evaluation benchmarks by name, local path or ``"name=path"``; Datasets given in a mapping pass through.

    Args:
        benchmarks: names/paths (default: the six of `EVAL_BENCHMARKS`) or a mapping name -> Dataset or path.
        max_problems: keep at most this many problems per benchmark.
        instruction: appended to every problem by the "boxed" template (ignored by "dapo").
        problem_field / answer_field: columns for local files.
        prompt_template: "boxed" (default) or "dapo" (DAPO's template, as the BandPO authors validate with).
            Datasets passed in a mapping keep their own prompts.

    Returns:
        dict benchmark name -> `datasets.Dataset` with ``prompt`` and ``solution``.
    """
    instruction = _check_template_arguments(prompt_template, instruction)
    if benchmarks is None:
        benchmarks = list(EVAL_BENCHMARKS)
    if isinstance(benchmarks, str):
        benchmarks = [part for part in benchmarks.split(",") if part.strip()]
    if isinstance(benchmarks, Mapping):
        items = list(benchmarks.items())
    else:
        items = []
        for entry in (os.fspath(entry).strip() for entry in benchmarks):
            name, equals, source = (part.strip() for part in entry.partition("="))
            if Path(entry).exists():
                items.append((Path(entry).stem, entry))
            elif not equals:
                items.append((resolve_dataset_name(entry) or entry, entry))
            elif source:
                items.append((name, source))
            else:
                raise ValueError(f"benchmark {name!r} has an empty path ({entry!r}): write name=path/to/file.jsonl.")
    loaded = {}
    for name, source in items:
        if hasattr(source, "column_names"):  # already a Dataset
            if max_problems is not None and len(source) > max_problems:
                source = source.select(range(max_problems))
            loaded[name] = source
        else:
            loaded[name] = load_math_dataset(
                source, max_samples=max_problems, instruction=instruction, prompt_template=prompt_template,
                problem_field=problem_field, answer_field=answer_field, data_source=name,
            )  # fmt: skip
    return loaded

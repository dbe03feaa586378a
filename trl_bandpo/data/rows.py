r"""From raw dataset rows to prompt rows: the problem text, the gold answer as text, and why a row is dropped.

Answers reach the reward exactly as stored: strings are stripped (a worked solution is reduced to its last
``\boxed{}``), JSON numbers keep their literal text (`trl_bandpo.data.files.JsonNumber`), integers are written in full
and floats with `repr` (the shortest text that reads back as the same float), except integral floats below 2**53,
written as integers (``27.0`` -> ``"27"``: benchmarks such as amc23 keep integer answers in float columns). Lists of
answers are joined by ", ". None, NaN and blank answers are missing.

A row is dropped, and counted under its first reason (`select_rows`), for an empty problem or answer, a problem or an
answer of the wrong type, a level outside the requested ones, or a repeated problem (when de-duplicating).
"""

from __future__ import annotations

import decimal
import math
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..scoring.answers import extract_boxed_answer
from .files import JsonNumber

EMPTY_PROBLEM = "empty problem"
EMPTY_ANSWER = "empty answer (missing, blank or NaN)"
PROBLEM_TYPE = "problem of the wrong type (not text)"
ANSWER_TYPE = "answer of the wrong type (not text, a number or a list)"
LEVEL = "level not in the requested levels"
DUPLICATE = "duplicate problem"
FILTERS = (LEVEL, DUPLICATE)  # asked for; every other reason is a defect of the data

# DAPO-Math-17k wraps each problem in this template (its reward reads "Answer: ..."); we swap it for ours.
_DAPO_PREFIX = re.compile(r"^\s*Solve the following math problem step by step\.[^\n]*\n\s*\n", re.DOTALL)
_DAPO_SUFFIX = re.compile(r"\s*Remember to put your answer on its own line after \"Answer:\"\.?\s*$")
_EXACT_FLOAT_INTEGERS = 2**53
_MISSING = object()


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


def _lookup(row: Mapping[str, Any], field: str, missing: Any = None) -> Any:
    """`get_field`, with `missing` for a field this row lacks (JSON rows need not all have the same keys)."""
    try:
        return get_field(row, field)
    except KeyError:
        return missing


def has_field(row: Mapping[str, Any], field: str) -> bool:
    return _lookup(row, field, _MISSING) is not _MISSING


def problem_text(value: Any) -> tuple[str, str | None]:
    """(problem text, drop reason or None) from a string or a conversation (its last user message), without DAPO's
    answer template."""
    if isinstance(value, (list, tuple)):
        messages = [m for m in value if isinstance(m, Mapping)]
        if not messages:
            return "", PROBLEM_TYPE if value else EMPTY_PROBLEM
        users = [m for m in messages if m.get("role") == "user"] or messages
        value = users[-1].get("content")
    if value is None:
        return "", EMPTY_PROBLEM
    if not isinstance(value, str) or isinstance(value, JsonNumber):
        return "", PROBLEM_TYPE
    text = _DAPO_SUFFIX.sub("", _DAPO_PREFIX.sub("", value, count=1)).strip()
    return text, None if text else EMPTY_PROBLEM


def answer_text(value: Any) -> tuple[str, str | None]:
    r"""(ground truth as text, drop reason or None); see the module docstring for the formatting rules."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "", EMPTY_ANSWER
    if isinstance(value, JsonNumber):
        return str(value), None
    if isinstance(value, (list, tuple)):
        items = [answer_text(item) for item in value]
        if any(reason == ANSWER_TYPE for _, reason in items):
            return "", ANSWER_TYPE
        parts = [text for text, _ in items if text]
        return (", ".join(parts), None) if parts else ("", EMPTY_ANSWER)
    if isinstance(value, bool):
        return "", ANSWER_TYPE
    if isinstance(value, (int, decimal.Decimal)):
        text = str(value)
    elif isinstance(value, float):
        text = str(int(value)) if value.is_integer() and abs(value) < _EXACT_FLOAT_INTEGERS else repr(value)
    elif isinstance(value, str):
        text = value.strip()
        if "\\boxed" in text or "\\fbox" in text:
            text = (extract_boxed_answer(text) or "").strip()
    else:
        return "", ANSWER_TYPE
    return text, None if text else EMPTY_ANSWER


def level_number(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = re.search(r"\d+", str(value)) if value is not None else None
    return int(match.group(0)) if match else None


def iter_rows(raw: Any, fields: Iterable[str]) -> Iterator[Mapping[str, Any]]:
    """Rows of a list of dicts, or of a `datasets.Dataset` read in batches (only the columns `fields` need)."""
    if isinstance(raw, list):
        yield from raw
        return
    columns = {name if name in raw.column_names else name.split(".")[0] for name in fields}
    for batch in raw.select_columns(sorted(columns & set(raw.column_names))).iter(batch_size=1000):
        names = list(batch)
        yield from (dict(zip(names, values)) for values in zip(*(batch[name] for name in names)))


@dataclass
class Selection:
    """What `select_rows` kept and dropped.

    Attributes:
        problems / solutions: the kept rows' problem text and answer text.
        examined: rows read (all of them, unless `max_samples` stopped the reading early).
        dropped: drop reason -> number of rows.
        examples: drop reason -> (row number, counting from 1, and the offending value) of its first row.
    """

    problems: list[str] = field(default_factory=list)
    solutions: list[str] = field(default_factory=list)
    examined: int = 0
    dropped: Counter = field(default_factory=Counter)
    examples: dict[str, tuple[int, Any]] = field(default_factory=dict)

    def describe_drops(self) -> str:
        """``"3 empty problem (first: row 2, value '');"``-style summary of the drop counts."""
        parts = []
        for reason, count in self.dropped.most_common():
            number, value = self.examples[reason]
            shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            parts.append(f"{count} {reason} (first: row {number}, value {shown})")
        return "; ".join(parts)


def select_rows(
    raw: Any,
    problem_key: str,
    answer_key: str,
    *,
    level_field: str | None = None,
    levels: set[int] | None = None,
    deduplicate: bool = False,
    max_samples: int | None = None,
) -> Selection:
    """Normalise every row (`problem_text`, `answer_text`) and keep the usable ones, counting drops per reason.

    Args:
        raw: a list of row dicts or a `datasets.Dataset`.
        problem_key / answer_key: the problem and answer fields (dotted names reach nested fields).
        level_field / levels: keep only rows whose level number is in `levels` (None: no level filter).
        deduplicate: drop rows whose problem text repeats an earlier kept row.
        max_samples: stop once this many rows are kept.
    """
    selection = Selection()
    seen: set[str] = set()
    fields = [problem_key, answer_key] + ([level_field] if levels is not None and level_field else [])
    for number, row in enumerate(iter_rows(raw, fields), start=1):
        if max_samples is not None and len(selection.problems) >= max_samples:
            break
        selection.examined = number
        value = _lookup(row, problem_key)  # the value of the first failing check
        problem, reason = problem_text(value)
        if reason is None:
            value = _lookup(row, answer_key)
            solution, reason = answer_text(value)
        if reason is None and levels is not None:
            value = _lookup(row, level_field)
            reason = None if level_number(value) in levels else LEVEL
        if reason is None and deduplicate:
            value = problem
            reason = DUPLICATE if problem in seen else None
            seen.add(problem)
        if reason is not None:
            selection.dropped[reason] += 1
            selection.examples.setdefault(reason, (number, value))
            continue
        selection.problems.append(problem)
        selection.solutions.append(solution)
    return selection

r"""Reading local dataset files into rows without changing a single answer.

`datasets.load_dataset("json" | "csv", ...)` infers one Arrow type per column, which silently rewrites gold answers:
a JSON column mixing floats and big integers becomes float64 (``9007199254740993`` -> ``9007199254740992``,
``12345678901234567890`` -> ``12345678901234567168``), and pandas reads CSV cells such as ``007`` or ``1.50`` as
numbers. So JSON, JSON Lines and CSV files are read here, in Python, with every value exactly as written: JSON
numbers as their literal text (`JsonNumber`: ``1.50`` stays ``"1.50"``; ``NaN`` becomes a float NaN, a missing
value), CSV cells as strings. Parquet files and ``save_to_disk`` folders keep their stored types (exact already) and
are read with `datasets`. Errors name the file, and for invalid JSON the line and column.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
_ENCODING = "utf-8-sig"  # UTF-8, ignoring a byte-order mark


class JsonNumber(str):
    """A JSON number kept as the exact text written in the file (``1.50`` stays ``"1.50"``).

    A `str`, so it serialises as text, while the loader can still tell a number from a string (a problem that is a
    number is a wrong type; an answer that is a number is taken as written).
    """

    __slots__ = ()

    def __repr__(self) -> str:  # shown as the number it is
        return str.__str__(self)


def _decode(text: str) -> Any:
    return json.loads(text, parse_int=JsonNumber, parse_float=JsonNumber)


def _as_row(value: Any, path: Path, where: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        kind = "number" if isinstance(value, (JsonNumber, float)) else type(value).__name__
        raise ValueError(f"{path}: {where} holds a JSON {kind} ({str(value)[:60]!r}), not an object with named fields")
    return dict(value)


def _read_json(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSON array, one JSON object (.json), or JSON Lines, with numbers as `JsonNumber`."""
    try:
        text = path.read_text(encoding=_ENCODING)
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text (byte {err.start}: {err.reason})") from None
    if not text.strip():
        raise ValueError(f"{path} is empty: it holds no rows")
    if text.lstrip().startswith("[") or path.suffix.lower() == ".json":  # one whole document
        try:
            document = _decode(text)
        except json.JSONDecodeError as err:
            if err.msg != "Extra data":  # "Extra data": several documents, i.e. JSON Lines in a .json file
                raise ValueError(f"{path}: invalid JSON at line {err.lineno}, column {err.colno}: {err.msg}") from None
        else:
            if isinstance(document, list):
                return [_as_row(item, path, f"item {i} of the JSON array") for i, item in enumerate(document)]
            return [_as_row(document, path, "the document")]
    rows = []
    # Split on "\n" only: str.splitlines would also split on U+2028 and friends, which JSON strings may hold.
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            rows.append(_as_row(_decode(line), path, f"line {number}"))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: invalid JSON at line {number}, column {err.colno}: {err.msg}") from None
    return rows


def _read_csv(path: Path) -> list[dict[str, Any]]:
    """Rows of a CSV file with a header line; every cell a string, exactly as written."""
    with open(path, newline="", encoding=_ENCODING) as handle:
        reader = csv.DictReader(handle)
        try:
            # Cells beyond the header land under the key None: not a column.
            return [{key: value for key, value in row.items() if key is not None} for row in reader]
        except csv.Error as err:
            raise ValueError(f"{path}: invalid CSV at line {reader.line_num}: {err}") from None


def _slice(rows: list[dict[str, Any]], split: str | None, path: Path) -> list[dict[str, Any]]:
    """`rows` cut by a split spec such as ``"train[:100]"`` (a single local file is the "train" split)."""
    if split is None:
        return rows
    import datasets

    try:
        parts = datasets.ReadInstruction.from_spec(split).to_absolute({"train": len(rows)})
    except (ValueError, AssertionError) as err:
        raise ValueError(
            f"split={split!r} for {path}: {err} (a single local file is the 'train' split; slices such as "
            "'train[:100]' or 'train[10%:]' work)"
        ) from None
    return [row for part in parts for row in rows[part.from_ : part.to]]


def read_local(path: Path, split: str | None = None):
    """Rows of a .jsonl/.json/.csv/.parquet file or ``save_to_disk`` folder: a list of row dicts (JSON, CSV: values
    as written) or a `datasets.Dataset` (Parquet, folders). `split`: of a folder holding a ``DatasetDict`` (default
    "train", else its first); for a file, the "train" split or a slice of it (``"train[:50]"``)."""
    if path.is_dir():
        import datasets

        try:
            loaded = datasets.load_from_disk(str(path))
        except FileNotFoundError:
            raise ValueError(
                f"{path} is a folder but no dataset saved with save_to_disk: give a file "
                f"({', '.join(sorted(LOCAL_FORMATS))}) or a folder written by Dataset.save_to_disk."
            ) from None
        if isinstance(loaded, datasets.DatasetDict):
            split = split or ("train" if "train" in loaded else next(iter(loaded)))
            if split not in loaded:
                raise ValueError(f"split={split!r} is not in {path} (has {list(loaded)})")
            return loaded[split]
        return loaded
    builder = LOCAL_FORMATS.get(path.suffix.lower())
    if builder is None:
        raise ValueError(
            f"name_or_path={str(path)!r}: unsupported file type {path.suffix!r}; use one of {sorted(LOCAL_FORMATS)}"
        )
    if builder in ("json", "csv"):
        return _slice((_read_json if builder == "json" else _read_csv)(path), split, path)
    import datasets
    import pyarrow

    try:
        return datasets.load_dataset(builder, data_files=str(path), split=split or "train")
    except (datasets.exceptions.DatasetGenerationError, pyarrow.ArrowException) as err:  # e.g. not a Parquet file
        cause = err.__cause__ or err
        raise ValueError(f"{path}: could not be read as {builder}: {type(cause).__name__}: {cause}") from None

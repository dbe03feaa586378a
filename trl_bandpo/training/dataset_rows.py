"""The dataset columns our trainers read, checked when a trainer is built, before its model loads (TRL reads them only
when it generates): docs/training.md, "What is checked in a dataset"."""

from __future__ import annotations

import base64
import inspect
import os

import datasets
import pyarrow as pa
import pyarrow.compute as pc
import torch
from trl.trainer.utils import get_callable_name

from ..core.checks import refuse

#: What TRL passes every reward function itself; any other argument one requires must be a dataset column.
TRL_PASSES = {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments"}
_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
_IMAGE = "an image: a PIL image, an image file's path, a URL or base64 data"


def _readable(image) -> bool:
    """Whether transformers' `load_image` reads `image`: a URL, a file's path, base64 data (after `data:` or not)."""
    if isinstance(image, str) and ("://" in image or image.startswith("data:") or os.path.isfile(image)):
        return True
    try:
        return bool(base64.b64decode(image, validate=True))
    except (TypeError, ValueError):  # not a string, or no base64
        return False


def _first(flags) -> int:
    """The first row where `flags` is true or null, or -1."""
    return pc.index(pc.fill_null(flags, True), True).as_py()


def check_dataset(dataset, name: str, reward_funcs, needs_prompt: bool = True) -> None:
    """Refuse `dataset` (a `datasets.Dataset`; nothing else is read), naming the column and the row TRL would fail on
    after the model loads: a column an argument of one of `reward_funcs` requires missing (TRL passes the columns by
    name); `prompt` missing (where `needs_prompt`), holding no strings or conversations, or None or [] in a row;
    `image` or `images` (a list per row) holding None or the path of no file (read as Arrow, no image decoded)."""
    if not isinstance(dataset, datasets.Dataset):
        return
    columns = set(dataset.column_names)
    for func in reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]:
        named = () if isinstance(func, torch.nn.Module) or not callable(func) else inspect.signature(func).parameters
        for argument in (named[key] for key in named):
            optional = argument.default is not argument.empty or argument.kind not in _NAMED
            if not optional and argument.name not in TRL_PASSES | columns - {"prompt", "completion"}:
                reads = f"a list with {argument.name!r} (reward function {get_callable_name(func)!r} reads it)"
                refuse(f"{name}'s columns", reads, sorted(columns))
    if needs_prompt and "prompt" not in columns:
        refuse(f"{name}'s columns", "a list with 'prompt'", sorted(columns))
    table = dataset.select_columns(sorted(columns & {"prompt", "image", "images"})).with_format("arrow")[:]
    if "prompt" in columns:
        prompts, kind = table["prompt"], table["prompt"].type
        conversations = pa.types.is_list(kind) or pa.types.is_large_list(kind)
        if not (conversations or pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            refuse(f"{name}['prompt']", "strings or lists of {'role', 'content'} messages", dataset.features["prompt"])
        if (row := _first(pc.equal(pc.list_value_length(prompts), 0) if conversations else prompts.is_null())) >= 0:
            refuse(f"{name}['prompt'][{row}]", "a string or a non-empty list of messages", prompts[row].as_py())
    for column in columns & {"image", "images"}:
        images, rows = table[column], range(len(dataset))
        if column == "images":  # a list per row: its images, each numbered with its row
            if (row := _first(images.is_null())) >= 0:
                refuse(f"{name}['images'][{row}]", "a list of images", None)
            rows = [row for row, length in enumerate(pc.list_value_length(images).to_pylist()) for _ in range(length)]
            images = pc.list_flatten(images)
        if pa.types.is_struct(images.type):  # datasets' `Image`: the image's bytes, or the path to read them from
            images = pc.if_else(pc.struct_field(images, "bytes").is_valid(), "data:", pc.struct_field(images, "path"))
        for row, image in zip(rows, images.to_pylist()):
            if not _readable(image):
                refuse(f"{name}[{column!r}][{row}]", _IMAGE, image)

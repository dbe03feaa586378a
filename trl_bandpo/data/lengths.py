"""Prompt lengths in tokens, measured as the trainer will see them, and the filter that drops overlong prompts.

The BandPO authors' verl runs drop every prompt longer than 1,024 tokens (``data.filter_overlong_prompts``); TRL has
no such setting, so `drop_long_prompts` applies the filter to a prompt dataset before training. A prompt is measured
as `trl.GRPOTrainer` tokenizes it: a conversation through the chat template with ``add_generation_prompt=True``, a
plain-text prompt with the tokenizer itself.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ..core.checks import Integer

logger = logging.getLogger(__name__)

_BATCH = 1000


def _is_conversation(prompt: Any) -> bool:
    return (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, str)
        and all(isinstance(message, Mapping) and "role" in message for message in prompt)
    )


def _check_prompts(prompts: Any) -> list[Any]:
    """`prompts` as a list, each a string or a non-empty list of ``{"role", "content"}`` messages; ValueError naming
    the first malformed one and the fix otherwise."""
    if isinstance(prompts, (str, bytes, Mapping)) or not isinstance(prompts, Sequence):
        raise ValueError(f"prompts must be a list of prompts (strings or chat conversations), got {prompts!r:.200}.")
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str) or (
            _is_conversation(prompt) and prompt and all(isinstance(m.get("content"), (str, list)) for m in prompt)
        ):
            continue
        raise ValueError(
            f"prompt {index} must be a string or a non-empty list of {{'role': ..., 'content': ...}} messages with "
            f"text content, got {prompt!r:.200}: fix the dataset's prompt column (TRL takes prompts in these forms)."
        )
    return list(prompts)


def prompt_lengths(
    prompts: Sequence[Any], tokenizer: Any, chat_template_kwargs: Mapping[str, Any] | None = None
) -> list[int]:
    """The number of tokens of each prompt (a string or a list of ``{"role", "content"}`` messages) as the trainer
    tokenizes it. `tokenizer` may be a model folder or Hub id; `chat_template_kwargs` as `GRPOConfig` passes them.
    ValueError names the first malformed prompt by its index."""
    prompts = _check_prompts(prompts)
    if isinstance(tokenizer, (str, os.PathLike)):  # a model folder or Hub id
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(os.fspath(tokenizer))
    kwargs = dict(chat_template_kwargs or {})
    lengths: list[int] = []
    for start in range(0, len(prompts), _BATCH):
        batch = list(prompts[start : start + _BATCH])
        conversational = [_is_conversation(prompt) for prompt in batch]
        chats = [prompt for prompt, is_chat in zip(batch, conversational) if is_chat]
        texts = [prompt for prompt, is_chat in zip(batch, conversational) if not is_chat]
        chat_ids, text_ids = iter([]), iter(tokenizer(text=texts)["input_ids"] if texts else [])
        if chats:
            encoded = tokenizer.apply_chat_template(chats, add_generation_prompt=True, return_dict=True, **kwargs)
            chat_ids = iter(encoded["input_ids"])
        lengths.extend(len(next(chat_ids) if is_chat else next(text_ids)) for is_chat in conversational)
    return lengths


def drop_long_prompts(
    dataset: Any,
    tokenizer: Any,
    max_tokens: int | None,
    *,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    prompt_column: str = "prompt",
    field: str = "max_tokens",
    label: str = "dataset",
):
    """The rows of `dataset` whose prompt (in `prompt_column`) has at most `max_tokens` tokens, chat template and
    generation prompt included (`prompt_lengths`), as the BandPO authors' scripts keep at 1,024; `dataset` itself
    when `max_tokens` is None or nothing is dropped. How many were dropped is logged. `field` and `label` are how
    messages name the setting (e.g. a recipe field) and the dataset (e.g. ``"training set"``).

    Raises:
        ValueError: `max_tokens` is not a positive integer, `prompt_column` is missing, or every prompt is longer
            (the message gives the shortest and the longest length).
    """
    max_tokens = Integer(low=1, optional=True)(max_tokens, field)
    if max_tokens is None:
        return dataset
    if prompt_column not in dataset.column_names:
        raise ValueError(f"{label} has no {prompt_column!r} column (columns: {dataset.column_names})")
    if len(dataset) == 0:
        return dataset
    lengths = prompt_lengths(dataset[prompt_column], tokenizer, chat_template_kwargs)
    keep = [index for index, length in enumerate(lengths) if length <= max_tokens]
    if not keep:
        raise ValueError(
            f"{field}={max_tokens} drops every prompt of the {label}: all {len(lengths)} are longer (shortest "
            f"{min(lengths)} tokens, longest {max(lengths)}, chat template included). Set {field} to at least "
            f"{min(lengths)}, or to null to keep every prompt."
        )
    dropped, setting = len(lengths) - len(keep), f"{field}={max_tokens}"
    if not dropped:
        logger.info("%s: all %d prompts of the %s fit (longest %d tokens)", setting, len(keep), label, max(lengths))
        return dataset
    summary = f"dropped {dropped} of {len(lengths)} prompts of the {label} longer than {max_tokens} tokens"
    logger.info("%s: %s (longest %d); %d kept", setting, summary, max(lengths), len(keep))
    return dataset.select(keep)

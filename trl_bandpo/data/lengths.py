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
    """The number of tokens of each prompt as the trainer tokenizes it.

    Args:
        prompts (`Sequence`):
            Conversational prompts (lists of ``{"role", "content"}`` messages) or plain strings.
        tokenizer (`PreTrainedTokenizerBase` or `str`):
            The model's tokenizer, or the model folder / Hub id to load it from.
        chat_template_kwargs (`Mapping`, *optional*):
            Extra arguments of the chat template (e.g. ``{"enable_thinking": False}``), as `GRPOConfig` passes them.

    Returns:
        `list[int]`: one length per prompt.

    Raises:
        ValueError: a malformed prompt (neither a string nor a list of messages), named by its index.
    """
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
        chat_ids = []
        if chats:
            chat_ids = tokenizer.apply_chat_template(
                chats, add_generation_prompt=True, tokenize=True, return_dict=True, **kwargs
            )["input_ids"]
        text_ids = tokenizer(text=texts)["input_ids"] if texts else []
        chat_iter, text_iter = iter(chat_ids), iter(text_ids)
        lengths.extend(len(next(chat_iter) if is_chat else next(text_iter)) for is_chat in conversational)
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
    """Drop the rows whose prompt is longer than `max_tokens` tokens, as the BandPO authors' scripts do at 1,024.

    Args:
        dataset (`datasets.Dataset`):
            A prompt dataset (a ``prompt`` column of conversations or strings).
        tokenizer (`PreTrainedTokenizerBase` or `str`):
            The tokenizer of the model to train, or its folder / Hub id.
        max_tokens (`int` or `None`):
            The longest prompt kept, in tokens (chat template and generation prompt included). `None` keeps all.
        chat_template_kwargs (`Mapping`, *optional*):
            Extra arguments of the chat template, as in `GRPOConfig.chat_template_kwargs`.
        prompt_column (`str`, *optional*, defaults to `"prompt"`):
            The column holding the prompts.
        field (`str`, *optional*, defaults to `"max_tokens"`):
            The setting to name in messages (e.g. ``"max_prompt_tokens"`` for a recipe field).
        label (`str`, *optional*, defaults to `"dataset"`):
            What the dataset is, for messages (e.g. ``"training set"``).

    Returns:
        `datasets.Dataset`: the rows whose prompt has at most `max_tokens` tokens (`dataset` itself when none is
        dropped or `max_tokens` is `None`). How many were dropped is logged.

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
    dropped = len(lengths) - len(keep)
    if not dropped:
        logger.info("%s=%d: all %d prompts of the %s fit (longest %d tokens)", field, max_tokens, len(lengths),
                    label, max(lengths))  # fmt: skip
        return dataset
    logger.info(
        "%s=%d: dropped %d of %d prompts of the %s longer than %d tokens (longest %d); %d kept",
        field, max_tokens, dropped, len(lengths), label, max_tokens, max(lengths), len(keep),
    )  # fmt: skip
    return dataset.select(keep)

"""Library messages that are not the user's to act on, filtered by their whole text within a block: transformers'
deprecations of `gradient_checkpointing` (TRL's default, and TRL's calls) and DeepSpeed's CPU-accelerator line."""

from __future__ import annotations

import contextlib
import logging
import re
import warnings

#: The FutureWarnings transformers (`transformers.training_args`, `transformers.modeling_utils`) emits for TRL's own
#: default (`gradient_checkpointing=True`) and calls, whole texts.
LIBRARY_FUTURE_WARNINGS = tuple(
    f"`{old}` is deprecated and will be removed in v6. Use `{new}` instead."
    for old, new in (
        ("gradient_checkpointing", "activation_checkpointing"),
        ("is_gradient_checkpointing", "is_activation_checkpointing"),
        ("gradient_checkpointing_disable", "activation_checkpointing_disable"),
        ("gradient_checkpointing_enable", "activation_checkpointing_enable"),
    )
)
#: DeepSpeed's line on a machine without a GPU (logged by its "DeepSpeed" logger when accelerate imports it).
DEEPSPEED_CPU_LINE = "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."


def _not_deepspeed_cpu_line(record: logging.LogRecord) -> bool:
    return record.getMessage() != DEEPSPEED_CPU_LINE


@contextlib.contextmanager
def library_noise_filtered():
    """Within the block, drop the messages of `LIBRARY_FUTURE_WARNINGS` and `DEEPSPEED_CPU_LINE`, nothing else."""
    deepspeed_logger = logging.getLogger("DeepSpeed")
    with warnings.catch_warnings():
        for message in LIBRARY_FUTURE_WARNINGS:
            # By the whole text, not the module: the trainers re-emit the library warnings raised while they are
            # built at the caller's line (`trl_bandpo.training.trainer`), so the module they carry is the caller's.
            warnings.filterwarnings("ignore", message=re.escape(message) + r"\Z", category=FutureWarning)
        added = _not_deepspeed_cpu_line not in deepspeed_logger.filters  # a nested block leaves the outer one's
        deepspeed_logger.addFilter(_not_deepspeed_cpu_line)
        try:
            yield
        finally:
            if added:
                deepspeed_logger.removeFilter(_not_deepspeed_cpu_line)

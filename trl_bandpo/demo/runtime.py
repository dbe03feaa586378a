"""Process plumbing shared by the demo's steps: seeding, forked RNG state, progress bars, quiet libraries."""

from __future__ import annotations

import contextlib
import logging
import random
import sys
import warnings


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global RNGs with `seed`."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@contextlib.contextmanager
def forked_rng(seed: int):
    """Run the block under torch's CPU RNG seeded with `seed`, restoring the global RNG state afterwards."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def progress_bar(**kwargs):
    """A `tqdm` progress bar on stderr; `kwargs` go to `tqdm` (e.g. ``total``, ``desc``, ``disable``)."""
    from tqdm.auto import tqdm

    return tqdm(dynamic_ncols=True, file=sys.stderr, **kwargs)


#: DeepSpeed's line on a machine without a GPU, logged when accelerate imports it.
_DEEPSPEED_CPU_LINE = "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."


def _not_deepspeed_cpu_line(record: logging.LogRecord) -> bool:
    return record.getMessage() != _DEEPSPEED_CPU_LINE


@contextlib.contextmanager
def quiet_libraries():
    """Silence library warnings, progress bars and DeepSpeed's CPU line during the demo, and restore the settings
    afterwards."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        import datasets

        datasets_bars = datasets.is_progress_bar_enabled()
        datasets.disable_progress_bars()
    except (ImportError, AttributeError):
        datasets, datasets_bars = None, False
    deepspeed_logger = logging.getLogger("DeepSpeed")
    deepspeed_logger.addFilter(_not_deepspeed_cpu_line)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        deepspeed_logger.removeFilter(_not_deepspeed_cpu_line)
        transformers.logging.set_verbosity(verbosity)
        if bars:
            transformers.utils.logging.enable_progress_bar()
        if datasets is not None and datasets_bars:
            datasets.enable_progress_bars()

"""BandPO and DGPO for HuggingFace TRL.

The public names load on first use (`import trl_bandpo` alone imports nothing heavy, so `trl-bandpo --help` starts at
once): the Band operator and the policy losses (`band_bounds`, `policy_loss`, ...; torch) and the configs and trainers
(TRL). Importing it registers the Triton KL solver, which `band_bounds` uses where it can run. The layers, one folder
each, are described in docs/architecture.md.
"""

import importlib
from typing import TYPE_CHECKING

from . import kernels  # noqa: F401  (registers the Triton KL solver with band_bounds; imports no torch)
from .version import __version__  # noqa: F401

_LAZY = {
    name: module
    for module, names in {
        "core.band": ("DIVERGENCES", "band_bounds"),
        "core.losses": ("POLICY_LOSSES", "policy_bounds", "policy_loss"),
        "training.configs": ("PolicyLossConfig", "BandPOConfig", "DGPOConfig"),
        "training.trainer": ("PolicyLossTrainer", "BandPOTrainer", "DGPOTrainer"),
        "training.async_trainer": ("AsyncPolicyLossConfig", "AsyncBandPOConfig", "AsyncDGPOConfig",
                                   "AsyncPolicyLossTrainer", "AsyncBandPOTrainer", "AsyncDGPOTrainer"),
    }.items()
    for name in names
}  # fmt: skip

# The async classes stay out of `import *`: they import TRL's experimental API (which warns on import).
__all__ = [name for name in _LAZY if not name.startswith("Async")]

if TYPE_CHECKING:
    from .core.band import DIVERGENCES, band_bounds  # noqa: F401
    from .core.losses import POLICY_LOSSES, policy_bounds, policy_loss  # noqa: F401
    from .training.async_trainer import (  # noqa: F401
        AsyncBandPOConfig,
        AsyncBandPOTrainer,
        AsyncDGPOConfig,
        AsyncDGPOTrainer,
        AsyncPolicyLossConfig,
        AsyncPolicyLossTrainer,
    )
    from .training.configs import BandPOConfig, DGPOConfig, PolicyLossConfig  # noqa: F401
    from .training.trainer import BandPOTrainer, DGPOTrainer, PolicyLossTrainer  # noqa: F401


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

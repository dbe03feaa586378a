"""BandPO and DGPO for HuggingFace TRL.

The public names load on first use (`import trl_bandpo` alone imports nothing heavy, so `trl-bandpo --help` starts at
once): the Band operator and the policy losses (`band_bounds`, `policy_loss`, ...; torch) and the configs and trainers
(TRL). Importing it registers the Triton KL solver, which `band_bounds` uses where it can run. The layers, one folder
each, are described in docs/architecture.md.
"""

from typing import TYPE_CHECKING

from . import kernels  # noqa: F401  (registers the Triton KL solver with band_bounds; imports no torch)
from .version import __version__  # noqa: F401

_LAZY = {
    "DIVERGENCES": "core.band",
    "band_bounds": "core.band",
    "POLICY_LOSSES": "core.losses",
    "policy_bounds": "core.losses",
    "policy_loss": "core.losses",
    "PolicyLossConfig": "training.configs",
    "BandPOConfig": "training.configs",
    "DGPOConfig": "training.configs",
    "PolicyLossTrainer": "training.trainer",
    "BandPOTrainer": "training.trainer",
    "DGPOTrainer": "training.trainer",
    "AsyncPolicyLossConfig": "training.async_trainer",
    "AsyncBandPOConfig": "training.async_trainer",
    "AsyncDGPOConfig": "training.async_trainer",
    "AsyncPolicyLossTrainer": "training.async_trainer",
    "AsyncBandPOTrainer": "training.async_trainer",
    "AsyncDGPOTrainer": "training.async_trainer",
}

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
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

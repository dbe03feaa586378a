"""BandPO and DGPO for HuggingFace TRL.

Layers, imported one way (docs/architecture.md): the math (`band`, `losses`, `metrics`) imports only torch; the
`kernels` import the math (Triton only on first use) and register the Triton solver with `band_bounds`; the
configs and trainers (imported on first use, they import TRL) build on both; the applications (`cli`, `demo`,
`evaluation`, `rewards`, `data`) come last.
"""

from typing import TYPE_CHECKING

from . import kernels  # noqa: F401  (registers the Triton KL solver with band_bounds)
from .core.band import DIVERGENCES, band_bounds
from .core.losses import POLICY_LOSSES, policy_bounds, policy_loss
from .version import __version__  # noqa: F401

_LAZY = {
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
__all__ = [
    "DIVERGENCES",
    "POLICY_LOSSES",
    "band_bounds",
    "policy_bounds",
    "policy_loss",
    *(name for name in _LAZY if not name.startswith("Async")),
]

if TYPE_CHECKING:
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

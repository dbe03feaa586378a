"""BandPO and DGPO for HuggingFace TRL.

The math (`band_bounds`, `policy_loss`) imports only torch; the trainers and configs import TRL on first use.
"""

from typing import TYPE_CHECKING

from .band import DIVERGENCES, band_bounds
from .losses import POLICY_LOSSES, policy_bounds, policy_loss

__version__ = "0.1.0"

_LAZY = {
    "PolicyLossConfig": "configs",
    "BandPOConfig": "configs",
    "DGPOConfig": "configs",
    "PolicyLossTrainer": "trainer",
    "BandPOTrainer": "trainer",
    "DGPOTrainer": "trainer",
}

__all__ = ["DIVERGENCES", "POLICY_LOSSES", "band_bounds", "policy_bounds", "policy_loss", *_LAZY]

if TYPE_CHECKING:
    from .configs import BandPOConfig, DGPOConfig, PolicyLossConfig
    from .trainer import BandPOTrainer, DGPOTrainer, PolicyLossTrainer


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

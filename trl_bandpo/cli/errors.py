"""The error type of the `trl-bandpo train` configuration checks."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A recipe or command line that does not describe a valid run (unknown key, bad value)."""

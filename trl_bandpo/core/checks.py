"""The checks every setting goes through (`Number`, `Integer`, `Choice`, `Flag`), and the one message they speak.

A check is called as ``check(value, field)``: it returns the value normalised (a `float` for a number, an `int` for
an integer, `None` for an optional setting given as None or as the word "none"/"null") or raises
``ValueError("<field> must be <what is allowed>, got <value>.")``.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: How YAML files and command lines spell None.
NONE_WORDS = ("none", "null")
#: float32's largest finite number (`torch.finfo(torch.float32).max`): a setting that reaches a float32 tensor as a
#: scalar must not exceed it (torch refuses to convert it, or it becomes inf and `inf * 0` NaN).
FLOAT32_MAX = 3.4028234663852886e38
#: Integers beyond int64 fit no tensor and no setting of TRL's: refused by every integer check.
INT64_LIMIT = 2**63


def none_word(value: Any) -> Any:
    """None for None and for the words of `NONE_WORDS` (any case, surrounding spaces ignored); else `value`."""
    if isinstance(value, str) and value.strip().lower() in NONE_WORDS:
        return None
    return value


def is_number(value: Any) -> bool:
    """Whether `value` is a real number: an int, a float or a NumPy scalar, but not a bool (nor a tensor)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def shown(value: Any) -> str:
    """`value` as a message shows it: its repr, but only the type and shape of a tensor (printing a CUDA tensor's
    values would synchronise with the device)."""
    if type(value).__module__.startswith("torch") and hasattr(value, "shape"):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, int) and abs(value) >= 10**30:  # Python refuses to print more than 4,300 digits
        return f"an integer of {int(abs(value).bit_length() * 0.30103) + 1} digits"
    return repr(value)


def _integral(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def as_float(value: Any) -> float:
    """`float(value)` for a real number, an integer too large for a float being +-inf (not an OverflowError)."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def refuse(field: str, allowed: str, value: Any) -> None:
    """Raise the one message of this package: ``<field> must be <allowed>, got <value>.``"""
    raise ValueError(f"{field} must be {allowed}, got {shown(value)}.")


class _Check:
    optional: bool

    def __call__(self, value: Any, field: str) -> Any:
        if self.optional and none_word(value) is None:
            return None
        if not self._accepts(value):
            refuse(field, self.allowed, value)
        return self._normalise(value)

    @property
    def allowed(self) -> str:
        """What the check accepts, in words (e.g. ``"a finite number > 0"``)."""
        return ("None or " if self.optional else "") + self._describe()

    def _normalise(self, value: Any) -> Any:
        return value


@dataclass(frozen=True)
class Number(_Check):
    """A real number in the interval from `low` to `high` (each end optional, closed unless `*_open`); finite unless
    `finite=False` (then an infinite end of the interval is allowed too, e.g. a cap of `inf`: no cap)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    optional: bool = False
    finite: bool = True

    def _accepts(self, value: Any) -> bool:
        if not is_number(value):
            return False
        value = as_float(value)
        if math.isnan(value) or (self.finite and math.isinf(value)):
            return False
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def _normalise(self, value: Any) -> float:
        return as_float(value)

    def _describe(self) -> str:
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            return f"a number in {left}{self.low:g}, {self.high:g}{right}"
        kind = "a finite number" if self.finite else "a number"
        if self.low is not None:
            return f"{kind} {'>' if self.low_open else '>='} {self.low:g}"
        if self.high is not None:
            return f"{kind} {'<' if self.high_open else '<='} {self.high:g}"
        return kind


@dataclass(frozen=True)
class Integer(_Check):
    """An integral number (Python or NumPy, not a bool; not a float, even 2.0) from `low` to `high` inclusive, and
    below `INT64_LIMIT` in magnitude unless `any_size` (pure arithmetic on Python integers)."""

    low: int | None = None
    high: int | None = None
    optional: bool = False
    any_size: bool = False

    def __call__(self, value: Any, field: str) -> Any:
        if not self.any_size and _integral(value) and not -INT64_LIMIT <= value < INT64_LIMIT:
            refuse(field, f"{self.allowed} that fits in 64 bits", value)
        return super().__call__(value, field)

    def _accepts(self, value: Any) -> bool:
        return (
            _integral(value) and (self.low is None or value >= self.low) and (self.high is None or value <= self.high)
        )

    def _normalise(self, value: Any) -> int:
        return int(value)

    def _describe(self) -> str:
        if self.low is not None and self.high is not None:
            return f"an integer in [{self.low}, {self.high}]"
        if self.low is not None:
            return f"an integer >= {self.low}"
        return "an integer of 64 bits"


@dataclass(frozen=True)
class Choice(_Check):
    """One of `choices` (compared with ``==``; a string is never taken for a bool or a number)."""

    choices: tuple
    optional: bool = False

    def _accepts(self, value: Any) -> bool:
        return any(type(value) is type(choice) and value == choice for choice in self.choices)

    def _describe(self) -> str:
        return f"one of {list(self.choices)}"


@dataclass(frozen=True)
class Flag(_Check):
    """True or False (a bool; not 0, 1 or a string)."""

    optional: bool = False

    def _accepts(self, value: Any) -> bool:
        return isinstance(value, bool)

    def _describe(self) -> str:
        return "true or false"


@dataclass(frozen=True)
class Text(_Check):
    """A non-empty string or path (returned as a string)."""

    optional: bool = False

    def _accepts(self, value: Any) -> bool:
        return isinstance(value, (str, os.PathLike)) and os.fspath(value).strip() != ""

    def _normalise(self, value: Any) -> str:
        return os.fspath(value)

    def _describe(self) -> str:
        return "a non-empty path or name"


@dataclass(frozen=True)
class JSONObject(_Check):
    """A mapping that JSON can write (configs are saved as JSON), or a string holding a JSON object (returned
    parsed)."""

    optional: bool = False

    def _accepts(self, value: Any) -> bool:
        try:
            value = json.loads(value) if isinstance(value, str) else value
            return isinstance(value, Mapping) and bool(json.dumps(dict(value)))
        except (ValueError, TypeError, RecursionError):
            return False

    def _normalise(self, value: Any) -> Any:
        return json.loads(value) if isinstance(value, str) else value

    def _describe(self) -> str:
        return "a mapping of JSON values, or a string holding a JSON object"

"""Checks of a `trl-bandpo train` configuration that TRL's parser does not make, run before any dataclass is built.

- Recipe values against the field types: argparse converts only the *string* defaults (what `TrlParser` makes of a
  recipe's values), so `learning_rate: [1]`, `max_steps: 1.5` or `use_vllm: 3` would otherwise reach the run as they
  are.
- After the command line is read (`check_namespace`): unknown flags first, then the required fields, a positive
  `max_completion_length`, and an explicit `policy_loss` whenever a loss-specific field (`band_*`, `dgpo_*`,
  `ce_gppo_*`, `aspo_*`) is set: without one the run is plain GRPO (`policy_loss="clip"`), which does not read them.
  Dynamic sampling (`dynamic_sampling*`) works with every policy loss, plain GRPO included, and needs none.
- `resume_from_checkpoint`: `true` / `false` (any case) mean what the YAML booleans mean (the latest checkpoint of
  `output_dir` / no resume), on the command line too, where the string field would otherwise keep the text.
- `prompt_template` (`check_prompt_fields`, from `ScriptArguments.__post_init__`): one of the registered templates;
  with `"dapo"`, an `instruction` other than the default is ignored, and a warning says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
import warnings
from collections.abc import Iterable, Sequence

from transformers.hf_argparser import string_to_bool
from trl import GRPOConfig

from ..core.loss_registry import registered_policy_losses
from ..data import BOXED_INSTRUCTION, PROMPT_TEMPLATES
from ..training.configs import PolicyLossConfig
from .errors import ConfigError

__all__ = [
    "ANY_LOSS_FIELDS",
    "REQUIRED",
    "check_namespace",
    "check_prompt_fields",
    "check_recipe_types",
    "loss_specific_fields",
    "scalar_field_types",
]

#: Fields a run cannot do without -> what they take.
REQUIRED = {
    "model_name_or_path": "a hub id or a local folder",
    "dataset_name": "a mix, registry names or local files",
}
_EXPECTED = {bool: "a boolean (true/false)", int: "an integer", float: "a number"}
_CONVERT = {bool: string_to_bool, int: int, float: float}


def scalar_field_types(dataclass_types: Iterable[type]) -> dict[str, tuple[type, bool, bool]]:
    """``name -> (type, nullable, is_list)`` for the fields typed `bool`, `int` or `float`, optionally `| None`, or a
    list of those. Fields that also take strings (``str | bool``) or other types are left out."""
    out = {}
    for dataclass_type in dataclass_types:
        hints = typing.get_type_hints(dataclass_type)
        for f in dataclasses.fields(dataclass_type):
            if not f.init:
                continue
            hint, nullable = hints[f.name], False
            if typing.get_origin(hint) in (typing.Union, types.UnionType):
                others = [arg for arg in typing.get_args(hint) if arg is not type(None)]
                nullable = len(others) < len(typing.get_args(hint))
                if len(others) != 1:
                    continue
                hint = others[0]
            is_list = typing.get_origin(hint) is list
            if is_list:
                hint = (typing.get_args(hint) or (None,))[0]
            if hint in _EXPECTED:
                out[f.name] = (hint, nullable, is_list)
    return out


def _is_instance(value, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    return isinstance(value, int) if kind is int else isinstance(value, (int, float))


def _check_value(name: str, value, kind: type, nullable: bool, is_list: bool, where: str) -> None:
    expected = f"a list of {_EXPECTED[kind].removeprefix('a ').removeprefix('an ')}s" if is_list else _EXPECTED[kind]
    expected += " or null" if nullable else ""
    if value is None:
        if nullable:
            return
        raise ConfigError(f"{name} {where} must be {expected}, got null.")
    if is_list and isinstance(value, list):
        bad = [item for item in value if not _is_instance(item, kind)]
        if bad:
            raise ConfigError(f"{name} {where} must be {expected}, got {value!r} ({bad[0]!r} is not).")
        return
    if isinstance(value, str):  # argparse converts a string default with the field's type: check it converts
        try:
            _CONVERT[kind](value)
        except (ValueError, argparse.ArgumentTypeError):
            hint = " (YAML writes None as null)" if nullable and value.strip().lower() in ("none", "null") else ""
            raise ConfigError(f"{name} {where} must be {expected}, got {value!r}{hint}.") from None
        return
    if not _is_instance(value, kind):
        raise ConfigError(f"{name} {where} must be {expected}, got {value!r} ({type(value).__name__}).")


def check_recipe_types(recipe: dict, dataclass_types: Iterable[type], where: str) -> None:
    """Raise `ConfigError` for a recipe value whose type does not fit its `bool` / `int` / `float` field.

    Integers are numbers; booleans are neither integers nor numbers; a string passes when the field's type converts
    it (``"1e-6"``, which YAML reads as a string, is the float 1e-6), as argparse will.

    Args:
        recipe: the recipe's ``{field: value}``.
        dataclass_types: the dataclasses the fields belong to.
        where: where the values come from, for the message (``"in recipe 'path'"``).
    """
    kinds = scalar_field_types(dataclass_types)
    for name, value in recipe.items():
        if name in kinds:
            _check_value(name, value, *kinds[name], where)


#: Fields `PolicyLossConfig` adds that every policy loss honours, plain GRPO (`policy_loss="clip"`) included: setting
#: them needs no explicit `policy_loss`.
ANY_LOSS_FIELDS = ("dynamic_sampling", "dynamic_sampling_max_rounds", "old_logps_source")


def loss_specific_fields() -> tuple[str, ...]:
    """The fields `PolicyLossConfig` adds to `trl.GRPOConfig` besides `policy_loss` (`band_*`, `dgpo_*`, ...) that
    only some policy losses read; `ANY_LOSS_FIELDS` (dynamic sampling) work with every loss and are not among them."""
    base = {f.name for f in dataclasses.fields(GRPOConfig)} | {"policy_loss", *ANY_LOSS_FIELDS}
    return tuple(f.name for f in dataclasses.fields(PolicyLossConfig) if f.name not in base)


def _losses_reading(fields: Sequence[str]) -> list[str]:
    """The registered policy losses (other than "clip") that read any of `fields` (only for the message's hint)."""
    names = []
    for name, spec in registered_policy_losses().items():
        read = set(spec.config_fields)
        if name != "clip" and read & set(fields):
            names.append(name)
    return names


def _unknown_flags(remaining: Sequence[str]) -> list[str]:
    flags = [s.split("=", 1)[0].lstrip("-").replace("-", "_") for s in remaining if s.startswith("-")]
    return flags or list(remaining)


def check_namespace(namespace: argparse.Namespace, remaining: Sequence[str], given: set[str], unknown_message):
    """Check the parsed (not yet built) configuration; fix `resume_from_checkpoint` in place.

    Args:
        namespace: argparse's values of every field (recipe values as defaults, command line on top).
        remaining: command-line strings no field took.
        given: the fields among `policy_loss` and `loss_specific_fields()` that the recipe or the command line set.
        unknown_message: ``(names, remaining) -> str``, the message for unknown flags.

    Raises:
        ConfigError: unknown flags; missing required fields; `max_completion_length` < 1; loss-specific fields
            without an explicit `policy_loss`.
    """
    if remaining:
        raise ConfigError(unknown_message(_unknown_flags(remaining), remaining))
    missing = [name for name in REQUIRED if getattr(namespace, name, None) in (None, "", [])]
    if missing:
        listed = "; ".join(f"{name} ({REQUIRED[name]})" for name in missing)
        raise ConfigError(
            f"missing required field(s): {listed}. Set them in the recipe (`field: value`) or on the command line "
            "(`--field value`)."
        )
    length = getattr(namespace, "max_completion_length", None)
    if length is not None and not length > 0:
        raise ConfigError(
            f"max_completion_length must be a positive integer (tokens generated per completion), got {length!r}."
        )
    loss_fields = [name for name in loss_specific_fields() if name in given]
    if loss_fields and "policy_loss" not in given:
        losses = _losses_reading(loss_fields)
        suggestion = f" (these fields are read by {', '.join(repr(n) for n in losses)})" if losses else ""
        raise ConfigError(
            f"{', '.join(loss_fields)} set but policy_loss is not: this run would train plain GRPO "
            f"(policy_loss='clip', the default), which does not read {'it' if len(loss_fields) == 1 else 'them'}. "
            f"Set policy_loss explicitly{suggestion}, e.g. "
            f"`policy_loss: {losses[0] if losses else 'band'}` in the recipe or `--policy_loss "
            f"{losses[0] if losses else 'band'}`; `policy_loss: clip` keeps GRPO."
        )
    resume = getattr(namespace, "resume_from_checkpoint", None)
    if isinstance(resume, str) and resume.strip().lower() in ("true", "false"):
        namespace.resume_from_checkpoint = resume.strip().lower() == "true"


def check_prompt_fields(prompt_template, instruction, reward=None) -> None:
    """Check `prompt_template` against `trl_bandpo.data.PROMPT_TEMPLATES`; warn when `"dapo"` meets an `instruction`.

    Args:
        prompt_template: the `ScriptArguments.prompt_template` value.
        instruction: the `ScriptArguments.instruction` value (None when unset with `none`/`null`).
        reward: the `ScriptArguments.reward` value: `"dapo"` (reads the "Answer:" line) and the DAPO template go
            together; a mismatch warns, since every answer would score wrong.

    Raises:
        ValueError: `prompt_template` is no registered template (the message names the field, the value and the
            choices).
    """
    if not isinstance(prompt_template, str) or prompt_template not in PROMPT_TEMPLATES:
        raise ValueError(f"prompt_template must be one of {list(PROMPT_TEMPLATES)}, got {prompt_template!r}.")
    if prompt_template == "dapo" and instruction not in (None, BOXED_INSTRUCTION):
        warnings.warn(
            f"prompt_template='dapo' ignores instruction={instruction!r}: DAPO's template carries its own "
            "instruction. Remove `instruction`, or set `prompt_template: boxed` to use it.",
            UserWarning,
            stacklevel=3,
        )
    if reward is not None and (reward == "dapo") != (prompt_template == "dapo"):
        warnings.warn(
            f"reward={reward!r} with prompt_template={prompt_template!r}: the 'dapo' reward reads the 'Answer:' line "
            "that DAPO's template asks for, the other rewards the last \\boxed{}; a prompt asking for the other "
            "format scores every answer wrong. Use 'dapo' for both, or for neither.",
            UserWarning,
            stacklevel=3,
        )

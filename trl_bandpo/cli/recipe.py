r"""Recipe parsing for `trl-bandpo train`: [`ScriptArguments`] and TRL's `TrlParser`, failing loudly and early.

A recipe (YAML) sets the defaults of three dataclasses and command-line flags override them: [`ScriptArguments`]
(data, reward), [`~trl_bandpo.PolicyLossConfig`] (every `trl.GRPOConfig` field plus the policy-loss fields) and
`trl.ModelConfig` (model, dtype, LoRA, quantisation). Unlike `trl grpo`, a key or flag that is no field of these is an
error naming it, the closest valid names and where it came from; so are a repeated key, a value of the wrong type and
loss-specific fields without `policy_loss` (`recipe_yaml`, `recipe_checks`). These errors come before the dataclasses
are built, so before their own checks (such as bf16 on a machine without a GPU) and before any model or data loads.
With `async_rollouts: true` the second dataclass is [`~trl_bandpo.AsyncPolicyLossConfig`] (TRL's `AsyncGRPOConfig`
plus the policy-loss fields) and `dtype` is read once, by it.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
import sys
import typing
from collections.abc import Sequence

from trl import ModelConfig, TrlParser

from ..data import TRAINING_MIXES
from ..training.configs import PolicyLossConfig, config_class_with_loss_fields
from .errors import ConfigError
from .recipe_checks import check_namespace, check_recipe_types, loss_specific_fields
from .recipe_yaml import read_recipe_yaml
from .script_arguments import REWARDS, ScriptArguments

__all__ = [
    "DATACLASS_TYPES",
    "REWARDS",
    "ConfigError",
    "ScriptArguments",
    "known_keys",
    "load_recipe",
    "make_parser",
    "parse_args",
]

_CPU_HINT = (
    " On a machine without a GPU set `use_cpu: true` and `bf16: false` in the recipe (or `--use_cpu true --bf16 "
    "false`)."
)


DATACLASS_TYPES = (ScriptArguments, PolicyLossConfig, ModelConfig)


@functools.cache
def _async_model_config() -> type:
    """`trl.ModelConfig`'s fields without those `AsyncGRPOConfig` has too (`dtype`): argparse takes each flag once,
    and the async trainer loads the model with its config's `dtype`. `parse_args` turns it into a `ModelConfig`."""
    from ..training.async_trainer import AsyncPolicyLossConfig

    shared = {f.name for f in dataclasses.fields(AsyncPolicyLossConfig)}
    specs = []
    for f in dataclasses.fields(ModelConfig):
        if f.init and f.name not in shared:
            default = {"default": f.default} if f.default is not dataclasses.MISSING else {}
            if f.default_factory is not dataclasses.MISSING:
                default = {"default_factory": f.default_factory}
            specs.append((f.name, f.type, dataclasses.field(metadata=f.metadata, **default)))
    return dataclasses.make_dataclass("AsyncModelConfig", specs, namespace={"__module__": __name__})


class _NotGiven:
    """Stand-in default of a field that neither the recipe nor the command line set; prints as the real default."""

    def __init__(self, default):
        self.default = default

    def __str__(self):
        return str(self.default)


class _RecipeParser(TrlParser):
    """`TrlParser` whose command-line ``--field none`` overrides (`unset`) win over the recipe's values, whose argparse
    errors raise `ConfigError`, and which runs `check` on the parsed values before the dataclasses are built.

    argparse would hand the string "none" to the field's type (``float("none")`` fails), so these fields are removed
    from the command line and set to None as defaults, after `TrlParser` has applied the recipe's defaults. `check`
    receives ``(namespace, remaining strings, given)``, where `given` holds the fields among `policy_loss` and the
    loss-specific ones that the recipe (`recipe_keys`) or the command line set.
    """

    def __init__(self, dataclass_types, **kwargs):
        super().__init__(dataclass_types, **kwargs)
        self.unset: tuple[str, ...] = ()
        self.recipe_keys: frozenset[str] = frozenset()
        self.check = None

    def error(self, message):  # argparse would print the whole usage and exit; the caller reports and exits
        raise ConfigError(message)

    def parse_known_args(self, args=None, namespace=None):
        tracked = ("policy_loss", *loss_specific_fields()) if self.check is not None else ()
        destinations = {action.dest for action in self._actions}  # the async config lacks some loss fields
        tracked = [name for name in tracked if name in destinations]
        not_given = {name: _NotGiven(self.get_default(name)) for name in tracked if name not in self.recipe_keys}
        self.set_defaults(**not_given)
        if self.unset:
            self.set_defaults(**dict.fromkeys(self.unset))
        try:
            namespace, remaining = super().parse_known_args(args, namespace)
        finally:
            self.set_defaults(**{name: stand_in.default for name, stand_in in not_given.items()})
        given = set()
        for name in tracked:
            value = getattr(namespace, name)
            if isinstance(value, _NotGiven):
                setattr(namespace, name, value.default)
            else:
                given.add(name)
        if self.check is not None:
            self.check(namespace, remaining, given)
        return namespace, remaining


def make_parser(prog: str | None = None, dataclass_types: tuple = DATACLASS_TYPES) -> TrlParser:
    """A fresh `TrlParser` over (`ScriptArguments`, `PolicyLossConfig`, `ModelConfig`) (or `dataclass_types`).

    Build a new one per parse: `TrlParser` stores the YAML values in its actions' defaults.
    """
    return _RecipeParser(dataclass_types, prog=prog or "trl-bandpo train")


def known_keys(dataclass_types: tuple = DATACLASS_TYPES) -> set[str]:
    """Every valid recipe key and flag: the init fields of `ScriptArguments`, `PolicyLossConfig`, `ModelConfig`."""
    return {f.name for dataclass_type in dataclass_types for f in dataclasses.fields(dataclass_type) if f.init}


def _given_value(argv: Sequence[str], recipe: dict, name: str, flag_alone=None):
    """The value of `name` the parse will see: the command line's (``--name value``, ``--name=value``, or
    `flag_alone` for a bare ``--name``) over the recipe's; None when neither sets it."""
    value = recipe.get(name)
    for index, arg in enumerate(argv):
        if arg == f"--{name}":
            following = argv[index + 1] if index + 1 < len(argv) else None
            value = following if following is not None and not following.startswith("--") else flag_alone
        elif arg.startswith(f"--{name}="):
            value = arg.partition("=")[2]
    return value


def _dataclass_types_for(argv: Sequence[str], recipe: dict) -> tuple:
    """`DATACLASS_TYPES`, with two substitutions for `PolicyLossConfig`: `AsyncPolicyLossConfig` when
    `async_rollouts` is set (TRL's asynchronous trainer, docs/off-policy-and-async.md), and, when the policy loss is
    an import path `package.module:loss` (a loss registered in the user's code, docs/adding-a-policy-loss.md), the
    config extended by that loss's fields, so that the recipe and the command line set them like ours."""
    asynchronous = _given_value(argv, recipe, "async_rollouts", flag_alone=True)
    if isinstance(asynchronous, str):  # the spellings argparse's boolean flags accept
        spelled = asynchronous.strip().lower()
        asynchronous = True if spelled in ("true", "yes", "1", "y", "t") else spelled
        asynchronous = False if asynchronous in ("false", "no", "0", "n", "f") else asynchronous
    if asynchronous is not None and not isinstance(asynchronous, bool):  # it selects the config: checked first
        raise ConfigError(f"async_rollouts must be true or false, got {asynchronous!r}.")
    config_class, model_config_class = PolicyLossConfig, ModelConfig
    if asynchronous:
        from ..training.async_trainer import AsyncPolicyLossConfig

        config_class, model_config_class = AsyncPolicyLossConfig, _async_model_config()
    policy_loss = _given_value(argv, recipe, "policy_loss")
    if isinstance(policy_loss, str) and ":" in policy_loss:
        try:
            config_class = config_class_with_loss_fields(config_class, policy_loss)
        except ValueError as err:
            raise ConfigError(str(err)) from err
    return (ScriptArguments, config_class, model_config_class)


def _unknown_message(kind: str, names: Sequence[str], known: set[str], where: str) -> str:
    lines = [f"unknown {kind} {where}:"]
    for name in names:
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
        hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
        lines.append(f"  {name!r}{hint}")
    if "weight_sync_steps" in known:  # AsyncPolicyLossConfig's field: async_rollouts is on
        config = "AsyncPolicyLossConfig (TRL's AsyncGRPOConfig + trl-bandpo fields, as async_rollouts is true)"
    else:
        config = "PolicyLossConfig (trl.GRPOConfig + trl-bandpo fields)"
    lines.append(
        f"Every key must be a field of ScriptArguments, {config} or trl.ModelConfig; run "
        "`python -m trl_bandpo.cli.train --help` for the list."
    )
    return "\n".join(lines)


def _normalize_config_flag(argv: list[str]) -> tuple[str | None, list[str]]:
    """Rewrite ``--config=PATH`` as ``--config PATH`` (the form `TrlParser` reads); return (PATH or None, argv)."""
    out, config_path, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config" or arg.startswith("--config="):
            if config_path is not None:
                raise ConfigError("--config was given more than once.")
            if arg == "--config":
                if i + 1 >= len(argv):
                    raise ConfigError("--config needs a path to a YAML recipe.")
                config_path = argv[i + 1]
                i += 1
            else:
                config_path = arg.split("=", 1)[1]
            out.extend(["--config", config_path])
        else:
            out.append(arg)
        i += 1
    return config_path, out


def load_recipe(path: str | os.PathLike, known: set[str] | None = None) -> dict:
    """Read a recipe YAML file as a dict, raising `ConfigError` for unreadable files, YAML syntax errors (with a hint
    at the likely cause), repeated keys and unknown keys.

    Args:
        path: the recipe. An empty file is an empty recipe.
        known: valid keys (`known_keys()`); None skips the key check. ``env`` (variables to export) is always valid.
    """
    recipe = read_recipe_yaml(path)
    if recipe is None:
        recipe = {}
    if "env" in recipe and not isinstance(recipe["env"], dict):
        raise ConfigError(f"`env` in recipe {os.fspath(path)!r} must be a mapping of variable: value.")
    if known is not None:
        check_recipe_keys(recipe, known, path)
    return recipe


def check_recipe_keys(recipe: dict, known: set[str], path: str | os.PathLike) -> None:
    """A `ConfigError` naming the recipe's keys that are no field (with the closest valid names)."""
    unknown = [key for key in recipe if key != "env" and key not in known]
    if unknown:
        raise ConfigError(_unknown_message("field(s)", unknown, known, f"in recipe {os.fspath(path)!r}"))


def _nullable_fields() -> set[str]:
    """Numeric / boolean fields that admit None (``delta: float | None``, ``generation_batch_size: int | None``...):
    ``--field none`` / ``--field null`` sets them to None. String fields are left alone: for them "none" can be a
    value (``--report_to none``)."""
    names = set()
    for dataclass_type in DATACLASS_TYPES:
        for name, hint in typing.get_type_hints(dataclass_type).items():
            args = typing.get_args(hint)
            others = [arg for arg in args if arg is not type(None)]
            if len(others) < len(args) and others and all(arg in (int, float, bool) for arg in others):
                names.add(name)
    return names


def _none_hint(message: str) -> str:
    """The hint ``(on the command line: `--FIELD none`)`` when `message` says None is allowed and the field it names
    first takes ``--FIELD none`` on the command line (`_nullable_fields`, or a string field that reads "none" as
    None); else "" (``policy_loss must be one of [...], got None`` allows no None)."""
    if "None" not in message:
        return ""
    found = [(match.start(), name) for name in known_keys() if (match := re.search(rf"\b{name}\b", message))]
    if not found:
        return ""
    name = min(found)[1]
    return f" (on the command line: `--{name} none`)" if name in _none_on_the_command_line() else ""


def _none_on_the_command_line() -> set[str]:
    """Fields for which ``--field none`` means None: the nullable numeric / boolean ones, and the string fields whose
    own check reads "none" as None."""
    return _nullable_fields() | _NONE_STRING_FIELDS


#: String fields whose own check turns "none" / "null" into None (`PolicyLossConfig`, `ScriptArguments`).
_NONE_STRING_FIELDS = {"band_radius_by", "instruction", "val_preset"}


def _pop_none_overrides(argv: list[str], nullable: set[str]) -> tuple[list[str], list[str]]:
    """Remove ``--field none|null`` (and ``--field=none``) for nullable fields; return (rest, fields to set None)."""
    rest, nones, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--"):
            name, eq, value = arg[2:].partition("=")
            dest = name.replace("-", "_")
            if not eq and i + 1 < len(argv):
                value = argv[i + 1]
            if dest in nullable and value.strip().lower() in ("none", "null"):
                nones.append(dest)
                i += 1 if eq else 2
                continue
        rest.append(arg)
        i += 1
    return rest, nones


def parse_args(argv: Sequence[str] | None = None):
    """Parse ``--config recipe.yaml`` and command-line overrides into the three dataclasses.

    `TrlParser.parse_args_and_config` exports the recipe's ``env:`` mapping, makes its values the parser's defaults
    and lets the command line override them; ``--field none`` sets a nullable numeric field to None.

    Checked in this order, each before anything that follows it: the recipe's syntax, repeated and unknown keys and
    value types; unknown flags; the required fields (`model_name_or_path`, `dataset_name`); an explicit `policy_loss`
    when loss-specific fields are set; then the dataclasses' own checks. ``--resume_from_checkpoint true|false``
    means what the YAML booleans mean.

    Returns:
        `(ScriptArguments, PolicyLossConfig, ModelConfig)`.

    Raises:
        ConfigError: for an unreadable or malformed recipe, repeated or unknown recipe keys or flags (named, with the
            closest valid names), missing required fields and invalid values.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    config_path, argv = _normalize_config_flag(argv)
    recipe = {} if config_path is None else load_recipe(config_path)
    dataclass_types = _dataclass_types_for(argv, recipe)  # a policy loss by import path brings its own fields
    known = known_keys(dataclass_types)
    # Checked before TrlParser exports `env:` and builds the dataclasses, whose own errors would hide a misspelled key.
    if config_path is not None:
        check_recipe_keys(recipe, known, config_path)
        check_recipe_types(recipe, dataclass_types, f"in recipe {config_path!r}")
    if config_path is not None and not recipe:
        at = argv.index("--config")  # an empty recipe sets nothing (TrlParser rejects a file that holds no mapping)
        del argv[at : at + 2]
    argv, nones = _pop_none_overrides(argv, _nullable_fields())
    parser = make_parser(dataclass_types=dataclass_types)
    parser.unset = tuple(nones)
    parser.recipe_keys = frozenset(recipe)

    def unknown_flags(names, rest):
        return _unknown_message("argument(s)", names, known, f"on the command line ({rest})")

    parser.check = functools.partial(check_namespace, unknown_message=unknown_flags)
    try:
        *parsed, recipe_rest, _ = parser.parse_args_and_config(
            argv, return_remaining_strings=True, separate_remaining_strings=True
        )
    except ConfigError:
        raise
    except (ValueError, TypeError) as err:  # __post_init__ validation of any of the three dataclasses
        hint = _none_hint(str(err))
        hint += _CPU_HINT if "bf16" in str(err) and "use_cpu" in str(err) else ""
        raise ConfigError(f"invalid configuration: {err}{hint}") from err
    if recipe_rest:  # recipe keys TrlParser did not consume, as ["--key", "value", ...]
        names = [flag[2:] for flag in recipe_rest[::2]]
        raise ConfigError(_unknown_message("field(s)", names, known, f"in recipe {config_path!r}"))
    script_args, training_args, model_args = parsed
    if not script_args.dataset_name:
        mixes = ", ".join(TRAINING_MIXES)
        raise ConfigError(f"dataset_name is required: a mix ({mixes}), registry names or local files.")
    if not model_args.model_name_or_path:
        raise ConfigError("model_name_or_path is required (a hub id or a local folder).")
    if script_args.async_rollouts:
        model_args = _check_async_model_args(model_args, training_args)
    return script_args, training_args, model_args


def _check_async_model_args(model_args, training_args) -> ModelConfig:
    """The `ModelConfig` of an `async_rollouts` run (`dtype` from the training config), refusing what TRL's
    asynchronous trainer cannot honour: it loads the model itself, with its tree attention and no quantisation."""
    if model_args.load_in_4bit or model_args.load_in_8bit:
        which = "load_in_4bit" if model_args.load_in_4bit else "load_in_8bit"
        raise ConfigError(
            f"{which}: true cannot be used with async_rollouts: true: TRL's asynchronous trainer takes no "
            "quantisation config. Train without it, or with async_rollouts: false."
        )
    if model_args.attn_implementation is not None:
        raise ConfigError(
            f"attn_implementation={model_args.attn_implementation!r} cannot be used with async_rollouts: true: TRL's "
            "asynchronous trainer packs samples into prefix trees and sets its own attention. Remove it."
        )
    try:
        return ModelConfig(**dataclasses.asdict(model_args), dtype=training_args.dtype)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"invalid configuration: {err}") from err

"""Recipe parsing for `trl-bandpo train`: TRL's `TrlParser` (the recipe read once), plus checks before anything
loads: repeated YAML keys, unknown keys and flags (with the closest valid names), YAML value types, `env` values,
required fields, `UnusedSettingWarning`; `~` and `$VAR` in paths expanded."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
import sys
import typing
import warnings
from collections.abc import Sequence

import yaml
from trl import ModelConfig, TrlParser

from ..core.checks import shown
from ..training.configs import PolicyLossConfig, UnusedSettingWarning, config_class_with_loss_fields
from .script_arguments import ScriptArguments

USAGE = "trl-bandpo train --config RECIPE [--field value ...]"
DESCRIPTION = (
    "Train from a YAML recipe (recipes/): --config RECIPE sets the fields below, and each --field value overrides one "
    "(`--field none` sets an optional number to None). Every field is one of ScriptArguments (data, reward, "
    "validation), PolicyLossConfig (TRL's GRPOConfig plus the policy-loss fields; AsyncPolicyLossConfig with "
    "async_rollouts) or TRL's ModelConfig. See recipes/README.md and docs/training.md."
)
REQUIRED = {
    "model_name_or_path": "a hub id, a local folder or a packaged model name",
    "dataset_name": "a mix, registry names or local files",
}
_KINDS = {"int": "an integer", "float": "a number", "string_to_bool": "true or false"}
#: The fields that hold paths: `~`, `$VAR` and `${VAR}` in them are expanded as a shell would (`expand_path`).
PATH_FIELDS = ("model_name_or_path", "output_dir", "resume_from_checkpoint", "dataset_name", "eval_dataset_name",
               "val_benchmarks", "deepspeed", "fsdp_config", "accelerator_config")  # fmt: skip
#: `$VAR`, `${VAR}`, and `~` that starts a path (first, or after the `,` of a list or the `=` of name=path).
_EXPANDABLE = re.compile(r"\$(\w+)|\$\{(\w+)\}|(?:^|(?<=[=,]))~(?=/|,|$)")
_CPU_HINT = " On a machine without a GPU set `use_cpu: true` and `bf16: false` (or `--use_cpu true --bf16 false`)."


class ConfigError(ValueError):
    """A recipe or command line that does not describe a valid run (unknown key, bad value)."""


class _RecipeLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` whose mappings refuse a repeated key, at any depth (`<<` merge keys may override)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value if isinstance(node, yaml.MappingNode) else ():
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, typing.Hashable) and seen.setdefault(key, line) != line:
                raise ConfigError(
                    f"duplicate key {key!r} in recipe {self.name!r} (lines {seen[key]} and {line}): YAML would keep "
                    "only the last value silently. Keep one of them."
                )
        return super().construct_mapping(node, deep=deep)


_SYNTAX_HINTS = (  # (pattern on a line, hint) for the usual causes of a YAML syntax error
    (re.compile(r"^\t"), "is indented with a tab: YAML indentation takes spaces only"),
    (re.compile(r"^\s*--?[A-Za-z_]"), "is command-line syntax: in a recipe write `key: value`"),
    (re.compile(r"^\s*[A-Za-z_][\w.-]*:(?![\s/])\S"), "has no space after the colon: write `key: value`"),
)


def read_recipe(path: str | os.PathLike) -> dict:
    """A recipe file as a dict (`{}` when empty); `ConfigError` for an unreadable file, a repeated key, invalid YAML
    (with a hint at the likely cause, by line) or content that is no mapping."""
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read recipe {os.fspath(path)!r}: {err}") from None
    try:
        loader = _RecipeLoader(text)  # refuses a control character (a NUL byte) at once
    except yaml.reader.ReaderError as err:
        line = text.count("\n", 0, err.position) + 1
        raise ConfigError(
            f"recipe {os.fspath(path)!r}, line {line}: YAML allows no control character such as "
            f"{chr(err.character)!r}: is it a text file?"
        ) from None
    loader.name = os.fspath(path)
    try:
        recipe = loader.get_single_data()
    except yaml.YAMLError as err:
        recipe = err
    finally:
        loader.dispose()
    if isinstance(recipe, dict) or recipe is None:
        return recipe or {}
    hints = [f"Hint: line {number} `{line.strip()}` {hint}." for number, line in enumerate(text.splitlines(), 1)
             for pattern, hint in _SYNTAX_HINTS if pattern.search(line)]  # fmt: skip
    problem = "must be a YAML mapping"
    if isinstance(recipe, yaml.YAMLError):
        problem = f"is not valid YAML: {recipe}"
    raise ConfigError("\n".join([f"recipe {os.fspath(path)!r} {problem}", *hints]))


def _close_matches(kind: str, names: Sequence[str], parser, where: str) -> str:
    lines = [f"unknown {kind} {where}:"]
    for name in names:
        close = difflib.get_close_matches(name, parser.known, n=3, cutoff=0.6)
        lines.append(f"  {name!r}" + (f" (did you mean {', '.join(map(repr, close))}?)" if close else ""))
    classes = ", ".join(dataclass_type.__name__ for dataclass_type in parser.dataclass_types)
    lines.append(f"Every key is a field of {classes} (`trl-bandpo train --help` lists them).")
    return "\n".join(lines)


class RecipeParser(TrlParser):
    """`TrlParser` whose errors are `ConfigError`s, with the checks of this module's docstring."""

    def __init__(self, dataclass_types, recipe_path=None, **kwargs):
        super().__init__(dataclass_types, **kwargs)
        self.recipe_path = recipe_path
        self.known = {f.name for cls in dataclass_types for f in dataclasses.fields(cls) if f.init}

    def error(self, message):
        """Raise: argparse would print the usage and exit; the entry point reports it."""
        raise ConfigError(message)

    def set_defaults_with_config(self, **recipe):
        unknown = [key for key in recipe if key not in self.known]
        if unknown:
            raise ConfigError(_close_matches("field(s)", unknown, self, f"in recipe {self.recipe_path!r}"))
        # from the annotations: HfArgumentParser rewrites the fields' own types (`float | None` -> float)
        hints = {name: hint for cls in self.dataclass_types for name, hint in typing.get_type_hints(cls).items()}
        for action in self._actions:
            kind = getattr(action.type, "__name__", "")
            if action.dest in recipe and kind in _KINDS:
                nullable = type(None) in typing.get_args(hints[action.dest])
                value = recipe[action.dest]
                items = value if isinstance(value, list) and action.nargs == "+" else [value]
                for item in items:
                    _check_recipe_value(action.dest, item, kind, nullable, self.recipe_path)
        return super().set_defaults_with_config(**recipe)

    def parse_known_args(self, args=None, namespace=None):
        namespace, remaining = super().parse_known_args(args, namespace)
        if remaining:
            flags = [arg.split("=")[0].lstrip("-").replace("-", "_") for arg in remaining if arg.startswith("-")]
            raise ConfigError(_close_matches("argument(s)", flags or remaining, self, "on the command line"))
        missing = [f"{name} ({what})" for name, what in REQUIRED.items() if not getattr(namespace, name, None)]
        if missing:
            raise ConfigError(
                f"missing required field(s): {'; '.join(missing)}. Set them in the recipe (`field: value`) or on the "
                "command line (`--field value`)."
            )
        if hasattr(namespace, "resume_from_checkpoint"):
            namespace.resume_from_checkpoint = _bool_word(namespace.resume_from_checkpoint)
        for name in (name for name in PATH_FIELDS if hasattr(namespace, name)):
            value = getattr(namespace, name)
            value = [expand_path(v, name) for v in value] if isinstance(value, list) else expand_path(value, name)
            setattr(namespace, name, value)
        return namespace, remaining


def _bool_word(value):
    """The words "true" / "false" (any case) as the YAML booleans; anything else as it is."""
    word = value.strip().lower() if isinstance(value, str) else None
    return {"true": True, "false": False}.get(word, value)


def expand_path(value, field: str):
    """`value` with `~` and each set `$VAR` / `${VAR}` expanded as a shell would; `ConfigError` naming `field` and
    the variable for an unset one. Anything but a string is returned as it is."""

    def expand(match: re.Match) -> str:
        name = match[1] or match[2]
        if name is None:
            return os.path.expanduser("~")
        if name not in os.environ:
            raise ConfigError(
                f"{field} {value!r} uses ${name}, which is not set in the environment: set it (export {name}=...) "
                "or write the path out."
            )
        return os.environ[name]

    return _EXPANDABLE.sub(expand, value) if isinstance(value, str) else value


def _check_recipe_value(name: str, value, kind: str, nullable: bool, path) -> None:
    """A YAML value (not a string: argparse converts those, and names the flag if it cannot) of the field's type."""
    if isinstance(value, str) or (value is None and nullable):
        return
    number = not isinstance(value, bool) and isinstance(value, int if kind == "int" else (int, float))
    fits = isinstance(value, bool) if kind == "string_to_bool" else number
    if not fits:
        shown = "null" if value is None else repr(value)
        raise ConfigError(f"{name} in recipe {path!r} must be {_KINDS[kind]}{' or null' * nullable}, got {shown}.")


@functools.cache
def _async_model_config() -> type:
    """`trl.ModelConfig` without the fields `AsyncGRPOConfig` has too (`dtype`): argparse takes each flag once."""
    from ..training.async_trainer import AsyncPolicyLossConfig

    shared = {f.name for f in dataclasses.fields(AsyncPolicyLossConfig)}
    fields = [(f.name, f.type, f) for f in dataclasses.fields(ModelConfig) if f.init and f.name not in shared]
    return dataclasses.make_dataclass("AsyncModelConfig", fields, namespace={"__module__": __name__})


def _given(argv: Sequence[str], recipe: dict, name: str, bare=None):
    """The value of `name` on the command line (`--name value`, `--name=value`, a bare `--name`: `bare`), else the
    recipe's."""
    value = recipe.get(name)
    for index, arg in enumerate(argv):
        if arg == f"--{name}":
            following = argv[index + 1] if index + 1 < len(argv) else "--"
            value = bare if following.startswith("--") else following
        elif arg.startswith(f"--{name}="):
            value = arg.partition("=")[2]
    return value


def _dataclass_types(argv: Sequence[str], recipe: dict) -> tuple:
    """(ScriptArguments, the config, the model config): `AsyncPolicyLossConfig` for `async_rollouts`, and a config
    extended by the fields of a policy loss given by import path (docs/adding-a-policy-loss.md)."""
    # it selects the config: checked first
    asynchronous = _bool_word(_given(argv, recipe, "async_rollouts", bare=True))
    if asynchronous is not None and not isinstance(asynchronous, bool):
        raise ConfigError(f"async_rollouts must be true or false, got {asynchronous!r}.")
    config_class, model_config_class = PolicyLossConfig, ModelConfig
    if asynchronous:
        from ..training.async_trainer import AsyncPolicyLossConfig

        config_class, model_config_class = AsyncPolicyLossConfig, _async_model_config()
    policy_loss = _given(argv, recipe, "policy_loss")
    if isinstance(policy_loss, str) and ":" in policy_loss:
        try:
            config_class = config_class_with_loss_fields(config_class, policy_loss)
        except ValueError as err:
            raise ConfigError(str(err)) from err
    return ScriptArguments, config_class, model_config_class


#: The dataclasses of a synchronous run with a built-in policy loss.
DATACLASS_TYPES = (ScriptArguments, PolicyLossConfig, ModelConfig)


def parse_args(argv: Sequence[str] | None = None):
    """`(ScriptArguments, the policy-loss config, ModelConfig)` of ``--config RECIPE`` and the overrides."""
    argv = list(sys.argv[1:] if argv is None else argv)
    for index, arg in enumerate(argv):  # `--config=PATH` as TrlParser reads it
        if arg.startswith("--config="):
            argv[index : index + 1] = ["--config", arg.partition("=")[2]]
    if argv.count("--config") > 1:
        raise ConfigError("--config was given more than once.")
    recipe, path = {}, None
    if "--config" in argv:
        at = argv.index("--config")
        if at + 1 >= len(argv):
            raise ConfigError("--config needs a path to a YAML recipe.")
        path = argv[at + 1]
        # read once (a FIFO such as `<(cat recipe.yaml)` cannot be read again): parsed below
        recipe = read_recipe(path)
        del argv[at : at + 2]
    env = recipe.pop("env", {})
    if not isinstance(env, dict):
        raise ConfigError("`env` in the recipe must be a mapping of variable: value.")
    for key, value in env.items():
        # os.environ refuses these keys with a bare "invalid configuration"
        if not str(key) or {"=", "\0"} & set(str(key)):
            raise ConfigError(f"env in recipe {path!r}: each key must be a variable name (not empty, without '=' or a "
                              f"NUL), got {shown(key)}.")  # fmt: skip
        # TrlParser would set the variable to str(value): "None"
        if not isinstance(value, (str, int, float)):
            raise ConfigError(
                f"env.{key} in recipe {path!r} must be a string, number or bool, got "
                f"{'null' if value is None else shown(value)}."
            )
    parser = RecipeParser(
        _dataclass_types(argv, recipe), recipe_path=path, prog="trl-bandpo train", usage=USAGE, description=DESCRIPTION
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UnusedSettingWarning)
            # as TrlParser sets them
            os.environ.update({str(key): str(value) for key, value in env.items()})
            parser.set_defaults_with_config(**recipe)
            script_args, training_args, model_args = parser.parse_args_into_dataclasses(argv)
    except ConfigError:
        raise
    except UnusedSettingWarning as warning:
        raise ConfigError(
            f"{warning} In a recipe this is an error: remove the setting or change policy_loss."
        ) from None
    except (ValueError, TypeError) as err:  # the dataclasses' own checks
        hint = _CPU_HINT if "bf16" in str(err) and "use_cpu" in str(err) else ""
        raise ConfigError(f"invalid configuration: {err}{hint}") from err
    if script_args.async_rollouts:
        model_args = _async_model_args(model_args, training_args)
    return script_args, training_args, model_args


def _async_model_args(model_args, training_args) -> ModelConfig:
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
    return ModelConfig(**dataclasses.asdict(model_args), dtype=training_args.dtype)

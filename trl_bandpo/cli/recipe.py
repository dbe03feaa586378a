r"""Recipe parsing for `trl-bandpo train`: [`ScriptArguments`] and TRL's `TrlParser`, failing loudly and early.

A recipe (YAML) sets the defaults of three dataclasses and command-line flags override them: [`ScriptArguments`]
(data, reward), [`~trl_bandpo.PolicyLossConfig`] (every `trl.GRPOConfig` field plus the policy-loss fields) and
`trl.ModelConfig` (model, dtype, LoRA, quantisation). Unlike `trl grpo`, a key or flag that is no field of these is an
error naming it, the closest valid names and where it came from; so are a repeated key, a value of the wrong type and
loss-specific fields without `policy_loss` (`recipe_yaml`, `recipe_checks`). These errors come before the dataclasses
are built, so before their own checks (such as bf16 on a machine without a GPU) and before any model or data loads.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import sys
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field

from trl import ModelConfig, TrlParser

from ..configs import PolicyLossConfig
from ..data import BOXED_INSTRUCTION, PROMPT_TEMPLATES, TRAINING_MIXES
from .errors import ConfigError
from .recipe_checks import check_namespace, check_prompt_fields, check_recipe_types, loss_specific_fields
from .recipe_yaml import read_recipe_yaml

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

#: `reward` choice -> (score of a correct answer, score of a wrong one, name of the logged metric).
REWARDS = {
    "signed": (1.0, -1.0, "boxed_signed_reward"),
    "accuracy": (1.0, 0.0, "boxed_accuracy_reward"),
    "dapo": (1.0, -1.0, "dapo_reward"),
}
_NONE_STRINGS = ("none", "null", "")
_CPU_HINT = (
    " On a machine without a GPU set `use_cpu: true` and `bf16: false` in the recipe (or `--use_cpu true --bf16 "
    "false`)."
)


@dataclass
class ScriptArguments:
    r"""
    Data and reward of a `trl-bandpo train` run.

    Parameters:
        dataset_name (`list[str]`):
            Training data: a mix name (`"bandpo"` = the BandPO authors' English DAPO-Math-17k + MATH levels 3-5,
            `"dgpo"` = DAPO-Math-17k as released), registry names from `trl_bandpo.data.DATASETS` (e.g.
            `dapo-math-17k`, `math-level3to5`, `dapo-math-17k-original`) or local files
            (.jsonl/.json/.parquet/.csv) / `save_to_disk` folders. Several entries are concatenated; a single string
            may also list them comma-separated.
        dataset_split (`str`, *optional*):
            Split (or slice such as `"train[:200]"`) of local files/folders. Registry datasets use their own split.
        problem_field / answer_field (`str`, *optional*):
            Columns of local files holding the problem and the final answer (dotted names reach nested fields).
            Guessed when not given; ignored for registry datasets.
        instruction (`str`, *optional*):
            Appended to every problem after a space by the `"boxed"` template (default: ask for the answer in
            `\boxed{}`). `null` for none. Ignored, with a warning when set, if `prompt_template` is `"dapo"`.
        prompt_template (`str`, defaults to `"boxed"`):
            `"boxed"` (problem + " " + `instruction`) or `"dapo"`: DAPO's "Answer:" template, in which the BandPO
            authors put every training and validation problem (`trl_bandpo.data.PROMPT_TEMPLATES`). It asks for the
            answer on a last line `Answer: ...`, not in `\boxed{}`: use it with a reward that reads that line.
        max_prompt_tokens (`int`, *optional*):
            Drop the training (and in-training evaluation) problems whose prompt, chat template included, is longer
            than this many tokens (the BandPO authors: 1024). `null` keeps all: TRL 1.16 does not limit prompts.
        max_train_samples (`int`, *optional*):
            Keep at most this many problems from each training dataset (quick runs).
        eval_dataset_name (`list[str]`, *optional*):
            Benchmarks evaluated during training when `eval_strategy` is not `"no"` (registry names such as
            `aime2024`, local files, or `name=path`; local files use `problem_field` / `answer_field` too).
            Paper-style mean@k / pass@k evaluation is a separate step.
        max_eval_samples (`int`, *optional*):
            Keep at most this many problems per benchmark.
        reward (`str`, defaults to `"signed"`):
            `"signed"`: +1 / -1 from math-verify on the last `\boxed{}` (DGPO); `"accuracy"`: the same as 1 / 0;
            `"dapo"`: +1 / -1 from the "Answer:" line compared as verl's `math_dapo` does (the BandPO authors'
            training reward, `trl_bandpo.rewards.dapo_reward`; use it with `prompt_template: dapo`). With the
            group-normalised advantage (`scale_rewards="group"`) signed and accuracy give the same advantages.
        reward_timeout (`float`, defaults to `5.0`):
            Wall-clock seconds allowed to `math_verify` per answer; an answer that takes longer scores wrong.
        reward_num_workers (`int`, *optional*):
            Verifier processes per training process (default `min(4, cpu_count)`).
    """

    dataset_name: list[str] | None = field(
        default=None,
        metadata={
            "help": "Training data: a mix (" + ", ".join(TRAINING_MIXES) + "), registry names "
            "(trl_bandpo.data.DATASETS) and/or local files; several are concatenated."
        },
    )
    dataset_split: str | None = field(
        default=None, metadata={"help": "Split of local training files (e.g. 'train' or 'train[:200]')."}
    )
    problem_field: str | None = field(default=None, metadata={"help": "Problem column of local training files."})
    answer_field: str | None = field(default=None, metadata={"help": "Answer column of local training files."})
    instruction: str | None = field(
        default=BOXED_INSTRUCTION, metadata={"help": "Appended to every problem ('boxed'); 'none' for nothing."}
    )
    prompt_template: str = field(
        default="boxed", metadata={"help": "'boxed' or 'dapo' (DAPO's template).", "choices": list(PROMPT_TEMPLATES)}
    )
    max_prompt_tokens: int | None = field(default=None, metadata={"help": "Drop longer prompts (BandPO: 1024)."})
    max_train_samples: int | None = field(
        default=None, metadata={"help": "At most this many problems from each training dataset."}
    )
    eval_dataset_name: list[str] | None = field(
        default=None, metadata={"help": "Benchmarks evaluated during training (needs eval_strategy != 'no')."}
    )
    max_eval_samples: int | None = field(default=None, metadata={"help": "At most this many problems per benchmark."})
    reward: str = field(
        default="signed",
        metadata={
            "help": "Reward: 'signed' (+1/-1 boxed, DGPO), 'accuracy' (1/0 boxed) or 'dapo' (+1/-1 'Answer:' line, "
            "BandPO).",
            "choices": list(REWARDS),
        },
    )
    reward_timeout: float = field(default=5.0, metadata={"help": "Seconds allowed to math_verify per answer."})
    reward_num_workers: int | None = field(default=None, metadata={"help": "Verifier processes per process."})

    def __post_init__(self):
        # argparse checks neither the types nor the choices of values that come from the YAML file.
        for name in ("dataset_name", "eval_dataset_name"):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))
            ):
                raise ValueError(
                    f"{name} must be a string or a list of strings (mix or registry names, local files), got "
                    f"{value!r}."
                )
        for name in ("dataset_split", "problem_field", "answer_field", "instruction"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a string or null, got {value!r} ({type(value).__name__}).")
        self.dataset_name = _split_names(self.dataset_name)
        self.eval_dataset_name = _split_names(self.eval_dataset_name)
        if isinstance(self.instruction, str) and self.instruction.strip().lower() in _NONE_STRINGS:
            self.instruction = None
        check_prompt_fields(self.prompt_template, self.instruction, self.reward)
        if not isinstance(self.reward, str) or self.reward not in REWARDS:
            raise ValueError(f"reward must be one of {list(REWARDS)}, got {self.reward!r}.")
        if isinstance(self.reward_timeout, bool) or not isinstance(self.reward_timeout, (int, float)):
            raise ValueError(f"reward_timeout must be a number of seconds, got {self.reward_timeout!r}.")
        if not 0 < float(self.reward_timeout) < float("inf"):
            raise ValueError(
                f"reward_timeout must be a positive finite number of seconds, got {self.reward_timeout!r}"
            )
        for name in ("max_train_samples", "max_eval_samples", "max_prompt_tokens", "reward_num_workers"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 or null, got {value!r}.")


def _split_names(names: Sequence[str] | None) -> list[str] | None:
    """Flatten comma-separated entries: ``["a,b", "c"]`` -> ``["a", "b", "c"]``; None stays None."""
    if names is None:
        return None
    if isinstance(names, str):
        names = [names]
    out = [part.strip() for name in names for part in str(name).split(",") if part.strip()]
    return out or None


DATACLASS_TYPES = (ScriptArguments, PolicyLossConfig, ModelConfig)


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


def make_parser(prog: str | None = None) -> TrlParser:
    """A fresh `TrlParser` over (`ScriptArguments`, `PolicyLossConfig`, `ModelConfig`).

    Build a new one per parse: `TrlParser` stores the YAML values in its actions' defaults.
    """
    return _RecipeParser(DATACLASS_TYPES, prog=prog or "trl-bandpo train")


def known_keys() -> set[str]:
    """Every valid recipe key and flag: the init fields of `ScriptArguments`, `PolicyLossConfig`, `ModelConfig`."""
    return {f.name for dataclass_type in DATACLASS_TYPES for f in dataclasses.fields(dataclass_type) if f.init}


def _unknown_message(kind: str, names: Sequence[str], known: set[str], where: str) -> str:
    lines = [f"unknown {kind} {where}:"]
    for name in names:
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
        hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
        lines.append(f"  {name!r}{hint}")
    lines.append(
        "Every key must be a field of ScriptArguments, PolicyLossConfig (trl.GRPOConfig + trl-bandpo fields) or "
        "trl.ModelConfig; run `python -m trl_bandpo.cli.train --help` for the list."
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
        unknown = [key for key in recipe if key != "env" and key not in known]
        if unknown:
            raise ConfigError(_unknown_message("field(s)", unknown, known, f"in recipe {os.fspath(path)!r}"))
    return recipe


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
    known = known_keys()
    config_path, argv = _normalize_config_flag(argv)
    recipe = {}
    # Checked before TrlParser exports `env:` and builds the dataclasses, whose own errors would hide a misspelled key.
    if config_path is not None:
        recipe = load_recipe(config_path, known)
        check_recipe_types(recipe, DATACLASS_TYPES, f"in recipe {config_path!r}")
    if config_path is not None and not recipe:
        at = argv.index("--config")  # an empty recipe sets nothing (TrlParser rejects a file that holds no mapping)
        del argv[at : at + 2]
    argv, nones = _pop_none_overrides(argv, _nullable_fields())
    parser = make_parser()
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
        hint = " (on the command line: `--<field> none`)" if "None" in str(err) else ""
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
    return script_args, training_args, model_args

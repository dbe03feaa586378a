r"""Training entry point: one recipe (YAML) + CLI overrides -> a BandPO / DGPO / baseline run.

Usage (see `recipes/README.md` for the recipes and how their batch sizes map onto the papers')::

    accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 8 \
        -m trl_bandpo.train --config recipes/bandpo/qwen2.5-3b-instruct_band-kl-0.05.yaml [--field value ...]
    trl-bandpo train --config recipes/lora/qwen2.5-0.5b-instruct_band-kl-0.05.yaml --max_steps 20
    python -m trl_bandpo.train --help

Every recipe key is a field of one of three dataclasses, parsed by TRL's `TrlParser` (YAML values become defaults,
command-line flags override them):

* [`ScriptArguments`] (below): training / evaluation data and the reward;
* [`trl_bandpo.PolicyLossConfig`]: every `trl.GRPOConfig` field plus ours (`policy_loss`, `band_*`, `dgpo_*`,
  `ce_gppo_*`, `aspo_*`), so any policy loss runs from one config class;
* `trl.ModelConfig`: `model_name_or_path`, `dtype`, `attn_implementation`, LoRA (`use_peft`, `lora_r`, ...) and
  4/8-bit loading.

Unlike `trl grpo` (which forwards unknown keys to `accelerate launch`), a key or flag that is no field of these fails
at once with a message naming it and the closest valid names. The trainer class follows `policy_loss`:
`DGPOTrainer` for `"dgpo"`, `BandPOTrainer` otherwise; both run every policy loss, the class only sets the model-card
tags.
"""

from __future__ import annotations

import difflib
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from trl import ModelConfig, TrlParser

from .configs import PolicyLossConfig
from .data import BOXED_INSTRUCTION, TRAINING_MIXES

__all__ = [
    "REWARDS",
    "ConfigError",
    "ScriptArguments",
    "build_reward",
    "describe_run",
    "load_eval_data",
    "load_train_data",
    "main",
    "make_parser",
    "parse_args",
    "run",
    "trainer_class_for",
]

logger = logging.getLogger(__name__)

#: `reward` choice -> (score of a correct answer, score of a wrong one, name of the logged metric).
REWARDS = {
    "signed": (1.0, -1.0, "boxed_signed_reward"),
    "accuracy": (1.0, 0.0, "boxed_accuracy_reward"),
}
_NONE_STRINGS = ("none", "null", "")


class ConfigError(ValueError):
    """A recipe or command line that does not describe a valid run (unknown key, bad value)."""


@dataclass
class ScriptArguments:
    r"""
    Data and reward of a `trl_bandpo.train` run.

    Parameters:
        dataset_name (`list[str]`):
            Training data: a mix name (`"bandpo"` = DAPO-Math-17k + MATH levels 3-5, `"dgpo"` = DAPO-Math-17k),
            registry names from `trl_bandpo.data.DATASETS` (e.g. `dapo-math-17k`, `math-level3to5`) or local files
            (.jsonl/.json/.parquet/.csv) / `save_to_disk` folders. Several entries are concatenated; a single string
            may also list them comma-separated.
        dataset_split (`str`, *optional*):
            Split (or slice such as `"train[:200]"`) of local files/folders. Registry datasets use their own split.
        problem_field / answer_field (`str`, *optional*):
            Columns of local files holding the problem and the final answer (dotted names reach nested fields).
            Guessed when not given; ignored for registry datasets.
        instruction (`str`, *optional*):
            Appended to every problem after a space (default: ask for the answer in `\boxed{}`). `null` for none.
        max_train_samples (`int`, *optional*):
            Keep at most this many problems from each training dataset (quick runs).
        eval_dataset_name (`list[str]`, *optional*):
            Benchmarks evaluated during training when `eval_strategy` is not `"no"` (registry names such as
            `aime2024`, local files, or `name=path`; local files use `problem_field` / `answer_field` too).
            Paper-style mean@k / pass@k evaluation is a separate step.
        max_eval_samples (`int`, *optional*):
            Keep at most this many problems per benchmark.
        reward (`str`, defaults to `"signed"`):
            `"signed"`: +1 correct / -1 otherwise (DGPO, and the verl DAPO-math scorer the BandPO authors used);
            `"accuracy"`: 1 / 0. With the group-normalised advantage (`scale_rewards="group"`) both give the same
            advantages; they differ for `scale_rewards="none"` and in the logged reward.
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
        default=BOXED_INSTRUCTION, metadata={"help": "Appended to every problem; 'none' for nothing."}
    )
    max_train_samples: int | None = field(
        default=None, metadata={"help": "At most this many problems from each training dataset."}
    )
    eval_dataset_name: list[str] | None = field(
        default=None, metadata={"help": "Benchmarks evaluated during training (needs eval_strategy != 'no')."}
    )
    max_eval_samples: int | None = field(default=None, metadata={"help": "At most this many problems per benchmark."})
    reward: str = field(
        default="signed",
        metadata={"help": "Reward: 'signed' (+1/-1, DGPO) or 'accuracy' (1/0).", "choices": list(REWARDS)},
    )
    reward_timeout: float = field(default=5.0, metadata={"help": "Seconds allowed to math_verify per answer."})
    reward_num_workers: int | None = field(default=None, metadata={"help": "Verifier processes per process."})

    def __post_init__(self):
        if isinstance(self.dataset_name, str):
            self.dataset_name = [self.dataset_name]
        if isinstance(self.eval_dataset_name, str):
            self.eval_dataset_name = [self.eval_dataset_name]
        self.dataset_name = _split_names(self.dataset_name)
        self.eval_dataset_name = _split_names(self.eval_dataset_name)
        if isinstance(self.instruction, str) and self.instruction.strip().lower() in _NONE_STRINGS:
            self.instruction = None
        if self.reward not in REWARDS:  # argparse does not check choices of values that come from the YAML file
            raise ValueError(f"reward must be one of {list(REWARDS)}, got {self.reward!r}.")
        if isinstance(self.reward_timeout, bool) or not isinstance(self.reward_timeout, (int, float)):
            raise ValueError(f"reward_timeout must be a number of seconds, got {self.reward_timeout!r}.")
        if not 0 < float(self.reward_timeout) < float("inf"):
            raise ValueError(f"reward_timeout must be a positive finite number of seconds, got {self.reward_timeout!r}")
        for name in ("max_train_samples", "max_eval_samples", "reward_num_workers"):
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


# ---------------------------------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------------------------------

DATACLASS_TYPES = (ScriptArguments, PolicyLossConfig, ModelConfig)


def make_parser(prog: str | None = None) -> TrlParser:
    """A fresh `TrlParser` over (`ScriptArguments`, `PolicyLossConfig`, `ModelConfig`).

    Build a new one per parse: `TrlParser` stores the YAML values in its actions' defaults.
    """
    return TrlParser(DATACLASS_TYPES, prog=prog or "trl-bandpo train")


def _known_keys(parser: TrlParser) -> set[str]:
    return {action.dest for action in parser._actions if action.dest not in ("help", "config")}


def _unknown_message(kind: str, names: Sequence[str], known: set[str], where: str) -> str:
    lines = [f"unknown {kind} {where}:"]
    for name in names:
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
        hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
        lines.append(f"  {name!r}{hint}")
    lines.append(
        "Every key must be a field of ScriptArguments, PolicyLossConfig (trl.GRPOConfig + trl-bandpo fields) or "
        "trl.ModelConfig; run `python -m trl_bandpo.train --help` for the list."
    )
    return "\n".join(lines)


def _split_config_flag(argv: list[str]) -> tuple[str | None, list[str]]:
    """Pull ``--config PATH`` / ``--config=PATH`` out of `argv`."""
    rest, config_path, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("--config needs a path to a YAML recipe.")
            if config_path is not None:
                raise ConfigError("--config was given more than once.")
            config_path = argv[i + 1]
            i += 2
            continue
        if arg.startswith("--config="):
            if config_path is not None:
                raise ConfigError("--config was given more than once.")
            config_path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return config_path, rest


def load_recipe(path: str | os.PathLike, known: set[str] | None = None) -> dict:
    """Read a recipe YAML file as a dict, raising `ConfigError` for unreadable files and unknown keys."""
    import yaml

    try:
        with open(path) as handle:
            recipe = yaml.safe_load(handle)
    except OSError as err:
        raise ConfigError(f"cannot read recipe {os.fspath(path)!r}: {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"recipe {os.fspath(path)!r} is not valid YAML: {err}") from None
    if recipe is None:
        recipe = {}
    if not isinstance(recipe, dict):
        raise ConfigError(f"recipe {os.fspath(path)!r} must be a YAML mapping of field: value.")
    if known is not None:
        unknown = [key for key in recipe if key != "env" and key not in known]
        if unknown:
            raise ConfigError(_unknown_message("field(s)", unknown, known, f"in recipe {os.fspath(path)!r}"))
    return recipe


def _nullable_fields() -> set[str]:
    """Numeric / boolean fields that admit None (``delta: float | None``, ``generation_batch_size: int | None``...):
    ``--field none`` / ``--field null`` sets them to None. String fields are left alone: for them "none" can be a
    value (``--report_to none``)."""
    import typing

    names = set()
    for dataclass_type in DATACLASS_TYPES:
        for name, hint in typing.get_type_hints(dataclass_type).items():
            args = typing.get_args(hint)
            others = [arg for arg in args if arg is not type(None)]
            if len(others) < len(args) and others and all(arg in (int, float, bool) for arg in others):
                names.add(name)
    return names


def _pop_none_overrides(argv: list[str], nullable: set[str]) -> tuple[list[str], list[str]]:
    """Remove ``--field none|null`` (and ``--field=none``) for nullable fields; return (rest, fields to set None).

    argparse would hand the string "None" to the field's type (``float("None")`` fails), so a value set in a recipe,
    such as ``delta: 10.0``, could not be unset from the command line otherwise.
    """
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

    The recipe's values become the parser's defaults (`TrlParser.set_defaults_with_config`, after its ``env:``
    mapping is exported), then the command line overrides them; ``--field none`` sets a nullable field to None.

    Returns:
        `(ScriptArguments, PolicyLossConfig, ModelConfig)`.

    Raises:
        ConfigError: for unknown recipe keys or flags (named, with the closest valid names) and invalid values.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = make_parser()
    known = _known_keys(parser)
    config_path, rest = _split_config_flag(argv)
    if config_path is not None:
        recipe = load_recipe(config_path, known)  # fails on unknown keys, which TrlParser would pass on quietly
        env = recipe.pop("env", None)
        if env is not None:
            if not isinstance(env, dict):
                raise ConfigError(f"`env` in recipe {config_path!r} must be a mapping of variable: value.")
            os.environ.update({str(key): str(value) for key, value in env.items()})
        leftover = parser.set_defaults_with_config(**recipe)
        if leftover:  # cannot happen unless TrlParser changes how it matches keys
            names = [s[2:] for s in leftover[::2]]
            raise ConfigError(_unknown_message("field(s)", names, known, f"in recipe {config_path!r}"))
    rest, nones = _pop_none_overrides(rest, _nullable_fields())
    if nones:
        parser.set_defaults(**dict.fromkeys(nones))
    try:
        *dataclasses, remaining = parser.parse_args_into_dataclasses(args=rest, return_remaining_strings=True)
    except ConfigError:
        raise
    except (ValueError, TypeError) as err:  # __post_init__ validation of any of the three dataclasses
        hint = " (on the command line: `--<field> none`)" if "None" in str(err) else ""
        raise ConfigError(f"invalid configuration: {err}{hint}") from err
    if remaining:
        flags = [s.split("=", 1)[0].lstrip("-").replace("-", "_") for s in remaining if s.startswith("-")]
        names = flags or list(remaining)
        raise ConfigError(_unknown_message("argument(s)", names, known, f"on the command line ({remaining})"))
    script_args, training_args, model_args = dataclasses
    if not script_args.dataset_name:
        mixes = ", ".join(TRAINING_MIXES)
        raise ConfigError(f"dataset_name is required: a mix ({mixes}), registry names or local files.")
    if not model_args.model_name_or_path:
        raise ConfigError("model_name_or_path is required (a hub id or a local folder).")
    return script_args, training_args, model_args


# ---------------------------------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------------------------------


def trainer_class_for(policy_loss: str):
    """`DGPOTrainer` for ``"dgpo"``, `BandPOTrainer` for every other policy loss (the class only sets tags)."""
    from .trainer import BandPOTrainer, DGPOTrainer

    return DGPOTrainer if policy_loss == "dgpo" else BandPOTrainer


def build_reward(script_args: ScriptArguments):
    """The `math_verify` reward on the last ``\\boxed{}`` answer chosen by `script_args.reward`."""
    from .rewards import math_verify_reward

    correct, wrong, name = REWARDS[script_args.reward]
    return math_verify_reward(
        correct=correct,
        wrong=wrong,
        timeout_s=float(script_args.reward_timeout),
        name=name,
        num_workers=script_args.reward_num_workers,
    )


def _expand_names(names: Sequence[str]) -> list[str]:
    out = []
    for name in names:
        mix = TRAINING_MIXES.get(name.strip().lower()) if not os.path.exists(name) else None
        out.extend(mix if mix else [name])
    return out


def load_train_data(script_args: ScriptArguments):
    """The training set: every entry of `dataset_name` (mixes expanded) loaded and concatenated."""
    import datasets

    from .data import load_math_dataset

    parts = []
    for name in _expand_names(script_args.dataset_name):
        local = os.path.exists(name)
        parts.append(
            load_math_dataset(
                name,
                split=script_args.dataset_split if local else None,
                problem_field=script_args.problem_field if local else None,
                answer_field=script_args.answer_field if local else None,
                instruction=script_args.instruction,
                max_samples=script_args.max_train_samples,
            )
        )
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def load_eval_data(script_args: ScriptArguments):
    """The evaluation benchmarks (dict name -> Dataset), or None when `eval_dataset_name` is unset."""
    if not script_args.eval_dataset_name:
        return None
    from .data import load_eval_benchmarks

    benchmarks = {}
    for entry in script_args.eval_dataset_name:
        local = os.path.exists(entry) or ("=" in entry and os.path.exists(entry.partition("=")[2].strip()))
        benchmarks.update(
            load_eval_benchmarks(
                [entry],
                max_problems=script_args.max_eval_samples,
                instruction=script_args.instruction,
                problem_field=script_args.problem_field if local else None,
                answer_field=script_args.answer_field if local else None,
            )
        )
    return benchmarks


def _model_init_kwargs(model_args: ModelConfig, training_args: PolicyLossConfig) -> dict:
    kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
    }
    kwargs = {key: value for key, value in kwargs.items() if value is not None}
    if training_args.model_init_kwargs:
        kwargs.update(training_args.model_init_kwargs)
    return kwargs


def describe_run(trainer) -> str:
    """One line: trainer, policy loss, parallelism and the batch mapping actually in effect (recipes/README.md)."""
    args, accelerator = trainer.args, trainer.accelerator
    processes = accelerator.num_processes
    parallel = str(accelerator.distributed_type).split(".")[-1]
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None:
        parallel += f" ZeRO-{plugin.zero_stage}"
    per_update = args.per_device_train_batch_size * processes * args.gradient_accumulation_steps
    generation = args.generation_batch_size
    return (
        f"trl-bandpo: {type(trainer).__name__}, policy_loss={args.policy_loss}, loss_type={args.loss_type} | "
        f"{processes} process(es), {parallel} | {generation} completions per generation "
        f"({generation // args.num_generations} prompts x {args.num_generations}), {per_update} per optimizer step "
        f"({args.per_device_train_batch_size} per device x {processes} x {args.gradient_accumulation_steps} "
        f"accumulation), {generation // per_update if per_update else '?'} optimizer step(s) per generation x "
        f"{args.num_iterations} iteration(s) | max_steps={args.max_steps}"
    )


def run(script_args: ScriptArguments, training_args: PolicyLossConfig, model_args: ModelConfig):
    """Build the datasets, reward and trainer, train, save; returns the trainer (process group still alive)."""
    import transformers
    from trl import get_peft_config, get_quantization_config

    log_level = training_args.get_process_log_level()
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=log_level)
    logger.setLevel(log_level)
    transformers.utils.logging.set_verbosity(log_level)

    training_args.model_init_kwargs = _model_init_kwargs(model_args, training_args)

    with training_args.main_process_first(desc="loading datasets"):
        train_dataset = load_train_data(script_args)
        eval_dataset = load_eval_data(script_args) if training_args.eval_strategy != "no" else None
    if script_args.eval_dataset_name and eval_dataset is None:
        logger.warning("eval_dataset_name is set but eval_strategy is 'no': no evaluation during training.")

    trainer_cls = trainer_class_for(training_args.policy_loss)
    logger.info(
        "%s: policy_loss=%s, loss_type=%s, %d training problems, model %s",
        trainer_cls.__name__, training_args.policy_loss, training_args.loss_type, len(train_dataset),
        model_args.model_name_or_path,
    )  # fmt: skip
    trainer = trainer_cls(
        model=model_args.model_name_or_path,
        reward_funcs=[build_reward(script_args)],
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )
    trainer.accelerator.print(describe_run(trainer))
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.save_state()  # trainer_state.json (log history) next to the model
    trainer.accelerator.print(f"Model and trainer state saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=",".join(script_args.dataset_name))
    return trainer


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` (default `sys.argv[1:]`), train, and return 0. Configuration errors exit with status 2."""
    try:
        script_args, training_args, model_args = parse_args(argv)
    except ConfigError as err:
        print(f"trl-bandpo train: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    trainer = run(script_args, training_args, model_args)
    if hasattr(trainer, "end"):  # transformers >= 5.18: finish trackers, destroy the process group
        trainer.end()
    return 0


if __name__ == "__main__":
    sys.exit(main())

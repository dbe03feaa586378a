"""`ScriptArguments`: the data, reward and validation fields of a recipe, each checked when it is built."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from ..core.checks import Choice, Flag, Integer, Number, none_word, refuse
from ..data import BOXED_INSTRUCTION, PROMPT_TEMPLATES, TRAINING_MIXES
from ..evaluation.settings import recipe_fields

#: `reward` choice -> (score of a correct answer, score of a wrong one, name of the logged metric).
REWARDS = {
    "signed": (1.0, -1.0, "boxed_signed_reward"),
    "accuracy": (1.0, 0.0, "boxed_accuracy_reward"),
    "dapo": (1.0, -1.0, "dapo_reward"),
    "last_number": (1.0, 0.0, "last_number_reward"),
}


def _field(default, help_text: str, **metadata):
    """A dataclass field with its ``--help`` text (and other `add_argument` keywords, such as ``choices``)."""
    return field(default=default, metadata={"help": help_text, **metadata})


@dataclass
class ScriptArguments(recipe_fields()):
    r"""
    Data and reward of a `trl-bandpo train` run.

    Parameters:
        dataset_name (`list[str]`):
            Training data, concatenated: a mix (`"bandpo"`: English DAPO-Math-17k + MATH levels 3-5; `"dgpo"`:
            DAPO-Math-17k), `trl_bandpo.data.DATASETS` names, local files or folders (a string: comma-separated).
        dataset_split (`str`, *optional*):
            Split (or slice such as `"train[:200]"`) of local files/folders; registry datasets use their own.
        problem_field / answer_field (`str`, *optional*):
            Problem and final-answer columns of local files (dotted names reach nested fields); guessed when unset.
        instruction (`str`, *optional*):
            Appended to every problem by the `"boxed"` template (default: ask for `\boxed{}`); `null` for none.
        prompt_template (`str`, defaults to `"boxed"`):
            `"boxed"` or `"dapo"`: DAPO's template (the BandPO authors'), asking for a last line `Answer: ...`.
        max_prompt_tokens (`int`, *optional*):
            Drop the problems whose prompt, chat template included, is longer (the BandPO authors: 1024).
        max_train_samples (`int`, *optional*):
            Keep at most this many problems from each training dataset.
        eval_dataset_name (`list[str]`, *optional*):
            Benchmarks evaluated during training when `eval_strategy` is not `"no"` (names, files or `name=path`).
        max_eval_samples (`int`, *optional*):
            Keep at most this many problems per benchmark.
        reward (`str`, defaults to `"signed"`):
            `"signed"`: +1 / -1 from math-verify on the last `\boxed{}` (DGPO); `"accuracy"`: 1 / 0; `"dapo"`:
            +1 / -1 from the "Answer:" line as verl's `math_dapo` compares it (the BandPO authors'); `"last_number"`:
            1 / 0 when the reply's last number is the answer (short numeric answers without a format, e.g. the
            SmolLM2 recipes).
        reward_timeout (`float`, defaults to `5.0`):
            Seconds allowed to `math_verify` per answer; an answer that takes longer scores wrong.
        reward_num_workers (`int`, *optional*):
            Verifier processes per training process (default `min(4, cpu_count)`).
        val_<setting> (*optional*):
            Validation during training: one field per `trl_bandpo.evaluation.ValidationSettings` setting
            (`val_preset`, `val_benchmarks`, ...; docs/evaluation.md), checked into `validation`.
        async_rollouts (`bool`, defaults to `False`):
            Train with TRL's asynchronous GRPO trainer and a vLLM server (docs/off-policy-and-async.md). Needs GPUs.
    """

    dataset_name: list[str] | None = _field(
        None,
        f"Training data: a mix ({', '.join(TRAINING_MIXES)}), registry names (trl_bandpo.data.DATASETS) and/or local "
        "files; several are concatenated.",
    )
    dataset_split: str | None = _field(None, "Split of local training files (e.g. 'train' or 'train[:200]').")
    problem_field: str | None = _field(None, "Problem column of local training files.")
    answer_field: str | None = _field(None, "Answer column of local training files.")
    instruction: str | None = _field(BOXED_INSTRUCTION, "Appended to every problem ('boxed'); 'none' for nothing.")
    prompt_template: str = _field("boxed", "'boxed' or 'dapo' (DAPO's template).", choices=list(PROMPT_TEMPLATES))
    max_prompt_tokens: int | None = _field(None, "Drop longer prompts (BandPO: 1024).")
    max_train_samples: int | None = _field(None, "At most this many problems from each training dataset.")
    eval_dataset_name: list[str] | None = _field(
        None, "Benchmarks evaluated during training (needs eval_strategy != 'no')."
    )
    max_eval_samples: int | None = _field(None, "At most this many problems per benchmark.")
    reward: str = _field(
        "signed",
        "Reward: 'signed' (+1/-1 boxed, DGPO), 'accuracy' (1/0 boxed) or 'dapo' (+1/-1 'Answer:' line, BandPO).",
        choices=list(REWARDS),
    )
    reward_timeout: float = _field(5.0, "Seconds allowed to math_verify per answer.")
    reward_num_workers: int | None = _field(None, "Verifier processes per process.")
    async_rollouts: bool = _field(
        False, "Train with TRL's asynchronous GRPO trainer and a vLLM server (AsyncBandPOTrainer, ...)."
    )

    FIELD_CHECKS: ClassVar[dict] = {
        "prompt_template": Choice(tuple(PROMPT_TEMPLATES)),
        "reward": Choice(tuple(REWARDS)),
        "reward_timeout": Number(low=0, low_open=True),
        **dict.fromkeys(("max_prompt_tokens", "max_train_samples", "max_eval_samples", "reward_num_workers"),
                        Integer(low=1, optional=True)),
        "async_rollouts": Flag(),
    }  # fmt: skip

    def __post_init__(self):
        for name in ("dataset_name", "eval_dataset_name"):
            value = getattr(self, name)
            strings = isinstance(value, list) and all(isinstance(v, str) for v in value)
            if value is not None and not isinstance(value, str) and not strings:
                refuse(name, "a string or a list of strings (names or local files)", value)
            setattr(self, name, _split_names(value))
        for name in ("dataset_split", "problem_field", "answer_field", "instruction"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                refuse(name, "a string or null", getattr(self, name))
        self.instruction = None if not self.instruction else none_word(self.instruction)
        for name, check in self.FIELD_CHECKS.items():
            setattr(self, name, check(getattr(self, name), name))
        if self.prompt_template == "dapo" and self.instruction not in (None, BOXED_INSTRUCTION):
            warnings.warn(
                f"prompt_template='dapo' ignores instruction={self.instruction!r}: DAPO's template carries its own "
                "instruction. Remove `instruction`, or set `prompt_template: boxed` to use it.",
                stacklevel=3,
            )
        if (self.reward == "dapo") != (self.prompt_template == "dapo"):
            warnings.warn(
                f"reward={self.reward!r} with prompt_template={self.prompt_template!r}: the 'dapo' reward reads the "
                "'Answer:' line that DAPO's template asks for, the other rewards the last \\boxed{}; a prompt asking "
                "for the other format scores every answer wrong. Use 'dapo' for both, or for neither.",
                stacklevel=3,
            )
        # the val_* fields, checked
        self.validation = self.validation_settings(self.prompt_template)
        self.val_preset = self.validation.preset  # "none" read as None
        if self.async_rollouts:
            names = ("val_preset", "val_benchmarks", "eval_dataset_name")
            given = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
            if given:
                raise ValueError(
                    f"{', '.join(f'{name}={value!r}' for name, value in given.items())} cannot be used with "
                    "async_rollouts: true: the asynchronous trainer has no generation engine of its own to validate "
                    "or evaluate with. Remove it (or set val_preset: none) and evaluate the saved checkpoints with "
                    "`trl-bandpo eval`."
                )


def _split_names(names: Sequence[str] | None) -> list[str] | None:
    """Flatten comma-separated entries: ``["a,b", "c"]`` -> ``["a", "b", "c"]``; None stays None."""
    names = [names] if isinstance(names, str) else names or []
    return [part.strip() for name in names for part in str(name).split(",") if part.strip()] or None

"""`ScriptArguments`: the data, reward and validation fields of a recipe (next to `PolicyLossConfig` and TRL's
`ModelConfig`), each checked once when it is built (`FIELD_CHECKS`). The validation fields (``val_*``) are those of
`trl_bandpo.evaluation.ValidationSettings`, which checks them (`recipe_fields`)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from ..core.checks import Choice, Flag, Integer, Number, none_word, refuse
from ..data import BOXED_INSTRUCTION, PROMPT_TEMPLATES, TRAINING_MIXES
from ..evaluation.settings import recipe_fields

__all__ = ["REWARDS", "ScriptArguments"]

#: `reward` choice -> (score of a correct answer, score of a wrong one, name of the logged metric).
REWARDS = {
    "signed": (1.0, -1.0, "boxed_signed_reward"),
    "accuracy": (1.0, 0.0, "boxed_accuracy_reward"),
    "dapo": (1.0, -1.0, "dapo_reward"),
}


@dataclass
class ScriptArguments(recipe_fields()):
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
            training reward, `trl_bandpo.scoring.rewards.dapo_reward`; use it with `prompt_template: dapo`). With the
            group-normalised advantage (`scale_rewards="group"`) signed and accuracy give the same advantages.
        reward_timeout (`float`, defaults to `5.0`):
            Wall-clock seconds allowed to `math_verify` per answer; an answer that takes longer scores wrong.
        reward_num_workers (`int`, *optional*):
            Verifier processes per training process (default `min(4, cpu_count)`).

        > Validation during training, as both papers ran it (docs/evaluation.md, "Validation during training")

        val_<setting> (*optional*):
            One field per `trl_bandpo.evaluation.ValidationSettings` setting, with its help and checks:
            `val_preset` (`"bandpo"` or `"dgpo"`: the `EVAL_PRESETS` protocol, which the other fields override; a
            `val_scorer` of `BENCHMARK=NAME` entries updates its scorers), `val_benchmarks` (none, and no preset:
            no validation), `val_every_steps`, `val_before_train` (verl's name for `at_start`), `val_at_end`,
            `val_num_samples`, `val_ks`, `val_max_new_tokens`, `val_temperature`, `val_top_p`, `val_top_k`,
            `val_prompt_template` (default: the preset's, else `prompt_template`), `val_scorer`, `val_seed`,
            `val_batch_size`, `val_max_problems`, `val_timeout_s`, `val_backend`. Not set (null): the preset's
            value, else `ValidationSettings`' default. Built and checked into `validation` (a `ValidationSettings`)
            with the arguments; set without benchmarks they are ignored, with a warning.

        > Asynchronous training (docs/off-policy-and-async.md)

        async_rollouts (`bool`, defaults to `False`):
            Train with TRL's asynchronous GRPO trainer (`AsyncBandPOTrainer`, `AsyncDGPOTrainer`,
            `AsyncPolicyLossTrainer`): a vLLM server (`vllm_server_base_url`) generates ahead of the trainer, which
            pushes its weights to it every `weight_sync_steps` steps. The training keys are then those of
            `AsyncPolicyLossConfig` (`trl.experimental.async_grpo.AsyncGRPOConfig` + the policy-loss fields), and
            in-training evaluation and validation are refused (the async trainer has no generation engine of its own:
            evaluate the saved checkpoints with `trl-bandpo eval`). Needs GPUs (weights travel over NCCL).
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
    async_rollouts: bool = field(
        default=False,
        metadata={"help": "Train with TRL's asynchronous GRPO trainer and a vLLM server (AsyncBandPOTrainer, ...)."},
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
            if value is not None and not isinstance(value, str):
                if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
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
                UserWarning,
                stacklevel=3,
            )
        if (self.reward == "dapo") != (self.prompt_template == "dapo"):
            warnings.warn(
                f"reward={self.reward!r} with prompt_template={self.prompt_template!r}: the 'dapo' reward reads the "
                "'Answer:' line that DAPO's template asks for, the other rewards the last \\boxed{}; a prompt asking "
                "for the other format scores every answer wrong. Use 'dapo' for both, or for neither.",
                UserWarning,
                stacklevel=3,
            )
        self.validation = self.validation_settings(self.prompt_template)  # the val_* fields, checked
        self.val_preset = self.validation.preset  # "none" read as None
        if self.async_rollouts:
            given = {"val_preset": self.val_preset, "val_benchmarks": self.val_benchmarks,
                     "eval_dataset_name": self.eval_dataset_name}  # fmt: skip
            given = {name: value for name, value in given.items() if value is not None}
            if given:
                raise ValueError(
                    f"{', '.join(f'{name}={value!r}' for name, value in given.items())} cannot be used with "
                    "async_rollouts: true: the asynchronous trainer has no generation engine of its own to validate "
                    "or evaluate with. Remove it (or set val_preset: none) and evaluate the saved checkpoints with "
                    "`trl-bandpo eval`."
                )


def _split_names(names: Sequence[str] | None) -> list[str] | None:
    """Flatten comma-separated entries: ``["a,b", "c"]`` -> ``["a", "b", "c"]``; None stays None."""
    if names is None:
        return None
    if isinstance(names, str):
        names = [names]
    out = [part.strip() for name in names for part in str(name).split(",") if part.strip()]
    return out or None

r"""The settings of an evaluation, each checked once, where it is declared.

`EvalSettings` holds every setting of `trl_bandpo.evaluation.evaluate`, with its help (``trl-bandpo eval`` parses
it with `transformers.HfArgumentParser`), and checks every value (`trl_bandpo.core.checks`) before any model or data
is loaded. `ValidationSettings` adds when to validate during training; `recipe_fields` makes the recipe's ``val_*``
fields from it. Messages name each setting as its caller spells it (``names``: flags, recipe fields).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import typing
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Any

from ..core.checks import Choice, Flag, Integer, Number, none_word, refuse
from ..data.prompts import PROMPT_TEMPLATES
from .presets import EVAL_PRESETS, PRESET_SETTINGS, preset_settings
from .scorers import SCORERS, check_scorer, parse_scorer, scorers_for
from .summary import default_ks

#: Model dtypes that both backends accept ("auto": the checkpoint's own).
DTYPES = ("auto", "bfloat16", "float16", "float32")
#: "auto": vLLM when installed (in training: the trainer's engine when it can be reused), else ``generate``.
BACKENDS = ("auto", "vllm", "transformers")

#: The check of every setting that one value decides (`benchmarks`, `ks`, `scorer` and `device` have their own).
CHECKS = {
    "preset": Choice(tuple(EVAL_PRESETS), optional=True),
    "num_samples": Integer(low=1),
    "max_new_tokens": Integer(low=1),
    "truncate_prompt_tokens": Integer(low=1, optional=True),
    "temperature": Number(low=0),
    "top_p": Number(low=0, high=1, low_open=True),
    "top_k": Integer(low=1, optional=True),
    "prompt_template": Choice(tuple(PROMPT_TEMPLATES)),
    "seed": Integer(low=0, high=2**32 - 1),
    "dtype": Choice(DTYPES),
    "batch_size": Integer(low=1),
    "max_problems": Integer(low=1, optional=True),
    "timeout_s": Number(low=0, low_open=True, optional=True),
    "backend": Choice(BACKENDS),
    "every_steps": Integer(low=1),
    "at_start": Flag(),
    "at_end": Flag(),
}
_PACKAGE = Path(__file__).resolve().parents[1]  # trl_bandpo/
_BENCHMARKS = "a registry name, a local file or name=path, a list of them, or a mapping name -> Dataset or path"


def _setting(default: Any, text: str, **extra: Any) -> Any:
    """A dataclass field with its `default` and its help (``metadata["help"]``, as `HfArgumentParser` reads it)."""
    return field(default=default, metadata={"help": text, **extra})


@dataclass
class EvalSettings:
    r"""
    Every setting of an evaluation: what `trl_bandpo.evaluation.evaluate` and ``trl-bandpo eval`` take, each described
    by its help. Each value is checked when the settings are built (ValueError naming the setting as `names` spells
    it: a flag, a recipe field) and normalised: numbers to `float`, `ks` to a sorted list (default: `default_ks`),
    `scorer` to a name or a mapping keyed by registry names (``"*"``: the others), comma-separated `benchmarks` to a
    list (in Python also a mapping name -> Dataset or path). `preset` is recorded in results.json and orders the
    estimators (`from_preset` fills the settings from it). A benchmark scored by ``"dapo"`` under the ``"boxed"``
    prompt gets a warning.
    """

    benchmarks: list[str] | None = field(
        default_factory=lambda: ["aime2024", "aime2025", "amc2023"],
        metadata={
            "help": "Benchmarks: registry names (aime2024 aime2025 amc2023 math500 minerva olympiadbench "
            "aime2024-math-ai aime2025-math-ai), local files (.jsonl/.json/.parquet/.csv) or name=path."
        },
    )
    preset: str | None = _setting(
        None,
        "A paper's protocol (docs/evaluation.md), which fills every setting not given: bandpo (AIME 2024/2025 + "
        "AMC 2023, DAPO prompt, 32 samples at T 1.0 / top-p 1.0, 4,096 new tokens; AIME by the dapo scorer, AMC "
        "by math_reward, which is inferred: scorer amc2023=dapo switches it) or dgpo (six benchmarks, boxed "
        "prompt, 32 samples at T 1.0 / top-p 1.0, 8,192 new tokens, strict scorer). Results show the estimator "
        "the paper reports (bootstrap best@k) first.",
    )
    num_samples: int = _setting(32, "Completions per problem (n of mean@n).")
    ks: list[int] | None = _setting(
        None, "The k of pass@k and best@k, each in [1, num_samples] (eval default: powers of 2 up to it)."
    )
    max_new_tokens: int = _setting(4096, "Generation budget per completion, in tokens.")
    truncate_prompt_tokens: int | None = _setting(
        None, "Keep only the last this many tokens of each prompt (none: a prompt that leaves the model no position "
        "to generate in is refused).",
    )  # fmt: skip
    temperature: float = _setting(1.0, "Sampling temperature (both papers: 1.0); 0 decodes greedily once and repeats.")
    top_p: float = _setting(1.0, "Top-p, in (0, 1] (both papers: 1.0).")
    top_k: int | None = _setting(None, "Sample among the k likeliest tokens (none: no top-k).")
    prompt_template: str = _setting(
        "boxed", "'boxed' (problem + \\boxed{} instruction) or 'dapo' (DAPO's 'Answer:' template)."
    )
    scorer: str = _setting(
        "math_verify",
        "Answer checker: math_verify, dapo, strict or math_reward for every benchmark, and/or BENCHMARK=NAME "
        "entries (comma-separated) for some, which update a preset's mapping rather than replace it.",
        nargs="+",
    )
    seed: int = _setting(0, "Sampling seed, in [0, 2**32).")
    dtype: str = _setting("auto", "Model dtype: auto, bfloat16, float16 or float32.")
    batch_size: int = _setting(64, "Sequences per generate call (transformers backend).")
    device: str | None = _setting(
        None, "Torch device of the transformers backend (cpu, cuda:1, ...; none: cuda if any)."
    )
    max_problems: int | None = _setting(None, "Only the first problems of each benchmark.")
    timeout_s: float | None = _setting(
        None,
        "Time limit per answer of the math_verify and strict scorers, in seconds (none: 2 and 10; dapo and "
        "math_reward take none).",
    )
    backend: str = _setting("auto", "auto (vLLM when installed), vllm or transformers (model.generate).")
    names: InitVar[Mapping[str, str] | None] = None

    def __post_init__(self, names: Mapping[str, str] | None) -> None:
        if names is not None and not (isinstance(names, Mapping) and all(isinstance(n, str) for n in names.values())):
            refuse("names", "None or a mapping of setting -> how messages name it (a string)", names)
        self.names = dict(names or {})
        for f in dataclasses.fields(self):
            if f.name in CHECKS:
                setattr(self, f.name, CHECKS[f.name](getattr(self, f.name), self.name(f.name)))
        self.benchmarks = _checked_benchmarks(self.benchmarks, self.name("benchmarks"))
        self.ks = self._checked_ks()
        self.scorer = check_scorer(parse_scorer(self.scorer), self.name("scorer"))
        if self.device is not None:
            check_device(self.device, self.name("device"))
        self._warn_about_dapo_scoring()

    def name(self, key: str) -> str:
        """How messages name setting `key`."""
        return self.names.get(key, key)

    @classmethod
    def from_preset(cls, preset: str | None = None, *, names: Mapping[str, str] | None = None, **given: Any):
        """The settings of `preset` (`EVAL_PRESETS`; None or "none": the defaults), the `given` ones winning
        (`preset_settings`: a given scorer mapping updates the preset's, its ks above a given num_samples are
        dropped)."""
        preset = CHECKS["preset"](preset, (names or {}).get("preset", "preset"))
        settings = cls(**(given if preset is None else preset_settings(preset, **given)), names=names)
        if preset is not None and given.get("benchmarks") is not None and "scorer" not in given:
            settings._check_preset_scorer()
        return settings

    def _check_preset_scorer(self) -> None:
        """ValueError naming `benchmarks` (given with the preset) for a benchmark its scorer mapping does not name."""
        for name in _benchmark_names(self.benchmarks):
            try:
                scorers_for(self.scorer, [name])
            except ValueError:
                raise ValueError(
                    f"{self.name('benchmarks')}: benchmark {name!r} has no scorer ({self.name('preset')} "
                    f"{self.preset} scores only {sorted(self.scorer)}): a custom benchmark needs "
                    f"{self.name('scorer')} {name}=NAME (or one NAME for every benchmark), NAME one of {list(SCORERS)}"
                ) from None

    def _default_ks(self) -> list[int]:
        return list(default_ks(self.num_samples))

    def _checked_ks(self) -> list[int]:
        ks, n = none_word(self.ks), self.num_samples
        if ks is None:
            return self._default_ks()
        allowed = f"None or a non-empty list of integers in [1, {self.name('num_samples')}={n}]"
        try:
            checked = sorted({Integer(low=1, high=n)(k, "k") for k in ks}) if not isinstance(ks, str) else []
        except (TypeError, ValueError):
            checked = []
        if not checked:
            refuse(self.name("ks"), allowed, ks)
        return checked

    def _warn_about_dapo_scoring(self) -> None:
        """Warn when a benchmark given by name or path is scored by "dapo" under a prompt that is not DAPO's."""
        mapping = {"every benchmark": self.scorer} if isinstance(self.scorer, str) else self.scorer
        dapo = ["the other benchmarks" if bench == "*" else bench for bench, s in mapping.items() if s == "dapo"]
        prompted = not isinstance(self.benchmarks, Mapping) or any(
            isinstance(source, (str, os.PathLike)) for source in self.benchmarks.values()
        )  # Datasets passed in a mapping keep their own prompts
        if dapo and prompted and self.prompt_template != "dapo":
            template, scorer = self.name("prompt_template"), self.name("scorer")
            conflict = f"{scorer} 'dapo' (for {', '.join(dapo)}) with {template}={self.prompt_template!r}"
            if self.preset and EVAL_PRESETS[self.preset]["prompt_template"] != self.prompt_template:  # template given
                conflict = (f"{template}={self.prompt_template!r} with {self.name('preset')} {self.preset}, whose "
                            f"{scorer} is 'dapo' for {', '.join(dapo)}")  # fmt: skip
            warnings.warn(
                f"{conflict}: the 'dapo' scorer reads the 'Answer:' line that DAPO's template asks for, this prompt "
                "asks for the last \\boxed{}, so every such answer scores wrong. Use 'dapo' for both, or another "
                "scorer.",
                UserWarning, stacklevel=4,
            )  # fmt: skip


@dataclass
class ValidationSettings(EvalSettings):
    r"""
    `EvalSettings` of validation during training (`trl_bandpo.evaluation.validation.ValidationCallback`), plus when
    to validate. `benchmarks` has no default (None: nothing to validate), `ks` defaults to `[num_samples]`, and the
    trainer's own model is sampled (no `dtype` or `device`). `at_start` is verl's ``val_before_train`` (its recipe
    field too), on in the BandPO authors' runs.
    """

    benchmarks: list[str] | None = field(
        default=None, metadata=EvalSettings.__dataclass_fields__["benchmarks"].metadata
    )
    dtype: str = field(default="auto", init=False, repr=False)
    device: str | None = field(default=None, init=False, repr=False)
    truncate_prompt_tokens: int | None = field(default=None, init=False, repr=False)
    every_steps: int = _setting(5, "Validate every this many optimizer steps (and at the end).")
    at_start: bool = _setting(
        False, "Also validate before the first step (verl's val_before_train; the BandPO authors' runs do)."
    )
    at_end: bool = _setting(True, "Also validate at the last step.")

    def _default_ks(self) -> list[int]:
        return [self.num_samples]


def _checked_benchmarks(benchmarks: Any, name: str) -> Any:
    """`benchmarks` (None, a string or path, a list of them, or a mapping name -> Dataset or path), comma-separated
    strings split into a list; ValueError naming `name` otherwise."""
    if benchmarks is None:
        return None
    if isinstance(benchmarks, Mapping):
        from datasets import Dataset

        if all(isinstance(k, str) and isinstance(v, (str, os.PathLike, Dataset)) for k, v in benchmarks.items()):
            return benchmarks
    elif isinstance(benchmarks, (str, os.PathLike)):
        return _checked_benchmarks([benchmarks], name)
    elif isinstance(benchmarks, Sequence) and all(isinstance(entry, (str, os.PathLike)) for entry in benchmarks):
        entries = [entry.split(",") if isinstance(entry, str) else [entry] for entry in benchmarks]
        return [
            part.strip() if isinstance(part, str) else part for parts in entries for part in parts if str(part).strip()
        ]
    refuse(name, _BENCHMARKS, benchmarks)


def check_device(device: Any, field: str = "device") -> str:
    """`device` if torch parses it and such a device is present here ("cpu", "cuda", "cuda:1", "mps", ...)."""
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        refuse(field, "a torch device such as 'cpu', 'cuda', 'cuda:1' or 'mps'", device)
    if parsed.type == "cpu":
        return device
    module = getattr(torch, parsed.type, None)
    is_available = getattr(module, "is_available", None) or getattr(
        getattr(torch.backends, parsed.type, None), "is_available", None
    )
    count = getattr(module, "device_count", lambda: None)() if is_available and is_available() else 0
    if count == 0 or (parsed.index is not None and count is not None and parsed.index >= count):
        refuse(
            field, f"a device of this machine ({count or 'no'} {parsed.type} device(s) here, indices from 0)", device
        )
    return device


def check_output_dir(output_dir: str | os.PathLike, field: str = "output_dir") -> Path:
    """Create `output_dir` if needed and make sure a file can be written in it; ValueError naming `field` otherwise.
    Warns when it is this project's checkout root or inside the package: a run would write among the sources."""
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{field}: {str(out)!r} is an existing file, not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as err:
        raise ValueError(f"{field}: {str(out)!r} is not a writable folder ({err.strerror or err})") from None
    where = out.resolve()
    why = "inside the installed trl_bandpo package" if where.is_relative_to(_PACKAGE) else None
    for root in (where, *where.parents):  # in a checkout (installed or not): its root, or inside its package folder
        pyproject = root / "pyproject.toml"
        if pyproject.is_file() and 'name = "trl-bandpo"' in pyproject.read_text(encoding="utf-8", errors="replace"):
            if where == root:
                why = "the root of the trl-bandpo checkout (its pyproject.toml)"
            elif where.is_relative_to(root / "trl_bandpo") and why is None:
                why = f"inside the package folder of the trl-bandpo checkout {root}"
            break
    if why:
        warnings.warn(
            f"the output folder {str(out)!r} is {why}: checkpoints and results would be written among the "
            "sources. Choose a folder outside the project.",
            UserWarning, stacklevel=1,  # at this line: shown once when two checks of one run (eval's) find it
        )  # fmt: skip
    return out


def _benchmark_names(benchmarks: Any) -> list[str]:
    """The names `load_eval_benchmarks` gives `benchmarks`: a mapping's keys, a file's stem, NAME of NAME=path, else
    the entry (a registry name, which the scorers resolve)."""
    if isinstance(benchmarks, Mapping):
        return list(benchmarks)
    return [Path(e).stem if Path(e).exists() else os.fspath(e).partition("=")[0].strip() for e in benchmarks]


def recipe_field(name: str) -> str:
    """The recipe field of `ValidationSettings` field `name`: ``val_<name>``, and verl's ``val_before_train`` for
    `at_start`."""
    return "val_before_train" if name == "at_start" else f"val_{name}"


def recipe_fields() -> type:
    """A dataclass with the recipe field (`recipe_field`) of every `ValidationSettings` setting, with its help, typed
    as it or None, default None (not set: the val_preset's value, else the default). ``validation_settings`` (a
    method) builds the `ValidationSettings` they describe, which checks them; `ScriptArguments` derives from it."""
    hints, specs = typing.get_type_hints(ValidationSettings), []
    for f in (f for f in dataclasses.fields(ValidationSettings) if f.init):
        default = "the training prompt_template" if f.name == "prompt_template" else str(f.default).lower()
        default = "num_samples" if f.name == "ks" else default
        unset = f"{'the val_preset value, else ' if f.name in PRESET_SETTINGS else ''}{default}"
        help_text = f"{f.metadata['help']} Not set: {unset}."
        specs.append((recipe_field(f.name), hints[f.name] | None, _setting(None, help_text)))
    namespace = {"__module__": __name__, "validation_settings": _validation_settings}
    return dataclasses.make_dataclass("ValidationFields", specs, namespace=namespace)


def _validation_settings(self, prompt_template: str = "boxed") -> ValidationSettings:
    """The `ValidationSettings` of these recipe fields: each field set, else the ``val_preset``'s value (a scorer
    mapping updates the preset's), else the default; the prompt template, else `prompt_template` (the training one).
    Each value is checked, named as its field; a warning names the fields set when no benchmark is (they are
    ignored) unless ``val_preset`` is "none" (validation turned off)."""
    names = {f.name: recipe_field(f.name) for f in dataclasses.fields(ValidationSettings) if f.init}
    given = {key: getattr(self, name) for key, name in names.items() if getattr(self, name) is not None}
    preset = given.pop("preset", None)
    unused = [names[key] for key in given if key != "benchmarks"]
    if none_word(preset) is None:
        given.setdefault("prompt_template", prompt_template)
    settings = ValidationSettings.from_preset(preset, names=names, **given)
    if settings.preset and "prompt_template" not in given and settings.prompt_template != prompt_template:
        warnings.warn(
            f"val_preset={settings.preset!r} validates with its val_prompt_template={settings.prompt_template!r}, "
            f"while training prompts with prompt_template={prompt_template!r}: the model is validated on prompts "
            "that ask for another answer format than it learns. Set val_prompt_template (and val_scorer) to the "
            "training one, or train with the preset's.",
            UserWarning, stacklevel=3,
        )  # fmt: skip
    if not settings.benchmarks and unused and preset is None:
        warnings.warn(
            f"{', '.join(unused)} set, but no benchmark to validate on (val_benchmarks, val_preset): they are "
            "ignored. Set val_benchmarks or val_preset to validate, or remove them.",
            UserWarning, stacklevel=3,
        )  # fmt: skip
    return settings

"""`trl-bandpo eval`: mean@n and pass@k of a model on math benchmarks (`trl_bandpo.evaluation.evaluate`); the flags
are `EvalSettings`' fields plus `EvalCommand`'s, every value checked before the model loads (docs/evaluation.md)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import MISSING, dataclass
from pathlib import Path

from transformers import HfArgumentParser

from ..core.checks import Integer, Number, none_word
from ..evaluation import EvalSettings, evaluate, load_benchmarks, merge_scorer, scorers_for
from ..evaluation.generation import PromptTooLongError, resolve_backend
from ..evaluation.scorers import SCORERS, parse_scorer
from ..evaluation.settings import check_output_dir
from ..evaluation.summary import write_markdown
from .script_arguments import _field

#: The flag of each `EvalSettings` field, as messages name it.
FLAGS = {f.name: "--" + f.name.replace("_", "-") for f in dataclasses.fields(EvalSettings)}
#: A setting not given on the command line: the preset's value, else the default.
_UNSET = object()


@dataclass
class EvalCommand:
    """The flags of ``trl-bandpo eval`` that are no evaluation setting; checked when built."""

    model: str = _field(MISSING, "Model folder, hub id, or a packaged model's name (trl-bandpo fetch-model).")
    output_dir: str = _field("eval_results", "Where results and samples are written.")
    overwrite: bool = _field(False, "Replace the results of an earlier run in --output-dir.")
    no_samples: bool = _field(False, "Do not write samples_<benchmark>.jsonl.")
    tensor_parallel_size: int | None = _field(None, "vLLM tensor parallelism.")
    gpu_memory_utilization: float | None = _field(None, "vLLM GPU memory fraction.")
    max_model_len: int | None = _field(None, "vLLM context length.")

    def __post_init__(self):
        from ..data.models import FetchError, resolve_model
        from ..training.policy_term import check_model_name

        try:  # a packaged model's name: its folder, fetched on first use; then training's check of the path
            self.model = resolve_model(self.model)
            check_model_name(self.model)
        except (ValueError, FetchError) as err:
            raise ValueError(f"--model: {err}") from None
        checks = {"tensor_parallel_size": Integer(low=1), "gpu_memory_utilization": Number(0, 1, low_open=True),
                  "max_model_len": Integer(low=1)}  # fmt: skip
        self.vllm_kwargs = {
            key: check(getattr(self, key), "--" + key.replace("_", "-"))
            for key, check in checks.items()
            if getattr(self, key) is not None
        }
        out = check_output_dir(self.output_dir, "--output-dir")
        earlier = sorted(p.name for p in out.glob("results.*") if p.suffix in (".json", ".md"))
        earlier += sorted(p.name for p in out.glob("samples_*.jsonl"))
        if earlier and not self.overwrite:
            raise ValueError(
                f"--output-dir: {str(out)!r} holds an earlier run's results ({', '.join(earlier)}): pass --overwrite "
                "to replace them, or choose another --output-dir"
            )


class _Parser(HfArgumentParser):
    """Leaves every `EvalSettings` flag not given unset (`_UNSET`), so that a preset can fill it."""

    def parse_known_args(self, args=None, namespace=None):
        return super().parse_known_args(args, namespace or argparse.Namespace(**dict.fromkeys(FLAGS, _UNSET)))


def build_parser() -> HfArgumentParser:
    """`HfArgumentParser` over `EvalCommand` and `EvalSettings`, the settings not given left unset."""
    parser = _Parser(
        (EvalCommand, EvalSettings),
        prog="trl-bandpo eval",
        description="Sample completions on math benchmarks and report mean@n, pass@k (unbiased) and best@k "
        "(bootstrap, as verl logs). --preset applies a paper's protocol (EVAL_PRESETS): it fills every setting not "
        "given explicitly, so the defaults shown apply without a preset. See docs/evaluation.md.",
    )
    for action in parser._actions:
        # --num-samples first, then --num_samples
        action.option_strings.sort(key=lambda flag: "_" in flag)
    return parser


def resolve_settings(args: argparse.Namespace) -> EvalSettings:
    """The effective settings: each flag given, else the preset's value, else the default (``--scorer`` entries
    update the preset's scorers, a bare name replaces them). Raises ValueError naming the flag."""
    given = {key: getattr(args, key) for key in FLAGS if getattr(args, key) is not _UNSET}
    if "scorer" in given and none_word(given.get("preset")) is None:
        given["scorer"] = merge_scorer(EvalSettings.scorer, given["scorer"])
    return EvalSettings.from_preset(given.pop("preset", None), names=FLAGS, **given)


def _check_scorers(parser: argparse.ArgumentParser, args, settings: EvalSettings, names: list[str]) -> None:
    """Every benchmark has a scorer, and every BENCHMARK=NAME of --scorer names a benchmark of this run."""
    from ..data import resolve_dataset_name

    known = set(names) | {resolve_dataset_name(name) or name for name in names}
    entries = [] if args.scorer is _UNSET else [parse_scorer(entry) for entry in args.scorer]
    for benchmark in (key for entry in entries if isinstance(entry, dict) for key in entry):
        if (resolve_dataset_name(benchmark) or benchmark) not in known:
            parser.error(f"argument --scorer: {benchmark!r} is not a benchmark of this run (benchmarks: {names})")
    scorer = settings.scorer
    origin = "--scorer names only"
    if settings.preset:
        origin = f"--preset {settings.preset} scores only"
    # a benchmark the mapping does not name: say what to add
    if isinstance(scorer, dict) and "*" not in scorer:
        for name in (name for name in names if name not in scorer and resolve_dataset_name(name) not in scorer):
            parser.error(
                f"argument --scorer: benchmark {name!r} has no scorer ({origin} {sorted(scorer)}): a custom "
                f"benchmark needs --scorer {name}=NAME (or one NAME for every benchmark), NAME one of {list(SCORERS)}"
            )


def describe_settings(settings: EvalSettings, benchmarks: Sequence[str]) -> str:
    """One line with exactly what a run uses (printed before the model is loaded), and where it comes from."""
    top_k = "no top-k" if settings.top_k is None else f"top-k {settings.top_k}"
    scorers = ", ".join(f"{name}: {scorer}" for name, scorer in scorers_for(settings.scorer, benchmarks).items())
    origin = f"preset {settings.preset}; flags given explicitly override it"
    if not settings.preset:
        origin = "no --preset: built-in defaults, not a paper's protocol; --preset bandpo or dgpo applies one"
    return (
        f"Settings ({origin}): {settings.num_samples} samples per problem at temperature {settings.temperature}, "
        f"top-p {settings.top_p}, {top_k}, seed {settings.seed}; at most {settings.max_new_tokens} new tokens; prompt "
        f"template {settings.prompt_template}; scorers {scorers}; k of pass@k and best@k {settings.ks}"
    )


def eval_main(argv: Sequence[str] | None = None) -> int:
    """``trl-bandpo eval ...``: prints the settings, then the tables (in %), and returns 0; bad arguments exit 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = resolve_settings(args)
        resolve_backend(settings.backend, FLAGS["backend"])
        command = EvalCommand(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EvalCommand)})
    except ValueError as err:
        parser.error(f"argument {err}")
    try:
        benchmarks = load_benchmarks(
            settings.benchmarks, max_problems=settings.max_problems, prompt_template=settings.prompt_template
        )
    except (ValueError, ConnectionError) as err:
        parser.error(f"argument --benchmarks: {err}")
    _check_scorers(parser, args, settings, list(benchmarks))
    # loaded and checked: evaluate takes them as they are
    settings.benchmarks = benchmarks
    print(describe_settings(settings, list(benchmarks)), flush=True)
    try:
        results = evaluate(
            command.model, settings=settings, output_dir=command.output_dir, save_samples=not command.no_samples,
            vllm_kwargs=command.vllm_kwargs,
        )  # fmt: skip
    except PromptTooLongError as err:  # measured before the model loads
        parser.error(f"argument {err}")
    ks, n = results["settings"]["ks"], results["settings"]["num_samples"]
    for key, label in results["estimators"].items():  # a preset's paper estimator first
        table = write_markdown(results["benchmarks"], ks, n, estimator=key.partition("@")[0])
        print(f"{label}, values in %:\n{table}", end="")
    print(f"Wrote {Path(command.output_dir) / 'results.json'} and results.md")
    return 0

r"""Evaluation protocols of the two papers as presets of `trl_bandpo.evaluation.evaluate` and ``trl-bandpo eval``.

`EVAL_PRESETS` maps a preset name (``"bandpo"``, ``"dgpo"``) to its settings, with a ``description`` and the
``sources`` of each value (docs/evaluation.md shows them as tables); ``estimator`` names which of our two estimators
the paper reports as its Pass@32 and ``paper_metric`` what the paper calls it (`estimator_labels`).
`preset_settings` turns a preset into `evaluate` keyword arguments, explicit values winning over the preset's.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from ..core.checks import Choice
from .scorers import parse_scorer
from .summary import BEST_LABEL, PASS_LABEL

_BANDPO = "BandPO (arXiv:2603.04918)"
_BANDPO_SCRIPTS = "the BandPO authors' verl scripts (github.com/OpenMOSS/BandPO, RLtraining/verl/baselinescripts)"
_DGPO = "DGPO (arXiv:2603.14389)"

#: Preset name -> settings. ``top_k`` None means no top-k; ``scorer`` is a name or a mapping benchmark -> name.
EVAL_PRESETS: dict[str, dict[str, Any]] = {
    "bandpo": {
        "description": (
            "BandPO's validation protocol: AIME 2024, AIME 2025 and AMC 2023 in DAPO's prompt template, 32 samples "
            "at temperature 1.0 / top-p 1.0 without top-k, 4,096 new tokens; AIME scored by the DAPO 'Answer:' rule "
            "as the authors' verl validation did, AMC by verl's math_reward rule (Hendrycks MATH string normalisation "
            "of the last \\boxed{} answer), which is inferred from their data scripts (scorer amc2023=dapo switches "
            "it). mean@32 and pass@32 reported; their pass@32 is, inferred from their pipeline, verl's bootstrap "
            "best@32."
        ),
        "benchmarks": ["aime2024", "aime2025", "amc2023"],
        "prompt_template": "dapo",
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": None,
        "num_samples": 32,
        "max_new_tokens": 4096,
        "scorer": {"aime2024": "dapo", "aime2025": "dapo", "amc2023": "math_reward"},
        "ks": [1, 2, 4, 8, 16, 32],
        "paper": "BandPO",
        "estimator": "best",
        "paper_metric": "pass@32",
        "sources": {
            "benchmarks": f"{_BANDPO}, §4: validated on AMC 2023, AIME 2024, AIME 2025; {_BANDPO_SCRIPTS}: "
            "data.val_files",
            "prompt_template": f"{_BANDPO_SCRIPTS}: the benchmark conversion scripts (data/dataset/*_dapo) wrap "
            "every problem in DAPO's template",
            "temperature": f"{_BANDPO}, §4: sampling temperature 1.0; scripts: rollout.val_kwargs.temperature=1.0",
            "top_p": f"{_BANDPO}, §4: top-p 1.0; scripts: rollout.val_kwargs.top_p=1.0",
            "top_k": f"{_BANDPO_SCRIPTS}: rollout.val_kwargs.top_k=-1 (none)",
            "num_samples": f"{_BANDPO}, §4: mean@32 and pass@32; scripts: rollout.val_kwargs.n=32",
            "max_new_tokens": f"{_BANDPO_SCRIPTS}: data.max_response_length=4096 (the '-L4k' runs)",
            "scorer": f"{_BANDPO_SCRIPTS}: AIME rows have data_source 'aime_*', scored by verl's math_dapo. AMC: "
            "inferred, not verified: their data script tags AMC rows 'lighteval/MATH', which verl scores with "
            "math_reward (last \\boxed{} answer, Hendrycks MATH string normalisation; the 'math_reward' scorer), but "
            "mixed with the AIME rows in one validation batch that pipeline stops on an assertion, and the prebuilt "
            "AMC file their scripts download is not public, so how their AMC numbers were scored is not known. "
            "scorer amc2023=dapo switches AMC to the 'dapo' scorer",
            "ks": "powers of two up to 32: verl logs best@2..best@32, the paper reports pass@32",
            "estimator": f"{_BANDPO}, §4 reports mean@32 and pass@32 from the authors' verl validation "
            "(trainer.test_freq=5, rollout.val_kwargs.n=32); their verl's validation metrics "
            "(process_validation_metrics) are mean@N and the bootstrap best@N/worst@N/maj@N only, with no unbiased "
            "pass@k, so their pass@32 is best@32/mean (inferred from the pipeline; unlike DGPO's, not checked "
            "against the reported values)",
        },
    },
    "dgpo": {
        "description": (
            "DGPO's evaluation protocol: AIME24/AIME25 (math-ai copies), AMC23, MATH500, Minerva and OlympiadBench, "
            "32 samples, 8,192 new tokens, Avg@32, Pass@32 and Pass@k for k in {1, 2, 4, 8, 16, 32}, scored by the "
            "conservative prime_math rules. The paper states temperature 1.0 / top-p 1.0 for rollout generation but "
            "no separate evaluation sampling: the preset uses the same values (our choice), no top-k and the boxed "
            "prompt (our choice; prime_math grades the last \\boxed{} answer)."
        ),
        "benchmarks": ["aime2024-math-ai", "aime2025-math-ai", "amc2023", "math500", "minerva", "olympiadbench"],
        "prompt_template": "boxed",
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": None,
        "num_samples": 32,
        "max_new_tokens": 8192,
        "scorer": "strict",
        "ks": [1, 2, 4, 8, 16, 32],
        "paper": "DGPO",
        "estimator": "best",
        "paper_metric": "P@32 and Pass@k",
        "sources": {
            "benchmarks": f"{_DGPO}, §5.1 and Appendix B.2 (AIME24, AIME25, AMC23, MATH500, Minerva, "
            "OlympiadBench); AIME from math-ai/aime24 and math-ai/aime25",
            "prompt_template": "not stated in the paper; our choice: the boxed prompt, since prime_math grades the "
            "last \\boxed{} answer",
            "temperature": f"{_DGPO}, Appendix B.4 'Common Configurations': rollout temperature 1.0; the paper states "
            "no separate evaluation temperature, we use the same",
            "top_p": f"{_DGPO}, Appendix B.4 'Common Configurations': rollout top-p 1.0; used for evaluation too",
            "top_k": "not stated in the paper; our choice: none",
            "num_samples": f"{_DGPO}, §5.1: Avg@32 and Pass@32",
            "max_new_tokens": f"{_DGPO}, Appendix B.2: maximum response length 8192",
            "scorer": f"{_DGPO}, §5.1: 'a conservative method prime_math is used for evaluation'",
            "ks": f"{_DGPO}, Appendix C.3: Pass@K for k in {{1, 2, 4, 8, 16, 32}} (§5.2 announces K = 1, ..., 32; the "
            "appendix lists these six)",
            "estimator": f"{_DGPO}: 38 of its 42 P@32 values on AIME24, AIME25 and AMC23 are multiples of neither "
            "1/30 nor 1/40, which the unbiased pass@32 of 32 samples (the share of problems solved at least once) "
            "always is: they are verl's bootstrap best@32",
        },
    },
}

#: The keys of a preset that are `evaluate` settings (the rest describe it).
PRESET_SETTINGS = tuple(
    "benchmarks prompt_template temperature top_p top_k num_samples max_new_tokens scorer ks".split()
)


def estimator_labels(preset: str | None = None) -> dict[str, str]:
    """The two estimators (``"pass@k"``, ``"best@k"``) -> the label results give them, in the order they are shown.

    Without a preset: the unbiased pass@k first (`PASS_LABEL`), then the bootstrap best@k (`BEST_LABEL`). With one:
    the estimator its paper reports first, labelled as that paper's metric, then the other, labelled as not it.

    Example:

    ```python
    >>> list(estimator_labels("dgpo").values())
    ["best@k (bootstrap; the DGPO paper's P@32 and Pass@k)", "pass@k (unbiased; not the DGPO paper's estimator)"]
    ```
    """
    if preset is None:
        return {"pass@k": PASS_LABEL, "best@k": BEST_LABEL}
    settings = get_preset(preset)
    kinds = {"pass@k": "unbiased", "best@k": "bootstrap"}
    first = f"{settings['estimator']}@k"
    second = next(key for key in kinds if key != first)
    paper = f"the {settings['paper']} paper's"
    return {
        first: f"{first} ({kinds[first]}; {paper} {settings['paper_metric']})",
        second: f"{second} ({kinds[second]}; not {paper} estimator)",
    }


def get_preset(name: str, argument: str = "preset") -> dict[str, Any]:
    """A deep copy of `EVAL_PRESETS[name]`; ValueError naming `argument`, the value and the presets otherwise."""
    return copy.deepcopy(EVAL_PRESETS[Choice(tuple(EVAL_PRESETS))(name, argument)])


def merge_scorer(base: Any, *updates: Any) -> Any:
    """The scorer setting `base` updated by each of `updates` in turn: a scorer name replaces it, a mapping benchmark
    -> name (or its text ``"aime2024=dapo,amc2023=dapo"``, or a list of such entries) updates it, a name in `base`
    becoming the scorer of every other benchmark (``"*"``). The result is checked where it is used (`check_scorer`).

    Example:

    ```python
    >>> merge_scorer({"aime2024": "dapo", "amc2023": "math_reward"}, "amc2023=dapo")
    {'aime2024': 'dapo', 'amc2023': 'dapo'}
    >>> merge_scorer("strict", ["math_verify", "x=dapo"])
    {'*': 'math_verify', 'x': 'dapo'}
    ```
    """
    for update in updates:
        if isinstance(update, Sequence) and not isinstance(update, str):
            base = merge_scorer(base, *update)
            continue
        update = parse_scorer(update)
        if isinstance(update, Mapping) and isinstance(base, (str, Mapping)):
            update = {**({"*": base} if isinstance(base, str) else base), **update}
        base = update
    return base


def preset_settings(name: str, **overrides: Any) -> dict[str, Any]:
    """`evaluate` keyword arguments of preset `name`; `overrides` (any `EvalSettings` field) win over its values.

    The preset's ``ks`` above an overriding ``num_samples`` are dropped (the preset's pass@k stop at num_samples); an
    overriding ``scorer`` that maps benchmarks to scorers updates the preset's mapping (`merge_scorer`: AMC by
    ``"dapo"`` keeps AIME by ``"dapo"``), a scorer name replaces it. ``preset=name`` is included, so that results.json
    records it.

    Example:

    ```python
    >>> settings = preset_settings("bandpo", max_new_tokens=1024, scorer="amc2023=dapo")
    >>> settings["temperature"], settings["max_new_tokens"], settings["scorer"], settings["preset"]
    (1.0, 1024, {'aime2024': 'dapo', 'aime2025': 'dapo', 'amc2023': 'dapo'}, 'bandpo')
    ```
    """
    preset = get_preset(name)
    settings = {key: preset[key] for key in PRESET_SETTINGS}
    if "num_samples" in overrides and "ks" not in overrides and isinstance(overrides["num_samples"], int):
        settings["ks"] = [k for k in settings["ks"] if k <= overrides["num_samples"]] or None
    if "scorer" in overrides:
        overrides = {**overrides, "scorer": merge_scorer(settings["scorer"], overrides["scorer"])}
    settings.update(overrides)
    settings["preset"] = name
    return settings

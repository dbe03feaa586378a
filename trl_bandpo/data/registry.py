"""The registry of math datasets: where each lives on the Hugging Face Hub and how to read it.

`DATASETS` maps a registry name to its `DatasetSpec` (the table in `trl_bandpo.data` lists them),
`resolve_dataset_name` accepts aliases such as ``"aime24"``, and `EVAL_BENCHMARKS` / `TRAINING_MIXES` name the sets
the papers evaluate and train on. The BandPO training sets follow the authors' public data-preparation scripts
(github.com/OpenMOSS/BandPO).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DatasetSpec:
    """Where a registered dataset lives and how to read it.

    Attributes:
        hub_id: Hugging Face Hub dataset id.
        split: split to load.
        problem_field: column with the problem (a string, or a conversation whose last user message is used);
            dotted names reach into nested columns.
        answer_field: column with the final answer (string, number or list of strings); dotted names allowed.
        configs: hub configuration names; several are loaded and concatenated (None: the default one).
        level_field / levels: keep only rows whose level (an int, or text such as "Level 3") is in `levels`.
        deduplicate: drop rows whose problem text repeats an earlier row.
        description: one line for listings.
    """

    hub_id: str
    split: str
    problem_field: str
    answer_field: str
    configs: tuple[str, ...] | None = None
    level_field: str | None = None
    levels: tuple[int, ...] | None = None
    deduplicate: bool = False
    description: str = ""


DATASETS: dict[str, DatasetSpec] = {
    # Training sets: the BandPO authors' sources.
    "dapo-math-17k": DatasetSpec(
        "open-r1/DAPO-Math-17k-Processed", "train", "prompt", "solution", configs=("en",), deduplicate=True,
        description="DAPO-Math-17k, English problems only (~14.1k, integer answers); BandPO training set"),
    "math-level3to5": DatasetSpec(
        "nlile/hendrycks-MATH-benchmark", "train", "problem", "answer", level_field="level", levels=(3, 4, 5),
        description="MATH train (12,000 problems), levels 3-5; merged with DAPO-Math-17k by BandPO"),
    # Other copies of the training sets.
    "dapo-math-17k-original": DatasetSpec(
        "BytedTsinghua-SIA/DAPO-Math-17k", "train", "prompt", "reward_model.ground_truth", deduplicate=True,
        description="DAPO-Math-17k as released (Chinese problems included), de-duplicated; the `dgpo` mix"),
    "math-level3to5-lighteval": DatasetSpec(
        "DigitalLearningGmbH/MATH-lighteval", "train", "problem", "solution", configs=("default",),
        level_field="level", levels=(3, 4, 5),
        description="MATH train (7,500 problems), levels 3-5 (answer = last \\boxed{} of the solution)"),
    "hendrycks-math-level3to5": DatasetSpec(
        "EleutherAI/hendrycks_math", "train", "problem", "solution",
        configs=tuple("algebra counting_and_probability geometry intermediate_algebra number_theory prealgebra "
                      "precalculus".split()),
        level_field="level", levels=(3, 4, 5),
        description="The same MATH levels 3-5 from the EleutherAI per-subject copy"),
    # Evaluation benchmarks.
    "aime2024": DatasetSpec("HuggingFaceH4/aime_2024", "train", "problem", "answer", description="AIME 2024 (30)"),
    "aime2025": DatasetSpec("yentinglin/aime_2025", "train", "problem", "answer", description="AIME 2025 (30)"),
    "amc2023": DatasetSpec("math-ai/amc23", "test", "question", "answer", description="AMC 2023 (40)"),
    "math500": DatasetSpec("HuggingFaceH4/MATH-500", "test", "problem", "answer", description="MATH-500 (500)"),
    "minerva": DatasetSpec("math-ai/minervamath", "test", "question", "answer", description="Minerva Math (272)"),
    "olympiadbench": DatasetSpec(
        "math-ai/olympiadbench", "test", "question", "final_answer", description="OlympiadBench (675)"),
    # The AIME copies the DGPO paper evaluates on (math-ai/aime24 keeps the answer as "\boxed{...}" in `solution`).
    "aime2024-math-ai": DatasetSpec(
        "math-ai/aime24", "test", "problem", "solution", description="AIME 2024 (30), math-ai copy (DGPO)"),
    "aime2025-math-ai": DatasetSpec(
        "math-ai/aime25", "test", "problem", "answer", description="AIME 2025 (30), math-ai copy (DGPO)"),
}  # fmt: skip

_ALIASES = {  # registry name -> its other spellings
    "dapo-math-17k": ("dapo", "dapo-math", "dapo-math-17k-en", "dapo-math-17k-processed"),
    "dapo-math-17k-original": ("dapo-original",),
    "aime2024-math-ai": ("aime24-math-ai",),
    "aime2025-math-ai": ("aime25-math-ai",),
    "math-level3to5": ("math-l3-5", "math-level-3-5"),
    "aime2024": ("aime24", "aime-2024"),
    "aime2025": ("aime25", "aime-2025"),
    "amc2023": ("amc23", "amc-2023"),
    "math500": ("math-500",),
    "minerva": ("minervamath", "minerva-math"),
    "olympiadbench": ("olympiad-bench",),
}
_CANONICAL = {alias: name for name, aliases in _ALIASES.items() for alias in aliases}

# The six DGPO benchmarks in the order the papers report them; BandPO uses amc2023, aime2024, aime2025.
EVAL_BENCHMARKS: dict[str, DatasetSpec] = {
    name: DATASETS[name] for name in ("aime2024", "aime2025", "amc2023", "math500", "minerva", "olympiadbench")
}
# "bandpo": the BandPO authors' two training sources; "dgpo": DAPO-Math-17k as released, unchanged.
TRAINING_MIXES: dict[str, tuple[str, ...]] = {
    "bandpo": ("dapo-math-17k", "math-level3to5"),
    "dgpo": ("dapo-math-17k-original",),
}


def resolve_dataset_name(name: str) -> str | None:
    """The registry key for `name` (case-, ``_``- and alias-insensitive), or None when it is not registered."""
    key = name.strip().lower().replace("_", "-")
    key = _CANONICAL.get(key, key)
    return key if key in DATASETS else None

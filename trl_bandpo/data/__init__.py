r"""Math datasets as TRL prompt datasets: a conversational ``prompt`` column and a ``solution`` column.

Every loader returns a `datasets.Dataset` with three string-valued columns:

* ``prompt``: ``[{"role": "user", "content": problem + " " + instruction}]`` (TRL's conversational format),
* ``solution``: the ground-truth final answer (what `trl_bandpo.rewards` compares the last ``\boxed{}`` with),
* ``data_source``: the registry name or file the row came from.

The papers append ``"Let's think step by step and output the final answer within \\boxed{}."`` to each problem
(`BOXED_INSTRUCTION`). Datasets come from the Hugging Face Hub by registry name (`DATASETS`: the BandPO/DGPO
training sets and the six evaluation benchmarks) or from local JSONL/JSON/Parquet/CSV files (and folders written by
``Dataset.save_to_disk``) for offline use. Local JSON and CSV files are read with every answer exactly as written
(``12345678901234567890`` and ``1.50`` stay as they are; `trl_bandpo.data.files`). A dataset of which no row is usable
is an error that counts the dropped rows per reason (empty problem or answer, wrong type, level, duplicate); a Hub
dataset that cannot be reached is one error that says how to pass a local file instead.

Hub ids, splits and columns (checked against the dataset cards / common loaders; override any of them with the
keyword arguments of `load_math_dataset`):

==================  ====================================  =====  ======================  ===========================
name                hub id                                split  problem column          answer column
==================  ====================================  =====  ======================  ===========================
dapo-math-17k       BytedTsinghua-SIA/DAPO-Math-17k       train  prompt (conversation)   reward_model.ground_truth
math-level3to5      DigitalLearningGmbH/MATH-lighteval    train  problem                 solution (last \boxed{})
aime2024            HuggingFaceH4/aime_2024               train  problem                 answer
aime2025            yentinglin/aime_2025                  train  problem                 answer
amc2023             math-ai/amc23                         test   question                answer
math500             HuggingFaceH4/MATH-500                test   problem                 answer
minerva             math-ai/minervamath                   test   question                answer
olympiadbench       math-ai/olympiadbench                 test   question                final_answer (list, joined)
==================  ====================================  =====  ======================  ===========================

DAPO-Math-17k stores each of its ~17k problems about a hundred times, wrapped in DAPO's own "Answer:" template: the
loader de-duplicates it and replaces that template by the boxed instruction (the rewards read ``\boxed{}``).
MATH levels 3-5 keep rows whose ``level`` is "Level 3", "Level 4" or "Level 5"; the answer is the last boxed
expression of the worked solution. BandPO trains on both merged (`TRAINING_MIXES["bandpo"]`), DGPO on DAPO only.
"""

from .loading import (
    ANSWER_FIELD_CANDIDATES,  # noqa: F401 - public, though outside `__all__`
    BOXED_INSTRUCTION,
    PROBLEM_FIELD_CANDIDATES,  # noqa: F401 - public, though outside `__all__`
    get_field,
    load_eval_benchmarks,
    load_math_dataset,
    load_training_mix,
)
from .registry import (
    BANDPO_EVAL_BENCHMARKS,  # noqa: F401 - public, though outside `__all__`
    DATASETS,
    EVAL_BENCHMARKS,
    TRAINING_MIXES,
    DatasetSpec,
    resolve_dataset_name,
)

__all__ = [
    "BOXED_INSTRUCTION",
    "DATASETS",
    "EVAL_BENCHMARKS",
    "TRAINING_MIXES",
    "DatasetSpec",
    "get_field",
    "load_eval_benchmarks",
    "load_math_dataset",
    "load_training_mix",
    "resolve_dataset_name",
]

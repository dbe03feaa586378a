r"""Math datasets as TRL prompt datasets: a conversational ``prompt`` column and a ``solution`` column.

Every loader returns a `datasets.Dataset` with three string-valued columns:

* ``prompt``: ``[{"role": "user", "content": ...}]`` (TRL's conversational format), the problem put in a prompt
  template (`PROMPT_TEMPLATES`, ``prompt_template=`` of the loaders; `trl_bandpo.data.prompts`): ``"boxed"`` (the
  default: problem + " " + `BOXED_INSTRUCTION`) or ``"dapo"`` (DAPO's "Answer:" template, as the BandPO authors'
  verl scripts prompt every problem);
* ``solution``: the ground-truth final answer (what the reward compares the model's answer with),
* ``data_source``: the registry name or file the row came from.

Datasets come from the Hugging Face Hub by registry name (`DATASETS`: hub id, configurations, split and columns of
each, from the dataset cards and the authors' data-preparation scripts) or from local JSONL/JSON/Parquet/CSV files
(and ``save_to_disk`` folders), read with every answer exactly as written (`trl_bandpo.data.files`). A dataset of
which no row is usable is an error that counts the dropped rows per reason; a Hub dataset that cannot be reached is
one error that says how to pass a local file instead. `drop_long_prompts` drops prompts longer than a number of
tokens, as the trainer will see them (`trl_bandpo.data.lengths`).

BandPO trains on its authors' two sources merged (`TRAINING_MIXES["bandpo"]`): DAPO-Math-17k in English only (the
``en`` configuration of open-r1's de-duplicated copy, about 14.1k problems) and the problems of levels 3, 4 and 5 of
the 12,000-problem MATH train split of nlile/hendrycks-MATH-benchmark, with its ``answer`` column as ground truth. The
``dgpo`` mix is DAPO-Math-17k as released (``dapo-math-17k-original``: each of its ~17k problems stored about a
hundred times, Chinese problems included), de-duplicated. DAPO's "Answer:" template is removed from problems that
carry it, then the chosen template is applied. The BandPO authors validate on aime2024, aime2025 and amc2023
(the ``bandpo`` preset of `trl_bandpo.evaluation`); the DGPO paper's AIME copies are aime2024-math-ai and
aime2025-math-ai.
"""

from .lengths import drop_long_prompts, prompt_lengths
from .loading import load_eval_benchmarks, load_math_dataset, load_training_mix
from .prompts import BOXED_INSTRUCTION, DAPO_PROMPT_PREFIX, DAPO_PROMPT_SUFFIX, PROMPT_TEMPLATES, format_prompt
from .registry import DATASETS, EVAL_BENCHMARKS, TRAINING_MIXES, DatasetSpec, resolve_dataset_name
from .rows import get_field

__all__ = [
    "BOXED_INSTRUCTION",
    "DAPO_PROMPT_PREFIX",
    "DAPO_PROMPT_SUFFIX",
    "DATASETS",
    "EVAL_BENCHMARKS",
    "PROMPT_TEMPLATES",
    "TRAINING_MIXES",
    "DatasetSpec",
    "drop_long_prompts",
    "format_prompt",
    "get_field",
    "load_eval_benchmarks",
    "load_math_dataset",
    "load_training_mix",
    "prompt_lengths",
    "resolve_dataset_name",
]

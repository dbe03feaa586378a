"""Tests of the math dataset loaders, on small local files only (nothing is downloaded)."""

import json

import datasets
import pytest

from trl_bandpo.data import (
    BOXED_INSTRUCTION,
    DATASETS,
    EVAL_BENCHMARKS,
    TRAINING_MIXES,
    get_field,
    load_eval_benchmarks,
    load_math_dataset,
    load_training_mix,
    resolve_dataset_name,
)
from trl_bandpo.scoring.rewards import boxed_accuracy_reward

DAPO_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.fixture
def aime_like(tmp_path):
    rows = [
        {"id": 1, "problem": "Find $x$ if $x + 1 = 8$.", "answer": "7"},
        {"id": 2, "problem": "What is $2^5$?", "answer": 32},
        {"id": 3, "problem": "Half of one?", "answer": 0.5},
    ]
    return write_jsonl(tmp_path / "aime_like.jsonl", rows)


def test_local_jsonl_becomes_a_conversational_prompt_dataset(aime_like):
    ds = load_math_dataset(aime_like)
    assert ds.column_names == ["prompt", "solution", "data_source"]
    assert len(ds) == 3
    assert ds[0]["prompt"] == [{"role": "user", "content": "Find $x$ if $x + 1 = 8$. " + BOXED_INSTRUCTION}]
    assert ds["solution"] == ["7", "32", "0.5"]
    assert ds["data_source"] == ["aime_like"] * 3
    assert BOXED_INSTRUCTION == "Let's think step by step and output the final answer within \\boxed{}."


def test_instruction_and_limits(aime_like):
    ds = load_math_dataset(aime_like, instruction=None, max_samples=2, data_source="mine")
    assert [p[0]["content"] for p in ds["prompt"]] == ["Find $x$ if $x + 1 = 8$.", "What is $2^5$?"]
    assert ds["data_source"] == ["mine", "mine"]
    assert len(load_math_dataset(aime_like, split="train[:1]")) == 1


def test_explicit_fields_and_clear_errors(tmp_path):
    path = write_jsonl(tmp_path / "custom.jsonl", [{"Q": "1+1?", "gold": "2", "note": "x"}])
    with pytest.raises(ValueError, match="problem"):
        load_math_dataset(path)  # no recognisable problem column
    ds = load_math_dataset(path, problem_field="Q", answer_field="gold")
    assert ds["solution"] == ["2"]
    with pytest.raises(ValueError, match="answer_field='nope'"):
        load_math_dataset(path, problem_field="Q", answer_field="nope")
    with pytest.raises(ValueError, match="max_samples"):
        load_math_dataset(path, problem_field="Q", answer_field="gold", max_samples=0)
    with pytest.raises(ValueError, match="unsupported file type"):
        bad = tmp_path / "data.txt"
        bad.write_text("hello")
        load_math_dataset(bad)
    with pytest.raises(ValueError, match="neither an existing file nor one of"):
        load_math_dataset("no-such-dataset-or-file")


def test_dapo_shaped_rows(tmp_path):
    """DAPO-Math-17k: the prompt is already a conversation in DAPO's template, the answer is nested, rows repeat."""

    def dapo_row(problem, answer, index):
        return {
            "data_source": "math_dapo",
            "prompt": [{"content": DAPO_TEMPLATE.format(problem=problem), "role": "user"}],
            "ability": "MATH",
            "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": str(index)},
        }

    rows = [dapo_row("How many primes are below 10?", "4", i) for i in range(3)]
    rows += [dapo_row("Compute $3 \\cdot 7$.", "21", 3)]
    path = write_jsonl(tmp_path / "dapo.jsonl", rows)
    ds = load_math_dataset(path, problem_field="prompt", answer_field="reward_model.ground_truth", deduplicate=True)
    assert len(ds) == 2
    assert ds["solution"] == ["4", "21"]
    content = ds[0]["prompt"][0]["content"]
    assert content == "How many primes are below 10? " + BOXED_INSTRUCTION  # DAPO's "Answer:" template is gone
    # Auto-detection finds the same columns; without de-duplication every row stays.
    assert len(load_math_dataset(path)) == 4
    # The reward reads the loader's `solution` column.
    assert boxed_accuracy_reward([r"\boxed{4}", r"\boxed{20}"], ds["solution"]) == [1.0, 0.0]


def test_math_levels_and_boxed_solutions_from_parquet(tmp_path):
    rows = {
        "problem": ["easy", "medium", "hard", "hardest", "unknown level"],
        "level": ["Level 1", "Level 3", "Level 4", "Level 5", "Level ?"],
        "type": ["Algebra"] * 5,
        "solution": [
            r"So \boxed{1}.",
            r"Thus $\boxed{\frac{1}{2}}$.",
            r"First \boxed{2}, no wait: \boxed{3}",
            r"Answer $\boxed{\{1,2\}}$",
            r"\boxed{9}",
        ],
    }
    path = tmp_path / "math_train.parquet"
    datasets.Dataset.from_dict(rows).to_parquet(str(path))
    ds = load_math_dataset(path, answer_field="solution", levels=(3, 4, 5), level_field="level")
    assert [p[0]["content"].split(" ")[0] for p in ds["prompt"]] == ["medium", "hard", "hardest"]
    assert ds["solution"] == [r"\frac{1}{2}", "3", r"\{1,2\}"]
    with pytest.raises(ValueError, match="level_field='difficulty'"):
        load_math_dataset(path, levels=(3,), level_field="difficulty")


def test_json_array_list_answers_and_empty_rows(tmp_path):
    rows = [
        {"question": "Solve $x^2 = 4$ for all x.", "final_answer": ["$2$", "$-2$"]},
        {"question": "No answer here", "final_answer": []},
        {"question": "", "final_answer": ["1"]},
    ]
    path = tmp_path / "olympiad.json"
    path.write_text(json.dumps(rows), encoding="utf-8")
    ds = load_math_dataset(path)
    assert len(ds) == 1  # rows without a problem or an answer are dropped
    assert ds["solution"] == ["$2$, $-2$"]


def test_save_to_disk_folder(tmp_path):
    folder = tmp_path / "saved"
    datasets.Dataset.from_dict({"problem": ["p"], "answer": ["1"]}).save_to_disk(str(folder))
    assert load_math_dataset(folder)["solution"] == ["1"]


def test_training_mix_concatenates(tmp_path, aime_like):
    rows = [{"question": "q1", "answer": "a"}, {"question": "q2", "answer": "b"}]
    other = write_jsonl(tmp_path / "other.jsonl", rows)
    mixed = load_training_mix([aime_like, other])
    assert len(mixed) == 5
    assert mixed["data_source"] == ["aime_like"] * 3 + ["other"] * 2
    assert mixed.column_names == ["prompt", "solution", "data_source"]
    shuffled = load_training_mix(f"{aime_like},{other}", seed=0, max_samples_per_dataset=1)
    assert sorted(shuffled["data_source"]) == ["aime_like", "other"]
    with pytest.raises(ValueError, match="at least one"):
        load_training_mix([])


def test_registry_names_and_aliases():
    assert resolve_dataset_name("AIME24") == "aime2024"
    assert resolve_dataset_name("aime_2025") == "aime2025"
    assert resolve_dataset_name("amc23") == "amc2023"
    assert resolve_dataset_name("MATH-500") == "math500"
    assert resolve_dataset_name("dapo") == "dapo-math-17k"
    assert resolve_dataset_name("unknown") is None
    assert list(EVAL_BENCHMARKS) == ["aime2024", "aime2025", "amc2023", "math500", "minerva", "olympiadbench"]
    assert TRAINING_MIXES["bandpo"] == ("dapo-math-17k", "math-level3to5")
    assert DATASETS["dapo-math-17k"].hub_id == "open-r1/DAPO-Math-17k-Processed"  # English only (config "en")
    assert DATASETS["dapo-math-17k"].answer_field == "solution"
    assert DATASETS["dapo-math-17k-original"].hub_id == "BytedTsinghua-SIA/DAPO-Math-17k"
    assert DATASETS["dapo-math-17k-original"].answer_field == "reward_model.ground_truth"
    assert DATASETS["math-level3to5"].levels == (3, 4, 5)


def test_hub_loading_uses_the_registry(monkeypatch):
    """The hub path calls datasets.load_dataset with the registered id/config/split (stubbed: no download)."""
    calls = []
    subjects = DATASETS["hendrycks-math-level3to5"].configs

    def fake_load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split))
        if path == "math-ai/olympiadbench":
            return datasets.Dataset.from_dict({"question": ["q"], "final_answer": [["$\\frac{1}{2}$"]]})
        return datasets.Dataset.from_dict(
            {"problem": [f"{name} p"], "level": ["Level 4"], "solution": [r"\boxed{5}"], "type": ["t"]}
        )

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    olympiad = load_math_dataset("olympiadbench")
    assert calls == [("math-ai/olympiadbench", None, "test")]
    assert olympiad["solution"] == ["$\\frac{1}{2}$"]
    assert olympiad["data_source"] == ["olympiadbench"]
    calls.clear()
    math_mix = load_math_dataset("hendrycks-math-level3to5")
    assert calls == [("EleutherAI/hendrycks_math", subject, "train") for subject in subjects]
    assert len(math_mix) == len(subjects) and set(math_mix["solution"]) == {"5"}


def test_get_field_reaches_nested_columns():
    row = {"reward_model": {"ground_truth": "12"}, "a.b": 1}
    assert get_field(row, "reward_model.ground_truth") == "12"
    assert get_field(row, "a.b") == 1
    with pytest.raises(KeyError, match="ground"):
        get_field(row, "reward_model.ground")


def test_load_eval_benchmarks_accepts_paths_names_and_datasets(aime_like):
    already = load_math_dataset(aime_like)
    loaded = load_eval_benchmarks([str(aime_like), f"mine={aime_like}"], max_problems=2)
    assert list(loaded) == ["aime_like", "mine"]
    assert len(loaded["mine"]) == 2 and loaded["mine"]["data_source"] == ["mine", "mine"]
    passed = load_eval_benchmarks({"given": already}, max_problems=1)
    assert len(passed["given"]) == 1

"""Regression tests of the data loaders: answers exactly as written, no silent empty datasets, clear errors for
unreadable files and unreachable Hub datasets (local files only; the Hub is offline in the tests)."""

import json
import logging
import math
import time

import datasets
import pytest

from trl_bandpo.data import DATASETS, DatasetSpec, load_math_dataset
from trl_bandpo.scoring.rewards import boxed_accuracy_reward

BIG_INTS = ("9007199254740993", "12345678901234567890")  # beyond float64's exact integers


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------------------------------
# Answers exactly as written
# ------------------------------------------------------------------------------------------------------------------


def test_jsonl_numbers_keep_their_exact_text(tmp_path):
    """A column mixing floats, big integers and strings: every answer is the text of the file (``1.50`` stays)."""
    path = write_lines(
        tmp_path / "mixed.jsonl",
        [
            '{"problem": "p1", "answer": 9007199254740993}',
            '{"problem": "p2", "answer": 12345678901234567890}',
            '{"problem": "p3", "answer": 1.50}',
            '{"problem": "p4", "answer": 0.1}',
            '{"problem": "p5", "answer": -7}',
        ],
    )
    ds = load_math_dataset(path)
    assert ds["solution"] == [*BIG_INTS, "1.50", "0.1", "-7"]
    assert boxed_accuracy_reward([rf"\boxed{{{BIG_INTS[0]}}}", r"\boxed{1.5}"], ds["solution"][::2][:2]) == [1.0, 1.0]
    # The same with a string in the column, in a JSON array, and with the numbers nested (DAPO's layout).
    path = tmp_path / "mixed.json"
    path.write_text('[{"q": "a", "gold": 12345678901234567890}, {"q": "b", "gold": 1.50}, {"q": "c", "gold": "x"}]')
    assert load_math_dataset(path, problem_field="q", answer_field="gold")["solution"] == [BIG_INTS[1], "1.50", "x"]
    path = write_lines(
        tmp_path / "nested.jsonl",
        [
            '{"prompt": [{"role": "user", "content": "p"}], "reward_model": {"ground_truth": 9007199254740993}}',
            '{"prompt": [{"role": "user", "content": "q"}], "reward_model": {"ground_truth": 2.5}}',
        ],
    )
    assert load_math_dataset(path)["solution"] == [BIG_INTS[0], "2.5"]


def test_csv_cells_are_read_as_written(tmp_path):
    path = tmp_path / "bench.csv"
    path.write_text(
        "problem,answer,level\n"
        f"p1,{BIG_INTS[0]},1\n"
        f"p2,{BIG_INTS[1]},2\n"
        "p3,1.50,3\n"
        "p4,007,4\n"
        '"p5, with a comma","1,2",5\n',
        encoding="utf-8",
    )
    ds = load_math_dataset(path)
    assert ds["solution"] == [*BIG_INTS, "1.50", "007", "1,2"]
    assert ds[4]["prompt"][0]["content"].startswith("p5, with a comma ")
    assert load_math_dataset(path, levels=(3, 4), level_field="level")["solution"] == ["1.50", "007"]
    # A column of numbers only (which pandas would read as float64) and an empty cell (a missing answer).
    path = tmp_path / "numbers.csv"
    path.write_text(f"problem,answer\np1,{BIG_INTS[0]}\np2,1.50\np3,007\np4,\n", encoding="utf-8")
    assert load_math_dataset(path)["solution"] == [BIG_INTS[0], "1.50", "007"]


def test_parquet_ints_in_full_floats_by_repr_and_nan_is_missing(tmp_path, caplog):
    """Parquet keeps its types: ints in full, floats by repr (integral ones as integers); NaN is a missing answer."""
    path = tmp_path / "typed.parquet"
    table = {"problem": ["a", "b", "c"], "answer": [int(BIG_INTS[0]), 2**63 - 1, 7]}
    datasets.Dataset.from_dict(table).to_parquet(str(path))
    assert load_math_dataset(path)["solution"] == [BIG_INTS[0], str(2**63 - 1), "7"]
    path = tmp_path / "floats.parquet"
    table = {"problem": ["a", "b", "c", "d", "e"], "answer": [1.5, 0.1, 27.0, math.nan, 1e300]}
    datasets.Dataset.from_dict(table).to_parquet(str(path))
    with caplog.at_level(logging.WARNING, logger="trl_bandpo.data"):
        ds = load_math_dataset(path)
    assert ds["solution"] == ["1.5", "0.1", "27", "1e+300"]  # the NaN row ("nan" before) is dropped
    assert "dropped 1 of 5 rows" in caplog.text and "1 empty answer" in caplog.text and str(path) in caplog.text


# ------------------------------------------------------------------------------------------------------------------
# Dropped rows
# ------------------------------------------------------------------------------------------------------------------


def test_a_dataset_without_usable_rows_is_an_error_counting_the_reasons(tmp_path):
    rows = [
        {"problem": "", "answer": "1"},  # empty problem
        {"problem": "p", "answer": "  "},  # empty answer
        {"problem": "q", "answer": None},  # missing answer
        {"problem": 42, "answer": "What is 6 times 7?"},  # swapped fields: a number is not a problem
        {"problem": "r", "answer": {"value": 3}},  # an answer of the wrong type
    ]
    path = tmp_path / "broken.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    with pytest.raises(ValueError) as info:
        load_math_dataset(path)
    message = str(info.value)
    assert str(path) in message and "none of its 5 rows is usable" in message
    assert "1 empty problem" in message and "2 empty answer" in message
    assert "1 problem of the wrong type" in message and "1 answer of the wrong type" in message
    assert "first: row 4, value 42" in message  # the offending value, shown as the number it is


def test_level_filter_and_duplicates_dropping_everything_is_an_error(tmp_path):
    path = tmp_path / "levels.jsonl"
    rows = [{"problem": "p", "answer": "1", "level": "Level 1"}, {"problem": "q", "answer": "2", "level": "Level 2"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    with pytest.raises(ValueError, match=r"levels=\[3, 4, 5\]\): 2 level not in the requested levels"):
        load_math_dataset(path, levels=(3, 4, 5))


def test_dropped_rows_are_logged(tmp_path, caplog):
    rows = [
        {"problem": "p", "answer": "1"},
        {"problem": "p", "answer": "1"},
        {"problem": "", "answer": "2"},
        {"problem": "r", "answer": float("nan")},
    ]
    path = tmp_path / "some.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")  # NaN is written as NaN
    with caplog.at_level(logging.INFO, logger="trl_bandpo.data"):
        ds = load_math_dataset(path, deduplicate=True)
    assert ds["solution"] == ["1"]
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert "dropped 3 of 4 rows" in record.getMessage()
    for reason in ("1 duplicate problem", "1 empty problem", "1 empty answer"):
        assert reason in record.getMessage()
    # Rows dropped only by the requested de-duplication are not a warning.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trl_bandpo.data"):
        load_math_dataset(path, deduplicate=True, max_samples=1)  # stops before the defective rows
        load_math_dataset(path, split="train[:2]", deduplicate=True)  # one duplicate
    assert [r.levelno for r in caplog.records] == [logging.INFO]


def test_the_training_entry_point_refuses_a_dataset_without_usable_rows(tmp_path):
    from trl_bandpo.cli.recipe import ScriptArguments
    from trl_bandpo.cli.train import load_train_data

    path = tmp_path / "swapped.jsonl"
    path.write_text(json.dumps({"problem": 7, "answer": "What is 3 + 4?"}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="none of its 1 rows is usable"):
        load_train_data(ScriptArguments(dataset_name=[str(path)]))


# ------------------------------------------------------------------------------------------------------------------
# Unreadable files
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, text", [("empty.jsonl", ""), ("blank.jsonl", "\n  \n"), ("empty.json", "")])
def test_an_empty_file_is_a_clear_error(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=rf"{path}.* no rows"):
        load_math_dataset(path)


@pytest.mark.parametrize(
    "name, text, line",
    [
        ("corrupt.jsonl", '{"problem": "a", "answer": "1"}\n\n{"problem": "b", answer: 2}\n', 3),
        ("first.jsonl", '{"problem": "a", "answer": \n{"problem": "b", "answer": "2"}\n', 1),
        ("truncated.json", '[{"problem": "a", "answer": "1"},\n {"problem": "b", "answer": "2"\n', 3),
    ],
)
def test_corrupt_json_names_the_file_and_line(tmp_path, name, text, line):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=rf"{path}: invalid JSON at line {line}, column \d+"):
        load_math_dataset(path)


def test_non_object_lines_and_bad_splits_are_clear_errors(tmp_path):
    path = write_lines(tmp_path / "scalars.jsonl", ['{"problem": "a", "answer": "1"}', "[1, 2]"])
    with pytest.raises(ValueError, match=rf"{path}: line 2 holds a JSON list"):
        load_math_dataset(path)
    path = write_lines(tmp_path / "ok.jsonl", ['{"problem": "a", "answer": "1"}'])
    with pytest.raises(ValueError, match="split='test'.*'train' split"):
        load_math_dataset(path, split="test")
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    with pytest.raises(ValueError, match=rf"{bad}: could not be read as parquet"):
        load_math_dataset(bad)


# ------------------------------------------------------------------------------------------------------------------
# Hub datasets that cannot be reached
# ------------------------------------------------------------------------------------------------------------------


def test_an_unreachable_registry_dataset_is_one_clear_error(monkeypatch):
    """Offline (conftest), a registry name fails at once with one line: which Hub id, and how to pass a file."""
    assert datasets.config.HF_HUB_OFFLINE or datasets.config.HF_DATASETS_OFFLINE
    spec = DatasetSpec("trl-bandpo-tests/no-such-dataset", "test", "question", "answer")
    monkeypatch.setitem(DATASETS, "offline-bench", spec)  # a Hub id no cache holds
    started = time.monotonic()
    with pytest.raises(ConnectionError) as info:
        load_math_dataset("offline-bench")
    assert time.monotonic() - started < 10  # no retries
    message = str(info.value)
    assert "\n" not in message
    assert "'offline-bench'" in message and "'trl-bandpo-tests/no-such-dataset'" in message
    assert "dataset_name: path/to/file.jsonl" in message and "problem_field" in message
    assert info.value.__suppress_context__  # no chained 35-line traceback


# ------------------------------------------------------------------------------------------------------------------
# An empty dataset name or path
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["", "   "])
def test_an_empty_dataset_path_is_a_clear_error(tmp_path, monkeypatch, name):
    """'' is no path: `Path('')` is the current folder, which must not be read as a dataset folder."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"^name_or_path is empty \(got '\s*'\): give a registry name") as info:
        load_math_dataset(name)
    assert "\n" not in str(info.value)


def test_an_empty_benchmark_path_is_a_clear_error(tmp_path, monkeypatch):
    from trl_bandpo.data import load_eval_benchmarks

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"benchmark 'mine' has an empty path \('mine='\)"):
        load_eval_benchmarks(["mine="])
    with pytest.raises(ValueError, match=r"^name_or_path is empty"):
        load_eval_benchmarks([""])


def test_a_folder_that_is_no_saved_dataset_is_a_clear_error(tmp_path):
    folder = tmp_path / "not-a-dataset"
    folder.mkdir()
    with pytest.raises(ValueError, match=r"not-a-dataset is a folder but no dataset saved with save_to_disk"):
        load_math_dataset(str(folder))

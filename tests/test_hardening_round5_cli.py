"""Hostile input to the command-line surfaces (`trl-bandpo train`, `eval`, `tiny-model`): each refused (or warned
about) early, by a message naming the field or file, the value and what is allowed."""

from __future__ import annotations

import os
import re
import threading
import warnings
from pathlib import Path

import pytest
import yaml

import trl_bandpo
from trl_bandpo import evaluation
from trl_bandpo.cli import eval as eval_cli
from trl_bandpo.cli import train
from trl_bandpo.cli.recipe import ConfigError, parse_args
from trl_bandpo.evaluation.settings import check_output_dir

CPU = ["--use_cpu", "true", "--bf16", "false"]


def _recipe(tmp_path: Path, **fields) -> str:
    data = tmp_path / "train.jsonl"
    data.write_text('{"problem": "What is 1 + 1?", "answer": 2}\n')
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"model_name_or_path": "m", "dataset_name": str(data), **fields}))
    return str(path)


def _train_error(argv, capsys) -> str:
    """`trl-bandpo train ARGV`'s one line on stderr, and exit status 2."""
    with pytest.raises(SystemExit) as info:
        train.main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(lines) == 1, lines
    return lines[0]


# ---------------------------------------------------------------------------------------------------------------------
# 1. `~`, `$VAR` and `${VAR}` in path fields
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, argv, field",
    [
        ({"output_dir": "$TRL_BANDPO_UNSET/run"}, [], "output_dir"),
        ({}, ["--model_name_or_path", "${TRL_BANDPO_UNSET}/model"], "model_name_or_path"),
        ({"dataset_name": ["a.jsonl", "$TRL_BANDPO_UNSET/b.jsonl"]}, [], "dataset_name"),
        ({"eval_dataset_name": ["aime=$TRL_BANDPO_UNSET/aime.jsonl"]}, [], "eval_dataset_name"),
        ({"val_benchmarks": ["$TRL_BANDPO_UNSET/x.jsonl"], "val_preset": "none"}, [], "val_benchmarks"),
        ({"resume_from_checkpoint": "$TRL_BANDPO_UNSET/checkpoint-2"}, [], "resume_from_checkpoint"),
        ({"deepspeed": "${TRL_BANDPO_UNSET}/zero3.json"}, [], "deepspeed"),
    ],
)
def test_an_unset_variable_in_a_path_is_refused_by_field_and_name(fields, argv, field, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TRL_BANDPO_UNSET", raising=False)
    recipe = _recipe(tmp_path, **fields)
    with pytest.raises(ConfigError, match=rf"^{field} .*uses \$TRL_BANDPO_UNSET, which is not set"):
        parse_args(["--config", recipe, *CPU, *argv])
    assert "TRL_BANDPO_UNSET" in _train_error(["--config", recipe, *CPU, *argv], capsys)


def test_set_variables_and_home_are_expanded_in_paths_only(tmp_path, monkeypatch):
    """As a shell would: `$VAR`, `${VAR}` (also one the recipe's `env` sets) and a leading `~` (also after
    `name=`); a string that is no path (`instruction`, `run_name`) is kept as written."""
    monkeypatch.setenv("TRL_BANDPO_DATA", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TRL_BANDPO_RUNS", raising=False)
    recipe = _recipe(
        tmp_path, env={"TRL_BANDPO_RUNS": str(tmp_path / "runs")}, output_dir="${TRL_BANDPO_RUNS}/run",
        eval_dataset_name=["aime=~/aime.jsonl"], instruction="Put $x$ in \\boxed{}.", run_name="$TRL_BANDPO_DATA",
    )  # fmt: skip
    script_args, training_args, model_args = parse_args(
        ["--config", recipe, *CPU, "--dataset_name", "$TRL_BANDPO_DATA/a.jsonl,~/b.jsonl"]
    )
    assert training_args.output_dir == str(tmp_path / "runs" / "run")
    assert script_args.dataset_name == [f"{tmp_path}/a.jsonl", f"{tmp_path}/home/b.jsonl"]
    assert script_args.eval_dataset_name == [f"aime={tmp_path}/home/aime.jsonl"]
    assert script_args.instruction == "Put $x$ in \\boxed{}." and training_args.run_name == "$TRL_BANDPO_DATA"


# ---------------------------------------------------------------------------------------------------------------------
# 2. A NUL byte in a recipe
# ---------------------------------------------------------------------------------------------------------------------


def test_a_nul_byte_in_a_recipe_names_the_file_and_the_line(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_bytes(b"model_name_or_path: m\ndataset_name: a.jsonl\x00\n")
    with pytest.raises(ConfigError, match=r"recipe '.*recipe\.yaml', line 2: YAML allows no control character"):
        parse_args(["--config", str(recipe)])
    assert "line 2" in _train_error(["--config", str(recipe)], capsys)


# ---------------------------------------------------------------------------------------------------------------------
# 3. A recipe given as a FIFO (`--config <(cat recipe.yaml)`) is read once
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_recipe_from_a_fifo_is_read_once(tmp_path):
    text = Path(_recipe(tmp_path, output_dir=str(tmp_path / "out"), learning_rate=0.5)).read_text()
    fifo = tmp_path / "recipe.fifo"
    os.mkfifo(fifo)
    opened = []

    def write():  # one writer, as the shell's `<(...)` gives: a second open for reading would wait forever
        with open(fifo, "w") as handle:
            opened.append(True)
            handle.write(text)

    threading.Thread(target=write, daemon=True).start()
    script_args, training_args, model_args = parse_args(["--config", str(fifo), *CPU])
    assert opened == [True] and training_args.learning_rate == 0.5 and model_args.model_name_or_path == "m"


# ---------------------------------------------------------------------------------------------------------------------
# 4. `env` values that are no scalar
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value, shown", [(None, "null"), ([1, 2], "[1, 2]"), ({"a": 1}, "{'a': 1}")])
def test_an_env_value_that_is_no_scalar_is_refused(value, shown, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TRL_BANDPO_X", raising=False)
    recipe = _recipe(tmp_path, env={"TRL_BANDPO_X": value})
    message = f"env.TRL_BANDPO_X in recipe {recipe!r} must be a string, number or bool, got {shown}."
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", recipe, *CPU])
    assert str(info.value) == message and "TRL_BANDPO_X" not in os.environ  # TrlParser would set it to 'None'
    assert message in _train_error(["--config", recipe, *CPU], capsys)


def test_scalar_env_values_are_set(tmp_path, monkeypatch):
    for name in ("TRL_BANDPO_S", "TRL_BANDPO_N", "TRL_BANDPO_B"):
        monkeypatch.setenv(name, "before")
    parse_args(
        ["--config", _recipe(tmp_path, env={"TRL_BANDPO_S": "s", "TRL_BANDPO_N": 3, "TRL_BANDPO_B": True}), *CPU]
    )
    assert [os.environ[name] for name in ("TRL_BANDPO_S", "TRL_BANDPO_N", "TRL_BANDPO_B")] == ["s", "3", "True"]


# ---------------------------------------------------------------------------------------------------------------------
# 5. A preset with a prompt template or local benchmarks of the user's
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture
def bench_file(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"problem": "What is 1 + 1?", "answer": "2"}\n{"problem": "What is 2 + 2?", "answer": "4"}\n')
    return path


def test_local_benchmarks_under_val_preset_name_val_benchmarks_when_parsed(bench_file, tmp_path, capsys):
    """Before: parsed, then a traceback naming val_scorer (which the recipe does not set) once training started."""
    recipe = _recipe(tmp_path, val_preset="bandpo", val_benchmarks=[str(bench_file)])
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", recipe, *CPU])
    assert str(info.value).startswith(
        "invalid configuration: val_benchmarks: benchmark 'a' has no scorer (val_preset bandpo scores only "
        "['aime2024', 'aime2025', 'amc2023']): a custom benchmark needs val_scorer a=NAME"
    )
    assert "val_benchmarks: benchmark 'a'" in _train_error(["--config", recipe, *CPU], capsys)
    parse_args(["--config", recipe, *CPU, "--val_scorer", "a=strict"])  # a scorer for it: accepted


def test_local_benchmarks_under_preset_name_benchmarks_in_eval(bench_file, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        eval_cli.eval_main(["--model", "m", "--output-dir", str(tmp_path / "out"), "--preset", "bandpo",
                            "--benchmarks", str(bench_file)])  # fmt: skip
    assert info.value.code == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .splitlines()[-1]
        .startswith(
            "trl-bandpo eval: error: argument --benchmarks: benchmark 'a' has no scorer (--preset bandpo scores only"
        )
    )


def _warnings_of(call) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in caught if "'dapo' scorer reads" in str(w.message)]


def test_a_prompt_template_against_the_preset_is_named_first(tmp_path):
    recipe = _recipe(tmp_path, val_preset="bandpo", val_prompt_template="boxed")
    [message] = _warnings_of(lambda: parse_args(["--config", recipe, *CPU]))
    assert message.startswith("val_prompt_template='boxed' with val_preset bandpo, whose val_scorer is 'dapo' for ")
    given = {"preset": "bandpo", "prompt_template": "boxed"}
    [message] = _warnings_of(lambda: eval_cli.resolve_settings(eval_cli.build_parser().parse_args(
        ["--model", "m", *(f"--{key.replace('_', '-')}={value}" for key, value in given.items())])))  # fmt: skip
    assert message.startswith("--prompt-template='boxed' with --preset bandpo, whose --scorer is 'dapo' for ")
    # the scorer set against the preset's template: the scorer is named first
    args = eval_cli.build_parser().parse_args(["--model", "m", "--preset", "dgpo", "--scorer", "dapo"])
    [message] = _warnings_of(lambda: eval_cli.resolve_settings(args))
    assert message.startswith("--scorer 'dapo' (for every benchmark) with --prompt-template='boxed'")


# ---------------------------------------------------------------------------------------------------------------------
# 6. `trl-bandpo eval`: prompt + --max-new-tokens against max_position_embeddings, before generating
# ---------------------------------------------------------------------------------------------------------------------


class _Generating(Exception):
    pass


@pytest.mark.parametrize(
    "tokens, expected",
    [
        ("600", r"^--max-new-tokens 600 = 600 tokens exceed the 512 positions of the model"),
        ("500", r"^the longest prompt \(\d+ tokens\) \+ --max-new-tokens 500 = \d+ tokens exceed the 512 positions"),
        ("8", None),
    ],
)
def test_eval_warns_about_positions_before_generating(tokens, expected, tiny_model_dir, bench_file, tmp_path,
                                                      monkeypatch):  # fmt: skip
    def generating(*args, **kwargs):
        raise _Generating

    monkeypatch.setattr(evaluation.generation, "load_generator", generating)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(_Generating):
            eval_cli.eval_main(["--model", tiny_model_dir, "--benchmarks", str(bench_file), "--max-new-tokens", tokens,
                                "--backend", "transformers", "--output-dir", str(tmp_path / "out")])  # fmt: skip
    messages = [str(w.message) for w in caught if "positions" in str(w.message)]
    assert (messages == []) if expected is None else (len(messages) == 1 and re.match(expected, messages[0]))
    if expected:
        assert "Lower --max-new-tokens (e.g. to " in messages[0]


# ---------------------------------------------------------------------------------------------------------------------
# 7. `trl-bandpo tiny-model PATH --overwrite` over a sharded checkpoint
# ---------------------------------------------------------------------------------------------------------------------


def test_tiny_model_overwrite_leaves_no_stale_shard_or_index(tmp_path, monkeypatch, capsys):
    from transformers import AutoModelForCausalLM

    from trl_bandpo.cli import main
    from trl_bandpo.cli import tiny_model as tiny_model_cli
    from trl_bandpo.demo.tiny_model import build_tiny_model, build_tiny_tokenizer, save_tiny_model

    folder = tmp_path / "model"
    build_tiny_model(build_tiny_tokenizer(), hidden_size=128, num_layers=3).save_pretrained(
        folder, max_shard_size="200KB"
    )
    assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("model-0*"))) > 1
    (folder / "notes.txt").write_text("mine")
    (folder / "run").mkdir()
    # the warm start (half a minute) stands in as a plain tiny model: what is tested is what PATH holds before it
    monkeypatch.setattr(tiny_model_cli, "save_answering_model",
                        lambda path: (save_tiny_model(path), {"steps": 0, "accuracy": 0.5})[1])  # fmt: skip
    main(["tiny-model", str(folder), "--overwrite"])
    capsys.readouterr()
    assert not (folder / "model.safetensors.index.json").exists() and not list(folder.glob("model-0*"))
    assert (folder / "notes.txt").read_text() == "mine" and (folder / "run").is_dir()
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (64, 2)


# ---------------------------------------------------------------------------------------------------------------------
# 8. An output folder among the project's sources
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture
def checkout(tmp_path):
    """A folder that holds this project's pyproject.toml, as a clone's root does."""
    root = tmp_path / "trl-bandpo"
    root.mkdir()
    (root / "pyproject.toml").write_text('[project]\nname = "trl-bandpo"\n')
    return root


def test_check_output_dir_warns_among_the_sources(checkout, tmp_path):
    package = Path(trl_bandpo.__file__).parent
    for folder, why in ((checkout, "the root of the trl-bandpo checkout"), (package / "cli", "inside the installed")):
        with pytest.warns(UserWarning, match=rf"output folder '{folder}' is {why}.*written among the sources"):
            check_output_dir(folder)
    elsewhere = tmp_path / "other"
    elsewhere.mkdir()
    (elsewhere / "pyproject.toml").write_text('[project]\nname = "other"\n')
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_output_dir(elsewhere)


def test_train_and_eval_warn_about_an_output_folder_among_the_sources(checkout, tiny_model_dir, bench_file,
                                                                      monkeypatch):  # fmt: skip
    recipe = _recipe(checkout.parent, model_name_or_path=tiny_model_dir, output_dir=str(checkout))
    with pytest.warns(UserWarning, match="root of the trl-bandpo checkout"):
        train.check_before_loading(*parse_args(["--config", recipe, *CPU]))

    def generating(*args, **kwargs):
        raise _Generating

    monkeypatch.setattr(evaluation.generation, "load_generator", generating)
    with pytest.warns(UserWarning, match="root of the trl-bandpo checkout"), pytest.raises(_Generating):
        eval_cli.eval_main(["--model", tiny_model_dir, "--benchmarks", str(bench_file), "--max-new-tokens", "4",
                            "--backend", "transformers", "--output-dir", str(checkout)])  # fmt: skip
    assert sorted(p.name for p in checkout.iterdir()) == ["pyproject.toml"]


# ---------------------------------------------------------------------------------------------------------------------
# Data that cannot be read or used: one line naming the field, status 2, before the model loads
# ---------------------------------------------------------------------------------------------------------------------

_ROWS = '{"problem": "What is 1 + 1?", "answer": 2}\n'
_EVAL = {"eval_strategy": "steps", "eval_steps": 1}


@pytest.mark.parametrize(
    "files, fields, field, says",
    [
        ({}, {"dataset_name": "{tmp}/missing.jsonl"}, "dataset_name", "neither an existing file"),
        ({"bad.jsonl": _ROWS + '{"problem": \n'}, {"dataset_name": "{tmp}/bad.jsonl"}, "dataset_name",
         "invalid JSON at line 2"),
        ({"q.jsonl": '{"question": "1 + 1?"}\n'}, {"dataset_name": "{tmp}/q.jsonl"}, "dataset_name", "answer column"),
        ({"empty.jsonl": ""}, {"dataset_name": "{tmp}/empty.jsonl"}, "dataset_name", "holds no rows"),
        ({}, {"eval_dataset_name": ["aime={tmp}/missing.jsonl"], **_EVAL}, "eval_dataset_name", "neither an existing"),
        ({"bad.jsonl": '{"problem": \n'}, {"eval_dataset_name": ["aime={tmp}/bad.jsonl"], **_EVAL},
         "eval_dataset_name", "invalid JSON at line 1"),
        ({}, {"val_benchmarks": ["{tmp}/missing.jsonl"], "val_preset": "none"}, "val_benchmarks",
         "neither an existing"),
        ({"bad.jsonl": '{"problem": \n'}, {"val_benchmarks": ["{tmp}/bad.jsonl"], "val_preset": "none"},
         "val_benchmarks", "invalid JSON at line 1"),
    ],
)  # fmt: skip
def test_unusable_data_is_one_line_naming_the_field(files, fields, field, says, tiny_model_dir, tmp_path, capsys,
                                                    monkeypatch):  # fmt: skip
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "train.jsonl").write_text(_ROWS * 8)
    fields = yaml.safe_load(yaml.safe_dump(fields).replace("{tmp}", str(tmp_path)))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"model_name_or_path": tiny_model_dir, "output_dir": str(tmp_path / "out"),
                                      "dataset_name": str(tmp_path / "train.jsonl"), **fields}))  # fmt: skip

    def no_model(*args, **kwargs):
        raise AssertionError("the trainer was built: the data were not checked first")

    monkeypatch.setattr(train, "trainer_class_for", no_model)
    line = _train_error(["--config", str(recipe), *CPU], capsys)
    assert line.startswith(f"trl-bandpo train: error: {field}: ") and says in line, line
    assert line.count(f"{field}:") == 1, line

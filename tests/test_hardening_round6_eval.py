"""Hardening round 6, the rest of the clear errors: `trl-bandpo eval` on a model folder that does not exist and on
prompts longer than the model's positions, `EvalSettings(names=...)` of the wrong type, a recipe's env key with '=',
an output folder inside a checkout's package folder, and a validation preset whose prompt template is not the
training one (tiny local model, local benchmark)."""

import json
import warnings

import pytest
import yaml

from trl_bandpo import evaluation
from trl_bandpo.cli import eval as eval_cli
from trl_bandpo.cli.recipe import ConfigError, parse_args
from trl_bandpo.cli.script_arguments import ScriptArguments
from trl_bandpo.evaluation import EvalSettings
from trl_bandpo.evaluation.settings import check_output_dir


def _eval_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        eval_cli.eval_main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2
    return lines[-1]


@pytest.fixture
def long_benchmark(tmp_path):
    """One problem of about 600 tokens of the tiny tokenizer (the tiny model has 512 positions) and one short."""
    path = tmp_path / "long.jsonl"
    rows = [{"problem": "What is " + " + ".join(["1"] * 300) + "?", "answer": "300"},
            {"problem": "What is 1 + 1?", "answer": "2"}]  # fmt: skip
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_eval_names_a_model_folder_that_does_not_exist(tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    error = _eval_error(["--model", str(missing), "--benchmarks", "gsm8k"], capsys)
    assert "--model" in error and str(missing) in error and "Repo id" not in error


def test_eval_refuses_a_prompt_that_fills_every_position_unless_told_to_truncate(
    tiny_model_dir, long_benchmark, tmp_path, capsys, monkeypatch
):
    base = ["--model", tiny_model_dir, "--benchmarks", str(long_benchmark), "--max-new-tokens", "4",
            "--num-samples", "1", "--backend", "transformers", "--output-dir", str(tmp_path / "out")]  # fmt: skip
    loaded = []
    monkeypatch.setattr(evaluation.generation, "load_generator", lambda *a, **k: loaded.append(1) / 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        error = _eval_error(base, capsys)
    assert loaded == []  # refused before the model loads
    assert "--truncate-prompt-tokens" in error and "512 positions" in error
    monkeypatch.undo()
    # with the flag: each prompt keeps its last 64 tokens, and the run completes within the positions
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert eval_cli.eval_main(base + ["--truncate-prompt-tokens", "64"]) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["settings"]["truncate_prompt_tokens"] == 64
    error = _eval_error(base + ["--truncate-prompt-tokens", "0", "--overwrite"], capsys)
    assert "--truncate-prompt-tokens" in error and "got 0" in error


@pytest.mark.parametrize("names", [5, {"temperature": 3}, ["a"]])
def test_eval_settings_refuse_names_that_are_no_mapping_of_strings(names):
    with pytest.raises(ValueError, match=r"^names must be None or a mapping"):
        EvalSettings(names=names)


@pytest.mark.parametrize("key", ["A=B", "", "X\0Y"])
def test_a_recipe_env_key_that_is_no_variable_name_is_refused(key, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"model_name_or_path": "m", "dataset_name": "d", "env": {key: "1"}}))
    with pytest.raises(ConfigError, match=r"env in recipe .* each key must be a variable name"):
        parse_args(["--config", str(recipe)])


def test_an_output_folder_inside_a_checkouts_package_folder_warns(tmp_path):
    root = tmp_path / "trl-bandpo"
    (root / "trl_bandpo" / "runs").mkdir(parents=True)
    (root / "pyproject.toml").write_text('[project]\nname = "trl-bandpo"\n')
    with pytest.warns(UserWarning, match=r"inside the package folder of the trl-bandpo checkout"):
        check_output_dir(root / "trl_bandpo" / "runs")
    with warnings.catch_warnings():  # beside the package, in the checkout: no warning
        warnings.simplefilter("error")
        (root / "runs").mkdir()
        check_output_dir(root / "runs")


@pytest.mark.parametrize("template, warns", [("boxed", True), ("dapo", False)])
def test_a_validation_preset_with_another_prompt_template_warns(template, warns):
    # the bandpo preset validates with DAPO's template
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ScriptArguments(dataset_name=["d"], prompt_template=template, val_preset="bandpo")
    messages = [str(w.message) for w in caught if "val_preset='bandpo'" in str(w.message)]
    assert len(messages) == int(warns)
    if warns:
        assert "val_prompt_template='dapo'" in messages[0] and "prompt_template='boxed'" in messages[0]
    # set explicitly, the validation template is the user's choice: no warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ScriptArguments(dataset_name=["d"], prompt_template="boxed", val_preset="bandpo", val_prompt_template="dapo")
    assert not [w for w in caught if "val_preset='bandpo'" in str(w.message)]

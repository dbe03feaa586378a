"""`trl-bandpo train` fails early and clearly on a bad recipe or command line: repeated keys, YAML syntax errors,
settings the run ignores (loss fields the selected loss does not read), values of the wrong type, missing required
fields; and
``--resume_from_checkpoint true|false`` means what the YAML booleans mean. Every case here only parses (no model, no
data), so the file runs in seconds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from trl_bandpo.cli.recipe import ConfigError, parse_args
from trl_bandpo.cli.script_arguments import ScriptArguments
from trl_bandpo.cli.train import describe_run, main

# A valid minimal recipe for a machine without a GPU.
BASE = "model_name_or_path: some/model\ndataset_name: some.jsonl\nuse_cpu: true\nbf16: false\n"


def _recipe(tmp_path, text: str):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def _parse(tmp_path, text: str, *extra: str):
    return parse_args(["--config", str(_recipe(tmp_path, text)), *extra])


# ---------------------------------------------------------------------------------------------------------------------
# Repeated keys and YAML syntax
# ---------------------------------------------------------------------------------------------------------------------


def test_duplicate_key_fails_naming_the_key_and_both_lines(tmp_path):
    text = BASE + "learning_rate: 1.0e-6\nmax_steps: 3\nlearning_rate: 2.0e-6\n"
    with pytest.raises(ConfigError, match=r"duplicate key 'learning_rate'.*lines 5 and 7"):
        _parse(tmp_path, text)


def test_duplicate_key_in_a_nested_mapping_fails(tmp_path):
    with pytest.raises(ConfigError, match=r"duplicate key 'A'.*lines 6 and 7"):
        _parse(tmp_path, BASE + "env:\n  A: 1\n  A: 2\n")


def test_main_exits_2_on_a_duplicate_key(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", str(_recipe(tmp_path, BASE + "seed: 1\nseed: 2\n"))])
    assert exit_info.value.code == 2
    assert "duplicate key 'seed'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text, hint",
    [
        ("model_name_or_path:some/model\ndataset_name: d\n", "line 1 `model_name_or_path:some/model` has no space"),
        ("model_name_or_path: m\n\tdataset_name: d\n", "line 2 `dataset_name: d` is indented with a tab"),
        ("model_name_or_path: m\n--dataset_name d\nseed: 1\n", "line 2 `--dataset_name d` is command-line syntax"),
    ],
    ids=["missing-space", "tab", "command-line-syntax"],
)
def test_yaml_syntax_error_keeps_file_and_line_and_hints_at_the_cause(tmp_path, text, hint):
    with pytest.raises(ConfigError) as err:
        _parse(tmp_path, text)
    message = str(err.value)
    assert "not valid YAML" in message and str(tmp_path / "recipe.yaml") in message and "line " in message
    assert "Hint: " + hint in message


def test_recipe_that_is_no_mapping_hints_at_command_line_syntax(tmp_path):
    with pytest.raises(ConfigError, match=r"must be a YAML mapping(.|\n)*line 1 `--model_name_or_path m` is command"):
        _parse(tmp_path, "--model_name_or_path m\n")


# ---------------------------------------------------------------------------------------------------------------------
# A setting the run ignores is an error in a recipe (the config warns about it)
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "recipe_lines, flags, field",
    [
        ("band_radius: 0.1\n", (), "band_radius"),
        ("", ("--dgpo_n", "2"), "dgpo_n"),
        ("ce_gppo_beta1: 0.5\n", (), "ce_gppo_beta1"),
        ("", ("--aspo_c_pos=2.0",), "aspo_c_pos"),
    ],
)
def test_loss_fields_without_policy_loss_fail(tmp_path, recipe_lines, flags, field):
    with pytest.raises(ConfigError) as err:
        _parse(tmp_path, BASE + recipe_lines, *flags)
    message = str(err.value)
    assert f"{field}=" in message and "has no effect with policy_loss='clip'" in message and "error" in message


@pytest.mark.parametrize("where", ["recipe", "command line"])
def test_loss_fields_with_an_explicit_policy_loss_parse(tmp_path, where):
    recipe_lines, flags = ("policy_loss: relaxed_band\n", ()) if where == "recipe" else ("", ("--policy_loss", "band"))
    _, args, _ = _parse(tmp_path, BASE + recipe_lines + "band_radius: 0.1\n", *flags)
    assert args.band_radius == 0.1 and args.policy_loss == ("relaxed_band" if where == "recipe" else "band")


def test_run_description_names_the_policy_loss():
    args = SimpleNamespace(policy_loss="clip", loss_type="grpo", per_device_train_batch_size=2,
                           gradient_accumulation_steps=2, generation_batch_size=8, num_generations=4,
                           num_iterations=1, max_steps=5)  # fmt: skip
    accelerator = SimpleNamespace(num_processes=1, distributed_type="DistributedType.NO", state=SimpleNamespace())
    line = describe_run(SimpleNamespace(args=args, accelerator=accelerator))
    assert line.startswith("trl-bandpo: SimpleNamespace, policy_loss=clip,")


# ---------------------------------------------------------------------------------------------------------------------
# resume_from_checkpoint
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, expected", [("true", True), ("TRUE", True), ("False", False), ("out/checkpoint-10", "out/checkpoint-10")]
)
def test_resume_from_checkpoint_on_the_command_line(tmp_path, value, expected):
    _, args, _ = _parse(tmp_path, BASE, "--resume_from_checkpoint", value)
    assert args.resume_from_checkpoint == expected and type(args.resume_from_checkpoint) is type(expected)


def test_resume_from_checkpoint_in_the_recipe(tmp_path):
    _, args, _ = _parse(tmp_path, BASE + "resume_from_checkpoint: true\n")
    assert args.resume_from_checkpoint is True


# ---------------------------------------------------------------------------------------------------------------------
# Value types
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "line, needle",
    [
        ("learning_rate: abc", "--learning_rate.*invalid float value: 'abc'"),
        ("learning_rate: [1.0]", r"learning_rate in recipe .* must be a number, got \[1.0\]"),
        ("max_steps: 1.5", "max_steps in recipe .* must be an integer, got 1.5"),
        ("use_vllm: 3", r"use_vllm in recipe .* must be true or false, got 3"),
        ("max_steps: null", "max_steps in recipe .* must be an integer, got null"),
        ("delta: [2]", r"delta in recipe .* must be a number or null, got \[2\]"),
    ],
)
def test_recipe_values_of_the_wrong_type_fail_naming_the_field(tmp_path, line, needle):
    with pytest.raises(ConfigError, match=needle):
        _parse(tmp_path, BASE + line + "\n")


def test_non_numeric_learning_rate_on_the_command_line_fails_naming_the_flag(tmp_path):
    with pytest.raises(ConfigError, match=r"--learning_rate.*invalid float value: 'abc'"):
        _parse(tmp_path, BASE, "--learning_rate", "abc")


def test_numbers_yaml_reads_as_strings_still_parse(tmp_path):
    _, args, _ = _parse(tmp_path, BASE + "learning_rate: 1e-6\nwarmup_steps: 0\nmax_steps: '7'\n")
    assert args.learning_rate == 1e-6 and args.warmup_steps == 0 and args.max_steps == 7


@pytest.mark.parametrize("where", ["recipe", "command line"])
@pytest.mark.parametrize("value", ["0", "-5"])
def test_non_positive_max_completion_length_fails(tmp_path, where, value):
    if where == "recipe":
        text, flags = BASE + f"max_completion_length: {value}\n", ()
    else:
        text, flags = BASE, ("--max_completion_length", value)
    with pytest.raises(ConfigError, match=f"max_completion_length must be None or an integer >= 1, got {value}"):
        _parse(tmp_path, text, *flags)


@pytest.mark.parametrize(
    "line, field",
    [
        ("dataset_name: 123", "dataset_name"),
        ("dataset_name: [a.jsonl, 1]", "dataset_name"),
        ("eval_dataset_name: {a: 1}", "eval_dataset_name"),
        ("problem_field: 3", "problem_field"),
        ("reward: [signed]", "reward"),
    ],
)
def test_script_arguments_of_the_wrong_type_fail_naming_the_field(tmp_path, line, field):
    text = BASE.replace("dataset_name: some.jsonl\n", "") + line + "\n"
    if not line.startswith("dataset_name"):
        text += "dataset_name: some.jsonl\n"
    with pytest.raises(ConfigError, match=f"{field} must be"):
        _parse(tmp_path, text)


def test_script_arguments_check_types_when_built_directly():
    with pytest.raises(ValueError, match="dataset_name must be a string or a list of strings.*got 123"):
        ScriptArguments(dataset_name=123)
    assert ScriptArguments(dataset_name="a,b").dataset_name == ["a", "b"]


# ---------------------------------------------------------------------------------------------------------------------
# What is reported first
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture
def no_bf16_device(monkeypatch):
    """A machine without bf16 support, wherever the test runs: TrainingArguments' bf16 check fires."""
    import transformers.training_args as training_args

    monkeypatch.setattr(training_args, "is_torch_bf16_gpu_available", lambda: False)
    monkeypatch.setattr(training_args, "is_torch_xla_available", lambda: False)


@pytest.mark.parametrize("argv", [["--config", "EMPTY"], []], ids=["empty-recipe", "no-arguments"])
def test_missing_required_fields_are_reported_first(tmp_path, no_bf16_device, argv):
    empty = _recipe(tmp_path, "")
    with pytest.raises(ConfigError) as err:
        parse_args([str(empty) if arg == "EMPTY" else arg for arg in argv])
    message = str(err.value)
    assert "model_name_or_path" in message and "dataset_name" in message and "bf16" not in message


def test_unknown_flag_is_reported_before_the_bf16_check(tmp_path, no_bf16_device):
    with pytest.raises(ConfigError, match=r"unknown argument\(s\)(.|\n)*'band_radus'.*did you mean 'band_radius'"):
        _parse(tmp_path, "model_name_or_path: m\ndataset_name: d\n", "--band_radus", "0.1")


def test_bf16_error_comes_with_the_cpu_hint(tmp_path, no_bf16_device):
    with pytest.raises(ConfigError, match=r"bf16/gpu.*set `use_cpu: true` and `bf16: false`"):
        _parse(tmp_path, "model_name_or_path: m\ndataset_name: d\n")


# ---------------------------------------------------------------------------------------------------------------------
# Dynamic sampling works with every policy loss; the `--field none` hint only where None is allowed
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["recipe", "command line"])
def test_dynamic_sampling_without_policy_loss_is_plain_grpo_with_dynamic_sampling(tmp_path, where):
    """Dynamic sampling is no loss-specific field: plain GRPO (policy_loss clip) runs it."""
    recipe_lines = "dynamic_sampling: true\ndynamic_sampling_max_rounds: 2\n" if where == "recipe" else ""
    flags = () if where == "recipe" else ("--dynamic_sampling", "true", "--dynamic_sampling_max_rounds", "2")
    _, args, _ = _parse(tmp_path, BASE + "num_generations: 4\nper_device_train_batch_size: 4\n" + recipe_lines, *flags)
    assert (args.policy_loss, args.dynamic_sampling, args.dynamic_sampling_max_rounds) == ("clip", True, 2)


def test_the_message_about_loss_fields_does_not_name_dynamic_sampling(tmp_path):
    with pytest.raises(ConfigError) as err:
        _parse(tmp_path, BASE + "dynamic_sampling: true\nnum_generations: 4\nband_radius: 0.1\n")
    message = str(err.value)
    assert message.startswith("band_radius=0.1 has no effect") and "dynamic_sampling" not in message


@pytest.mark.parametrize(
    "line, field",
    [("policy_loss: null\n", "policy_loss"), ("loss_type: null\n", "loss_type"), ("reward: null\n", "reward")],
)
def test_no_none_hint_for_fields_that_do_not_accept_none(tmp_path, line, field):
    with pytest.raises(ConfigError) as err:
        _parse(tmp_path, BASE + line)
    message = str(err.value)
    assert field in message and "got None" in message and "none`" not in message


@pytest.mark.parametrize("where", ["recipe", "command line"])
def test_none_sets_an_optional_number_to_none(tmp_path, where):
    """`none` (any case) or `null` for an optional number, in a recipe and on the command line (TRL's parser)."""
    lines, flags = ("policy_loss: band\nband_upper_max: none\ndelta: NONE\n", ())
    if where == "command line":
        lines, flags = "policy_loss: band\n", ("--band_upper_max", "none", "--delta=null")
    _, args, _ = _parse(tmp_path, BASE + lines, *flags)
    assert args.band_upper_max is None and args.delta is None

"""End-to-end runs of the training entry point on a tiny local model and a tiny local JSONL dataset.

In-process `main([...])` runs (one process, seconds) and one 2-process DeepSpeed ZeRO-3 run through
`accelerate launch -m trl_bandpo.cli.train` on CPU, with `accelerate_configs/zero3.yaml` adapted for CPU.

The batch mapping mirrors the paper recipes at toy scale: 4 prompts x 4 samples = 16 completions per generation,
2 prompts x 4 = 8 completions per optimizer step, so 2 optimizer steps per generation (the second off-policy).
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trl_bandpo.cli import train

ROOT = Path(__file__).resolve().parents[1]
ACCELERATE = Path(sys.executable).with_name("accelerate")


def _write_dataset(path: Path) -> Path:
    # Non-default column names, so problem_field / answer_field are exercised.
    rows = [{"question": f"What is {a} + {b}?", "final": a + b} for a in range(1, 9) for b in range(1, 3)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _write_recipe(tmp_path: Path, model_dir: str, *, processes: int, **overrides) -> Path:
    recipe = {
        "model_name_or_path": model_dir,
        "dtype": "float32",
        "dataset_name": [str(_write_dataset(tmp_path / "train.jsonl"))],
        "dataset_split": "train",
        "problem_field": "question",
        "answer_field": "final",
        "reward": "signed",
        "reward_timeout": 10.0,
        "reward_num_workers": 1,
        "policy_loss": "band",
        "band_radius": 0.05,
        "loss_type": "grpo",
        "beta": 0.001,
        "delta": 10.0,
        "num_generations": 4,
        "per_device_train_batch_size": 8 // (2 * processes),
        "gradient_accumulation_steps": 2,
        "generation_batch_size": 16,
        "max_completion_length": 8,
        "max_steps": 2,
        "learning_rate": 1.0e-3,
        "lr_scheduler_type": "constant",
        "logging_steps": 1,
        "use_cpu": True,
        "bf16": False,
        "gradient_checkpointing": False,
        "save_strategy": "no",
        "report_to": "none",
        "output_dir": str(tmp_path / "out"),
        "seed": 0,
    }
    recipe.update(overrides)
    path = tmp_path / "recipe.yaml"
    path.write_text("# tiny CPU recipe for tests\n" + yaml.safe_dump(recipe, sort_keys=False))
    return path


def _train_logs(output_dir: Path) -> list[dict]:
    state = json.loads((output_dir / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    logs = [entry for entry in state["log_history"] if "loss" in entry]
    assert len(logs) == 2
    return logs


def _assert_band_metrics(logs: list[dict]):
    for entry in logs:
        for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "entropy", "kl"):
            assert key in entry, key
        lower, upper = entry["bounds/lower_mean"], entry["bounds/upper_mean"]
        assert 0.0 <= lower < 1.0 < upper <= 10.0, (lower, upper)  # per-token Band bounds, capped at 10
        assert any(key.startswith("clip_ratio_by_prob/high/") for key in entry)
    assert "rewards/boxed_signed_reward/mean" in logs[0]
    assert -1.0 <= logs[0]["rewards/boxed_signed_reward/mean"] <= 1.0


@pytest.fixture
def captured_trainer(monkeypatch):
    """Keep the trainer that `main` builds (main itself returns an exit status)."""
    captured = {}
    run = train.run

    def keep(*args):
        captured["trainer"] = run(*args)
        return captured["trainer"]

    monkeypatch.setattr(train, "run", keep)
    return captured


def test_main_in_process_band(tmp_path, tiny_model_dir, captured_trainer):
    recipe = _write_recipe(tmp_path, tiny_model_dir, processes=1)
    assert train.main(["--config", str(recipe)]) == 0
    trainer = captured_trainer["trainer"]
    assert type(trainer).__name__ == "BandPOTrainer"
    assert trainer.args.steps_per_generation == 2 * trainer.args.gradient_accumulation_steps
    assert trainer.args.beta == 0.001 and trainer.args.delta == 10.0
    _assert_band_metrics(_train_logs(tmp_path / "out"))
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_main_in_process_dgpo_with_overrides(tmp_path, tiny_model_dir, captured_trainer):
    """`policy_loss` picks the trainer class; command-line flags override the recipe (`--delta none` unsets it);
    in-training evaluation on a local benchmark file."""
    recipe = _write_recipe(tmp_path, tiny_model_dir, processes=1)
    benchmark = tmp_path / "bench.jsonl"
    rows = [{"question": f"What is {a} * 3?", "final": 3 * a} for a in range(4)]
    benchmark.write_text("".join(json.dumps(row) + "\n" for row in rows))
    argv = ["--config", str(recipe), "--policy_loss", "dgpo", "--dgpo_n", "2", "--delta", "none",
            "--loss_type", "dapo", "--beta", "0.0", "--reward", "accuracy",
            "--eval_strategy", "steps", "--eval_steps", "2", "--eval_dataset_name", f"bench={benchmark}",
            "--num_generations_eval", "4", "--per_device_eval_batch_size", "4"]  # fmt: skip
    assert train.main(argv) == 0
    trainer = captured_trainer["trainer"]
    assert type(trainer).__name__ == "DGPOTrainer"
    assert (trainer.args.policy_loss, trainer.args.dgpo_n, trainer.args.delta) == ("dgpo", 2, None)
    logs = _train_logs(tmp_path / "out")
    assert "rewards/boxed_accuracy_reward/mean" in logs[0]
    history = json.loads((tmp_path / "out" / "trainer_state.json").read_text())["log_history"]
    assert any("eval_bench_loss" in entry for entry in history)
    assert any("eval_rewards/boxed_accuracy_reward/mean" in entry for entry in history)
    for entry in logs:
        fractions = [entry[key] for key in (f"dgpo/frac_{r}" for r in ("LN", "HP", "LP", "HN")) if key in entry]
        assert fractions and all(0.0 <= f <= 1.0 for f in fractions if not math.isnan(f))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_accelerate_launch_two_process_zero3_cpu(tmp_path, tiny_model_dir):
    """`accelerate launch --config_file <zero3 for CPU> -m trl_bandpo.cli.train --config recipe.yaml`, 2 processes."""
    config = yaml.safe_load((ROOT / "accelerate_configs" / "zero3.yaml").read_text())
    config.update(use_cpu=True, mixed_precision="no", num_processes=2)
    accelerate_config = tmp_path / "zero3_cpu.yaml"
    accelerate_config.write_text(yaml.safe_dump(config))
    recipe = _write_recipe(tmp_path, tiny_model_dir, processes=2)

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    command = [str(ACCELERATE), "launch", "--config_file", str(accelerate_config), "--main_process_port",
               str(_free_port()), "-m", "trl_bandpo.cli.train", "--config", str(recipe)]  # fmt: skip
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    assert "2 process(es), DEEPSPEED ZeRO-3" in output
    assert "16 completions per generation (4 prompts x 4), 8 per optimizer step" in output
    assert "2 optimizer step(s) per generation" in output
    assert "bounds/upper_mean" in output
    logs = _train_logs(tmp_path / "out")
    _assert_band_metrics(logs)
    # Both processes generated: 16 completions per generation batch, across 2 processes.
    assert logs[0]["num_tokens"] > 0


def test_validation_settings_take_the_preset_and_the_overrides():
    from trl_bandpo.cli.script_arguments import ScriptArguments
    from trl_bandpo.evaluation import ValidationSettings

    assert train.validation_settings(ScriptArguments(dataset_name=["d"])) is None  # no benchmarks, no validation
    args = ScriptArguments(
        dataset_name=["d"], val_preset="bandpo", val_every_steps=20, val_num_samples=8, val_before_train=True
    )
    assert train.validation_settings(args) == ValidationSettings(
        benchmarks=["aime2024", "aime2025", "amc2023"],
        preset="bandpo",
        num_samples=8,  # the override wins
        scorer={"aime2024": "dapo", "aime2025": "dapo", "amc2023": "math_reward"},
        max_new_tokens=4096,
        temperature=1.0,
        top_p=1.0,
        top_k=None,
        prompt_template="dapo",
        ks=[1, 2, 4, 8],  # the preset's ks up to the samples drawn
        every_steps=20,
        at_start=True,
    )
    args = ScriptArguments(dataset_name=["d"], val_benchmarks=["a.jsonl"], val_scorer="strict")
    assert train.validation_settings(args) == ValidationSettings(
        benchmarks=["a.jsonl"], scorer="strict", prompt_template="boxed", every_steps=5, ks=[32]
    )
    with pytest.raises(ValueError, match="val_preset must be None or one of"):
        ScriptArguments(dataset_name=["d"], val_preset="verl")
    with pytest.raises(ValueError, match="val_every_steps must be an integer >= 1"):
        ScriptArguments(dataset_name=["d"], val_every_steps=0)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("val_benchmarks", 5, r"val_benchmarks must be a registry name, a local file .*got 5"),
        ("val_benchmarks", [1, 2], r"val_benchmarks must be a registry name, a local file .*got \[1, 2\]"),
        (
            "val_scorer",
            "bogus",
            r"val_scorer must be one of \['math_verify', 'dapo', 'strict', 'math_reward'\].*got 'bogus'",
        ),
        ("val_scorer", "aime2024=nope", r"val_scorer\['aime2024'\] must be one of .*got 'nope'"),
        ("val_scorer", 3, r"val_scorer must be one of .*got 3"),
        ("val_max_problems", 0, r"val_max_problems must be None or an integer >= 1, got 0"),
        ("val_num_samples", True, r"val_num_samples must be an integer >= 1, got True"),
    ],
)
def test_bad_validation_fields_fail_when_the_arguments_are_built(field, value, message):
    from trl_bandpo.cli.script_arguments import ScriptArguments

    with pytest.raises(ValueError, match=message):
        ScriptArguments(dataset_name=["d"], val_preset="bandpo", **{field: value})


# (setting, value, refused): values at and beyond the limits of `EvalSettings`, written by hand from its help.
EVAL_VALUES = [
    ("num_samples", 0, True), ("num_samples", 2.5, True), ("num_samples", 1, False),
    ("ks", [0], True), ("ks", [33], True), ("ks", [], True), ("ks", [1, 32], False),
    ("max_new_tokens", 0, True), ("max_new_tokens", 1, False),
    ("temperature", -0.5, True), ("temperature", math.nan, True), ("temperature", math.inf, True),
    ("temperature", 0.0, False),
    ("top_p", 0.0, True), ("top_p", 1.5, True), ("top_p", 1.0, False),
    ("top_k", 0, True), ("top_k", 1, False),
    ("prompt_template", "chatml", True), ("prompt_template", "dapo", False),
    ("scorer", "prime", True), ("scorer", "aime2024=nope", True), ("scorer", "strict", False),
    ("seed", -1, True), ("seed", 2**32, True), ("seed", 2**32 - 1, False),
    ("batch_size", 0, True), ("batch_size", 1, False),
    ("max_problems", 0, True), ("max_problems", 1, False),
    ("timeout_s", 0.0, True), ("timeout_s", math.inf, True), ("timeout_s", 0.5, False),
    ("backend", "sglang", True), ("backend", "transformers", False),
    ("preset", "verl", True), ("preset", "dgpo", False),
    ("benchmarks", 123, True),
]  # fmt: skip


@pytest.mark.parametrize("setting, value, refused", EVAL_VALUES, ids=[f"{s}={v!r}" for s, v, _ in EVAL_VALUES])
def test_a_recipe_refuses_exactly_what_evaluate_refuses(setting, value, refused, tmp_path, monkeypatch):
    """The recipe's `val_<setting>` and `evaluate(<setting>=...)` take and refuse the same values, both before any
    model or benchmark loads, each message naming the setting as its caller spells it."""
    from trl_bandpo import evaluation
    from trl_bandpo.cli.recipe import parse_args

    def no_model(*args, **kwargs):
        raise RuntimeError("past the checks: the model would load now")

    monkeypatch.setattr(evaluation.generation, "load_generator", no_model)
    monkeypatch.setattr(evaluation, "load_benchmarks", no_model)
    with pytest.raises(
        ValueError if refused else RuntimeError, match=rf"^{setting}\b.* must be" if refused else "past"
    ):
        evaluation.evaluate("no-such-model", **{"benchmarks": ["aime2024"], setting: value})

    recipe = {"model_name_or_path": "no-such-model", "dataset_name": ["train.jsonl"], "use_cpu": True, "bf16": False}
    recipe["val_benchmarks"] = ["aime2024"]
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({**recipe, f"val_{setting}": value}))
    if refused:
        with pytest.raises(train.ConfigError, match=rf"\bval_{setting}\b[^\n]* must be"):
            parse_args(["--config", str(path)])
    else:
        script_args, _, _ = parse_args(["--config", str(path)])
        assert getattr(script_args.validation, setting) is not None


def test_val_scorer_entries_update_the_presets_scorers():
    """`val_scorer: amc2023=dapo` with `val_preset: bandpo` switches AMC to the "dapo" rule and keeps AIME's."""
    from trl_bandpo.cli.script_arguments import ScriptArguments

    args = ScriptArguments(dataset_name=["d"], val_preset="bandpo", val_scorer="amc2023=dapo")
    assert args.validation.scorer == {"aime2024": "dapo", "aime2025": "dapo", "amc2023": "dapo"}
    args = ScriptArguments(dataset_name=["d"], val_preset="bandpo", val_scorer="strict")  # a name replaces them
    assert args.validation.scorer == "strict"


def test_val_fields_without_benchmarks_warn_naming_them(recwarn):
    from trl_bandpo.cli.script_arguments import ScriptArguments

    with pytest.warns(UserWarning, match=r"^val_num_samples, val_before_train set, but no benchmark .*ignored"):
        args = ScriptArguments(dataset_name=["d"], val_num_samples=8, val_before_train=True)
    assert train.validation_settings(args) is None
    recwarn.clear()
    ScriptArguments(dataset_name=["d"], val_preset="none", val_every_steps=20)  # validation turned off: no warning
    ScriptArguments(dataset_name=["d"], val_preset="bandpo", val_every_steps=20)
    assert not [w for w in recwarn if "no benchmark" in str(w.message)]


def test_val_scorer_dapo_with_the_boxed_prompt_warns_as_training_does(recwarn):
    """The "dapo" scorer reads the "Answer:" line: under the boxed prompt every answer scores wrong."""
    from trl_bandpo.cli.script_arguments import ScriptArguments

    with pytest.warns(UserWarning, match=r"^val_scorer 'dapo' \(for aime2024\) with val_prompt_template='boxed'"):
        ScriptArguments(dataset_name=["d"], val_benchmarks=["aime2024"], val_scorer="aime2024=dapo,*=strict")
    recwarn.clear()
    ScriptArguments(dataset_name=["d"], val_preset="bandpo", prompt_template="dapo")  # DAPO's prompt, AIME by "dapo"
    ScriptArguments(
        dataset_name=["d"], val_benchmarks=["aime2024"], val_scorer="dapo", prompt_template="dapo", reward="dapo"
    )  # the training prompt, DAPO's, is validation's too
    assert not [w for w in recwarn if "scorer" in str(w.message)]


def test_a_missing_validation_benchmark_fails_before_the_model_loads(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """The benchmarks are loaded before the trainer: a missing file is named (one line, status 2) and no trainer (or
    model) is built."""
    recipe = tmp_path / "recipe.yaml"
    bench = tmp_path / "train.jsonl"
    bench.write_text(json.dumps({"problem": "1+1=?", "answer": "2"}) + "\n")
    recipe.write_text(
        f"model_name_or_path: {tiny_model_dir}\ndataset_name: [{bench}]\nuse_cpu: true\nbf16: false\n"
        f"output_dir: {tmp_path / 'out'}\nreport_to: none\nval_benchmarks: [{tmp_path / 'missing.jsonl'}]\n"
    )

    def never(*args, **kwargs):
        raise AssertionError("the trainer was built before the missing benchmark was named")

    monkeypatch.setattr(train, "trainer_class_for", never)
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--config", str(recipe)])
    assert exit_info.value.code == 2
    assert re.search(r"error: val_benchmarks: .*missing\.jsonl", capsys.readouterr().err)


def test_main_validates_during_training_from_recipe_fields(tmp_path, tiny_model_dir, captured_trainer):
    """`val_*` recipe fields attach the validation callback: val/<benchmark>/mean@n lands in the log history."""
    bench = tmp_path / "bench.jsonl"
    bench.write_text("".join(json.dumps({"problem": f"{a}+1=?", "answer": str(a + 1)}) + "\n" for a in range(3)))
    recipe = _write_recipe(
        tmp_path, tiny_model_dir, processes=1, val_benchmarks=[f"tiny={bench}"], val_every_steps=1,
        val_num_samples=2, val_max_new_tokens=4, val_scorer="math_verify",
    )  # fmt: skip
    assert train.main(["--config", str(recipe)]) == 0
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    validated = [entry for entry in state["log_history"] if "val/tiny/mean@2" in entry]
    assert [entry["step"] for entry in validated] == [1, 2]
    assert all(0.0 <= entry["val/tiny/mean@2"] <= 1.0 for entry in validated)
    assert len([entry for entry in state["log_history"] if "loss" in entry]) == 2  # training logs intact


# ------------------------------------------------------------------------------------------------------------------
# Before the model loads: a training set too small for one generation batch; completions beyond the model
# ------------------------------------------------------------------------------------------------------------------


def test_a_training_set_smaller_than_one_generation_batch_fails_before_the_model_loads(
    tmp_path, tiny_model_dir, capsys, monkeypatch
):
    """16 rows, generation_batch_size 64 / num_generations 4 = 16 prompts per generation batch would fit; 8 rows do
    not: TRL's sampler would draw no batch, stop at step 0 and save. Refused with status 2, before the model loads."""
    recipe = _write_recipe(
        tmp_path, tiny_model_dir, processes=1, max_train_samples=8, generation_batch_size=64,
        per_device_train_batch_size=8,
    )  # fmt: skip

    def never(*args, **kwargs):
        raise AssertionError("the trainer was built before the data was refused")

    monkeypatch.setattr(train, "trainer_class_for", never)
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--config", str(recipe)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert (
        "the training set has 8 prompts, but one generation batch needs 16 (generation_batch_size 64 / "
        "num_generations 4, where generation_batch_size = per_device_train_batch_size 8 x steps_per_generation 8 x "
        "1 process(es))"
    ) in err
    assert "Lower generation_batch_size" in err and "add data" in err


def test_check_dataset_size_at_the_boundary():
    from trl_bandpo import PolicyLossConfig

    args = PolicyLossConfig(
        output_dir="unused", use_cpu=True, report_to="none", num_generations=4, per_device_train_batch_size=4,
        gradient_accumulation_steps=2, generation_batch_size=24,
    )  # fmt: skip
    train.check_dataset_size(6, args)  # 24 / 4 = 6 prompts: exactly one generation batch
    with pytest.raises(train.ConfigError, match="has 5 prompts, but one generation batch needs 6"):
        train.check_dataset_size(5, args)


class _Stop(Exception):
    pass


def _stop_before_the_trainer(monkeypatch):
    def stop(policy_loss, asynchronous=False):
        raise _Stop

    monkeypatch.setattr(train, "trainer_class_for", stop)


def test_completions_beyond_the_models_positions_warn(tmp_path, tiny_model_dir, monkeypatch):
    """The tiny model has 512 positions: 600 completion tokens alone exceed them."""
    _stop_before_the_trainer(monkeypatch)
    recipe = _write_recipe(tmp_path, tiny_model_dir, processes=1, max_completion_length=600)
    with pytest.warns(UserWarning, match=r"max_completion_length 600 = 600 tokens exceed the 512 positions"):
        with pytest.raises(_Stop):
            train.main(["--config", str(recipe)])


@pytest.mark.parametrize("completion, warns", [(480, True), (479, False)])
def test_the_longest_prompt_counts_when_it_is_measured(tmp_path, tiny_model_dir, monkeypatch, completion, warns):
    """With max_prompt_tokens the prompts are measured: "What is 8 + 2?" (14 bytes, no instruction) in the ChatML
    template is <|im_start|> + "user\\n" (5) + 14 + <|im_end|> + "\\n" + <|im_start|> + "assistant\\n" (10) = 33
    tokens of the byte-level tokenizer, so 33 + 480 = 513 > 512 warns and 33 + 479 = 512 does not."""
    import warnings

    _stop_before_the_trainer(monkeypatch)
    recipe = _write_recipe(
        tmp_path, tiny_model_dir, processes=1, max_completion_length=completion, max_prompt_tokens=64,
        instruction=None,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(_Stop):
            train.main(["--config", str(recipe)])
    messages = [str(w.message) for w in caught if "positions" in str(w.message)]
    if warns:
        assert messages and messages[0].startswith(
            "the longest prompt (33 tokens) + max_completion_length 480 = 513 tokens exceed the 512 positions"
        )
    else:
        assert not messages


# ------------------------------------------------------------------------------------------------------------------
# Library messages that are not the user's to act on
# ------------------------------------------------------------------------------------------------------------------


def test_library_noise_is_filtered_narrowly():
    """The four transformers FutureWarnings about TRL's gradient_checkpointing use and DeepSpeed's CPU line are
    dropped inside the block, from their own module or re-attributed to a caller; other warnings, other DeepSpeed
    lines, and everything after the block pass."""
    import logging
    import warnings

    from trl_bandpo.training.library_noise import LIBRARY_FUTURE_WARNINGS, library_noise_filtered

    noise = (
        "`is_gradient_checkpointing` is deprecated and will be removed in v6. Use `is_activation_checkpointing` "
        "instead."
    )
    assert noise in LIBRARY_FUTURE_WARNINGS and len(LIBRARY_FUTURE_WARNINGS) == 4
    deepspeed = logging.getLogger("DeepSpeed")
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Keep()
    deepspeed.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with library_noise_filtered():
                for module in ("transformers.modeling_utils", "__main__"):
                    warnings.warn_explicit(noise, FutureWarning, "modeling_utils.py", 3312, module=module)
                warnings.warn_explicit(noise + " Extra.", FutureWarning, "x.py", 1, module="transformers.x")
                warnings.warn_explicit(noise, DeprecationWarning, "x.py", 1, module="transformers.x")
                with library_noise_filtered():  # a nested block (the CLI's around a config's) ...
                    pass
                deepspeed.warning(  # ... leaves the outer block's filter in place
                    "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
                )
                deepspeed.warning("another DeepSpeed line")
            warnings.warn_explicit(
                noise, FutureWarning, "modeling_utils.py", 3312, module="transformers.modeling_utils"
            )
            deepspeed.warning(
                "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
            )
    finally:
        deepspeed.removeHandler(handler)
    kept = [(str(w.message), w.category) for w in caught]
    assert kept == [(noise + " Extra.", FutureWarning), (noise, DeprecationWarning), (noise, FutureWarning)]
    assert records == [
        "another DeepSpeed line",
        "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.",
    ]


# ---------------------------------------------------------------------------------------------------------------------
# What would fail after the model loads is refused before anything loads (exit 2, one line)
# ---------------------------------------------------------------------------------------------------------------------


def _refused_before_loading(recipe, *flags, capsys, monkeypatch) -> str:
    """Runs `trl-bandpo train`; nothing may load: the data loader and the trainer raise if reached."""

    def never(*args, **kwargs):
        raise AssertionError("the data or the model loaded before the setting was refused")

    monkeypatch.setattr(train, "load_train_data", never)
    monkeypatch.setattr(train, "trainer_class_for", never)
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--config", str(recipe), *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("trl-bandpo train: error: ") and len(err.splitlines()) == 1, err
    return err


def test_output_dir_that_is_a_file_or_unwritable_is_refused_first(tmp_path, tiny_model_dir, capsys, monkeypatch):
    recipe = _write_recipe(tmp_path, tiny_model_dir, processes=1)
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    err = _refused_before_loading(recipe, "--output_dir", str(a_file), capsys=capsys, monkeypatch=monkeypatch)
    assert "output_dir" in err and "existing file" in err
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.access(locked, os.W_OK):  # root ignores the mode
        pytest.skip("this user can write anywhere")
    err = _refused_before_loading(recipe, "--output_dir", str(locked / "run"), capsys=capsys, monkeypatch=monkeypatch)
    assert "not a writable folder" in err


def test_resume_true_without_a_checkpoint_is_refused_first(tmp_path, tiny_model_dir, capsys, monkeypatch):
    recipe = _write_recipe(tmp_path, tiny_model_dir, processes=1)
    out = tmp_path / "fresh"
    err = _refused_before_loading(
        recipe, "--output_dir", str(out), "--resume_from_checkpoint", "true", capsys=capsys, monkeypatch=monkeypatch
    )
    assert "holds no complete checkpoint" in err
    err = _refused_before_loading(
        recipe, "--resume_from_checkpoint", str(out / "checkpoint-9"), capsys=capsys, monkeypatch=monkeypatch
    )
    assert "is no checkpoint folder" in err


def test_async_rollouts_without_cuda_is_refused_first(tmp_path, tiny_model_dir, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    recipe = ROOT / "recipes" / "async" / "qwen2.5-3b-instruct_band-kl-0.05_async.yaml"
    err = _refused_before_loading(
        recipe, "--model_name_or_path", tiny_model_dir, "--dataset_name", "d.jsonl", "--use_cpu", "true",
        "--bf16", "false", "--dtype", "float32", "--output_dir", str(tmp_path / "out"), capsys=capsys,
        monkeypatch=monkeypatch,
    )  # fmt: skip
    assert "async_rollouts: true needs CUDA GPUs" in err and "async_rollouts: false" in err


@pytest.mark.parametrize(
    "model, needle",
    [
        ("/no/such/folder", "is no folder here"),
        ("./relative/missing", "is no folder here"),
        ("no-such-org/no-such-model", "no local folder, nor found on the Hub"),
    ],
)
def test_a_model_that_is_neither_local_nor_reachable_is_one_line(tmp_path, tiny_model_dir, capsys, monkeypatch,
                                                                 model, needle):  # fmt: skip
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    recipe = _write_recipe(tmp_path, tiny_model_dir, processes=1)
    err = _refused_before_loading(recipe, "--model_name_or_path", model, capsys=capsys, monkeypatch=monkeypatch)
    assert needle in err and "tiny-model" in err


def test_an_output_dir_with_another_runs_checkpoints_warns(tmp_path, tiny_model_dir, monkeypatch):
    _stop_before_the_trainer(monkeypatch)
    recipe = _write_recipe(tmp_path, tiny_model_dir, processes=1)
    out = tmp_path / "reused"
    (out / "checkpoint-40").mkdir(parents=True)
    with pytest.warns(UserWarning, match=r"holds checkpoints of an earlier run \(checkpoint-40\)"):
        with pytest.raises(_Stop):
            train.main(["--config", str(recipe), "--output_dir", str(out)])

"""The SmolLM2 recipes (recipes/smollm2/, docs/real-model.md) without the real model: their data is the real-model
demo's split, the recipes of a kind differ only where their names say, the `last_number` reward scores as it is
written, and a recipe trains as written for one step with the tiny model standing in for SmolLM2 (the real model
runs them in tests/real_model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from trl_bandpo.cli import train
from trl_bandpo.cli.recipe import parse_args
from trl_bandpo.demo.task import make_problems
from trl_bandpo.scoring.rewards import LastNumberReward

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "recipes" / "smollm2"
RECIPES = sorted(FOLDER.glob("*.yaml"))
#: What a recipe's name says, and the keys that may differ for it from the LoRA BandPO recipe.
LOSS_KEYS = {"policy_loss", "epsilon", "epsilon_high", "band_divergence", "band_radius", "band_upper_max", "dgpo_n",
             "dgpo_m"}  # fmt: skip
LORA_KEYS = {"use_peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "learning_rate"}
SERVER_KEYS = {"use_vllm", "vllm_mode", "vllm_server_base_url"}
BASE = FOLDER / "smollm2-135m-instruct-lora_band-kl-0.02.yaml"


def _rows(name):
    return [json.loads(line) for line in (FOLDER / name).read_text().splitlines()]


def test_the_data_is_the_demos_split_of_the_chat_task():
    train_rows, held_out = make_problems(10, 0, 20, seed=0, chat=True)
    recipe = yaml.safe_load(BASE.read_text())
    for name, rows in (("addition_train.jsonl", train_rows), ("addition_heldout.jsonl", held_out)):
        written = _rows(name)
        asked = [f"{row['problem']} {recipe['instruction']}" for row in written]  # the "boxed" template's prompt
        assert asked == [row["prompt"][0]["content"] for row in rows]
        assert [row["answer"] for row in written] == [row["answer"] for row in rows]
    assert not {row["problem"] for row in _rows("addition_train.jsonl")} & {
        row["problem"] for row in _rows("addition_heldout.jsonl")
    }


@pytest.mark.parametrize("path", RECIPES, ids=[path.name for path in RECIPES])
def test_each_recipe_parses_and_differs_from_the_lora_bandpo_one_only_where_its_name_says(path):
    script_args, training_args, model_args = parse_args(["--config", str(path)])
    assert model_args.model_name_or_path == "smollm2-135m-instruct" and script_args.reward == "last_number"
    assert training_args.use_cpu and not training_args.bf16 and training_args.max_steps == 16
    base, recipe = yaml.safe_load(BASE.read_text()), yaml.safe_load(path.read_text())
    method, kind = path.stem.split("_")[1], path.stem.split("_")[0].rsplit("-", 1)[1]
    allowed = {"output_dir", "run_name"} | (LOSS_KEYS if method != "band-kl-0.02" else set())
    allowed |= LORA_KEYS if kind == "full" else set()
    allowed |= SERVER_KEYS if path.stem.endswith("_vllm-server") else set()
    differ = {key for key in base.keys() | recipe.keys() if base.get(key) != recipe.get(key)}
    assert differ <= allowed, differ - allowed
    assert recipe["output_dir"] == f"runs/smollm2/{path.stem}" and f"--config recipes/smollm2/{path.name}" in (
        path.read_text()
    )
    expected = {"grpo": "clip", "band-kl-0.02": "band", "dgpo": "dgpo"}[method]
    assert training_args.policy_loss == expected and model_args.use_peft == (kind == "lora")


def test_the_last_number_reward_reads_the_replys_last_number():
    reward = LastNumberReward()
    replies = ["The answer is 12.", "12", "3 + 9 = 12", "12, or maybe 13", "-12", "twelve", "", "121", "12.5",
               "1,012", "12.0"]  # fmt: skip
    assert reward(replies, solution=["12"] * len(replies)) == [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0]
    assert reward(["It is 5", "12.5"], answer=["5", "12.5"]) == [1.0, 1.0]  # an `answer` column works too
    assert reward([[{"role": "assistant", "content": "7"}]], solution=[" 7 "]) == [1.0]
    with pytest.raises(ValueError, match="needs one gold answer per completion"):
        reward(["7"])
    with pytest.raises(ValueError, match="same length, got 3 and 2"):  # not a silently scored prefix
        reward(["1", "2", "3"], solution=["1", "2"])
    assert LastNumberReward(correct=2.0, wrong=-1.0, name="n")(["1", "2"], solution=["1", "1"]) == [2.0, -1.0]


def test_a_recipe_trains_as_written_with_a_stand_in_model(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the data paths are relative to the repository root, as documented
    argv = ["--config", str(BASE.relative_to(ROOT)), "--model_name_or_path", tiny_model_dir, "--max_steps", "2",
            "--max_completion_length", "4", "--output_dir", str(tmp_path / "run")]  # fmt: skip
    assert train.main(argv) == 0
    (state,) = (tmp_path / "run").glob("**/trainer_state.json") or [None]
    logs = json.loads(state.read_text())["log_history"] if state else []
    steps = [entry for entry in logs if "loss" in entry]
    # one generation of 16 completions rewarded by the recipe's reward, then two optimizer steps with Band bounds
    assert len(steps) == 2 and "rewards/last_number_reward/mean" in steps[0]
    assert all(entry["bounds/lower_mean"] < 1 < entry["bounds/upper_mean"] for entry in steps)

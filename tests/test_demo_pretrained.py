"""`trl-bandpo demo --model`: a pretrained chat model (here a tiny local one with a ChatML template), trained with LoRA
on the chat task; the real SmolLM2 run is the real-model tier's (tests/real_model) and the README's."""

from __future__ import annotations

import json

import pytest

from trl_bandpo import demo
from trl_bandpo.demo import cli
from trl_bandpo.demo.task import CHAT_QUESTION, last_number_reward, make_problems


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from trl_bandpo.demo.tiny_model import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("chat_model"), hidden_size=32)


def test_last_number_reward_scores_the_replys_last_integer():
    replies = ["The answer is 12.", "12", "3 + 9 = 12", "12, or maybe 13", "-12", "twelve", "", "The answer is 121"]
    assert last_number_reward(replies, ["12"] * len(replies)) == [1, 1, 1, 0, 0, 0, 0, 0]
    conversational = [[{"role": "assistant", "content": "It is 7"}], [{"role": "assistant", "content": "7 is 8"}]]
    assert last_number_reward(conversational, ["7", "7"]) == [1.0, 0.0]


def test_chat_problems_are_the_same_split_as_a_user_message():
    plain_train, plain_held_out = make_problems(10, 0, 20, seed=4)
    train, held_out = make_problems(10, 0, 20, seed=4, chat=True)
    assert [row["answer"] for row in train] == [row["answer"] for row in plain_train]
    for chat_row, plain_row in zip(train + held_out, plain_train + plain_held_out):
        a, b = plain_row["prompt"].rstrip("=").split("+")
        assert chat_row["prompt"] == [{"role": "user", "content": CHAT_QUESTION.format(a=a, b=b)}]


def test_demo_trains_a_pretrained_model_with_lora_and_its_defaults(chat_model, tmp_path, monkeypatch):
    trained = []
    train_method = cli.train_method

    def spy(*args, **kwargs):
        trainer, history, seconds = train_method(*args, **kwargs)
        trained.append((kwargs.get("peft_config"), type(trainer.model).__name__, trainer.args))
        return trainer, history, seconds

    monkeypatch.setattr(cli, "train_method", spy)
    out = tmp_path / "out"
    argv = ["--model", str(chat_model), "--methods", "grpo", "bandpo", "--steps", "2", "--num-eval", "4",
            "--eval-samples", "1", "--output-dir", str(out), "--quiet"]  # fmt: skip
    assert demo.main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    settings = results["settings"]
    for key, value in cli.PRETRAINED_DEFAULTS.items():  # every pretrained default not given on the command line
        if key not in ("methods", "steps", "num_eval", "eval_samples"):
            assert settings[key] == value, key
    assert settings["steps"] == 2 and list(results["methods"]) == ["grpo", "bandpo"]
    assert [peft.r for peft, _, _ in trained] == [16, 16] and {name for _, name, _ in trained} == {
        "PeftModelForCausalLM"
    }
    assert all(not args.bf16 and not args.gradient_checkpointing and args.temperature == 0.7 for *_, args in trained)
    assert all(args.max_completion_length == cli.CHAT_COMPLETION_TOKENS for *_, args in trained)
    summary = (out / "summary.md").read_text()
    assert "| pretrained model (no RL) |" in summary and "LoRA rank 16" in summary and "temperature 0.7" in summary
    assert results["warm_start"]["label"] == "pretrained model" and not (out / "warmstart").exists()
    # full fine-tuning with --lora-rank 0
    trained.clear()
    assert demo.main([*argv[:-3], "--lora-rank", "0", "--methods", "grpo", "--output-dir", str(tmp_path / "full"),
                      "--quiet"]) == 0  # fmt: skip
    assert trained[0][0] is None and trained[0][1] == "Qwen2ForCausalLM"


@pytest.mark.parametrize("flag", ["--hidden-size", "--num-layers", "--warmup-steps", "--warmup-target"])
def test_tiny_model_flags_are_refused_with_a_model(flag, chat_model, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        demo.main(["--model", str(chat_model), flag, "2", "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exc.value.code == 2 and flag in err and "tiny model only" in err and not (tmp_path / "out").exists()


def test_bad_lora_rank_and_temperature_are_refused(chat_model, tmp_path, capsys):
    for flag, value, allowed in (("--lora-rank", "-1", "an integer >= 0"), ("--temperature", "0", "> 0")):
        with pytest.raises(SystemExit) as exc:
            demo.main(["--model", str(chat_model), flag, value, "--output-dir", str(tmp_path / "out")])
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert exc.value.code == 2 and f"{flag} must be" in err and allowed in err

"""The tiny local model and tokenizer used by the tests, the demo and the notebooks, and `trl-bandpo tiny-model`."""

import io
import json
from contextlib import redirect_stdout

import pytest

from trl_bandpo.cli import main


def test_tiny_model_tokenizer_survives_reloading_as_trl_does(tmp_path):
    """TRL reloads the model folder with AutoProcessor/AutoTokenizer (a Qwen2Tokenizer for a Qwen2 model): the text
    and the token ids must come back unchanged, spaces and newlines included."""
    from transformers import AutoProcessor, AutoTokenizer

    from trl_bandpo.demo.tiny_model import build_tiny_tokenizer, save_tiny_model

    path = save_tiny_model(tmp_path / "tiny")
    text = "What is 12 + 7?\nAnswer: 19 = \\boxed{19}"
    built = build_tiny_tokenizer()
    for reloaded in (AutoTokenizer.from_pretrained(path), AutoProcessor.from_pretrained(path)):
        ids = reloaded(text)["input_ids"]
        assert ids == built(text)["input_ids"] and len(ids) == len(text.encode())
        assert reloaded.decode(ids) == text
        chat = reloaded.apply_chat_template([{"role": "user", "content": "1 + 1"}], tokenize=False,
                                            add_generation_prompt=True)  # fmt: skip
        assert chat == "<|im_start|>user\n1 + 1<|im_end|>\n<|im_start|>assistant\n"


# ---------------------------------------------------------------------------------------------------------------------
# trl-bandpo tiny-model PATH
# ---------------------------------------------------------------------------------------------------------------------

OLD_FILES = {"config.json": '{"model_type": "llama"}', "problems.jsonl": '{"problem": "mine", "answer": 1}\n'}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """`trl-bandpo tiny-model PATH --overwrite` on a folder that holds another model's config and problems."""
    folder = tmp_path_factory.mktemp("tiny") / "model"
    folder.mkdir()
    for name, text in OLD_FILES.items():
        (folder / name).write_text(text)
    printed = io.StringIO()
    with redirect_stdout(printed):
        main(["tiny-model", str(folder), "--overwrite"])
    return folder, printed.getvalue()


@pytest.mark.parametrize("held", [OLD_FILES, {"notes.txt": "my notes"}], ids=["a model", "anything"])
def test_a_folder_that_is_not_empty_is_refused_without_overwrite(held, tmp_path, capsys):
    folder = tmp_path / "model"
    folder.mkdir()
    for name, text in held.items():
        (folder / name).write_text(text)
    with pytest.raises(SystemExit) as exc:
        main(["tiny-model", str(folder)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "not empty" in err and "--overwrite" in err and str(folder) in err
    assert {p.name: p.read_text() for p in folder.iterdir()} == held  # nothing written


def test_overwrite_replaces_the_model_and_the_problems(made):
    folder, printed = made
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["max_position_embeddings"] == 512
    rows = [json.loads(line) for line in (folder / "problems.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and rows[3] == {"problem": "What is 3 + 4?", "answer": 7}
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (folder / name).is_file(), name


@pytest.mark.parametrize("where", ["under a file", "a file"])
def test_an_unwritable_path_is_one_line_and_exit_2(where, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    path = blocker / "tiny" if where == "under a file" else blocker
    with pytest.raises(SystemExit) as exc:
        main(["tiny-model", str(path)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert str(path) in err and "Traceback" not in err
    assert blocker.read_text() == "x"


@pytest.mark.parametrize("template,reward", [("boxed", "boxed_signed_reward"), ("dapo", "dapo_reward")])
def test_the_model_answers_its_problems_right_part_of_the_time_for_both_rewards(made, template, reward):
    """Sampled at temperature 1 from the prompts a recipe builds (the problems file, the prompt template, the chat
    template), the model's answers are scored by the recipes' own rewards: the boxed math-verify reward for the
    boxed template, the DAPO "Answer:" reward for DAPO's template. Some are right and some wrong, within the
    completions of one prompt too, so group-relative advantages are not all zero."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_bandpo.data import load_math_dataset
    from trl_bandpo.scoring import rewards

    folder, _ = made
    data = load_math_dataset(str(folder / "problems.jsonl"), prompt_template=template)
    tokenizer, model = AutoTokenizer.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder)
    prompts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in data["prompt"]]
    samples = 4
    batch = tokenizer(prompts * samples, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(**batch, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=32)
    completions = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    scores = getattr(rewards, reward)(completions, solution=list(data["solution"]) * samples)
    assert set(scores) <= {1.0, -1.0}
    right = scores.count(1.0) / len(scores)
    assert 0.1 <= right <= 0.9, (right, completions[:4])
    groups = [scores[i :: len(prompts)] for i in range(len(prompts))]  # the samples of each prompt
    assert sum(len(set(group)) > 1 for group in groups) >= 2, groups


def test_the_printed_command_names_only_the_recipes_it_runs(made):
    """The printed overrides run the synchronous recipes; the asynchronous trainer's recipe refuses them (and needs a
    GPU), so the message says "synchronous" and excludes the asynchronous recipes instead of claiming any recipe."""
    from pathlib import Path

    from trl_bandpo.cli.recipe import parse_args
    from trl_bandpo.cli.tiny_model import cpu_train_command

    _, printed = made
    text = " ".join(printed.split())
    assert "any synchronous recipe" in text and "asynchronous recipes need a GPU" in text
    assert "any recipe" not in text
    recipes = Path(__file__).resolve().parents[1] / "recipes"
    for path in (recipes / "lora" / "qwen2.5-0.5b-instruct_band-kl-0.05.yaml", *sorted(recipes.glob("async/*.yaml"))):
        argv = cpu_train_command("/tmp/tiny", str(path)).split()[3:]
        if path.parent.name == "async":
            with pytest.raises((SystemExit, ValueError)):
                parse_args(argv)
        else:
            parse_args(argv)

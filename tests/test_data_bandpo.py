r"""The BandPO authors' data and prompt: DAPO's prompt template, the registry entries of their training sources (and of
the DGPO paper's AIME copies), the 1,024-token prompt filter, and the recipe fields that switch them on.

Offline and fast: local files, `datasets.load_dataset` stubbed with in-memory rows laid out like the Hub datasets,
and the tiny local model, whose tokenizer makes one token of each character (a run of newlines is one token) and
wraps a user message in ChatML: ``<|im_start|>user\n`` + content + ``<|im_end|>\n<|im_start|>assistant\n``, i.e.
3 special tokens + "user\n" (5) + "\n" (1) + "assistant\n" (10) = 19 tokens around the content.
"""

from __future__ import annotations

import json
import logging
import warnings

import datasets
import pytest

from trl_bandpo.cli import train
from trl_bandpo.cli.recipe import ConfigError, parse_args
from trl_bandpo.cli.script_arguments import ScriptArguments
from trl_bandpo.data import (
    BOXED_INSTRUCTION,
    DATASETS,
    PROMPT_TEMPLATES,
    TRAINING_MIXES,
    DatasetSpec,
    drop_long_prompts,
    format_prompt,
    load_eval_benchmarks,
    load_math_dataset,
    load_training_mix,
    prompt_lengths,
    resolve_dataset_name,
)
from trl_bandpo.demo.tiny_model import CHAT_TEMPLATE, build_tiny_tokenizer

# DAPO's template, written out by hand (DAPO-Math-17k's prompts; the BandPO authors' verl data).
DAPO_EXPECTED = (
    "Solve the following math problem step by step. The last line of your response should be of the form Answer: "
    "$Answer (without quotes) where $Answer is the answer to the problem.\n\nWhat is $\\frac{1}{2} + 1$?\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
CHATML_TOKENS = 19  # tokens the tiny tokenizer's chat template adds around one user message (module docstring)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def chat(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


# ------------------------------------------------------------------------------------------------------------------
# The prompt templates
# ------------------------------------------------------------------------------------------------------------------


def test_dapo_template_text_is_exact():
    assert list(PROMPT_TEMPLATES) == ["boxed", "dapo"]
    assert format_prompt("What is $\\frac{1}{2} + 1$?", "dapo") == DAPO_EXPECTED
    # Today's behaviour is the "boxed" template: problem, a space, the instruction.
    assert format_prompt("What is 2?") == "What is 2? " + BOXED_INSTRUCTION
    assert format_prompt("What is 2?", "boxed", "Box it.") == "What is 2? Box it."
    assert format_prompt("What is 2?", "boxed", None) == "What is 2?"
    assert format_prompt("What is 2?", "dapo", "Box it.") == format_prompt("What is 2?", "dapo")  # ignored
    # Plain substitution: braces and a literal "{problem}" in a problem stay as they are.
    assert "Is {problem} $\\{1,2\\}$?\n\n" in format_prompt("Is {problem} $\\{1,2\\}$?", "dapo")
    with pytest.raises(ValueError, match=r"prompt_template must be one of \['boxed', 'dapo'\], got 'chatml'"):
        format_prompt("x", "chatml")


def test_load_math_dataset_with_the_dapo_template(tmp_path, caplog):
    rows = [
        {"problem": "What is $\\frac{1}{2} + 1$?", "answer": "\\frac{3}{2}"},
        {"problem": format_prompt("Compute $3 \\cdot 7$.", "dapo"), "answer": 21},  # already in DAPO's template
    ]
    path = write_jsonl(tmp_path / "local.jsonl", rows)
    ds = load_math_dataset(path, prompt_template="dapo")
    assert ds[0]["prompt"] == [{"role": "user", "content": DAPO_EXPECTED}]
    assert ds[1]["prompt"][0]["content"] == format_prompt("Compute $3 \\cdot 7$.", "dapo")  # wrapped once
    assert ds["solution"] == ["\\frac{3}{2}", "21"]
    # The default is unchanged; an instruction set with "dapo" is ignored, with a warning.
    assert load_math_dataset(path)[0]["prompt"][0]["content"] == rows[0]["problem"] + " " + BOXED_INSTRUCTION
    with caplog.at_level(logging.WARNING, logger="trl_bandpo.data.loading"):
        ignored = load_math_dataset(path, prompt_template="dapo", instruction="Box it.")
    assert ignored["prompt"] == ds["prompt"]
    assert "prompt_template='dapo' ignores instruction='Box it.'" in caplog.text
    with pytest.raises(ValueError, match=r"prompt_template must be one of \['boxed', 'dapo'\], got 'DAPO'"):
        load_math_dataset(path, prompt_template="DAPO")


def test_training_mix_and_benchmarks_take_the_template(tmp_path):
    path = write_jsonl(tmp_path / "bench.jsonl", [{"question": "What is $\\frac{1}{2} + 1$?", "answer": "1.5"}])
    mixed = load_training_mix([path], prompt_template="dapo")
    assert mixed[0]["prompt"][0]["content"] == DAPO_EXPECTED
    benchmarks = load_eval_benchmarks([f"mine={path}"], prompt_template="dapo", instruction="ignored")
    assert benchmarks["mine"][0]["prompt"][0]["content"] == DAPO_EXPECTED
    with pytest.raises(ValueError, match="prompt_template"):
        load_training_mix([path], prompt_template="x")


# ------------------------------------------------------------------------------------------------------------------
# The registry: the authors' training sources and the DGPO paper's AIME copies
# ------------------------------------------------------------------------------------------------------------------


def test_registry_holds_the_authors_sources():
    # open-r1/DAPO-Math-17k-Processed: configs all / en / cn, split train, columns prompt (text) and solution.
    assert DATASETS["dapo-math-17k"] == DatasetSpec(
        "open-r1/DAPO-Math-17k-Processed",
        "train",
        "prompt",
        "solution",
        configs=("en",),
        deduplicate=True,
        description=DATASETS["dapo-math-17k"].description,
    )
    # nlile/hendrycks-MATH-benchmark: default config, train (12,000) / test (500); problem, solution, answer,
    # subject, level (int64), unique_id. The authors keep levels 3-5 of train and use `answer` as ground truth.
    math = DATASETS["math-level3to5"]
    assert (math.hub_id, math.configs, math.split) == ("nlile/hendrycks-MATH-benchmark", None, "train")
    assert (math.problem_field, math.answer_field, math.level_field, math.levels) == (
        "problem",
        "answer",
        "level",
        (3, 4, 5),
    )
    assert TRAINING_MIXES["bandpo"] == ("dapo-math-17k", "math-level3to5")
    assert {(DATASETS[name].hub_id, DATASETS[name].configs) for name in TRAINING_MIXES["bandpo"]} == {
        ("open-r1/DAPO-Math-17k-Processed", ("en",)),
        ("nlile/hendrycks-MATH-benchmark", None),
    }
    # The previous sources stay available under explicit names; the DGPO mix keeps DAPO-Math-17k as released.
    original, lighteval = DATASETS["dapo-math-17k-original"], DATASETS["math-level3to5-lighteval"]
    assert (original.hub_id, original.problem_field, original.answer_field) == (
        "BytedTsinghua-SIA/DAPO-Math-17k",
        "prompt",
        "reward_model.ground_truth",
    )
    assert (lighteval.hub_id, lighteval.configs, lighteval.answer_field, lighteval.levels) == (
        "DigitalLearningGmbH/MATH-lighteval",
        ("default",),
        "solution",
        (3, 4, 5),
    )
    assert TRAINING_MIXES["dgpo"] == ("dapo-math-17k-original",)
    # The DGPO paper's AIME copies: math-ai/aime24 (id, problem, solution = "\boxed{...}", url), math-ai/aime25
    # (problem, answer, id), both one "test" split.
    aime24, aime25 = DATASETS["aime2024-math-ai"], DATASETS["aime2025-math-ai"]
    assert (aime24.hub_id, aime24.split, aime24.problem_field, aime24.answer_field) == (
        "math-ai/aime24",
        "test",
        "problem",
        "solution",
    )
    assert (aime25.hub_id, aime25.split, aime25.problem_field, aime25.answer_field) == (
        "math-ai/aime25",
        "test",
        "problem",
        "answer",
    )
    assert DATASETS["aime2024"].hub_id == "HuggingFaceH4/aime_2024"  # the existing entries stay
    assert resolve_dataset_name("aime24_math_ai") == "aime2024-math-ai"
    assert resolve_dataset_name("dapo-original") == "dapo-math-17k-original"


def _dapo_processed_row(problem: str, answer: str, index: int) -> dict:
    """A row of open-r1/DAPO-Math-17k-Processed: `prompt` the text of the original conversation, `solution` its
    ground truth, plus the original columns."""
    content = format_prompt(problem, "dapo")
    return {
        "prompt": content,
        "solution": answer,
        "data_source": "math_dapo",
        "source_prompt": [{"content": content, "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": str(index)},
    }


ENGLISH = [("How many primes are below 10?", "4"), ("Compute $3 \\cdot 7$.", "21")]
CHINESE = [("求 $1+2$ 的值。", "3")]
MATH_ROWS = [  # (problem, worked solution, answer, level)
    ("L1 problem", "So $\\boxed{1}$.", "1", 1),
    ("L3 problem", "Thus $\\boxed{\\dfrac12}$.", "\\frac{1}{2}", 3),
    ("L2 problem", "Hence $\\boxed{2}$.", "2", 2),
    ("L5 problem", "We get $\\boxed{\\{1,2\\}}$.", "\\{1,2\\}", 5),
    ("L4 problem", "It is $\\boxed{7}$.", "7", 4),
]


def _fake_hub(calls: list):
    def load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split))
        if path == "open-r1/DAPO-Math-17k-Processed":
            picked = {"en": ENGLISH, "cn": CHINESE}.get(name, ENGLISH + CHINESE)
            rows = [_dapo_processed_row(p, a, i) for i, (p, a) in enumerate(picked)]
            return datasets.Dataset.from_list(rows)
        if path == "nlile/hendrycks-MATH-benchmark":
            keys = ("problem", "solution", "answer", "level")
            rows = [dict(zip(keys, row), subject="Algebra", unique_id=f"{i}.json") for i, row in enumerate(MATH_ROWS)]
            return datasets.Dataset.from_list(rows)
        if path == "math-ai/aime24":
            return datasets.Dataset.from_dict(
                {"id": [60], "problem": ["Find $n$."], "solution": ["\\boxed{204}"], "url": ["https://aops"]}
            )
        if path == "math-ai/aime25":
            return datasets.Dataset.from_dict({"problem": ["Find $m$."], "answer": ["70"], "id": ["0"]})
        raise AssertionError(f"unexpected Hub id {path!r}")

    return load_dataset


def test_hub_loading_keeps_english_dapo_and_math_levels_3_to_5(monkeypatch):
    calls = []
    monkeypatch.setattr(datasets, "load_dataset", _fake_hub(calls))
    dapo = load_math_dataset("dapo-math-17k")
    assert calls == [("open-r1/DAPO-Math-17k-Processed", "en", "train")]
    assert [p[0]["content"] for p in dapo["prompt"]] == [f"{p} {BOXED_INSTRUCTION}" for p, _ in ENGLISH]
    assert dapo["solution"] == ["4", "21"] and dapo["data_source"] == ["dapo-math-17k"] * 2
    assert load_math_dataset("dapo", prompt_template="dapo")["prompt"][1] == chat(format_prompt(ENGLISH[1][0], "dapo"))

    calls.clear()
    math = load_math_dataset("math-level3to5")
    assert calls == [("nlile/hendrycks-MATH-benchmark", None, "train")]
    assert [p[0]["content"].split(" ")[0] for p in math["prompt"]] == ["L3", "L5", "L4"]
    assert math["solution"] == ["\\frac{1}{2}", "\\{1,2\\}", "7"]  # the `answer` column, not the worked solution

    calls.clear()
    mix = load_training_mix("bandpo", prompt_template="dapo")
    assert calls == [
        ("open-r1/DAPO-Math-17k-Processed", "en", "train"),
        ("nlile/hendrycks-MATH-benchmark", None, "train"),
    ]
    assert mix["data_source"] == ["dapo-math-17k"] * 2 + ["math-level3to5"] * 3
    assert all(p[0]["content"].startswith("Solve the following math problem") for p in mix["prompt"])

    benchmarks = load_eval_benchmarks(["aime2024-math-ai", "aime25-math-ai"])
    assert benchmarks["aime2024-math-ai"]["solution"] == ["204"]  # "\boxed{204}" reduced to its argument
    assert benchmarks["aime2025-math-ai"]["solution"] == ["70"]


# ------------------------------------------------------------------------------------------------------------------
# Prompts longer than a number of tokens are dropped
# ------------------------------------------------------------------------------------------------------------------


def test_prompt_lengths_by_hand(tokenizer):
    assert prompt_lengths([chat("abc"), chat(""), chat("1+1=?")], tokenizer) == [22, 19, 24]
    assert prompt_lengths(["abc", "1+1=?"], tokenizer) == [3, 5]  # plain text: no chat template
    # DAPO's template: 178 + 12 + 62 = 252 characters, one token each (byte-level, ASCII), plus 19 for the chat markup.
    dapo = format_prompt("What is 1+1?", "dapo")
    assert len(dapo) == 252 and dapo.count("\n\n") == 2
    assert prompt_lengths([chat(dapo)], tokenizer) == [271]


def test_prompt_lengths_pass_chat_template_kwargs():
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE + "{% if think %}{{ '<think>' }}{% endif %}"
    assert prompt_lengths([chat("abc")], tokenizer) == [22]
    assert prompt_lengths([chat("abc")], tokenizer, {"think": True}) == [22 + len("<think>")]


def test_drop_long_prompts_keeps_prompts_up_to_the_limit(tokenizer, caplog):
    contents = ["a" * 5, "b" * 6, "c" * 4, "d" * 10]  # 24, 25, 23, 29 tokens
    ds = datasets.Dataset.from_dict({"prompt": [chat(c) for c in contents], "solution": ["1", "2", "3", "4"]})
    assert drop_long_prompts(ds, tokenizer, None) is ds
    with caplog.at_level(logging.INFO, logger="trl_bandpo.data.lengths"):
        kept = drop_long_prompts(ds, tokenizer, 24, field="max_prompt_tokens", label="training set")
    assert kept["solution"] == ["1", "3"]  # 24 tokens is kept, 25 is not
    assert "max_prompt_tokens=24: dropped 2 of 4 prompts of the training set longer than 24 tokens" in caplog.text
    assert drop_long_prompts(ds, tokenizer, 29) is ds
    with pytest.raises(ValueError, match=r"max_tokens=22 drops every prompt.*shortest 23 tokens, longest 29"):
        drop_long_prompts(ds, tokenizer, 22)
    for bad in (0, -1, 1.5, True, "24"):
        with pytest.raises(ValueError, match=rf"max_prompt_tokens must be None or an integer >= 1, got {bad!r}"):
            drop_long_prompts(ds, tokenizer, bad, field="max_prompt_tokens")
    with pytest.raises(ValueError, match="no 'messages' column"):
        drop_long_prompts(ds, tokenizer, 24, prompt_column="messages")


def test_drop_long_prompts_loads_the_tokenizer_from_a_model_folder(tiny_model_dir):
    """A model folder or Hub id stands for its tokenizer, loaded with `AutoTokenizer` as the trainer loads it."""
    from transformers import AutoTokenizer

    prompts = [chat("a" * 5), chat("b" * 6)]
    lengths = prompt_lengths(prompts, tiny_model_dir)
    assert lengths == prompt_lengths(prompts, AutoTokenizer.from_pretrained(tiny_model_dir))
    assert lengths[1] == lengths[0] + 1
    ds = datasets.Dataset.from_dict({"prompt": prompts})
    assert len(drop_long_prompts(ds, tiny_model_dir, lengths[0])) == 1


# ------------------------------------------------------------------------------------------------------------------
# Recipe fields and the training entry point
# ------------------------------------------------------------------------------------------------------------------


def test_script_arguments_fields_and_their_checks():
    args = ScriptArguments(dataset_name=["d"])
    assert (args.prompt_template, args.max_prompt_tokens) == ("boxed", None)
    args = ScriptArguments(dataset_name=["d"], prompt_template="dapo", max_prompt_tokens=1024)
    assert (args.prompt_template, args.max_prompt_tokens) == ("dapo", 1024)
    with pytest.raises(ValueError, match=r"prompt_template must be one of \['boxed', 'dapo'\], got 'qwen'"):
        ScriptArguments(dataset_name=["d"], prompt_template="qwen")
    for bad in (0, -3, 1.5, True, "1024"):
        with pytest.raises(ValueError, match=rf"max_prompt_tokens must be None or an integer >= 1, got {bad!r}"):
            ScriptArguments(dataset_name=["d"], max_prompt_tokens=bad)
    with pytest.warns(UserWarning, match=r"prompt_template='dapo' ignores instruction='Box it.'"):
        ScriptArguments(dataset_name=["d"], prompt_template="dapo", instruction="Box it.")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # the default instruction: nothing to say
        ScriptArguments(dataset_name=["d"], prompt_template="dapo", reward="dapo")
        ScriptArguments(dataset_name=["d"], prompt_template="dapo", instruction="none", reward="dapo")
    # the DAPO prompt asks for an "Answer:" line, the boxed rewards read \boxed{}: a mismatch warns
    with pytest.warns(UserWarning, match="reward='signed' with prompt_template='dapo'"):
        ScriptArguments(dataset_name=["d"], prompt_template="dapo")
    with pytest.warns(UserWarning, match="reward='dapo' with prompt_template='boxed'"):
        ScriptArguments(dataset_name=["d"], reward="dapo")


def test_recipe_and_command_line_set_the_fields(tmp_path):
    base = "model_name_or_path: some/model\ndataset_name: some.jsonl\nuse_cpu: true\nbf16: false\n"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(base + "prompt_template: dapo\nmax_prompt_tokens: 1024\n")
    script_args, _, _ = parse_args(["--config", str(recipe)])
    assert (script_args.prompt_template, script_args.max_prompt_tokens) == ("dapo", 1024)
    script_args, _, _ = parse_args(["--config", str(recipe), "--max_prompt_tokens", "none"])
    assert script_args.max_prompt_tokens is None
    with pytest.raises(ConfigError, match="--max_prompt_tokens.*invalid int value: 'long'"):
        recipe.write_text(base + "max_prompt_tokens: long\n")
        parse_args(["--config", str(recipe)])
    recipe.write_text(base + "prompt_template: chatml\n")
    with pytest.raises(ConfigError, match=r"prompt_template must be one of \['boxed', 'dapo'\], got 'chatml'"):
        parse_args(["--config", str(recipe)])
    with pytest.raises(ConfigError, match="prompt_template.*invalid choice: 'chatml'"):
        parse_args(["--config", str(recipe), "--prompt_template", "chatml"])


def _train_file(tmp_path):
    """Problems of 5, 6, 4 and 10 letters: one token per letter, so their prompts are that many tokens longer than
    the template around them."""
    rows = [{"problem": "a" * n, "answer": str(n)} for n in (5, 6, 4, 10)]
    return write_jsonl(tmp_path / "train.jsonl", rows)


def test_the_entry_point_drops_long_prompts(tmp_path, tiny_model_dir):
    path = _train_file(tmp_path)
    model_args = parse_args(["--model_name_or_path", tiny_model_dir, "--dataset_name", str(path), "--use_cpu", "true",
                             "--bf16", "false"])[2]  # fmt: skip
    tokenizer = train.load_prompt_tokenizer(model_args)
    # The template around a problem, in tokens of the saved model's tokenizer (as the trainer will load it).
    around = prompt_lengths([chat("a")], tokenizer)[0] - 1
    args = ScriptArguments(dataset_name=[str(path)], instruction=None, max_prompt_tokens=around + 5)
    assert train.load_train_data(args, tokenizer)["solution"] == ["5", "4"]
    assert train.load_train_data(args, tiny_model_dir)["solution"] == ["5", "4"]  # the folder names the tokenizer
    around_dapo = prompt_lengths([chat(format_prompt("a", "dapo"))], tokenizer)[0] - 1
    dapo = ScriptArguments(dataset_name=[str(path)], prompt_template="dapo", max_prompt_tokens=around_dapo + 6)
    kept = train.load_train_data(dapo, tokenizer)
    assert kept["solution"] == ["5", "6", "4"] and kept[0]["prompt"] == chat(format_prompt("aaaaa", "dapo"))
    evaluated = ScriptArguments(dataset_name=[str(path)], eval_dataset_name=[f"bench={path}"], instruction=None,
                                max_prompt_tokens=around + 6)  # fmt: skip
    assert train.load_eval_data(evaluated, tokenizer)["bench"]["solution"] == ["5", "6", "4"]
    with pytest.raises(ValueError, match=f"max_prompt_tokens={around + 5} needs the model's tokenizer"):
        train.load_train_data(args)
    too_short = ScriptArguments(dataset_name=[str(path)], instruction=None, max_prompt_tokens=around + 3)
    message = rf"max_prompt_tokens={around + 3} drops every prompt of the training set.*shortest {around + 4} tokens, "
    with pytest.raises(ValueError, match=message + rf"longest {around + 10}"):
        train.load_train_data(too_short, tokenizer)
    assert len(train.load_train_data(ScriptArguments(dataset_name=[str(path)]))) == 4  # unset: keep every prompt


def test_run_loads_the_tokenizer_once_and_filters_before_training(tmp_path, tiny_model_dir, monkeypatch):
    """`run` measures prompts with the model's tokenizer, loaded once for the training and evaluation sets, before
    the trainer is built (the trainer is a stand-in here: nothing trains)."""
    path = _train_file(tmp_path)
    around = prompt_lengths([chat("a")], tiny_model_dir)[0] - 1
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"model_name_or_path: {tiny_model_dir}\ndataset_name: [{path}]\ninstruction: null\n"
        f"max_prompt_tokens: {around + 5}\n"
        f"eval_dataset_name: [bench={path}]\neval_strategy: steps\neval_steps: 1\nuse_cpu: true\nbf16: false\n"
        f"report_to: none\nreward_num_workers: 1\noutput_dir: {tmp_path / 'out'}\n"
    )
    loads, built = [], {}
    real_loader = train.load_prompt_tokenizer
    monkeypatch.setattr(train, "load_prompt_tokenizer", lambda *a: loads.append(a) or real_loader(*a))

    class StandIn:
        def __init__(self, **kwargs):
            built.update(kwargs)
            self.accelerator = type("Accelerator", (), {"print": staticmethod(lambda *a: None)})()

        def train(self, **kwargs):
            pass

        def save_model(self, *args):
            pass

        def save_state(self):
            pass

    monkeypatch.setattr(train, "trainer_class_for", lambda policy_loss, asynchronous=False: StandIn)
    monkeypatch.setattr(train, "describe_run", lambda trainer: "")
    train.run(*parse_args(["--config", str(recipe)]))
    assert len(loads) == 1
    assert built["train_dataset"]["solution"] == ["5", "4"]
    assert built["eval_dataset"]["bench"]["solution"] == ["5", "4"]

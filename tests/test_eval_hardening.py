"""Regression tests of `trl-bandpo eval`: bad arguments fail before any model is loaded, and samples reach the disk
batch by batch, so that a failure late in a run keeps what was generated (tiny local model, local benchmark)."""

import importlib.util
import json
import math

import pytest
import transformers
from transformers.generation.utils import GenerationMixin

from trl_bandpo import evaluation
from trl_bandpo.cli.eval import eval_main


@pytest.fixture
def tiny_benchmark(tmp_path):
    rows = [{"problem": f"{i}+{i}=?", "answer": str(2 * i)} for i in (1, 2, 3)]
    path = tmp_path / "tiny_bench.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def no_model_loading(monkeypatch):
    """Any attempt to load a model fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(evaluation.generation, "load_generator", refuse, raising=False)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)


def base_arguments(model, benchmark, out):
    return [
        "--model", str(model), "--benchmarks", str(benchmark), "--num-samples", "4", "--max-new-tokens", "4",
        "--backend", "transformers", "--output-dir", str(out),
    ]  # fmt: skip


BAD_ARGUMENTS = [
    (["--num-samples", "0"], ["argument --num-samples", "got 0", "integer >= 1"]),
    (["--ks", "1", "8"], ["argument --ks", "8", "[1, --num-samples=4]"]),
    (["--ks", "0"], ["argument --ks", "got [0]", "integers in [1, --num-samples=4]"]),
    (["--max-new-tokens", "-3"], ["argument --max-new-tokens", "got -3", "integer >= 1"]),
    (["--temperature", "nan"], ["argument --temperature", "got nan", "finite number >= 0"]),
    (["--temperature", "-0.5"], ["argument --temperature", "got -0.5", "finite number >= 0"]),
    (["--top-p", "0"], ["argument --top-p", "got 0.0", "(0, 1]"]),
    (["--top-p", "1.5"], ["argument --top-p", "got 1.5", "(0, 1]"]),
    (["--timeout-s", "0"], ["argument --timeout-s", "got 0.0", "finite number > 0"]),
    (["--timeout-s", "nan"], ["argument --timeout-s", "got nan", "finite number > 0"]),
    (["--seed", "-1"], ["argument --seed", "got -1", "[0, 4294967295]"]),
    (["--batch-size", "0"], ["argument --batch-size", "got 0", "integer >= 1"]),
    (["--max-problems", "0"], ["argument --max-problems", "got 0", "integer >= 1"]),
    (["--tensor-parallel-size", "0"], ["argument --tensor-parallel-size", "got 0"]),
    (["--gpu-memory-utilization", "2"], ["argument --gpu-memory-utilization", "got 2.0", "(0, 1]"]),
    (["--dtype", "fp8"], ["argument --dtype", "'fp8'", "bfloat16"]),
    (["--device", "gpu0"], ["argument --device", "'gpu0'", "'cuda:1'"]),
    (["--device", "cuda:99"], ["argument --device", "'cuda:99'"]),
    (["--top-k", "0"], ["argument --top-k", "got 0", "integer >= 1"]),
    (["--scorer", "prime"], ["argument --scorer", "'prime'", "'math_verify', 'dapo', 'strict'"]),
    (["--scorer", "other=dapo"], ["argument --scorer", "'other' is not a benchmark of this run", "tiny_bench"]),
    (["--preset", "verl"], ["argument --preset", "'verl'", "'bandpo', 'dgpo'"]),
    (["--prompt-template", "chat"], ["argument --prompt-template", "'chat'", "'boxed', 'dapo'"]),
    (["--benchmarks", "no-such-benchmark"], ["argument --benchmarks", "'no-such-benchmark'", "aime2024"]),
    (["--benchmarks", "aime2024"], ["argument --benchmarks", "HuggingFaceH4/aime_2024", "aime2024=path/to/file"]),
]


@pytest.mark.parametrize("extra, expected", BAD_ARGUMENTS, ids=[" ".join(extra) for extra, _ in BAD_ARGUMENTS])
def test_bad_arguments_exit_2_before_the_model_loads(
    extra, expected, tiny_model_dir, tiny_benchmark, tmp_path, no_model_loading, capsys
):
    with pytest.raises(SystemExit) as info:
        eval_main(base_arguments(tiny_model_dir, tiny_benchmark, tmp_path / "out") + extra)
    assert info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("trl-bandpo eval: error: argument --")
    for part in expected:
        assert part in error, (part, error)


def test_unusable_output_dirs_exit_2_before_the_model_loads(
    tiny_model_dir, tiny_benchmark, tmp_path, no_model_loading, capsys
):
    existing_file = tmp_path / "results.txt"
    existing_file.write_text("not a folder")
    for out in (existing_file, existing_file / "below"):
        with pytest.raises(SystemExit) as info:
            eval_main(base_arguments(tiny_model_dir, tiny_benchmark, out))
        assert info.value.code == 2
        error = capsys.readouterr().err
        assert "argument --output-dir" in error and str(existing_file) in error


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
def test_vllm_backend_without_vllm_exits_2(tiny_model_dir, tiny_benchmark, tmp_path, no_model_loading, capsys):
    arguments = base_arguments(tiny_model_dir, tiny_benchmark, tmp_path / "out") + ["--backend", "vllm"]
    with pytest.raises(SystemExit) as info:
        eval_main(arguments)
    error = capsys.readouterr().err
    assert info.value.code == 2 and "argument --backend='vllm' needs vLLM, which is not installed" in error


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": math.nan}, "timeout_s"),
        ({"dtype": "float8"}, "dtype"),
        ({"seed": -1}, "seed"),
        ({"device": "not-a-device"}, "device"),
        ({"max_problems": 0}, "max_problems"),
    ],
)
def test_evaluate_checks_settings_before_the_model_loads(kwargs, match, tiny_benchmark, no_model_loading):
    with pytest.raises(ValueError, match=match):
        evaluate_arguments = {"num_samples": 2, "backend": "transformers"} | kwargs
        evaluation.evaluate("unused", [str(tiny_benchmark)], **evaluate_arguments)


def test_evaluate_rejects_an_output_dir_that_is_a_file(tiny_benchmark, tmp_path, no_model_loading):
    existing_file = tmp_path / "taken"
    existing_file.write_text("")
    with pytest.raises(ValueError, match="output_dir: .*existing file, not a folder"):
        evaluation.evaluate(
            "unused", [str(tiny_benchmark)], num_samples=2, backend="transformers", output_dir=existing_file
        )


@pytest.mark.parametrize("fail_at_call, lines_kept", [(4, 3), (3, 2)])
def test_a_late_failure_keeps_the_samples_generated(
    monkeypatch, tiny_model_dir, tiny_benchmark, tmp_path, fail_at_call, lines_kept
):
    """One problem per generate call (batch 2 = 2 samples): call 4 is the second benchmark's first, call 3 the first
    benchmark's last. What was scored before the failure is on disk."""
    original = GenerationMixin.generate
    calls = []

    def failing_generate(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == fail_at_call:
            raise RuntimeError("injected failure (out of memory)")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", failing_generate)
    out = tmp_path / "out"
    arguments = base_arguments(tiny_model_dir, tiny_benchmark, out)
    arguments += ["--benchmarks", str(tiny_benchmark), f"second={tiny_benchmark}", "--num-samples", "2"]
    arguments += ["--batch-size", "2", "--temperature", "1.0"]
    with pytest.raises(RuntimeError, match="injected failure"):
        eval_main(arguments)
    records = [json.loads(line) for line in (out / "samples_tiny_bench.jsonl").read_text().splitlines()]
    assert len(records) == lines_kept
    assert [r["solution"] for r in records] == ["2", "4", "6"][:lines_kept]
    assert all(len(r["completions"]) == 2 and len(r["correct"]) == 2 for r in records)
    assert not (out / "results.json").exists()
    second = out / "samples_second.jsonl"
    assert not second.exists() or second.read_text() == ""


def test_an_earlier_runs_results_are_kept_unless_overwrite(
    tiny_model_dir, tiny_benchmark, tmp_path, no_model_loading, capsys
):
    """`trl-bandpo eval` into a folder holding results.json stops before the model loads, naming --overwrite; with
    --overwrite it goes on (here to the model loading that the fixture refuses)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text("{}")
    with pytest.raises(SystemExit) as info:
        eval_main(base_arguments(tiny_model_dir, tiny_benchmark, out))
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert info.value.code == 2 and error.startswith("trl-bandpo eval: error: argument --output-dir: ")
    assert "results.json" in error and "pass --overwrite" in error
    assert (out / "results.json").read_text() == "{}"
    with pytest.raises(AssertionError, match="the model was loaded"):
        eval_main(base_arguments(tiny_model_dir, tiny_benchmark, out) + ["--overwrite"])


def test_the_dapo_scorer_under_the_boxed_prompt_warns(tiny_model_dir, tiny_benchmark, tmp_path, no_model_loading):
    """As training warns for reward dapo with a non-dapo prompt: the "dapo" scorer reads an "Answer:" line."""
    arguments = base_arguments(tiny_model_dir, tiny_benchmark, tmp_path / "out") + ["--scorer", "dapo"]
    with pytest.warns(UserWarning, match=r"^--scorer 'dapo' \(for every benchmark\) with --prompt-template='boxed'"):
        with pytest.raises(AssertionError, match="the model was loaded"):
            eval_main(arguments)
    with pytest.warns(UserWarning, match=r"^scorer 'dapo' \(for tiny_bench\) with prompt_template='boxed'"):
        with pytest.raises(AssertionError, match="the model was loaded"):
            evaluation.evaluate("unused", [str(tiny_benchmark)], scorer={"tiny_bench": "dapo"}, backend="transformers")


def test_benchmarks_of_the_wrong_type_are_named(tiny_benchmark, no_model_loading):
    """`evaluate` and `ValidationCallback` with benchmarks=123 say what benchmarks may be, before anything loads."""
    from trl_bandpo.evaluation.validation import ValidationCallback

    allowed = r"benchmarks must be a registry name, a local file or name=path, a list of them, or a mapping"
    for bad in (123, [str(tiny_benchmark), 5], {"a": 5}):
        with pytest.raises(ValueError, match=rf"^{allowed} name -> Dataset or path, got"):
            evaluation.evaluate("unused", bad, backend="transformers")
        with pytest.raises(ValueError, match=rf"^{allowed} name -> Dataset or path, got"):
            ValidationCallback(benchmarks=bad)


def test_prompt_lengths_names_a_malformed_prompt(tiny_model_dir):
    """`trl_bandpo.data.prompt_lengths` on prompts that are neither text nor chat messages: the index, the prompt and
    the fix, not a tokenizer or template error from inside."""
    from trl_bandpo.data import prompt_lengths

    chat = [{"role": "user", "content": "1+1=?"}]
    assert len(prompt_lengths(["1+1=?", chat], tiny_model_dir)) == 2
    malformed = [None, 5, b"1+1", [], [{"content": "1+1=?"}], [{"role": "user"}], [{"role": "user", "content": 5}]]
    for prompt in malformed:
        with pytest.raises(ValueError, match=r"^prompt 1 must be a string or a non-empty list of .*fix the dataset"):
            prompt_lengths(["1+1=?", prompt], tiny_model_dir)
    with pytest.raises(ValueError, match="^prompts must be a list of prompts"):
        prompt_lengths("1+1=?", tiny_model_dir)

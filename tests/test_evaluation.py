"""Tests of pass@k / mean@k and of the evaluation routine (tiny offline model, transformers backend)."""

import json
import math
from itertools import combinations, pairwise

import pytest

from trl_bandpo import evaluation
from trl_bandpo.cli.eval import eval_main
from trl_bandpo.evaluation import (
    default_ks,
    evaluate,
    mean_accuracy,
    pass_at_k,
    summarize_correctness,
    write_markdown,
)


def brute_force_pass_at_k(n, c, k):
    """Fraction of the k-subsets of n samples (c of them correct) that hold at least one correct sample."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(combinations(range(n), k))
    return sum(any(samples[i] for i in subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_matches_enumeration_of_k_subsets(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_closed_forms_and_stability():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the accuracy
    assert pass_at_k(32, 0, 32) == 0.0
    assert pass_at_k(32, 1, 32) == 1.0
    assert pass_at_k(5, 5, 2) == 1.0
    # Large n, where C(n, k) overflows floats: agrees with exact integer binomials.
    n, c, k = 2000, 7, 500
    exact = 1 - math.comb(n - c, k) / math.comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-12)
    # Non-decreasing in k.
    values = [pass_at_k(32, 4, k) for k in range(1, 33)]
    assert all(a <= b + 1e-15 for a, b in pairwise(values))


@pytest.mark.parametrize(
    "n, c, k, match",
    [
        (0, 0, 1, "n must"),
        (4, 5, 1, "c must be <= n"),
        (4, -1, 1, "c must"),
        (4, 2, 0, "k must"),
        (4, 2, 5, "k must be <= n"),
        (4.0, 2, 1, "n must"),
    ],
)
def test_pass_at_k_rejects_bad_arguments(n, c, k, match):
    with pytest.raises(ValueError, match=match):
        pass_at_k(n, c, k)


def test_mean_accuracy_and_default_ks():
    assert mean_accuracy(32, 8) == 0.25
    assert default_ks(32) == (1, 2, 4, 8, 16, 32)
    assert default_ks(12) == (1, 2, 4, 8, 12)
    assert default_ks(1) == (1,)
    with pytest.raises(ValueError, match="num_samples"):
        default_ks(0)


def test_summarize_correctness():
    correct = [[True, False, False, False], [False] * 4, [True, True, True, True]]
    summary = summarize_correctness(correct, ks=(1, 2, 4))
    assert summary["problems"] == 3 and summary["samples_per_problem"] == 4
    assert summary["correct_per_problem"] == [1, 0, 4]
    assert summary["mean@4"] == pytest.approx((0.25 + 0 + 1) / 3)
    assert summary["pass@1"] == pytest.approx(summary["mean@4"])
    assert summary["pass@2"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert summary["pass@4"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="same number of samples"):
        summarize_correctness([[True], [True, False]], ks=(1,))
    with pytest.raises(ValueError, match="ks must be <="):
        summarize_correctness(correct, ks=(8,))
    table = write_markdown({"a": summary, "b": summary}, ks=(1, 2, 4), num_samples=4)
    assert table.splitlines()[0] == "| Benchmark | Problems | mean@4 | pass@1 | pass@2 | pass@4 |"
    assert "| a | 3 | 41.7 | 41.7 | 50.0 | 66.7 |" in table
    assert "**Average** | 6 |" in table


@pytest.fixture
def tiny_benchmark(tmp_path):
    rows = [
        {"problem": "1+1=?", "answer": "2"},
        {"problem": "2+2=?", "answer": "4"},
        {"problem": "3+3=?", "answer": "6"},
    ]
    path = tmp_path / "tiny_bench.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def check_metrics_are_consistent(metrics, num_samples, ks):
    counts = metrics["correct_per_problem"]
    assert len(counts) == metrics["problems"]
    assert all(0 <= c <= num_samples for c in counts)
    for key in [f"mean@{num_samples}"] + [f"pass@{k}" for k in ks]:
        assert 0.0 <= metrics[key] <= 1.0
    assert metrics["pass@1"] == pytest.approx(metrics[f"mean@{num_samples}"])
    assert metrics[f"mean@{num_samples}"] == pytest.approx(sum(counts) / (num_samples * len(counts)))
    assert metrics[f"pass@{num_samples}"] == pytest.approx(sum(c > 0 for c in counts) / len(counts))
    passes = [metrics[f"pass@{k}"] for k in ks]
    assert passes == sorted(passes)


def test_eval_cli_end_to_end_with_tiny_model(tiny_model_dir, tiny_benchmark, tmp_path):
    out = tmp_path / "eval_out"
    code = eval_main(
        [
            "--model", tiny_model_dir,
            "--benchmarks", str(tiny_benchmark), f"again={tiny_benchmark}",
            "--num-samples", "4",
            "--ks", "1", "2", "4",
            "--max-new-tokens", "6",
            "--temperature", "1.0",
            "--top-p", "1.0",
            "--backend", "transformers",
            "--batch-size", "8",
            "--output-dir", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["backend"] == "transformers"
    assert results["settings"]["ks"] == [1, 2, 4]
    assert list(results["benchmarks"]) == ["tiny_bench", "again"]
    for metrics in results["benchmarks"].values():
        assert metrics["problems"] == 3 and metrics["samples_per_problem"] == 4
        check_metrics_are_consistent(metrics, 4, (1, 2, 4))
    table = (out / "results.md").read_text()
    assert "| Benchmark | Problems | mean@4 | pass@1 | pass@2 | pass@4 |" in table
    assert "| tiny_bench | 3 |" in table
    samples = [json.loads(line) for line in (out / "samples_tiny_bench.jsonl").read_text().splitlines()]
    assert len(samples) == 3 and all(len(s["completions"]) == 4 for s in samples)
    assert [sum(s["correct"]) for s in samples] == results["benchmarks"]["tiny_bench"]["correct_per_problem"]


def test_evaluate_scores_completions_with_known_answers(monkeypatch, tiny_benchmark, tmp_path):
    """With generation stubbed, the metrics are the exact pass@k of known correct counts (1/4, 0/4, 4/4)."""
    canned = [
        [r"\boxed{2}", r"\boxed{3}", "no idea", r"\boxed{5}"],
        [r"\boxed{5}"] * 4,
        [r"so \boxed{6}", r"\boxed{06}", r"\boxed{\frac{12}{2}}", r"\boxed{6.0}"],
    ]
    seen = {}

    def fake_load_generator(backend, model, settings):
        def generate(prompts):
            seen["prompts"] = prompts
            return canned

        return generate, None  # None: the whole benchmark in one call

    monkeypatch.setattr(evaluation.generation, "load_generator", fake_load_generator)
    benchmarks = {"tiny": str(tiny_benchmark)}
    results = evaluate("unused", benchmarks, num_samples=4, backend="transformers", output_dir=tmp_path)
    metrics = results["benchmarks"]["tiny"]
    assert metrics["correct_per_problem"] == [1, 0, 4]
    assert metrics["mean@4"] == pytest.approx(5 / 12)
    assert metrics["pass@2"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert metrics["pass@4"] == pytest.approx(2 / 3)
    assert results["settings"]["ks"] == [1, 2, 4]
    assert seen["prompts"][0][0]["content"].startswith("1+1=? Let's think step by step")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_samples": 0}, "num_samples"),
        ({"ks": (8,)}, "num_samples=4"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"backend": "tensorrt"}, "backend"),
    ],
)
def test_evaluate_rejects_bad_arguments(kwargs, match, tiny_benchmark):
    arguments = {"num_samples": 4, "backend": "transformers"} | kwargs
    with pytest.raises(ValueError, match=match):
        evaluate("unused", [str(tiny_benchmark)], **arguments)


def test_greedy_decoding_repeats_one_completion(tiny_model_dir, tiny_benchmark):
    results = evaluate(
        tiny_model_dir, [str(tiny_benchmark)], num_samples=3, max_new_tokens=4, temperature=0.0, backend="transformers"
    )
    metrics = results["benchmarks"]["tiny_bench"]
    assert all(c in (0, 3) for c in metrics["correct_per_problem"])  # identical samples: all right or all wrong
    assert results["settings"]["ks"] == [1, 2, 3]


def test_vllm_backend_requests_n_samples_per_prompt(monkeypatch, tiny_model_dir, tiny_benchmark):
    """The vLLM path, against a stand-in `vllm` module: one engine, SamplingParams(n=k), token-id prompts."""
    import importlib.machinery
    import sys
    import types

    from transformers import AutoTokenizer

    calls = {}

    class SamplingParams:
        def __init__(self, **kwargs):
            calls["sampling"] = kwargs

    class LLM:
        def __init__(self, model, **kwargs):
            calls["engine"] = (model, kwargs)

        def get_tokenizer(self):
            return AutoTokenizer.from_pretrained(tiny_model_dir)

        def generate(self, prompts, params):
            calls["prompts"] = prompts
            n = calls["sampling"]["n"]
            choice = types.SimpleNamespace
            return [types.SimpleNamespace(outputs=[choice(text=r"\boxed{2}") for _ in range(n)]) for _ in prompts]

    fake = types.ModuleType("vllm")
    fake.LLM, fake.SamplingParams = LLM, SamplingParams
    fake.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    monkeypatch.setitem(sys.modules, "vllm", fake)

    results = evaluate(
        tiny_model_dir, [str(tiny_benchmark)], num_samples=4, max_new_tokens=16, temperature=1.0, top_p=1.0,
        backend="auto", seed=3, vllm_kwargs={"tensor_parallel_size": 1},
    )  # fmt: skip
    assert results["settings"]["backend"] == "vllm"
    assert calls["engine"] == (tiny_model_dir, {"seed": 3, "dtype": "auto", "tensor_parallel_size": 1})
    assert calls["sampling"] == {"n": 4, "temperature": 1.0, "top_p": 1.0, "max_tokens": 16, "seed": 3}
    assert len(calls["prompts"]) == 3 and all(p["prompt_token_ids"] for p in calls["prompts"])
    assert results["benchmarks"]["tiny_bench"]["correct_per_problem"] == [4, 0, 0]  # only 1+1 has answer 2

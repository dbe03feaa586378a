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
from trl_bandpo.evaluation.scorers import score
from trl_bandpo.scoring.math_reward import last_boxed_answer, math_reward_correct, normalize_answer


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


# ------------------------------------------------------------------------------------------------------------------
# The math_reward scorer: verl's Hendrycks MATH string check, which the BandPO authors scored AMC with
# ------------------------------------------------------------------------------------------------------------------

MATH_REWARD_CASES = [
    # (completion, gold, verdict): each worked by hand from the rule in trl_bandpo/scoring/math_reward.py
    (r"so \boxed{12}", "12", True),
    (r"\boxed{\dfrac{1}{2}}", r"\frac{1}{2}", True),  # dfrac -> frac
    (r"\boxed{\tfrac12}", r"\frac{1}{2}", True),  # tfrac -> frac, \frac12 -> \frac{1}{2}
    (r"\boxed{0.5}", r"\frac{1}{2}", True),  # the one decimal rewritten
    (r"\boxed{.5}", "0.5", True),  # leading 0 added, then both become \frac{1}{2}
    (r"\boxed{1/2}", r"\frac{1}{2}", True),  # a/b of plain integers
    (r"\boxed{\frac{1}{2}}", "1/2", True),  # the gold is normalised too
    (r"\boxed{x = 5}", "5", True),  # left side of at most 2 characters dropped
    (r"\boxed{5\text{ cm}}", "5", True),  # unit after "\text{ " dropped
    (r"\boxed{50\%}", "50", True),
    (r"\boxed{90^\circ}", "90", True),
    (r"\boxed{\$18}", "18", True),
    (r"\boxed{\left( 1, 2 \right)}", "(1,2)", True),  # \left, \right and spaces dropped
    (r"\boxed{\sqrt2}", r"\sqrt{2}", True),
    (r"\boxed{\frac{1}{2}\!}", r"\frac12", True),
    (r"the answer is \boxed 7$.", "7", True),  # "\boxed " (a space): up to the next "$"
    (r"\boxed{3}, no: \boxed{4}", "4", True),  # the last box
    (r"\boxed{\sqrt}", r"\sqrt", True),  # cannot be normalised: compared as written
    (r"\boxed{4}, no: \boxed{3}", "4", False),
    (r"\boxed 7 or \boxed{8}", "8", False),  # a "\boxed " anywhere wins: the answer is "7 or \boxed{8}"
    (r"\boxed{xy = 5}", "5", False),  # left side of 3 characters kept
    (r"\boxed{01/2}", r"\frac{1}{2}", False),  # not an integer written plainly
    (r"\boxed{5\text{ cm}\text{ long}}", "5", False),  # two units: compared as written
    (r"\boxed{5", "5", False),  # unclosed
    ("The answer is 5.", "5", False),  # no box
    (r"\fbox{5}", "5", False),  # found, then rejected (verl: \fbox is not \boxed{...})
    # math-verify accepts these five (test_math_verify_accepts_what_math_reward_rejects):
    (r"\boxed{0.25}", r"\frac{1}{4}", False),  # no numeric equivalence
    (r"\boxed{\frac{2}{4}}", r"\frac{1}{2}", False),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", False),
    (r"\boxed{12.0}", "12", False),  # the answer is not rewritten
]


@pytest.mark.parametrize("completion, gold, verdict", MATH_REWARD_CASES)
def test_math_reward_verdicts(completion, gold, verdict):
    assert math_reward_correct(completion, gold) is verdict
    assert score("math_reward", [completion], [gold]) == [verdict]


def test_math_reward_normal_form():
    assert normalize_answer(r"\dfrac12") == r"\frac{1}{2}"
    assert normalize_answer(r"\\frac{1}{2}") == r"\frac{1}{2}"  # \\ -> \
    assert normalize_answer(r"50\\%") == "50"
    assert normalize_answer(" .5") == r"\frac{1}{2}"  # " ." -> " 0.", spaces dropped, 0.5 rewritten
    assert normalize_answer("k = 3") == "3" and normalize_answer("abc = 3") == "abc=3"
    assert normalize_answer("10/4") == r"\frac{10}{4}" and normalize_answer("+1/2") == "+1/2"
    assert normalize_answer(r"\frac1{72}") == r"\frac{1}{72}"
    assert normalize_answer(r"\frac1") == r"\frac1"  # a one-character tail: the rewrite is abandoned
    assert normalize_answer("0.50") == "0.50"  # only "0.5" itself
    with pytest.raises(ValueError):
        normalize_answer(r"5\text{ cm}\text{ m}")
    with pytest.raises(ValueError):
        normalize_answer(r"\sqrt")
    assert last_boxed_answer(r"a \boxed{\frac{1}{2}} b") == r"\frac{1}{2}"
    assert last_boxed_answer(r"\boxed{a}\fbox{b}") == "a" and last_boxed_answer(r"\fbox{b}") is None


def test_math_reward_gold_answers():
    """Integer-valued float golds: a number is written as an integer (as the loader does), a decimal string also
    accepts its integer form; the answer is never rewritten."""
    assert math_reward_correct(r"\boxed{12}", "12.0") and math_reward_correct(r"\boxed{12.0}", "12.0")
    assert math_reward_correct(r"\boxed{-3}", "-3.00")
    assert math_reward_correct(r"\boxed{12}", 12.0) and not math_reward_correct(r"\boxed{12.0}", 12.0)
    assert not math_reward_correct(r"\boxed{12}", "12.5") and math_reward_correct(r"\boxed{12.5}", 12.5)
    assert math_reward_correct(r"\boxed{7}", 7) and math_reward_correct(r"\boxed{4}", ["3", "4"])
    assert not math_reward_correct(r"\boxed{1}", True) and not math_reward_correct(r"\boxed{1}", None)
    assert not math_reward_correct(r"\boxed{1}", float("nan"))
    assert math_reward_correct([{"role": "assistant", "content": r"\boxed{2}"}], "2")  # a conversation
    with pytest.raises(ValueError, match="same length"):
        score("math_reward", ["a"], [])


def test_math_verify_accepts_what_math_reward_rejects():
    rejected = [(c, g) for c, g, verdict in MATH_REWARD_CASES[-4:]] + [(r"\fbox{5}", "5")]
    completions, golds = [c for c, _ in rejected], [g for _, g in rejected]
    assert score("math_verify", completions, golds) == [True] * 5
    assert score("math_reward", completions, golds) == [False] * 5

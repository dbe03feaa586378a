"""The evaluation presets, the scorers by name, `--preset` and its overrides, and the two pass@k estimators
(unbiased pass@k and verl's bootstrap best@k). Nothing here loads a model: generation is stubbed."""

import json
import math
import random

import pytest
import transformers

from trl_bandpo import evaluation
from trl_bandpo.cli import eval as eval_cli
from trl_bandpo.data import resolve_dataset_name
from trl_bandpo.evaluation import (
    BEST_LABEL,
    EVAL_PRESETS,
    PASS_LABEL,
    EvalSettings,
    best_at_k,
    bootstrap_best_at_k,
    check_scorer,
    estimator_labels,
    evaluate,
    pass_at_k,
    preset_settings,
    scorers_for,
    summarize_correctness,
)
from trl_bandpo.evaluation.scorers import score

# ------------------------------------------------------------------------------------------------------------------
# Presets
# ------------------------------------------------------------------------------------------------------------------

EXPECTED = {
    "bandpo": {
        "benchmarks": ["aime2024", "aime2025", "amc2023"],
        "prompt_template": "dapo",
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": None,
        "num_samples": 32,
        "max_new_tokens": 4096,
        "scorer": {"aime2024": "dapo", "aime2025": "dapo", "amc2023": "math_reward"},
        "ks": [1, 2, 4, 8, 16, 32],
    },
    "dgpo": {
        "benchmarks": ["aime2024-math-ai", "aime2025-math-ai", "amc2023", "math500", "minerva", "olympiadbench"],
        "prompt_template": "boxed",
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": None,
        "num_samples": 32,
        "max_new_tokens": 8192,
        "scorer": "strict",
        "ks": [1, 2, 4, 8, 16, 32],  # Appendix C.3 lists these six k (its §5.2 announces K = 1..32)
    },
}


# What each paper reports as Pass@32: verl's bootstrap best@k (docs/evaluation.md, "Which estimator each paper
# reports").
REPORTED = {
    "bandpo": {"paper": "BandPO", "estimator": "best", "paper_metric": "pass@32"},
    "dgpo": {"paper": "DGPO", "estimator": "best", "paper_metric": "P@32 and Pass@k"},
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_values(name):
    preset = EVAL_PRESETS[name]
    assert {key: preset[key] for key in EXPECTED[name]} == EXPECTED[name]
    assert {key: preset[key] for key in REPORTED[name]} == REPORTED[name]
    assert set(preset) == set(EXPECTED[name]) | set(REPORTED[name]) | {"description", "sources"}
    assert preset["description"].strip()
    assert set(preset["sources"]) == set(EXPECTED[name]) | {"estimator"}, "every value needs its source"
    assert all(text.strip() for text in preset["sources"].values())


def test_what_is_inferred_says_so():
    """The BandPO AMC scorer and the BandPO pass@32 estimator are inferred from the authors' pipeline, not read off
    the paper: the preset's sources, its description, the --preset help and the module docs say so, and name the
    switch to the "dapo" scorer."""
    bandpo = EVAL_PRESETS["bandpo"]
    assert "inferred" in bandpo["sources"]["scorer"] and "amc2023=dapo" in bandpo["sources"]["scorer"]
    assert "inferred" in bandpo["description"] and "inferred" in bandpo["sources"]["estimator"]
    help_text = " ".join(eval_cli.build_parser().format_help().split())
    assert "AMC by math_reward, which is inferred: scorer amc2023=dapo switches it" in help_text
    from trl_bandpo.evaluation import summary

    for doc in (evaluation.__doc__, summary.__doc__):
        flat = " ".join(doc.split())
        assert "both papers' Pass@32" not in flat and "inferred" in flat


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_benchmarks_are_registry_names_and_settings_are_valid(name):
    preset = EVAL_PRESETS[name]
    assert all(resolve_dataset_name(b) == b for b in preset["benchmarks"])
    check_scorer(preset["scorer"])
    assert scorers_for(preset["scorer"], preset["benchmarks"])  # a scorer for every benchmark
    assert all(k <= preset["num_samples"] for k in preset["ks"])


def test_preset_settings_overrides_win_and_drop_large_ks():
    settings = preset_settings("dgpo", max_new_tokens=1024, temperature=0.6)
    assert settings["max_new_tokens"] == 1024 and settings["temperature"] == 0.6
    assert settings["preset"] == "dgpo" and settings["scorer"] == "strict"
    assert preset_settings("dgpo", num_samples=4)["ks"] == [1, 2, 4]
    assert preset_settings("bandpo", num_samples=8)["ks"] == [1, 2, 4, 8]
    assert preset_settings("bandpo", num_samples=8, ks=[3])["ks"] == [3]
    settings["scorer"] = "changed"
    assert EVAL_PRESETS["dgpo"]["scorer"] == "strict"  # a copy
    with pytest.raises(ValueError, match=r"preset must be one of \['bandpo', 'dgpo'\], got 'verl'"):
        preset_settings("verl")


# ------------------------------------------------------------------------------------------------------------------
# Scorers
# ------------------------------------------------------------------------------------------------------------------


def test_scorers_by_name():
    assert score("dapo", ["work\nAnswer: 42", r"\boxed{42}"], ["42", "42"]) == [True, False]
    assert score("math_verify", [r"so \boxed{42}", "Answer: 42"], ["42", "42"]) == [True, False]
    # an unboxed completion is graded on the text after its last "answer:" (prime_math's rule), else on all of it
    assert score("strict", [r"so \boxed{x = 6}", "Answer: 6", "I think 6"], ["6", "6", "6"]) == [True, True, False]
    assert score("math_verify", [r"\boxed{0.5}"], [r"\frac{1}{2}"]) == [True]
    assert score("dapo", ["Answer: 0.5"], [r"\frac{1}{2}"]) == [False]  # string equality only


def test_scorer_resolution():
    assert check_scorer("strict") == "strict"
    assert check_scorer({"aime24": "dapo", "*": "strict"}) == {"aime2024": "dapo", "*": "strict"}
    mapping = {"aime24": "dapo", "amc2023": "math_verify"}
    assert scorers_for(mapping, ["aime2024", "amc2023"]) == {"aime2024": "dapo", "amc2023": "math_verify"}
    assert scorers_for("dapo", ["a", "b"]) == {"a": "dapo", "b": "dapo"}
    assert scorers_for({"a": "dapo", "*": "strict"}, ["a", "b"]) == {"a": "dapo", "b": "strict"}
    with pytest.raises(
        ValueError, match=r"scorer must be one of \['math_verify', 'dapo', 'strict', 'math_reward'\].*'prime'"
    ):
        check_scorer("prime")
    with pytest.raises(ValueError, match=r"val_scorer\['aime2024'\] must be one of .*'verl'"):
        check_scorer({"aime2024": "verl"}, "val_scorer")
    with pytest.raises(ValueError, match="non-empty mapping"):
        check_scorer({})
    with pytest.raises(ValueError, match=r"scorer has no scorer for benchmark 'math500' .*add math500=NAME"):
        scorers_for({"aime2024": "dapo"}, ["aime2024", "math500"])


@pytest.fixture
def no_model_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(evaluation.generation, "load_generator", refuse)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


@pytest.fixture
def bench_files(tmp_path):
    """Two local benchmarks: 'a' (answers 2, 4) and 'b' (answers 6, 8)."""
    paths = {}
    for name, answers in (("a", (2, 4)), ("b", (6, 8))):
        rows = [{"problem": f"What is {x // 2}+{x // 2}?", "answer": str(x)} for x in answers]
        paths[name] = tmp_path / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return paths


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"scorer": "prime"}, r"scorer must be one of \['math_verify', 'dapo', 'strict', 'math_reward'\]"),
        ({"scorer": {"a": "dapo"}}, "scorer has no scorer for benchmark 'b'"),
        ({"top_k": 0}, "top_k must be None or an integer >= 1, got 0"),
        ({"prompt_template": "chatml"}, r"prompt_template must be one of \['boxed', 'dapo'\]"),
        ({"preset": "verl"}, r"preset must be None or one of \['bandpo', 'dgpo'\]"),
    ],
)
def test_evaluate_rejects_bad_scorers_before_the_model_loads(kwargs, match, bench_files, no_model_loading):
    with pytest.raises(ValueError, match=match):
        evaluate("unused", [str(p) for p in bench_files.values()], num_samples=2, backend="transformers", **kwargs)


def canned_generator(texts_by_answer):
    """A stand-in `load_generator`: each prompt gets the canned completions of its answer."""
    seen = {}

    def load_generator(backend, model, settings):
        seen["settings"] = settings

        def generate(prompts):
            seen.setdefault("prompts", []).extend(prompts)
            return [texts_by_answer[p[0]["content"].split("?")[0].split("is ")[-1]] for p in prompts]

        return generate, None

    return load_generator, seen


def test_evaluate_scores_each_benchmark_with_its_scorer(monkeypatch, bench_files, tmp_path):
    canned = {
        "1+1": [r"\boxed{2}", "Answer: 2"],
        "2+2": ["Answer: 4", "Answer: 5"],
        "3+3": [r"\boxed{6}", "Answer: 6"],
        "4+4": ["Answer: 8", r"\boxed{8}"],
    }
    fake, seen = canned_generator(canned)
    monkeypatch.setattr(evaluation.generation, "load_generator", fake)
    results = evaluate(
        "unused", {name: str(p) for name, p in bench_files.items()}, num_samples=2, backend="transformers",
        output_dir=tmp_path / "out", scorer={"a": "dapo", "*": "math_verify"}, top_k=5, prompt_template="dapo",
        preset="bandpo",
    )  # fmt: skip
    assert results["benchmarks"]["a"]["correct_per_problem"] == [1, 1]  # "Answer:" lines only
    assert results["benchmarks"]["b"]["correct_per_problem"] == [1, 1]  # boxed answers only
    settings = results["settings"]
    assert settings["scorer"] == {"a": "dapo", "b": "math_verify"}
    assert settings["timeout_s"] == {"a": None, "b": 2.0}
    assert (settings["top_k"], settings["prompt_template"], settings["preset"]) == (5, "dapo", "bandpo")
    assert seen["settings"]["top_k"] == 5
    assert seen["prompts"][0][0]["content"].startswith("Solve the following math problem step by step.")
    assert results["estimators"] == {
        "best@k": "best@k (bootstrap; the BandPO paper's pass@32)",
        "pass@k": "pass@k (unbiased; not the BandPO paper's estimator)",
    }
    assert list(results["estimators"]) == ["best@k", "pass@k"]  # the paper's estimator first
    assert results["benchmarks"]["a"]["best@2"] == pytest.approx(0.75)  # 1 - (1 - 1/2)^2
    assert results["benchmarks"]["a"]["pass@2"] == pytest.approx(1.0)
    on_disk = json.loads((tmp_path / "out" / "results.json").read_text())
    assert on_disk["settings"]["scorer"] == settings["scorer"]


# ------------------------------------------------------------------------------------------------------------------
# --preset and the flags that override it
# ------------------------------------------------------------------------------------------------------------------


SETTINGS = ("benchmarks", "num_samples", "ks", "max_new_tokens", "temperature", "top_p", "top_k", "prompt_template")


def parse(argv):
    """The preset-able settings `trl-bandpo eval` resolves from `argv`."""
    parser = eval_cli.build_parser()
    settings = eval_cli.resolve_settings(parser.parse_args(["--model", "m", *argv]))
    return {key: getattr(settings, key) for key in (*SETTINGS, "scorer", "preset")}


def test_no_preset_samples_as_both_papers():
    """Without --preset the sampling is both papers' (T 1.0, top-p 1.0, no top-k), not 0.6 / 0.95."""
    settings = parse([])
    assert settings == {
        "benchmarks": ["aime2024", "aime2025", "amc2023"], "num_samples": 32, "ks": [1, 2, 4, 8, 16, 32],
        "max_new_tokens": 4096, "temperature": 1.0, "top_p": 1.0, "top_k": None, "prompt_template": "boxed",
        "scorer": "math_verify", "preset": None,
    }  # fmt: skip
    defaults = EvalSettings()  # what `evaluate` samples with when not told otherwise
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (1.0, 1.0, None)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_fills_every_setting(name):
    assert parse(["--preset", name]) == {**EXPECTED[name], "preset": name}


def test_explicit_flags_override_the_preset():
    # amc2023: a benchmark the preset's scorer mapping names (math500 would need --scorer math500=NAME)
    settings = parse([
        "--preset", "bandpo", "--temperature", "0.6", "--top-p", "0.95", "--top-k", "20", "--max-new-tokens", "2048",
        "--num-samples", "8", "--prompt-template", "boxed", "--benchmarks", "amc2023",
    ])  # fmt: skip
    assert settings["temperature"] == 0.6 and settings["top_p"] == 0.95 and settings["top_k"] == 20
    assert settings["max_new_tokens"] == 2048 and settings["num_samples"] == 8
    assert settings["ks"] == [1, 2, 4, 8]  # the preset's ks up to --num-samples
    assert settings["prompt_template"] == "boxed" and settings["benchmarks"] == ["amc2023"]
    assert settings["scorer"] == EXPECTED["bandpo"]["scorer"] and settings["preset"] == "bandpo"
    assert parse(["--preset", "dgpo", "--ks", "1", "4"])["ks"] == [1, 4]


def test_scorer_flag_replaces_or_updates_the_preset_mapping():
    assert parse(["--preset", "bandpo", "--scorer", "strict"])["scorer"] == "strict"
    updated = parse(["--preset", "bandpo", "--scorer", "amc2023=dapo"])["scorer"]
    assert updated == {"aime2024": "dapo", "aime2025": "dapo", "amc2023": "dapo"}
    assert preset_settings("bandpo", scorer={"amc2023": "dapo"})["scorer"] == updated  # the same in Python
    assert parse(["--preset", "dgpo", "--scorer", "math500=math_verify"])["scorer"] == {
        "*": "strict", "math500": "math_verify",
    }  # fmt: skip
    assert parse(["--scorer", "dapo", "x=strict"])["scorer"] == {"*": "dapo", "x": "strict"}


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--preset", "verl"], ["argument --preset", "'verl'", "'bandpo', 'dgpo'"]),
        (["--scorer", "prime"], ["argument --scorer", "'prime'", "'math_verify', 'dapo', 'strict', 'math_reward'"]),
        (["--scorer", "=dapo"], ["argument --scorer", "every key must be a benchmark name", "got ''"]),
        (["--top-k", "0"], ["argument --top-k", "got 0", "integer >= 1"]),
        (["--prompt-template", "chatml"], ["argument --prompt-template", "'chatml'", "'boxed', 'dapo'"]),
        (["--preset", "dgpo", "--num-samples", "4", "--ks", "8"], ["argument --ks", "8", "[1, --num-samples=4]"]),
    ],
)
def test_bad_preset_arguments_exit_2(argv, expected, tmp_path, no_model_loading, capsys):
    with pytest.raises(SystemExit) as info:
        eval_cli.eval_main(["--model", "m", "--output-dir", str(tmp_path / "out"), *argv])
    assert info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("trl-bandpo eval: error: argument --")
    for part in expected:
        assert part in error, (part, error)


def test_scorer_mapping_must_cover_the_benchmarks(bench_files, tmp_path, no_model_loading, capsys):
    base = ["--model", "m", "--output-dir", str(tmp_path / "out"), "--benchmarks", *map(str, bench_files.values())]
    for extra, part in (
        (["--scorer", "dapo", "c=strict"], "argument --scorer: 'c' is not a benchmark of this run"),
        (
            ["--preset", "bandpo", "--scorer", "a=dapo"],
            "argument --scorer: benchmark 'b' has no scorer (--preset bandpo scores only ['a', 'aime2024', ",
        ),
    ):
        with pytest.raises(SystemExit) as info:
            eval_cli.eval_main(base + extra)
        assert info.value.code == 2 and part in capsys.readouterr().err


def test_a_custom_benchmark_under_a_preset_needs_scorer(bench_files, tmp_path, no_model_loading, capsys):
    """`--preset bandpo --benchmarks a.jsonl` without --scorer: one line naming --benchmarks (the flag given against
    the preset), the benchmark, the scorers the preset has and the --scorer entry to add, with the names allowed."""
    with pytest.raises(SystemExit) as info:
        eval_cli.eval_main([
            "--model", "m", "--output-dir", str(tmp_path / "out"), "--preset", "bandpo", "--benchmarks",
            str(bench_files["a"]),
        ])  # fmt: skip
    assert info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == (
        "trl-bandpo eval: error: argument --benchmarks: benchmark 'a' has no scorer (--preset bandpo scores only "
        "['aime2024', 'aime2025', 'amc2023']): a custom benchmark needs --scorer a=NAME (or one NAME for every "
        "benchmark), NAME one of ['math_verify', 'dapo', 'strict', 'math_reward']"
    )


def test_preset_run_records_the_effective_settings(monkeypatch, bench_files, tmp_path, capsys):
    """`--preset bandpo` on local copies named like its benchmarks, one flag overriding it: the settings are printed
    before generation, results.json holds the preset's name and the effective values, AMC is scored by math_reward
    (``\\boxed{6.0}`` is not 6), and results.md and stdout show the paper's estimator (best@k) first, in %."""
    canned = {"1+1": ["Answer: 2"] * 4, "2+2": [r"\boxed{4}"] * 4, "3+3": [r"\boxed{6}", r"\boxed{6.0}", "y", "z"]}
    canned["4+4"] = ["no"] * 4
    fake, seen = canned_generator(canned)
    monkeypatch.setattr(evaluation.generation, "load_generator", fake)
    out = tmp_path / "out"
    code = eval_cli.eval_main([
        "--model", "m", "--preset", "bandpo", "--benchmarks", f"aime2024={bench_files['a']}",
        f"amc2023={bench_files['b']}", "--num-samples", "4", "--backend", "transformers", "--output-dir", str(out),
    ])  # fmt: skip
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    settings = results["settings"]
    assert settings["preset"] == "bandpo" and settings["num_samples"] == 4 and settings["ks"] == [1, 2, 4]
    assert (settings["temperature"], settings["top_p"], settings["top_k"]) == (1.0, 1.0, None)
    assert settings["max_new_tokens"] == 4096 and settings["prompt_template"] == "dapo"
    assert settings["scorer"] == {"aime2024": "dapo", "amc2023": "math_reward"}
    assert settings["timeout_s"] == {"aime2024": None, "amc2023": None}
    assert seen["settings"]["temperature"] == 1.0
    assert results["benchmarks"]["aime2024"]["correct_per_problem"] == [4, 0]  # boxed 4 is no "Answer:" line
    assert results["benchmarks"]["amc2023"]["correct_per_problem"] == [1, 0]  # 6.0 is not 6 under math_reward
    best, unbiased = (
        "best@k (bootstrap; the BandPO paper's pass@32)",
        "pass@k (unbiased; not the BandPO paper's estimator)",
    )
    assert list(results["estimators"].items()) == [("best@k", best), ("pass@k", unbiased)]
    # amc2023, counts 1/4 and 0/4: mean 12.5 %; best@2 = (1 - (3/4)^2)/2 = 21.875 %, best@4 = (1 - (3/4)^4)/2
    # = 34.18 %; pass@2 = (1 - C(3,2)/C(4,2))/2 = 25 %, pass@4 = 50 %.
    best_row, pass_row = "| amc2023 | 2 | 12.5 | 12.5 | 21.9 | 34.2 |", "| amc2023 | 2 | 12.5 | 12.5 | 25.0 | 50.0 |"
    table = (out / "results.md").read_text()
    assert table.index(f"## {best}") < table.index(best_row) < table.index(f"## {unbiased}") < table.index(pass_row)
    assert "| Benchmark | Problems | mean@4 | best@1 | best@2 | best@4 |" in table
    assert "| Benchmark | Problems | mean@4 | pass@1 | pass@2 | pass@4 |" in table
    assert "Preset `bandpo`" in table and "aime2024: dapo" in table and "amc2023: math_reward" in table
    printed = capsys.readouterr().out
    assert printed.splitlines()[0] == (
        "Settings (preset bandpo; flags given explicitly override it): 4 samples per problem at temperature 1.0, "
        "top-p 1.0, no top-k, seed 0; at most 4096 new tokens; prompt template dapo; scorers aime2024: dapo, "
        "amc2023: math_reward; k of pass@k and best@k [1, 2, 4]"
    )
    assert printed.index(f"{best}, values in %:") < printed.index(best_row)
    assert printed.index(best_row) < printed.index(f"{unbiased}, values in %:") < printed.index(pass_row)


def test_no_preset_prints_what_it_uses_and_the_unbiased_estimator_first(monkeypatch, bench_files, tmp_path, capsys):
    """Without --preset the run says so, prints the exact sampling it uses, and labels both tables (in %)."""
    fake, _ = canned_generator({"1+1": [r"\boxed{2}", "x"], "2+2": ["y", "z"]})
    monkeypatch.setattr(evaluation.generation, "load_generator", fake)
    code = eval_cli.eval_main([
        "--model", "m", "--benchmarks", str(bench_files["a"]), "--num-samples", "2", "--backend", "transformers",
        "--output-dir", str(tmp_path / "out"),
    ])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert printed.splitlines()[0] == (
        "Settings (no --preset: built-in defaults, not a paper's protocol; --preset bandpo or dgpo applies one): 2 "
        "samples per problem at temperature 1.0, top-p 1.0, no top-k, seed 0; at most 4096 new tokens; prompt "
        "template boxed; scorers a: math_verify; k of pass@k and best@k [1, 2]"
    )
    # a: counts 1/2 and 0/2: mean 25 %; pass@2 = 50 %; best@2 = (1 - (1/2)^2)/2 = 37.5 %.
    pass_at, best_at = printed.index(f"{PASS_LABEL}, values in %:"), printed.index(f"{BEST_LABEL}, values in %:")
    assert (
        pass_at
        < printed.index("| a | 2 | 25.0 | 25.0 | 50.0 |")
        < best_at
        < printed.index("| a | 2 | 25.0 | 25.0 | 37.5 |")
    )


def test_preset_end_to_end_with_tiny_model(tiny_model_dir, bench_files, tmp_path):
    """The dgpo preset on the tiny model (transformers backend, top-k, the strict scorer), shrunk by flags: its k
    up to --num-samples 3 are 1 and 2."""
    out = tmp_path / "out"
    code = eval_cli.eval_main([
        "--model", tiny_model_dir, "--preset", "dgpo", "--benchmarks", str(bench_files["a"]), "--num-samples", "3",
        "--max-new-tokens", "4", "--top-k", "5", "--backend", "transformers", "--output-dir", str(out),
    ])  # fmt: skip
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["preset"] == "dgpo" and results["settings"]["ks"] == [1, 2]
    assert results["settings"]["scorer"] == {"a": "strict"} and results["settings"]["top_k"] == 5
    metrics = results["benchmarks"]["a"]
    assert metrics["problems"] == 2 and all(0.0 <= metrics[f"best@{k}"] <= 1.0 for k in (1, 2))


# ------------------------------------------------------------------------------------------------------------------
# The two estimators
# ------------------------------------------------------------------------------------------------------------------


def verl_style_bootstrap(n, c, k, resamples=1000, seed=42):
    """verl's procedure, written independently: resample k of the n 0/1 scores with replacement, take the best,
    average over the resamples."""
    import numpy as np

    scores = [1.0] * c + [0.0] * (n - c)
    rng = np.random.default_rng(seed)
    return float(np.mean([max(scores[i] for i in rng.integers(0, n, size=k)) for _ in range(resamples)]))


def test_one_correct_of_32():
    assert pass_at_k(32, 1, 32) == 1.0
    assert best_at_k(32, 1, 32) == pytest.approx(1 - (31 / 32) ** 32)
    assert best_at_k(32, 1, 32) == pytest.approx(0.638, abs=5e-4)
    assert verl_style_bootstrap(32, 1, 32, resamples=4000) == pytest.approx(0.638, abs=0.03)


@pytest.mark.parametrize("n, c, k", [(32, 1, 32), (32, 4, 8), (16, 8, 2), (8, 0, 8), (8, 8, 3), (5, 2, 16)])
def test_best_at_k_closed_form_matches_monte_carlo(n, c, k):
    exact = best_at_k(n, c, k)
    resamples = 20_000
    tolerance = 4 * math.sqrt(exact * (1 - exact) / resamples) + 1e-12
    assert bootstrap_best_at_k(n, c, k, resamples=resamples, seed=1) == pytest.approx(exact, abs=tolerance)
    assert verl_style_bootstrap(n, c, k, resamples=resamples) == pytest.approx(exact, abs=tolerance)


def test_best_at_k_with_huge_counts():
    """Any integer sizes: k beyond the float range, and c/n below the float resolution, where 1 - (1 - c/n)^k
    computed directly overflows or cancels to 0."""
    assert best_at_k(32, 1, 10**400) == 1.0
    assert best_at_k(32, 0, 10**400) == 0.0 and best_at_k(32, 32, 10**400) == 1.0
    assert best_at_k(10**20, 1, 10**20) == pytest.approx(1 - math.exp(-1), rel=1e-12)  # (1 - 1/N)^N -> e^-1
    assert best_at_k(10**400, 10**399, 2) == pytest.approx(1 - 0.9**2, rel=1e-12)
    assert best_at_k(10**30, 3, 10**10) == pytest.approx(3e-20, rel=1e-9)  # ~ k c / n when that is tiny


def test_best_at_k_properties():
    assert best_at_k(10, 3, 1) == pytest.approx(0.3) == pass_at_k(10, 3, 1)  # both equal the accuracy at k = 1
    for n, c in ((32, 1), (32, 5), (8, 3)):
        for k in range(2, n + 1):
            assert best_at_k(n, c, k) <= pass_at_k(n, c, k) + 1e-15  # with replacement: never above
    assert best_at_k(4, 4, 2) == 1.0 and best_at_k(4, 0, 2) == 0.0
    with pytest.raises(ValueError, match="c must be <= n"):
        best_at_k(4, 5, 1)
    rng = random.Random(0)
    correct = [[rng.random() < 0.3 for _ in range(8)] for _ in range(5)]
    summary = summarize_correctness(correct, ks=(1, 8))
    counts = summary["correct_per_problem"]
    assert summary["best@8"] == pytest.approx(sum(best_at_k(8, c, 8) for c in counts) / 5)
    assert summary["best@1"] == pytest.approx(summary["mean@8"])


def test_unbiased_pass_at_n_is_a_multiple_of_one_over_the_problems_and_best_at_n_is_not():
    """Why the DGPO paper's P@32 is best@32: with n = k = 32 the unbiased pass@32 is the share of problems solved at
    least once, a multiple of 1/30 on AIME (1/40 on AMC23); the bootstrap best@32 is not."""
    counts = [1] + [0] * 29  # 30 problems, one solved once in 32 samples
    summary = summarize_correctness([[i < c for i in range(32)] for c in counts], ks=(32,))
    assert summary["pass@32"] == pytest.approx(1 / 30)
    assert summary["best@32"] == pytest.approx((1 - (31 / 32) ** 32) / 30)  # 0.6379 / 30 = 0.02126
    assert summary["best@32"] * 30 == pytest.approx(0.6379, abs=1e-4)  # 30 x best@32 is no integer


@pytest.mark.parametrize(
    "preset, expected",
    [
        (None, [("pass@k", PASS_LABEL), ("best@k", BEST_LABEL)]),
        (
            "bandpo",
            [
                ("best@k", "best@k (bootstrap; the BandPO paper's pass@32)"),
                ("pass@k", "pass@k (unbiased; not the BandPO paper's estimator)"),
            ],
        ),
        (
            "dgpo",
            [
                ("best@k", "best@k (bootstrap; the DGPO paper's P@32 and Pass@k)"),
                ("pass@k", "pass@k (unbiased; not the DGPO paper's estimator)"),
            ],
        ),
    ],
)
def test_each_preset_shows_the_estimator_its_paper_reports_first(preset, expected):
    assert list(estimator_labels(preset).items()) == expected


def test_dgpo_run_writes_the_papers_estimator_first(monkeypatch, bench_files, tmp_path):
    fake, _ = canned_generator({"1+1": [r"\boxed{2}", "x"], "2+2": ["y", "z"]})
    monkeypatch.setattr(evaluation.generation, "load_generator", fake)
    settings = preset_settings("dgpo", num_samples=2, benchmarks=[str(bench_files["a"])])
    results = evaluate("unused", **settings, backend="transformers", output_dir=tmp_path)
    assert list(results["estimators"]) == ["best@k", "pass@k"]
    assert json.loads((tmp_path / "results.json").read_text())["estimators"] == results["estimators"]
    headings = [line for line in (tmp_path / "results.md").read_text().splitlines() if line.startswith("## ")]
    assert headings == [
        "## best@k (bootstrap; the DGPO paper's P@32 and Pass@k)",
        "## pass@k (unbiased; not the DGPO paper's estimator)",
    ]

"""`benchmarks/study.py` (the study of docs/evidence.md): the divisors task and its warm-start rows, one complete row
per run in runs.csv, resuming without redoing finished runs, and the intervals and paired differences against values
computed by hand."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("study", ROOT / "benchmarks" / "study.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


study = _load()

TINY = [
    "--seeds", "0",
    "--steps", "4",
    "--hidden-size", "32",
    "--addition-warmup-steps", "10",
    "--addition-warmup-target", "0",
    "--divisors-warmup-steps", "10",
    "--prompts-per-generation", "4",
    "--num-generations", "4",
    "--steps-per-generation", "2",
    "--probe-every", "2",
    "--quiet",
]  # fmt: skip


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_divisors_task():
    train, held_out = study.divisors_problems(0)
    assert (len(train), len(held_out)) == (65, 20)
    numbers = [int(row["prompt"][1:-1]) for row in train + held_out]
    assert sorted(numbers) == [n for n in range(2, 200) if sum(n % d == 0 for d in range(2, n)) >= 4]
    for row in train + held_out:
        n = int(row["prompt"][1:-1])
        assert row["prompt"] == f"d{n}=" and row["valid"].split() == [str(d) for d in range(2, n) if n % d == 0]
        assert row["answer"] == row["valid"].split()[0]
    assert study.divisors_problems(0) == (train, held_out)
    assert study.divisors_problems(1)[1] != held_out
    assert study.valid_answer_reward(["3", " 4 ", "5", "12"], ["2 3 4 6"] * 4) == [1.0, 1.0, 0.0, 0.0]
    assert study.max_new_tokens("divisors") == 4 and study.max_new_tokens("addition") == 4

    from trl_bandpo.demo.tiny_model import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()  # the prompt spelling is one the tokenizer encodes and decodes as is
    ids = tokenizer("d120=", add_special_tokens=False)["input_ids"]
    assert len(ids) == 5 and tokenizer.decode(ids) == "d120=" and tokenizer.unk_token_id not in ids


def test_warm_start_rows_are_the_planned_mixture_exactly():
    rows = [{"prompt": "d12=", "answer": "2", "valid": "2 3 4 6"},  # 3 others
            {"prompt": "d24=", "answer": "2", "valid": "2 3 4 6 8 12"}]  # 5 others  # fmt: skip
    mixture = study.WarmStartRows(rows)
    assert len(mixture) == 2 * 10 * 15  # lcm(3, 5) = 15
    counts = {}
    for item in mixture:
        counts[item["prompt"], item["answer"]] = counts.get((item["prompt"], item["answer"]), 0) + 1
    assert counts == {("d12=", "2"): 135, **{("d12=", a): 5 for a in "346"}, ("d24=", "2"): 135,
                      **{("d24=", a): 3 for a in ("3", "4", "6", "8", "12")}}  # fmt: skip
    with pytest.raises(IndexError):
        mixture[len(mixture)]


@pytest.fixture(scope="module")
def tiny_study(tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    assert study.main([*TINY, "--methods", "clip,band_0.05", "--output-dir", str(out)]) == 0
    return out


@pytest.mark.slow
def test_one_complete_row_per_run_and_the_outputs(tiny_study):
    rows = _rows(tiny_study / "runs.csv")
    assert tuple(rows[0]) == study.COLUMNS
    assert sorted((r["arm"], r["method"], r["seed"]) for r in rows) == [
        ("addition", "band_0.05", "0"), ("addition", "clip", "0"), ("divisors", "band_0.05", "0"),
        ("divisors", "clip", "0"),
    ]  # fmt: skip
    for row in rows:
        assert row["steps"] == "4"
        for key in ("heldout_mean_at8", "pass_at8", "pass_minus_mean_at8", "clip_rate", "entropy_last30"):
            assert math.isfinite(float(row[key])), key
        assert 0 <= float(row["pass_minus_mean_at8"]) <= float(row["pass_at8"]) <= 1
        assert float(row["train_seconds"]) > 0 and float(row["run_seconds"]) >= float(row["train_seconds"])
        assert (tiny_study / "histories" / f"{row['arm']}__{row['method']}__seed0.json").is_file()
        if row["arm"] == "divisors":
            assert row["rare_censored"] in ("True", "False")
            assert float(row["steps_to_rare_10pct"]) in (2, 4, 6)  # probes at 2 and 4; censored: 4 + 2
            assert (row["rare_censored"] == "True") == (float(row["steps_to_rare_10pct"]) == 6)
            masses = [float(row[f"warm_{key}"]) for key in ("dominant_mass", "rare_mass", "rare_share")]
            assert all(0 <= value <= 1 for value in masses) and float(row["distinct_valid"]) >= 0
        else:  # divisors-only columns stay empty on addition
            assert row["steps_to_rare_10pct"] == row["rare_censored"] == row["distinct_valid"] == ""
            assert row["warm_dominant_mass"] == "" and row["warm_sft_steps"] == "10"
    summary = _rows(tiny_study / "summary.csv")
    assert {(r["arm"], r["method"], r["metric"]) for r in summary} >= {("divisors", "clip", "steps_to_rare_10pct")}
    assert all(r["verdict"] in ("reference", "n/a") for r in summary)  # one seed: no interval
    for name in ("summary.md", "curves_divisors.png", "estimates_addition.png", "differences_divisors.png"):
        assert (tiny_study / name).is_file(), name


@pytest.mark.slow
def test_a_second_invocation_resumes_without_redoing_finished_runs(tiny_study, monkeypatch):
    before = (tiny_study / "runs.csv").read_text()
    calls, run_one = [], study.run_one

    def counted(arm, method, seed, *args, **kwargs):
        calls.append((arm, method, seed))
        return run_one(arm, method, seed, *args, **kwargs)

    monkeypatch.setattr(study, "run_one", counted)
    assert study.main([*TINY, "--methods", "clip,band_0.05", "--output-dir", str(tiny_study)]) == 0
    assert calls == [] and (tiny_study / "runs.csv").read_text() == before
    # a line cut short by a killed study is dropped; only the missing run is done
    with open(tiny_study / "runs.csv", "a") as handle:
        handle.write("divisors,unclipped,0,4,0.5")
    args = [*TINY, "--arms", "divisors", "--methods", "clip", "unclipped", "--output-dir", str(tiny_study)]
    assert study.main(args) == 0
    assert calls == [("divisors", "unclipped", 0)]
    after = (tiny_study / "runs.csv").read_text()
    assert after.startswith(before) and after.count("\n") == before.count("\n") + 1
    new = _rows(tiny_study / "runs.csv")[-1]
    assert new["method"] == "unclipped" and new["tail_share"] == ""  # it clips nothing: metric 1 undefined
    with pytest.raises(SystemExit):  # other settings in the same folder are refused
        study.main([*TINY[:-1], "--steps", "5", "--quiet", "--output-dir", str(tiny_study)])


def test_the_exploration_reward_pays_rare_valid_answers_twice_the_smallest():
    completions = ["2", " 3 ", "6", "5", "12", "", "2 3"]
    assert study.rarity_reward(completions, ["2"] * 7, ["2 3 4 6"] * 7) == [0.5, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


@pytest.mark.slow
def test_the_exploration_arm_starts_from_the_divisors_warm_start(tiny_study):
    assert study.main([*TINY, "--arms", "exploration", "--methods", "clip", "--output-dir", str(tiny_study)]) == 0
    rows = {(row["arm"], row["method"]): row for row in _rows(tiny_study / "runs.csv")}
    explored, divisors = rows["exploration", "clip"], rows["divisors", "clip"]
    assert not (tiny_study / "warmstart" / "exploration-seed0").exists()
    assert all(explored[key] == divisors[key] for key in study.WARM_COLUMNS)  # the same warm start, not rebuilt
    assert float(explored["steps_to_rare_25pct"]) in (2, 4, 6)  # probes at 2 and 4; censored: 4 + 2
    assert (explored["rare25_censored"] == "True") == (float(explored["steps_to_rare_25pct"]) == 6)
    assert explored["rare_share_50"] == explored["rare_share_150"] == ""  # a 4-step run has no probe there
    assert 0 <= float(explored["final_rare_share"]) <= 1 and 0 <= float(explored["heldout_reward"]) <= 1
    summary = {(r["arm"], r["metric"]): r for r in _rows(tiny_study / "summary.csv") if r["method"] == "clip"}
    assert summary["exploration", "steps_to_rare_25pct"]["censored"] in ("0", "1")
    assert ("exploration", "distinct_valid") not in summary and ("divisors", "heldout_reward") not in summary


@pytest.mark.slow
def test_a_run_repeats_exactly_from_its_seed(tiny_study):
    """The same (arm, method, seed) from the same warm start gives the same numbers (times aside)."""
    args = study.build_parser().parse_args(TINY)
    train_rows, eval_rows = study.problems("divisors", 0)
    path = tiny_study / "warmstart" / "divisors-seed0"
    first, second = (study.run_one("divisors", "clip_higher", 0, path, train_rows, eval_rows, tiny_study, args)
                     for _ in range(2))  # fmt: skip
    same = lambda a, b: json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)  # noqa: E731  (NaN == NaN)
    assert same(first[1], second[1])  # the logged steps and the probes
    for row in (first[0], second[0]):
        del row["train_seconds"], row["run_seconds"]
    assert same(first[0], second[0])


def test_arguments_are_checked(tmp_path):
    for bad in (["--methods", "ppo"], ["--arms", "sums"], ["--seeds", "3-1"], ["--steps", "0"]):
        with pytest.raises(SystemExit):
            study.main([*bad, "--output-dir", str(tmp_path), "--quiet"])
    with pytest.raises(SystemExit):  # nothing to report
        study.main(["--report-only", "--output-dir", str(tmp_path), "--quiet"])
    assert study._seeds(["0-2", "4,1"]) == [0, 1, 2, 4]


def _runs_csv_with_seed(out: Path, seed: str) -> None:
    out.mkdir()
    with open(out / "runs.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, study.COLUMNS)
        writer.writeheader()
        writer.writerow({"arm": "addition", "method": "clip", "seed": seed, "heldout_mean_at8": 0.5})


BAD_VALUES = [
    # before: an empty study, then ValueError "no finished runs" from the report
    (["--seeds", ""], None, "--seeds must be integers in [0, 4294967295] or ranges like 0-4, at most 1000 seeds in "
     "all, got ''."),
    # before: a list of 10^11 seeds, MemoryError
    (["--seeds", "0-99999999999"], None, "--seeds must be integers in [0, 4294967295] or ranges like 0-4, at most "
     "1000 seeds in all, got '0-99999999999'."),
    # before: torch's RuntimeError "set_num_threads expects a positive integer" when the study started
    (["--threads", "-1"], None, "--threads must be an integer >= 0, got -1."),
    # before: the study ran with a NaN target, and study.json then refused every rerun (NaN != NaN)
    (["--addition-warmup-target", "nan"], None, "--addition-warmup-target must be a number in [0, 1], got nan."),
    # before: ValueError "invalid literal for int()" from the report
    (["--report-only"], lambda out: _runs_csv_with_seed(out, "abc"), "runs.csv line 2: arm and seed must be one of "
     "['addition', 'divisors', 'exploration', 'smollm2'] and an integer >= 0, got ('addition', 'abc')."),
    # before: AttributeError "'list' object has no attribute 'get'"
    ([], lambda out: (out.mkdir(), (out / "study.json").write_text("[1, 2]")), "study.json must be a JSON object "
     '{"settings": {...}, ...} as this script writes (else use another --output-dir), got [1, 2].'),
    (["--report-only"], lambda out: (_runs_csv_with_seed(out, "0"), (out / "study.json").write_text("[1, 2]")),
     "study.json must be a JSON object"),
]  # fmt: skip


@pytest.mark.parametrize(
    "extra, prepare, says", BAD_VALUES, ids=["seeds-empty", "seeds-too-many", "threads-negative", "target-nan",
                                             "runs-seed-abc", "study-json-list", "study-json-list-report"]
)  # fmt: skip
def test_bad_values_are_one_line_naming_the_flag_or_file(tmp_path, capsys, extra, prepare, says):
    """Each is refused before any run, status 2, the last line naming the flag or file, the value and what is
    allowed (the tiny settings: where a value once went through, the test stays short)."""
    out = tmp_path / "out"
    if prepare:
        prepare(out)
    with pytest.raises(SystemExit) as info:
        study.main([*TINY, "--arms", "addition", "--methods", "clip", *extra, "--output-dir", str(out)])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert info.value.code == 2 and error.startswith("python benchmarks/study.py: error: ") and says in error
    assert not (out / "warmstart").exists()


def test_t_quantiles():
    assert study.t_quantile(4) == pytest.approx(2.7764, abs=1e-4)
    assert study.t_quantile(1) == pytest.approx(12.7062, abs=1e-4)
    assert study.t_quantile(30) == pytest.approx(2.0423, abs=1e-4)
    assert study.t_quantile(31) == pytest.approx(2.0395, abs=1e-4)  # the expansion above the table
    assert study.t_quantile(60) == pytest.approx(2.0003, abs=1e-4)
    assert study.t_quantile(10_000) == pytest.approx(1.9602, abs=1e-4)


#: A made-up runs.csv (addition, held-out mean@8 only): clip and four methods over seeds 0-4.
CLIP = [0.50, 0.52, 0.48, 0.55, 0.45]
OFFSETS = {
    "clip_higher": [0.10, 0.12, 0.08, 0.11, 0.09],  # clearly higher
    "dgpo": [0.05, -0.04, 0.02, -0.03, 0.01],  # straddles 0
    "band_0.02": [-0.1] * 5,  # the same difference on every seed: a zero-width interval below 0
    "dppo_tv": [0.05, 0.05, 0.07, 0.03, None],  # no seed 4: paired on seeds 0-3 only
}


def test_intervals_and_paired_differences_match_hand_computed_values(tmp_path):
    with open(tmp_path / "runs.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, study.COLUMNS)
        writer.writeheader()
        for seed, value in enumerate(CLIP):
            writer.writerow({"arm": "addition", "method": "clip", "seed": seed, "heldout_mean_at8": value})
            for method, offsets in OFFSETS.items():
                if offsets[seed] is not None:
                    writer.writerow({"arm": "addition", "method": method, "seed": seed,
                                     "heldout_mean_at8": value + offsets[seed]})  # fmt: skip
    assert study.main(["--report-only", "--output-dir", str(tmp_path), "--quiet"]) == 0
    summary = {r["method"]: r for r in _rows(tmp_path / "summary.csv") if r["metric"] == "heldout_mean_at8"}
    get = lambda method, *keys: [float(summary[method][key]) for key in keys]  # noqa: E731

    # clip: mean 0.50; deviations 0, .02, -.02, .05, -.05: s^2 = .0058 / 4 = .00145, s = .0380789,
    # half-width t_{.975,4} s / sqrt(5) = 2.776445 x .0170294 = .0472811
    assert summary["clip"]["n"] == "5" and summary["clip"]["verdict"] == "reference"
    assert get("clip", "mean", "ci_low", "ci_high") == pytest.approx([0.50, 0.4527189, 0.5472811], abs=1e-6)
    # clip_higher - clip: mean .10, deviations 0, .02, -.02, .01, -.01: s^2 = .001 / 4, s = .0158114,
    # half-width 2.776445 x .00707107 = .0196323: [.0803677, .1196323] above 0
    assert get("clip_higher", "diff", "diff_low", "diff_high") == pytest.approx([0.10, 0.0803677, 0.1196323], abs=1e-6)
    assert summary["clip_higher"]["verdict"] == "higher" and summary["clip_higher"]["n_paired"] == "5"
    assert get("clip_higher", "mean") == pytest.approx([0.60], abs=1e-9)
    # dgpo - clip: mean .002, deviations .048, -.042, .018, -.032, .008: s^2 = .00548 / 4 = .00137, s = .0370135,
    # half-width 2.776445 x .0165529 = .0459582: [-.0439582, .0479582] contains 0
    assert get("dgpo", "diff", "diff_low", "diff_high") == pytest.approx([0.002, -0.0439582, 0.0479582], abs=1e-6)
    assert summary["dgpo"]["verdict"] == "no difference detected"
    # band_0.02 - clip: -.1 on every seed, s = 0: the interval is the point -.1, below 0
    assert get("band_0.02", "diff", "diff_low", "diff_high") == pytest.approx([-0.1, -0.1, -0.1], abs=1e-9)
    assert summary["band_0.02"]["verdict"] == "lower"
    # dppo_tv: 4 seeds; differences .05, .05, .07, .03: mean .05, s^2 = .0008 / 3, s = .0163299,
    # half-width t_{.975,3} s / 2 = 3.182446 x .00816497 = .0259845
    assert summary["dppo_tv"]["n"] == "4" and summary["dppo_tv"]["n_paired"] == "4"
    assert get("dppo_tv", "diff", "diff_low", "diff_high") == pytest.approx([0.05, 0.0240155, 0.0759845], abs=1e-6)
    text = (tmp_path / "summary.md").read_text()
    assert "no difference detected" in text and "+0.100 [0.080, 0.120]" in text
    assert (tmp_path / "differences_addition.png").is_file()


def test_round_2_defaults_to_its_own_folder_and_is_not_mixed_into_round_1s(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(study, "DEFAULT_OUTPUT_ROUND2", tmp_path / "round2")
    with pytest.raises(SystemExit):  # the folder is round 2's: nothing to report there yet
        study.main(["--arms", "exploration", "--report-only", "--quiet"])
    assert f"no finished runs in {tmp_path / 'round2' / 'runs.csv'}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        study.main(["--arms", "divisors", "exploration", "--quiet"])
    assert "--arms must be round 1's arms or the exploration arm, not both" in capsys.readouterr().err


# -- the real-model arm (here on a tiny chat model: the real one is the real-model tier's) ----------------------------


@pytest.fixture(scope="module")
def chat_study(tmp_path_factory):
    from trl_bandpo.demo.tiny_model import save_tiny_model

    model = save_tiny_model(tmp_path_factory.mktemp("chat_model"), hidden_size=32)
    out = tmp_path_factory.mktemp("chat_study")
    argv = ["--arms", "smollm2", "--model", str(model), "--methods", "clip", "cppo", "--seeds", "0", "--steps", "8",
            "--threads", "1", "--output-dir", str(out), "--quiet"]  # fmt: skip
    assert study.main(argv) == 0
    return out


@pytest.mark.slow
def test_the_real_model_arm_trains_lora_with_its_defaults_and_writes_its_metrics(chat_study):
    settings = json.loads((chat_study / "study.json").read_text())["settings"]
    for name, value in study.REAL_MODEL_DEFAULTS.items():  # its defaults where no flag was given
        if name not in ("seeds", "steps", "threads"):
            assert settings[name] == value, name
    assert settings["steps"] == 8 and Path(settings["model"]).name.startswith("chat_model")  # the given folder
    rows = {row["method"]: row for row in _rows(chat_study / "runs.csv")}
    assert sorted(rows) == ["clip", "cppo"]
    for method, row in rows.items():
        history = json.loads((chat_study / "histories" / f"smollm2__{method}__seed0.json").read_text())["history"]
        # the area: the mean over generation batches (4 optimizer steps each: 2 per pass, 2 passes) of the reward
        batches = {}
        for entry in history:
            if "reward" in entry:
                batches.setdefault((entry["step"] - 1) // 4, []).append(entry["reward"])
        area = sum(sum(v) / len(v) for v in batches.values()) / len(batches)
        assert float(row["reward_area"]) == pytest.approx(area, abs=1e-9) and len(batches) == 2
        assert 0 <= float(row["heldout_mean_at4"]) <= float(row["pass_at4"]) <= 1
        assert float(row["pass_minus_mean_at4"]) == pytest.approx(
            float(row["pass_at4"]) - float(row["heldout_mean_at4"])
        )
        assert 0 <= float(row["heldout_greedy"]) <= 1 and math.isfinite(float(row["entropy_last_quarter"]))
        assert all(0 <= float(row[f"clip_rate_{b}"]) <= 1 for b in study.PROB_BUCKETS if row[f"clip_rate_{b}"])
        assert row["clip_rate_p0.0-0.2"] != ""  # a random tiny model samples tail tokens
        assert row["heldout_mean_at8"] == row["entropy_last30"] == row["warm_sft_steps"] == ""  # tiny arms' columns
        assert 0 <= float(row["warm_heldout_mean_at4"]) <= 1 and 0 <= float(row["warm_heldout_greedy"]) <= 1
    for name in ("summary.md", "curves_smollm2.png", "buckets_smollm2.png", "differences_smollm2.png"):
        assert (chat_study / name).is_file(), name
    text = (chat_study / "summary.md").read_text()
    assert "R7. clip rate, tokens with old p < 0.2" in text and "| CPPO δ=0.15 |" in text


@pytest.mark.slow
def test_the_real_model_arm_is_trained_with_lora_at_its_temperature(chat_study, monkeypatch):
    seen = []

    def train_method(config, label, model_path, rows, bar, reward, callbacks, peft_config=None):
        seen.append((config.temperature, config.max_completion_length, peft_config.r, reward, type(rows[0]["prompt"])))
        raise KeyboardInterrupt  # what it was given is all this test needs

    monkeypatch.setattr(study, "train_method", train_method)
    with pytest.raises(KeyboardInterrupt):
        study.main(["--arms", "smollm2", "--model", json.loads((chat_study / "study.json").read_text())["settings"][
            "model"], "--methods", "dgpo", "--seeds", "0", "--threads", "1", "--output-dir",
            str(chat_study), "--steps", "8", "--quiet"])  # fmt: skip
    assert seen == [(0.7, 16, 16, study.last_number_reward, list)]


def test_the_real_model_arm_runs_alone(tmp_path, capsys):
    with pytest.raises(SystemExit):
        study.main(["--arms", "smollm2", "divisors", "--output-dir", str(tmp_path), "--quiet"])
    assert "--arms must be smollm2 alone (its settings are the real model's), got 'smollm2 divisors'." in (
        capsys.readouterr().err
    )
    with pytest.raises(SystemExit):  # before: a traceback from transformers after study.json was written
        study.main(["--arms", "smollm2", "--model", str(tmp_path / "missing"), "--output-dir", str(tmp_path / "o")])
    assert "--model must be a packaged model's name (smollm2-135m-instruct) or a local model folder" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "o").exists()
    with pytest.raises(SystemExit):  # not silently ignored
        study.main(["--arms", "divisors", "--model", "smollm2-135m-instruct", "--output-dir", str(tmp_path / "o")])
    assert "--arms must be smollm2 with --model (the other arms train the tiny model), got 'divisors'." in (
        capsys.readouterr().err
    )


def test_a_runs_file_of_an_earlier_version_gains_the_new_columns_empty(tmp_path):
    old_columns = [c for c in study.COLUMNS if c not in ("reward_area", "pass_at4", "clip_rate_p0.4-0.6")]
    with open(tmp_path / "runs.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, old_columns, lineterminator="\n")
        writer.writeheader()
        writer.writerow({"arm": "divisors", "method": "clip", "seed": 3, "heldout_mean_at8": 0.25})
    rows = study.read_runs(tmp_path / "runs.csv")
    assert [(r["arm"], r["method"], r["seed"], r["heldout_mean_at8"], r["reward_area"]) for r in rows] == [
        ("divisors", "clip", "3", "0.25", "")
    ]
    assert tuple(_rows(tmp_path / "runs.csv")[0]) == study.COLUMNS  # rewritten with every column
    (tmp_path / "runs.csv").write_text("arm,method,seed,bogus\n")
    with pytest.raises(ValueError, match="has other columns than this script writes"):
        study.read_runs(tmp_path / "runs.csv")


@pytest.mark.slow
def test_the_real_model_arms_defaults_apply_where_no_flag_is_given(chat_study, monkeypatch):
    seen = []
    monkeypatch.setattr(study, "run_study", lambda args, out: seen.append(args) or 0)
    model = json.loads((chat_study / "study.json").read_text())["settings"]["model"]
    with pytest.raises(SystemExit):  # the folder's runs were made with 8 steps, not the default 16
        study.main(["--arms", "smollm2", "--model", model, "--output-dir", str(chat_study), "--quiet"])
    argv = ["--arms", "smollm2", "--model", model, "--steps", "8", "--output-dir", str(chat_study), "--quiet"]
    assert study.main(argv) == 0
    (args,) = seen
    assert args.seeds == [0, 1, 2] and args.methods == list(study.REAL_MODEL_METHODS) and args.threads == 0
    assert (args.lr, args.num_iterations, args.steps_per_generation) == (5e-4, 2, 2)

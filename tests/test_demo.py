"""The offline demo (`trl_bandpo.demo`) at reduced size: files, figure, table, and numbers consistent with the log."""

import json
import math
import re
import warnings
from pathlib import Path

import pytest

from trl_bandpo import PolicyLossConfig, demo

SMALL = [
    "--methods", "grpo,bandpo",
    "--steps", "4",
    "--max-operand", "10",
    "--num-eval", "20",
    "--eval-samples", "2",
    "--hidden-size", "32",
    "--warmup-steps", "20",
    "--warmup-target", "0",
    "--prompts-per-generation", "4",
    "--num-generations", "4",
    "--steps-per-generation", "2",
    "--num-iterations", "2",
    "--lr", "1e-2",
    "--seed", "3",
    "--quiet",
]  # fmt: skip


#: The RL progress bars of the `small_run` fixture: (total, description, steps counted when closed).
BARS: list[tuple] = []


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    import io
    from contextlib import redirect_stdout

    from trl_bandpo.demo import cli

    def recording_bar(**kwargs):  # a disabled (--quiet) tqdm counts nothing: count the updates here
        bar = tqdm(**kwargs)
        close, update, counted, closed = bar.close, bar.update, [0], []

        def count_and_update(n=1):
            counted[0] += n
            return update(n)

        def record_and_close():  # once: tqdm's __del__ closes again
            if kwargs.get("desc", "").startswith("RL") and not closed:
                BARS.append((kwargs.get("total"), kwargs["desc"], counted[0]))
            closed.append(True)
            close()

        bar.update, bar.close = count_and_update, record_and_close
        return bar

    tqdm = cli.tqdm
    buffer = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, redirect_stdout(buffer):
        patch.setattr(cli, "tqdm", recording_bar)
        assert demo.main([*SMALL, "--output-dir", str(out)]) == 0
    return out, buffer.getvalue()


def test_one_progress_bar_per_method_with_its_true_total(small_run):
    """4 steps per method: one bar per method of total 4, named after it, full at the end (not one bar of
    4 x methods whose first ETA covers every method)."""
    assert BARS == [(4, "RL GRPO", 4), (4, "RL BandPO", 4)]


def _table(summary: str):
    lines = [line for line in summary.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    assert set(lines[1].replace("|", "")) <= {"-"}
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]
    return header, {row[0]: dict(zip(header, row)) for row in rows}


def test_files_and_figure(small_run):
    from PIL import Image  # matplotlib (a dependency) brings Pillow

    out, _ = small_run
    for name in ("metrics.csv", "figure.png", "summary.md", "results.json", "warmstart/config.json"):
        assert (out / name).is_file(), name
    assert (out / "figure.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(out / "figure.png") as image:
        image.verify()
    with Image.open(out / "figure.png") as image:
        width, height = image.size
        assert width > 300 and height > 300
        low, high = image.convert("L").getextrema()
        assert low < high  # something was drawn


def test_table_printed_and_complete(small_run):
    out, printed = small_run
    summary = (out / "summary.md").read_text()
    assert summary.strip() in printed  # the summary is what the demo prints at the end
    header, rows = _table(summary)
    assert header[0] == "method" and "entropy final" in header and "held-out acc (greedy)" in header
    assert list(rows) == ["warm start (no RL)", "GRPO", "BandPO"]
    assert rows["BandPO"]["policy loss"] == "band" and rows["GRPO"]["policy loss"] == "clip"
    for label in ("GRPO", "BandPO"):
        columns = ("held-out acc (greedy)", "held-out acc (sampled)", "entropy final", "entropy mean", "clip rate")
        for column in columns:
            value = float(rows[label][column])
            assert math.isfinite(value)
        assert 0 <= float(rows[label]["held-out acc (greedy)"]) <= 1
    # observations: one line per comparison, each answered from the numbers
    observations = [line for line in summary.splitlines() if line.startswith("- ")]
    assert any(line.startswith("- BandPO kept entropy higher than GRPO: ") for line in observations)
    for line in observations:
        assert re.search(r": (yes|no|n/a)\b", line), line


def test_numbers_match_the_logged_metrics(small_run):
    out, _ = small_run
    metrics = demo.read_metrics_csv(out / "metrics.csv")
    results = json.loads((out / "results.json").read_text())
    _, table = _table((out / "summary.md").read_text())
    assert set(metrics) == {"grpo", "bandpo"} == set(results["methods"])
    for method, history in metrics.items():
        row = results["methods"][method]
        assert [int(entry["step"]) for entry in history] == [1, 2, 3, 4]
        entropy = [entry["entropy"] for entry in history]
        assert all(math.isfinite(x) and x >= 0 for x in entropy)
        assert any(math.isfinite(entry["reward"]) for entry in history)
        for entry in history:
            for key in ("clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean"):
                assert 0 <= entry[key] <= 1
            low, high = entry["clip_ratio/low_mean"], entry["clip_ratio/high_mean"]
            assert math.isclose(entry["clip_ratio/region_mean"], low + high, abs_tol=1e-9)
        # the table and results.json are computed from exactly these logged values
        assert row["entropy_final"] == entropy[-1]
        assert math.isclose(row["entropy_mean"], sum(entropy) / len(entropy), rel_tol=1e-12)
        assert table[row["method"]]["entropy final"] == f"{entropy[-1]:.3f}"
        region = [entry["clip_ratio/region_mean"] for entry in history]
        assert math.isclose(row["clip_rate_mean"], sum(region) / len(region), rel_tol=1e-12, abs_tol=1e-15)
        tail, _, steps = demo.tail_share_of_upper_clipping(history)
        assert row["tail_share_steps"] == steps
        assert (row["tail_share"] is None and math.isnan(tail)) or math.isclose(row["tail_share"], tail)
        columns = {"heldout_acc_greedy": "held-out acc (greedy)", "heldout_acc_sampled": "held-out acc (sampled)"}
        for key, column in columns.items():
            assert 0 <= row[key] <= 1
            assert table[row["method"]][column] == f"{row[key]:.3f}"
        if method == "bandpo":  # per-token Band bounds were logged; GRPO's are the constants 0.8 / 1.2
            assert all(entry["bounds/upper_mean"] > 1 for entry in history)
        else:
            assert all(math.isclose(entry["bounds/upper_mean"], 1.2, rel_tol=1e-6) for entry in history)
    # same seed, same data: the first generation batch (and so its reward) is identical across methods
    first_reward = {m: next(e["reward"] for e in h if math.isfinite(e["reward"])) for m, h in metrics.items()}
    assert first_reward["grpo"] == first_reward["bandpo"]


def test_warm_start_is_cached(small_run):
    out, _ = small_run
    again = [*SMALL, "--output-dir", str(out)]
    again[again.index("grpo,bandpo")] = "grpo"
    again[again.index("--steps") + 1] = "2"
    assert demo.main(again) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["warm_start"]["reused"] is True
    assert list(results["methods"]) == ["grpo"]


def test_method_settings_and_arguments():
    assert demo.method_settings("clip_higher", 0.02)["epsilon_high"] == 0.28
    band = demo.method_settings("bandpo", 0.03)
    assert band["policy_loss"] == "band" and band["band_radius"] == 0.03 and band["band_upper_max"] == 10.0
    dgpo = demo.method_settings("dgpo", 0.02)
    assert (dgpo["dgpo_n"], dgpo["dgpo_m"], dgpo["epsilon"], dgpo["epsilon_high"]) == (1, 2.0, 0.2, 0.2)
    assert demo.method_settings("relaxed_band", 0.05)["epsilon_high"] == 0.28
    assert demo.method_settings("dcpo", 0.05)["epsilon"] == 0.16
    assert demo.method_settings("aspo", 0.05)["policy_loss"] == "aspo"
    dppo = demo.method_settings("dppo", 0.02)
    assert (dppo["policy_loss"], dppo["dppo_kl_radius"], dppo["dppo_ratio_cap"]) == ("dppo_kl", 0.02, 10000.0)
    assert "epsilon" not in demo.method_settings("band", 0.05)  # Band does not read epsilon: setting it would warn

    # the masking trust regions at their authors' settings: the config's defaults, but CPPO's delta for dense models
    def config(name):
        fields = {k: v for k, v in demo.method_settings(name, 0.02).items() if k != "label"}
        return PolicyLossConfig(output_dir="unused", use_cpu=True, report_to="none", **fields)

    assert "epsilon" not in demo.method_settings("cppo", 0.02)  # CPPO does not read epsilon
    cppo, trm, m2po, icepop = (config(name) for name in ("cppo", "trm", "m2po", "icepop"))
    assert (cppo.cppo_delta, cppo.cppo_w_min, cppo.cppo_delta_b) == (0.15, 0.8, 0.02)
    assert (trm.trm_divergence, trm.trm_reduce, trm.trm_threshold, trm.epsilon, trm.epsilon_high) == (
        "k3",
        "mean",
        0.01,
        0.2,
        None,
    )  # fmt: skip  (epsilon_high None: TRL reads epsilon)
    assert (m2po.m2po_threshold, icepop.icepop_low, icepop.icepop_high) == (0.04, 0.5, 5.0)
    # every method builds a config without "no effect" warnings
    for name in ("bandpo", "dppo", "band", "band_dgpo", "drpo", "spo", "ipo", "cppo", "trm", "m2po", "icepop"):
        fields = {k: v for k, v in demo.method_settings(name, 0.02).items() if k != "label"}
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*no effect.*")
            PolicyLossConfig(output_dir="unused", use_cpu=True, report_to="none", **fields)
    with pytest.raises(ValueError, match="unknown method"):
        demo.method_settings("ppo2", 0.05)
    with pytest.raises(SystemExit):
        demo.main(["--methods", "nope", "--quiet"])
    with pytest.raises(SystemExit):
        demo.main(["--steps", "0", "--quiet"])
    train, held_out = demo.make_problems(10, 0, 20, seed=0)
    assert len(train) == 80 and len(held_out) == 20
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    assert demo.correctness_reward(["12", " 12", "13", "121"], ["12"] * 4) == [1.0, 1.0, 0.0, 0.0]


def test_observations_are_computed_not_asserted():
    base = {"entropy_first": 1.0, "entropy_final": 0.5, "entropy_mean": 0.7, "entropy_end": 0.5,
            "entropy_end_se": 0.01, "tail_share": 0.6, "tail_share_se": 0.01, "clip_rate_mean": 0.1,
            "clip_rate_mean_se": 0.001, "heldout_acc_sampled": 0.5, "heldout_acc_sampled_se": 0.005}  # fmt: skip
    rows = {
        "grpo": {**base, "method": "GRPO"},
        "bandpo": {
            **base,
            "method": "BandPO",
            "entropy_end": 0.3,
            "tail_share": 0.1,
            "heldout_acc_sampled": 0.505,
            "tail_share_se": float("nan"),
        },  # fmt: skip
    }
    lines = demo.observations(rows, "grpo", {"sampled": 0.4, "sampled_se": 0.005})
    text = "\n".join(lines)
    assert "BandPO kept entropy higher than GRPO: no (0.300 vs 0.500" in text
    assert "BandPO put a smaller share of its upper-side clipping on tail tokens (p < 0.2) than GRPO: yes (0.1" in text
    assert "BandPO reached a higher held-out accuracy (sampled) than GRPO: yes, within noise (0.505 vs 0.500)" in text
    assert "GRPO improved held-out accuracy (sampled) over the warm start: yes (0.400 -> 0.500)" in text


def test_clip_rate_panel_groups_off_policy_updates_by_generation_batch():
    """The per-step clip rate is a sawtooth (0 on the first, on-policy update of each generation batch): the
    figure plots one value per batch, the mean of its off-policy updates, so methods can be compared."""
    from trl_bandpo.demo.figure import clip_rate_per_generation_batch

    updates = 4
    per_batch = [0.10, 0.30]
    history = []
    for batch, rate in enumerate(per_batch):
        for k in range(updates):
            step = batch * updates + k + 1
            history.append({"step": step, "clip_ratio/region_mean": 0.0 if k == 0 else rate + 0.01 * (k - 2)})
    xs, ys = clip_rate_per_generation_batch(history, updates)
    assert xs == [4, 8]
    assert ys == pytest.approx(per_batch)  # the on-policy zeros are left out, the rest averaged
    assert clip_rate_per_generation_batch(history, 1) == ([], [])


def test_the_printed_figure_and_metrics_paths_open_as_printed(small_run):
    """The summary names the figure and the metrics with their folder: the paths it prints are files."""
    out, printed = small_run
    figure = re.search(r"Figure: (\S+)\. Per-step metrics: (\S+)\. ", printed)
    assert figure, printed[-500:]
    assert figure.group(1) == str(out / "figure.png") and figure.group(2) == str(out / "metrics.csv")
    assert all(Path(path).is_file() for path in figure.groups())


def test_help_lists_every_method_the_demo_runs(capsys):
    """Every named method and every built-in policy loss (the registry, not a list in the demo) is in ``--help``,
    and each one passes the argument checks."""
    from trl_bandpo import POLICY_LOSSES
    from trl_bandpo.demo.cli import _check_args

    with pytest.raises(SystemExit):
        demo.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    listed = text[text.index("--methods METHOD") :]
    names = [*demo.METHOD_PRESETS, *POLICY_LOSSES]
    assert {"adaptive_band", "band_dgpo", "dppo", "dppo_tv", "dppo_kl", "cispo", "drpo", "spo", "ipo"} <= set(names)
    assert {"cppo", "trm", "m2po", "icepop"} <= set(names)
    for name in names:
        assert re.search(rf"[\s:]{name}[,( ]", listed), name
        settings, _, _ = _check_args(demo.build_parser().parse_args(["--methods", name]))
        assert list(settings) == [name]


BAD_VALUES = [
    ("--seed", "-1", "an integer in [0, 4294967295]"),
    ("--seed", "4294967296", "an integer in [0, 4294967295]"),
    ("--steps", "0", "an integer >= 1"),
    ("--steps", "-5", "an integer >= 1"),
    ("--lr", "nan", "a finite number > 0"),
    ("--lr", "0", "a finite number > 0"),
    ("--lr", "inf", "a finite number > 0"),
    ("--warmup-lr", "-0.001", "a finite number > 0"),
    ("--band-radius", "inf", "a finite number >= 1.17549e-38"),
    ("--band-radius", "nan", "a finite number >= 1.17549e-38"),
    ("--band-radius", "0", "a finite number >= 1.17549e-38"),
    ("--warmup-target", "1.5", "a number in [0, 1]"),
    ("--warmup-target", "nan", "a number in [0, 1]"),
    ("--num-generations", "1", "an integer >= 2"),
    ("--num-iterations", "0", "an integer >= 1"),
    ("--steps-per-generation", "0", "an integer >= 1"),
    ("--steps-per-generation", "3", "a divisor of"),
    ("--prompts-per-generation", "0", "an integer >= 1"),
    ("--prompts-per-generation", "81", "at most the 80 training prompts"),
    ("--eval-samples", "-1", "an integer >= 0"),
    ("--num-eval", "0", "an integer >= 1"),
    ("--num-eval", "100", "below the 100 problems"),
    ("--num-prompts", "-3", "an integer >= 0"),
    ("--num-prompts", "81", "at most the 80 problems left"),
    ("--max-operand", "1", "an integer in [2, 1000]"),
    ("--max-operand", "1001", "an integer in [2, 1000]"),
    ("--hidden-size", "12", "a multiple of 8"),
    ("--hidden-size", "0", "an integer >= 8"),
    ("--num-layers", "0", "an integer in [1, 64]"),
    ("--warmup-steps", "-1", "an integer >= 0"),
    ("--warmup-batch-size", "0", "an integer >= 1"),
    ("--threads", "-2", "an integer >= 0"),
    ("--methods", "ppo2", "one of ['grpo', 'clip_higher'"),
]


@pytest.mark.parametrize("flag,value,allowed", BAD_VALUES, ids=[f"{f}={v}" for f, v, _ in BAD_VALUES])
def test_a_bad_value_is_refused_when_the_arguments_are_parsed(flag, value, allowed, tmp_path, capsys):
    """Exit status 2 at once, naming the flag, the value and what is allowed, with nothing written (the warm start
    writes the output folder first)."""
    arguments = [*SMALL, "--output-dir", str(tmp_path / "out"), flag, value]
    with pytest.raises(SystemExit) as exc:
        demo.main(arguments)
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert exc.value.code == 2
    assert f"{flag} must be " in message and allowed in message and value in message, message
    assert not (tmp_path / "out").exists()


def test_an_unwritable_output_folder_is_one_line_and_exit_2(tmp_path, capsys):
    """A folder that cannot be created (its parent is a file), or a file given as the folder: one line naming
    --output-dir and the path, exit status 2, before any work."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for output_dir in (blocker / "out", blocker):
        with pytest.raises(SystemExit) as exc:
            demo.main([*SMALL, "--output-dir", str(output_dir)])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and len(err.strip().splitlines()) == 1, err
        assert "--output-dir" in err and str(output_dir) in err and "Traceback" not in err
    assert blocker.read_text() == "x"

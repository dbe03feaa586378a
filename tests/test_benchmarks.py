"""The GPU run's harness works before a GPU is lent: `benchmarks/bench_train_gpu.py` trains GRPOTrainer and
BandPOTrainer side by side on CPU and records finite losses, and `benchmarks/run_gpu.sh` parses, names only files
and steps that exist, refuses bad settings, and removes its working folder however it ends."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_training_benchmark_runs_trl_and_our_trainers_side_by_side(tmp_path):
    bench = _load("bench_train_gpu")
    out = tmp_path / "train.md"
    argv = ["--device", "cpu", "--sizes", "tiny", "--steps", "8", "--batch", "16", "--length", "8", "--rounds", "1",
            "--methods", "grpo,band,dgpo", "--out", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    rows = json.loads(out.with_suffix(".json").read_text())
    assert set(rows) == {"tiny/grpo", "tiny/band", "tiny/dgpo"}
    assert rows["tiny/grpo"]["ratio"] == 1.0
    for row in rows.values():
        assert row["non_finite"] == 0 and row["logged"] > 0
        assert math.isfinite(row["train_ms"]) and math.isfinite(row["generation_ms"]) and row["train_ms"] > 0
    table = out.read_text()
    assert table.count("| tiny ") == 3 and "ratio to grpo" in table


def test_training_benchmark_rejects_unknown_methods():
    bench = _load("bench_train_gpu")
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--methods", "grpo,ppo"])


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not installed")
def test_run_gpu_script_parses_and_its_files_exist():
    script = ROOT / "benchmarks" / "run_gpu.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    for path in sorted(set(re.findall(r"\b((?:tests|benchmarks|accelerate_configs)/[\w./-]+\.(?:py|yaml|sh))", text))):
        assert (ROOT / path).exists(), path
    steps = re.findall(r"^run_step (\w+) (\d+) ", text, flags=re.M)
    assert [name for name, _ in steps] == [
        "gpu_tests", "bench_kl", "train_tiny", "train_wide", "zero3", "entropies", "bench_bf16", "interpreter",
    ]  # fmt: skip
    for name, _ in steps:  # every step is documented in the header
        assert re.search(rf"^#\s+{name}\s", text, flags=re.M), name


STEPS = "gpu_tests,bench_kl,train_tiny,train_wide,zero3,entropies,bench_bf16,interpreter"


def _run_gpu(tmp_path, **env) -> subprocess.CompletedProcess:
    """run_gpu.sh with PYTHON=true, a stand-in that does nothing: a step that runs (a missed check) ends at once."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": "true", **env}
    script = ROOT / "benchmarks" / "run_gpu.sh"
    return subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not installed")
def test_run_gpu_script_steps_list_is_its_run_steps():
    """The names RUN_GPU_STEPS is checked against are the steps the script runs."""
    text = (ROOT / "benchmarks" / "run_gpu.sh").read_text()
    listed = re.search(r"^STEPS=\(([\w ]+)\)", text, flags=re.M).group(1).split()
    assert listed == re.findall(r"^run_step (\w+) ", text, flags=re.M) == STEPS.split(",")


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not installed")
@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RUN_GPU_STEPS": "train_wide,zer03"}, f"RUN_GPU_STEPS='train_wide,zer03' names an unknown step 'zer03'; "
                                                f"the steps are {STEPS}"),
        ({"RUN_GPU_BUDGET_S": "abc"}, "RUN_GPU_BUDGET_S='abc' is not a whole number of seconds"),
        ({"RUN_GPU_BUDGET_S": "9m"}, "RUN_GPU_BUDGET_S='9m' is not a whole number of seconds"),
        ({"RUN_GPU_REHEARSAL": "yes"}, "RUN_GPU_REHEARSAL='yes' is not 1"),
        ({"PYTHON": "no-such-python3"}, "PYTHON='no-such-python3' is not a command"),
    ],
)  # fmt: skip
def test_run_gpu_script_refuses_a_bad_setting_before_running_anything(tmp_path, env, message):
    """A typo is an error that names the setting (exit 2, no step, no output), not a run that skips every step and
    exits 0, nor bash's "unbound variable"."""
    result = _run_gpu(tmp_path, **env)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert f"run_gpu.sh: error: {message}" in result.stderr
    assert "unbound variable" not in result.stderr and result.stdout == ""
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not installed")
def test_run_gpu_script_refuses_an_unwritable_output_folder(tmp_path):
    (tmp_path / "a_file").write_text("")
    out = tmp_path / "a_file" / "out"  # a folder below a file: cannot be created, even by root
    result = _run_gpu(tmp_path, OUT=str(out), RUN_GPU_STEPS="interpreter")
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert f"run_gpu.sh: error: cannot write to the output folder OUT='{out}'" in result.stderr
    assert result.stdout == ""


SLOW_STEP = """#!/bin/sh
# Stand-in for python: a step (pytest) writes its pid and sleeps; everything else succeeds at once.
case "$*" in *pytest*) echo $$ > "$FAKE_PID"; exec sleep 60 ;; esac
exit 0
"""


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not installed")
@pytest.mark.parametrize("python", ["true", "false"])
def test_run_gpu_script_removes_its_working_folder(tmp_path, python):
    """Issue 27, item 9: the working folder (mktemp -d under $TMPDIR) is gone when the run ends, passed or failed."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    result = _run_gpu(tmp_path, TMPDIR=str(tmpdir), RUN_GPU_STEPS="interpreter", PYTHON=python)
    assert result.returncode == (0 if python == "true" else 1), result.stdout[-2000:] + result.stderr[-2000:]
    assert "run_gpu.sh: step interpreter" in result.stdout and (tmp_path / "out" / "results.tar.gz").exists()
    assert list(tmpdir.iterdir()) == []


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not installed")
@pytest.mark.parametrize(("sig", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 129)])
def test_run_gpu_script_stopped_by_a_signal_stops_its_step_and_removes_its_working_folder(tmp_path, sig, status):
    tmpdir, pid_file, python = tmp_path / "tmp", tmp_path / "step.pid", tmp_path / "python"
    tmpdir.mkdir()
    python.write_text(SLOW_STEP)
    python.chmod(0o755)
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": str(python), "TMPDIR": str(tmpdir),
           "FAKE_PID": str(pid_file), "RUN_GPU_STEPS": "interpreter"}  # fmt: skip
    script = subprocess.Popen(["bash", str(ROOT / "benchmarks" / "run_gpu.sh")], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.05)
        step = int(pid_file.read_text())
        assert len(list(tmpdir.iterdir())) == 1  # the working folder, while the step runs
        script.send_signal(sig)
        assert script.wait(timeout=20) == status  # at once, not after the step's 60 s
    finally:
        script.kill()
    assert list(tmpdir.iterdir()) == []
    for _ in range(100):  # the step was stopped too
        try:
            os.kill(step, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.kill(step, signal.SIGKILL)
        raise AssertionError("the step outlived the script")

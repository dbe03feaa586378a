"""The GPU run's harness works before a GPU is lent: `benchmarks/bench_train_gpu.py` trains GRPOTrainer and
BandPOTrainer side by side on CPU and records finite losses, and `benchmarks/run_gpu.sh` parses and names only files
and steps that exist."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shutil
import subprocess
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

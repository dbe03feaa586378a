"""``trl-bandpo eval --backend vllm`` with a real engine (its own process, as a user runs it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_tier import MAX_MODEL_LEN, require_vllm

require_vllm()  # before anything here touches vLLM

PROBLEMS = [(i, 2 * i) for i in (1, 2, 3)]


@pytest.fixture(scope="module")
def bench(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("eval_bench") / "tiny.jsonl"
    path.write_text("".join(json.dumps({"problem": f"{a}+{a}=?", "answer": str(b)}) + "\n" for a, b in PROBLEMS))
    return path


def run_eval(model_dir, bench, out: Path, backend: str, *flags: str) -> tuple[dict, list[dict]]:
    command = [
        str(Path(sys.executable).with_name("trl-bandpo")), "eval", "--model", str(model_dir),
        "--benchmarks", f"tiny={bench}", "--backend", backend, "--max-new-tokens", "8", "--dtype", "float32",
        "--max-model-len", str(MAX_MODEL_LEN), "--output-dir", str(out), "--device", "cpu", *flags,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    results = json.loads((out / "results.json").read_text())
    samples = [json.loads(line) for line in (out / "samples_tiny.jsonl").read_text().splitlines()]
    return results, samples


def test_greedy_vllm_eval_matches_transformers(vllm_model_dir, bench, tmp_path):
    """Greedy decoding through the engine gives exactly ``generate``'s completions (same prompts, no extra BOS,
    same decoding), n times each; the metrics are computed from them."""
    flags = ("--temperature", "0", "--num-samples", "2")
    results, samples = run_eval(vllm_model_dir, bench, tmp_path / "vllm", "vllm", *flags)
    _, reference = run_eval(vllm_model_dir, bench, tmp_path / "hf", "transformers", *flags)
    assert results["settings"]["backend"] == "vllm"
    assert [row["solution"] for row in samples] == [str(b) for _, b in PROBLEMS]
    assert [row["completions"] for row in samples] == [row["completions"] for row in reference]
    for row in samples:
        assert len(row["completions"]) == 2 and row["completions"][0] == row["completions"][1] != ""
    correct = results["benchmarks"]["tiny"]["correct_per_problem"]
    assert correct == [sum(row["correct"]) for row in samples]


def test_sampled_vllm_eval(vllm_model_dir, bench, tmp_path):
    results, samples = run_eval(
        vllm_model_dir, bench, tmp_path / "vllm", "vllm", "--num-samples", "4", "--seed", "3", "--ks", "1", "4"
    )
    settings = results["settings"]
    assert settings["backend"] == "vllm" and settings["num_samples"] == 4 and settings["temperature"] == 1.0
    assert len(samples) == len(PROBLEMS) and all(len(row["completions"]) == 4 for row in samples)
    assert len({text for row in samples for text in row["completions"]}) > len(PROBLEMS)  # sampled, not repeated
    metrics = results["benchmarks"]["tiny"]
    assert metrics["correct_per_problem"] == [sum(row["correct"]) for row in samples]
    assert {"mean@4", "pass@1", "pass@4"} <= set(metrics)

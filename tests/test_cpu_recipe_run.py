"""The documented one-minute CPU run of a recipe (docs/training.md, "Run a recipe on CPU"; the README shows the same
commands) runs as written and trains: rewards that differ within a group, a gradient, and policy-loss bounds that act
on the second, off-policy, step, for the documented BandPO LoRA recipe and a full-size BandPO recipe (DAPO's prompt
and reward), offline, without library noise. (How long it takes is measured, not asserted here: a busy machine
stretches it.)"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FULL_SIZE_BANDPO = "recipes/bandpo/qwen2.5-3b-instruct_band-kl-0.05.yaml"


def documented_commands() -> tuple[str, str]:
    """docs/training.md's two commands: `trl-bandpo tiny-model /tmp/tiny` and the `trl-bandpo train` line."""
    text = (ROOT / "docs" / "training.md").read_text()
    (block,) = [b for b in re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL) if "trl-bandpo tiny-model" in b]
    lines = [line.strip() for line in re.sub(r"\s*\\\n\s*", " ", block).splitlines() if line.strip()]
    make, train = [line for line in lines if not line.startswith("#")]
    return make, train


def run(line: str, folder: Path) -> subprocess.CompletedProcess:
    """Run a documented command as written, but for the folder (/tmp/tiny -> `folder`) and `trl-bandpo` (this
    environment's)."""
    args = shlex.split(line.replace("/tmp/tiny", str(folder)))
    env = {**os.environ, "HF_HUB_OFFLINE": "0"}  # whatever the suite sets: the command's own assignment counts
    while "=" in args[0]:
        name, _, value = args.pop(0).partition("=")
        env[name] = value
    assert args[0] == "trl-bandpo"
    return subprocess.run([str(Path(sys.executable).with_name("trl-bandpo")), *args[1:]], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    make, line = documented_commands()
    folder = tmp_path_factory.mktemp("cpu_run") / "tiny"
    made = run(make, folder)
    assert made.returncode == 0, made.stderr[-3000:]
    recipe = shlex.split(line)[shlex.split(line).index("--config") + 1]
    printed = made.stdout.strip().splitlines()[-1]  # the command tiny-model prints is the documented one
    assert printed.replace("--config RECIPE", f"--config {recipe}") == line.replace("/tmp/tiny", str(folder))
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["documented", FULL_SIZE_BANDPO])
def test_the_documented_cpu_run_trains_and_its_bounds_act(recipe, tiny):
    folder = tiny
    _, line = documented_commands()
    documented = shlex.split(line)[shlex.split(line).index("--config") + 1]
    assert documented.startswith("recipes/lora/") and "band" in documented  # the BandPO LoRA recipe
    if recipe != "documented":
        line = line.replace(f"--config {documented}", f"--config {recipe}")
    trained = run(line, folder)
    output = trained.stdout + trained.stderr
    assert trained.returncode == 0, output[-3000:]
    for noise in ("FutureWarning", "Setting accelerator to CPU", "exceed the", "Traceback"):
        assert noise not in output, noise
    state = json.loads((folder / "run" / "trainer_state.json").read_text())
    first, second = [entry for entry in state["log_history"] if "loss" in entry]
    (reward,) = [key for key in first if key.startswith("rewards/") and key.endswith("/mean")]
    # 1. rewards differ within a group: some right (+1), some wrong (-1), and not every group alike
    assert -1 < first[reward] < 1 and first["reward_std"] > 0 and first["frac_reward_zero_std"] < 1, first
    # 2. a gradient on both steps (the on-policy loss itself can be 0: group-normalised advantages sum to 0)
    assert first["grad_norm"] > 0 and second["grad_norm"] > 0 and second["loss"] != 0, (first, second)
    # 3. the first step is on-policy (every ratio 1: nothing clipped); on the second, off-policy, the Band bounds act
    assert first["clip_ratio/region_mean"] == 0, first
    assert second["clip_ratio/region_mean"] > 0, second
    assert 0 < second["bounds/lower_mean"] < 1 < second["bounds/upper_mean"], second

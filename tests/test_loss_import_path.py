"""A policy loss from the user's own package, named by import path `package.module:loss` (docs/adding-a-policy-loss.md,
"From a recipe, by import path"): the pure API, the errors, and `trl-bandpo train` running the page's recipe and
command as written."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from test_docs import fenced_blocks

from trl_bandpo import PolicyLossConfig, policy_loss
from trl_bandpo.cli.tiny_model import write_problems
from trl_bandpo.demo.tiny_model import save_tiny_model

PAGE = Path(__file__).resolve().parents[1] / "docs" / "adding-a-policy-loss.md"

# Appended after the page's loss function: the same loss, recording the `leak` each call receives.
RECORDING = textwrap.dedent(
    """
    import os as _os

    _page_loss = leaky_clip_loss


    def leaky_clip_loss(log_ratio, advantages, lower, upper, *, leak=0.1):
        with open(_os.environ["LEAK_RECORD"], "a") as record:
            record.write(f"{leak}\\n")
        return _page_loss(log_ratio, advantages, lower, upper, leak=leak)
    """
)


@pytest.fixture(scope="module")
def user_package(tmp_path_factory):
    """`my_losses/leaky.py` made of the page's steps 1 and 2 (the loss and its registration), on sys.path."""
    root = tmp_path_factory.mktemp("user_code")
    package = root / "my_losses"
    package.mkdir()
    (package / "__init__.py").write_text("")
    loss_block, register_block = fenced_blocks(PAGE.read_text(), "python")[:2]
    assert "def leaky_clip_loss" in loss_block and "register_policy_loss" in register_block
    (package / "leaky.py").write_text(loss_block + RECORDING + register_block)
    import trl_bandpo.core.loss_registry as registry

    saved = dict(registry._REGISTRY)
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))
    for name in [name for name in sys.modules if name == "my_losses" or name.startswith("my_losses.")]:
        del sys.modules[name]
    registry._REGISTRY.clear()  # the user's loss does not leak into other tests
    registry._REGISTRY.update(saved)


def test_the_pure_api_imports_and_runs_the_users_loss(user_package, tmp_path, monkeypatch):
    monkeypatch.setenv("LEAK_RECORD", str(tmp_path / "record"))
    old = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    logps = (old + torch.log(torch.tensor([[0.5, 1.0]], dtype=torch.float64))).requires_grad_(True)
    advantages = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    loss = policy_loss("my_losses.leaky:leaky_clip", logps, old, advantages, leak=0.25)
    loss.sum().backward()
    # r = 0.5 < 1 - 0.2 with A < 0 (LN): leak * r = 0.125; r = 1 inside: w = 1
    torch.testing.assert_close(-logps.grad / advantages, torch.tensor([[0.125, 1.0]], dtype=torch.float64))


@pytest.mark.parametrize(
    "name,needle",
    [
        ("no_such_package.losses:leaky_clip", "cannot import 'no_such_package.losses'"),
        ("my_losses.leaky:leaky", "registered no policy loss named 'leaky'"),
        ("my_losses.leaky:", "an import path is 'package.module:loss'"),
    ],
)
def test_errors_name_what_failed(user_package, name, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        PolicyLossConfig(output_dir="unused", use_cpu=True, report_to="none", policy_loss=name)


def _page_recipe_and_command(tmp_path: Path) -> tuple[Path, list[str]]:
    """The page's recipe (its paths moved under `tmp_path`) and its command's arguments."""
    text = PAGE.read_text()
    recipe = fenced_blocks(text, "yaml")[-1].replace("/tmp/tiny", str(tmp_path / "tiny"))
    path = tmp_path / "leaky.yaml"
    path.write_text(recipe)
    (command,) = fenced_blocks(text, "console")
    words = shlex.split(command.strip())
    assert words[:2] == ["PYTHONPATH=.", "trl-bandpo"] and words[2:5] == ["train", "--config", "leaky.yaml"]
    return path, words[5:]


def _train(user_package, tmp_path, extra=()):
    save_tiny_model(tmp_path / "tiny")
    write_problems(tmp_path / "tiny" / "problems.jsonl")
    _, args = _page_recipe_and_command(tmp_path)
    trl_bandpo = Path(sys.executable).parent / "trl-bandpo"
    env = dict(os.environ, PYTHONPATH=str(user_package), HF_HUB_OFFLINE="1", LEAK_RECORD=str(tmp_path / "record"))
    command = [str(trl_bandpo), "train", "--config", "leaky.yaml", *args, *extra]
    return subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)


@pytest.mark.slow
def test_trl_bandpo_train_runs_the_pages_recipe_with_the_users_loss(user_package, tmp_path):
    run = _train(user_package, tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    leaks = (tmp_path / "record").read_text().split()
    assert leaks and set(leaks) == {"0.25"}  # the recipe's value reached every call of the user's loss


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--leaky_clip_lek", "0.3"], "leaky_clip_lek"),
        (["--leaky_clip_leak", "2"], "leaky_clip_leak must be a number in [0, 1]"),
        (["--policy_loss", "my_losses.nowhere:leaky_clip"], "cannot import 'my_losses.nowhere'"),
    ],
)
def test_train_refuses_a_bad_setting_of_the_users_loss_by_name(user_package, tmp_path, extra, needle):
    run = _train(user_package, tmp_path, extra)
    assert run.returncode == 2, run.stderr[-3000:]
    assert needle in run.stderr
    assert not (tmp_path / "record").exists()  # nothing trained

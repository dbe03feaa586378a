"""The `trl-bandpo` command: `demo` (the offline CPU demo), `bounds` (a Band bounds table), `train`, `eval`,
`tiny-model` (a tiny local model for CPU runs of any recipe).

Each subcommand lives in its own module (`bounds`, `train`, `eval`, `tiny_model`; the demo is
`trl_bandpo.demo.main`) and is imported only when it runs.
"""

from __future__ import annotations

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
  tiny-model PATH
           save a tiny local model and problems, and print the command that runs any recipe on CPU with them
  patched-source
           print TRL's loss methods as trl-bandpo patches them (docs/upgrading-trl.md)
"""


def main(argv: Sequence[str] | None = None) -> None:
    """Dispatch ``trl-bandpo <command> [options]`` (default `sys.argv[1:]`); an unknown command exits with status 2.
    ``--version`` / ``-V`` prints the package version."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return
    if argv[0] in ("-V", "--version"):
        print(f"trl-bandpo {__version__}")
        return
    command, rest = argv[0], argv[1:]
    if command == "bounds":
        from .bounds import bounds_main

        bounds_main(rest)
    elif command == "demo":
        from ..demo import main as demo_main

        demo_main(rest)
    elif command == "train":
        from .train import main as train_main

        train_main(rest)
    elif command == "eval":
        from .eval import eval_main

        eval_main(rest)
    elif command == "patched-source":
        print_patched_source()
    elif command == "tiny-model":
        from .tiny_model import tiny_model_main

        tiny_model_main(rest)
    else:
        print(f"trl-bandpo: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        sys.exit(2)


def print_patched_source() -> None:
    """Print each TRL method trl-bandpo runs patched (`trl_bandpo.training.trl_patches`), as it runs."""
    import inspect

    from ..training import async_trainer, trainer  # noqa: F401 - importing them applies the patches
    from ..training.trl_patches import PATCHED_METHODS

    for name, function in PATCHED_METHODS.items():
        print(f"# {name}: {function.__code__.co_filename}\n{inspect.getsource(function)}")

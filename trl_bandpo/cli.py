"""`trl-bandpo` command: `demo` (the offline CPU demo), `bounds` (print a Band bounds table), `train`, `eval`."""

from __future__ import annotations

import argparse
import sys

USAGE = """trl-bandpo <command> [options]

commands:
  demo     train GRPO, Clip-Higher, BandPO and DGPO on a tiny offline task and plot the comparison
  bounds   print the Band ratio bounds for a divergence and radius
  train    train from a YAML recipe (TRL's TrlParser; see recipes/)
  eval     mean@k and pass@k on math benchmarks
"""

DEFAULT_PROBABILITIES = (1e-6, 1e-4, 1e-3, 0.01, 0.05, 0.08, 0.2, 0.5, 0.8, 0.95, 0.99, 0.999)


def bounds_main(argv=None) -> None:
    import torch

    from .band import DIVERGENCES, band_bounds

    parser = argparse.ArgumentParser(prog="trl-bandpo bounds", description="Band ratio bounds per old probability p.")
    parser.add_argument("--divergence", default="kl", choices=DIVERGENCES)
    parser.add_argument("--radius", type=float, default=0.05, help="trust-region radius delta")
    parser.add_argument("--upper-max", type=float, default=None, help="cap on the upper bound (authors: 10)")
    parser.add_argument("--relax", type=float, nargs=2, metavar=("EPS_LOW", "EPS_HIGH"), default=None)
    parser.add_argument("--p", type=float, nargs="+", default=list(DEFAULT_PROBABILITIES), help="probabilities")
    args = parser.parse_args(argv)
    try:
        logp = torch.tensor(args.p, dtype=torch.float64).log()
        lower, upper = band_bounds(
            logp, args.radius, args.divergence, upper_max=args.upper_max, relax=args.relax, solver="torch"
        )
    except ValueError as err:
        parser.error(str(err))
    print(f"Band bounds, divergence={args.divergence}, radius={args.radius}, upper_max={args.upper_max}")
    print("| p | lower | upper | allowed new p: [p*lower, p*upper] |")
    print("|---|---|---|---|")
    for p, lo, up in zip(args.p, lower.tolist(), upper.tolist()):
        print(f"| {p:g} | {lo:.10g} | {up:.10g} | [{p * lo:.6g}, {min(p * up, 1.0):.6g}] |")


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return
    command, rest = argv[0], argv[1:]
    if command == "bounds":
        bounds_main(rest)
    elif command == "demo":
        from .demo import main as demo_main

        demo_main(rest)
    elif command == "train":
        from .train import main as train_main

        train_main(rest)
    elif command == "eval":
        from .evaluation import eval_main

        eval_main(rest)
    else:
        print(f"trl-bandpo: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()

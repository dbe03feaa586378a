"""`trl-bandpo bounds`: print the Band ratio bounds for a divergence and radius as a Markdown table."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

__all__ = ["DEFAULT_PROBABILITIES", "bounds_main"]

DEFAULT_PROBABILITIES = (1e-6, 1e-4, 1e-3, 0.01, 0.05, 0.08, 0.2, 0.5, 0.8, 0.95, 0.99, 0.999)


def build_parser() -> argparse.ArgumentParser:
    """The `trl-bandpo bounds` argument parser."""
    from ..band import DIVERGENCES

    parser = argparse.ArgumentParser(prog="trl-bandpo bounds", description="Band ratio bounds per old probability p.")
    parser.add_argument("--divergence", default="kl", choices=DIVERGENCES)
    parser.add_argument("--radius", type=float, default=0.05, help="trust-region radius delta")
    parser.add_argument("--upper-max", type=float, default=None, help="cap on the upper bound (authors: 10)")
    parser.add_argument("--relax", type=float, nargs=2, metavar=("EPS_LOW", "EPS_HIGH"), default=None)
    parser.add_argument("--p", type=float, nargs="+", default=list(DEFAULT_PROBABILITIES), help="probabilities")
    return parser


def bounds_main(argv: Sequence[str] | None = None) -> None:
    """Print ``| p | lower | upper | allowed new p |`` for each old probability p; bad arguments exit with status 2."""
    import torch

    from ..band import band_bounds

    parser = build_parser()
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

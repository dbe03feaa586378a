"""`trl-bandpo bounds`: print the Band ratio bounds for a divergence and radius as a Markdown table."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

__all__ = ["DEFAULT_PROBABILITIES", "DEFAULT_UPPER_MAX", "bounds_main"]

DEFAULT_PROBABILITIES = (1e-6, 1e-4, 1e-3, 0.01, 0.05, 0.08, 0.2, 0.5, 0.8, 0.95, 0.99, 0.999)


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None


def _probability(text: str) -> float:
    """An old probability p in (0, 1]: p = 0 has no ratio bounds, and p > 1 or p < 0 is no probability."""
    value = _number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a probability in (0, 1]")
    return value


def _radius(text: str) -> float:
    value = _number(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"the radius delta must be a finite number > 0, got {text!r}")
    return value


#: The cap on the upper bound when `--upper-max` is not given: the configs' `band_upper_max` default (the BandPO
#: authors trained with 10), so the table shows the bounds training uses.
DEFAULT_UPPER_MAX = 10.0


def _upper_max(text: str) -> float | None:
    """A cap >= 1, or None (no cap: only the simplex limit 1/p) for "none" / "null"."""
    if text.strip().lower() in ("none", "null"):
        return None
    value = _number(text)
    if not value >= 1:  # also rejects nan
        raise argparse.ArgumentTypeError(
            f"the cap on the upper bound must be a number >= 1 or none (no cap), got {text!r}"
        )
    return value


def build_parser() -> argparse.ArgumentParser:
    """The `trl-bandpo bounds` argument parser."""
    from ..core.band import DIVERGENCES

    parser = argparse.ArgumentParser(prog="trl-bandpo bounds", description="Band ratio bounds per old probability p.")
    parser.add_argument("--divergence", default="kl", choices=DIVERGENCES)
    parser.add_argument("--radius", type=_radius, default=0.05, help="trust-region radius delta (finite, > 0)")
    parser.add_argument(
        "--upper-max",
        type=_upper_max,
        default=DEFAULT_UPPER_MAX,
        help="cap on the upper bound, >= 1 (default: 10, the configs' band_upper_max and the BandPO authors' "
        "setting); --upper-max none shows the uncapped Band (only the simplex limit 1/p)",
    )
    parser.add_argument("--relax", type=float, nargs=2, metavar=("EPS_LOW", "EPS_HIGH"), default=None)
    parser.add_argument(
        "--p", type=_probability, nargs="+", default=list(DEFAULT_PROBABILITIES), help="old probabilities, in (0, 1]"
    )
    return parser


def bounds_main(argv: Sequence[str] | None = None) -> None:
    """Print ``| p | lower | upper | allowed new p |`` for each old probability p; bad arguments exit with status 2."""
    import torch

    from ..core.band import band_bounds

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

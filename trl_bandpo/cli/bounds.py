"""`trl-bandpo bounds`: print the Band ratio bounds for a divergence and radius as a Markdown table."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ..core.band import DIVERGENCES, RADIUS, RELAX_HIGH, RELAX_LOW, UPPER_MAX, band_bounds
from ..core.checks import Number, none_word

DEFAULT_PROBABILITIES = (1e-6, 1e-4, 1e-3, 0.01, 0.05, 0.08, 0.2, 0.5, 0.8, 0.95, 0.99, 0.999)
#: The default cap on the upper bound: the configs' `band_upper_max` (the BandPO authors'), as training uses it.
DEFAULT_UPPER_MAX = 10.0


def _flag(check):
    """An argparse type: the text as a number (or None, for "none" where `check` allows it) that `check` accepts."""

    def parse(text: str):
        value = none_word(text) if check.optional else text
        try:
            return check(None if value is None else float(value), "value")
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {check.allowed}, got {text!r}") from None

    return parse


def build_parser() -> argparse.ArgumentParser:
    """The `trl-bandpo bounds` argument parser."""
    parser = argparse.ArgumentParser(
        prog="trl-bandpo bounds",
        description="Band ratio bounds per old probability p (docs/band-operator.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--divergence", default="kl", choices=DIVERGENCES, help="f-divergence of the trust region")
    parser.add_argument("--radius", type=_flag(RADIUS), default=0.05, help="trust-region radius delta (>= 1.2e-38)")
    parser.add_argument(
        "--upper-max", type=_flag(UPPER_MAX), default=DEFAULT_UPPER_MAX,
        help="cap on the upper bound, >= 1 (the configs' band_upper_max, the BandPO authors' setting); "
        "`--upper-max none`: no cap but the simplex limit 1/p",
    )  # fmt: skip
    parser.add_argument(
        "--relax", type=_flag(Number(low=0)), nargs=2, metavar=("EPS_LOW", "EPS_HIGH"),
        help="the Relaxed Band: the union with the clip interval [1 - EPS_LOW, 1 + EPS_HIGH] (EPS_LOW in [0, 1))",
    )  # fmt: skip
    parser.add_argument(
        "--p", type=_flag(Number(low=0, high=1, low_open=True)), nargs="+", default=list(DEFAULT_PROBABILITIES),
        help="old probabilities, in (0, 1]",
    )  # fmt: skip
    return parser


def bounds_main(argv: Sequence[str] | None = None) -> None:
    """Print ``| p | lower | upper | allowed new p |`` for each old probability p; bad arguments exit with status 2."""
    import torch

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.relax is not None:
        try:
            RELAX_LOW(args.relax[0], "EPS_LOW"), RELAX_HIGH(args.relax[1], "EPS_HIGH")
        except ValueError as err:
            parser.error(f"argument --relax: {err}")
    logp = torch.tensor(args.p, dtype=torch.float64).log()
    lower, upper = band_bounds(
        logp, args.radius, args.divergence, upper_max=args.upper_max, relax=args.relax, solver="torch"
    )
    print(f"Band bounds, divergence={args.divergence}, radius={args.radius}, upper_max={args.upper_max}")
    print("| p | lower | upper | allowed new p: [p*lower, p*upper] |")
    print("|---|---|---|---|")
    for p, lo, up in zip(args.p, lower.tolist(), upper.tolist()):
        print(f"| {p:g} | {lo:.10g} | {up:.10g} | [{p * lo:.6g}, {min(p * up, 1.0):.6g}] |")

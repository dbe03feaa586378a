r"""Offline CPU demo: GRPO, Clip-Higher, BandPO and DGPO on a toy arithmetic task, the papers' Figure 3 at toy scale.

``trl-bandpo demo`` (or ``python -m trl_bandpo.demo``) needs no network, no GPU and no downloaded weights. It

1. builds a tiny Qwen2 causal LM (hidden 128, 2 layers, 0.34M parameters) and gives it a short supervised warm start
   on two-operand addition ``"a+b="`` -> ``"<a+b>"`` until it is right about 40% of the time at temperature 1
   (`trl_bandpo.demo.task`, `trl_bandpo.demo.sft`);
2. trains a copy of that model with RL for each method, same seed, same prompts, same hyper-parameters, only the
   per-token policy term differs (`trl_bandpo.demo.runs`):

   ============  ==============================================================================================
   ``grpo``      ``policy_loss="clip"``, ε− = ε+ = 0.2
   ``clip_higher`` ``policy_loss="clip"``, ε− = 0.2, ε+ = 0.28 (DAPO's Clip-Higher)
   ``bandpo``    ``policy_loss="band"``, KL trust region of radius ``--band-radius`` (default 0.02), upper bound
                 capped at 10 (``band_upper_max``, as the BandPO authors trained)
   ``dgpo``      ``policy_loss="dgpo"``, n = 1, m = 2, ε = 0.2/0.2
   ``adaptive_band`` extension: ``bandpo`` with a per-token radius from the old policy's entropy
                 (``band_radius_by="entropy"``, radii in [δ/4, 4δ]; docs/extensions.md)
   ``band_dgpo`` extension: DGPO's decay (n = 1, m = 2) outside the Band bounds of radius ``--band-radius``
   ``dppo``      DPPO-Binary-KL (``policy_loss="dppo_kl"``) of radius ``--band-radius``, truncation C = 10,000 as
                 its authors: the Band's gradient without the Band's cap (docs/band-and-dppo.md)
   any other     a name of `trl_bandpo.POLICY_LOSSES` (``relaxed_band``, ``dcpo``, ``gppo``, ``ce_gppo``, ``aspo``,
                 ``band``, ``clip``...) with the ε of the BandPO paper's baselines (Section 6.1): 0.2/0.28 for
                 ``relaxed_band``, 0.16/0.2 for ``dcpo``, 0.2/0.2 otherwise
   ============  ==============================================================================================

   The reward is 1 for the exact answer and 0 otherwise. Every generation batch is reused for
   ``steps_per_generation × num_iterations`` optimizer steps (default 4 × 2), with a learning rate large enough
   that the ratios move within those steps: clipping is active, which is what the methods differ on;
3. writes to ``--output-dir`` (default ``demo_output/``) ``metrics.csv`` (every logged value, one row per method and
   step), ``figure.png`` (reward, entropy, clip rate and tail share of upper clipping per method: BandPO Figure 3 at
   toy scale), ``results.json`` and ``summary.md`` (held-out accuracy, entropy, clip rates, and one computed
   observation per comparison with GRPO), and prints the summary (`trl_bandpo.demo.report`,
   `trl_bandpo.demo.figure`; the metrics are defined in `docs/metrics.md`).

Why δ = 0.02 for BandPO here. With a KL trust region, the Band interval at p = 0.5 is [0.80, 1.20] for
δ = KL(Bern(0.5) ‖ Bern(0.6)) ≈ 0.0204, i.e. exactly GRPO's ε = 0.2 interval. With δ = 0.02 BandPO is thus as
tight as GRPO for mid-probability tokens, tighter for confident ones (p = 0.9: [0.92, 1.06]) and wider for tail
tokens (p = 0.1: [0.51, 1.70]; p = 0.01: [0.05, 4.43]): the comparison isolates the probability-aware *shape* of the
bounds, not a mere widening. The paper's δ = 0.05 (tuned for lr 1e-6 on billion-parameter models) gives
[0.69, 1.31] at p = 0.5 and is wider than GRPO's interval for every p below about 0.8, so a difference from GRPO
would mix "wider" with "probability-aware". Pass ``--band-radius 0.05`` to run the paper's value (see
`docs/bandpo.md` for the Band bounds).

What the demo shows is measured, not asserted: the observations are computed from this run's numbers, with one
seed at toy scale, and can go either way. The same run, same seed and same machine gives the same numbers.
"""

from .cli import build_parser, main
from .figure import plot_figure
from .report import (
    TAIL_P,
    markdown_table,
    observations,
    read_metrics_csv,
    summarize_history,
    tail_share_of_upper_clipping,
    write_metrics_csv,
)
from .runs import DEFAULT_METHODS, METHOD_PRESETS, method_settings
from .sft import warm_start
from .task import correctness_reward, evaluate_accuracy, make_problems

__all__ = [
    "main",
    "build_parser",
    "DEFAULT_METHODS",
    "METHOD_PRESETS",
    "method_settings",
    "make_problems",
    "correctness_reward",
    "evaluate_accuracy",
    "warm_start",
    "summarize_history",
    "tail_share_of_upper_clipping",
    "write_metrics_csv",
    "read_metrics_csv",
    "observations",
    "markdown_table",
    "plot_figure",
    "TAIL_P",
]

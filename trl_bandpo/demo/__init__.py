r"""Offline CPU demo (``trl-bandpo demo``, ``python -m trl_bandpo.demo``): GRPO, Clip-Higher, BandPO and DGPO on toy
addition, the papers' Figure 3 at toy scale, with no network, GPU or downloaded weights.

It warm-starts a tiny Qwen2 (hidden 128, 2 layers) with supervised steps on ``"a+b="`` -> ``"<a+b>"`` until it is
right about 40% of the time at temperature 1 (`task`, `sft`), trains a copy with RL per method (same seed, prompts
and hyper-parameters; only the per-token policy term differs; `runs`), and writes to ``--output-dir``
``metrics.csv``, ``figure.png`` (reward, entropy, clip rate, tail share of upper clipping), ``results.json`` and
``summary.md`` (held-out accuracy, entropy, clip rates, one computed observation per comparison with GRPO; `report`,
`figure`, docs/metrics.md). The reward is 1 for the exact answer, else 0; every generation batch is reused for
``steps_per_generation × num_iterations`` optimizer steps at a learning rate that moves the ratios, so clipping acts.

The methods:

- ``grpo``: ``policy_loss="clip"``, ε− = ε+ = 0.2; ``clip_higher``: ε+ = 0.28 (DAPO's Clip-Higher);
- ``bandpo``: ``policy_loss="band"``, KL radius ``--band-radius`` (default 0.02), upper bound capped at 10 (as the
  BandPO authors trained); ``dgpo``: ``policy_loss="dgpo"``, n = 1, m = 2, ε = 0.2/0.2;
- extensions (docs/extensions.md): ``adaptive_band`` (``bandpo`` with per-token radii in [δ/4, 4δ] from the old
  policy's entropy) and ``band_dgpo`` (DGPO's decay, n = 1, m = 2, outside the Band bounds);
- ``dppo``: DPPO-Binary-KL (``dppo_kl``) of radius ``--band-radius``, truncation C = 10,000 (docs/band-and-dppo.md);
- any other built-in policy loss by its own name (``--help`` lists them) with the ε of the BandPO paper's baselines:
  0.2/0.28 for ``relaxed_band``, 0.16/0.2 for ``dcpo``, else 0.2/0.2. ``--band-radius`` is the KL radius of
  ``band``, ``relaxed_band``, ``band_dgpo`` and ``dppo_kl`` (``dppo_tv`` keeps its TV radius, 0.15).

Why δ = 0.02: the KL Band at p = 0.5 is [0.80, 1.20], GRPO's ε = 0.2 interval, for δ ≈ 0.0204. BandPO is then as
tight as GRPO for mid-probability tokens, tighter for confident ones (p = 0.9: [0.92, 1.06]) and wider for tail
tokens (p = 0.01: [0.05, 4.43]): the comparison isolates the probability-aware *shape* of the bounds. The paper's
δ = 0.05 is wider than GRPO's interval for every p below about 0.8; ``--band-radius 0.05`` runs it.

The observations are computed from one run's numbers (one seed, toy scale) and can go either way. A run repeats
exactly on one machine, but another CPU can give other numbers from the same seed: compare methods across seeds.
"""

from .cli import build_parser, main
from .report import observations, read_metrics_csv, tail_share_of_upper_clipping
from .runs import METHOD_PRESETS, method_settings
from .task import correctness_reward, make_problems

__all__ = [
    "main",
    "build_parser",
    "METHOD_PRESETS",
    "method_settings",
    "make_problems",
    "correctness_reward",
    "observations",
    "read_metrics_csv",
    "tail_share_of_upper_clipping",
]

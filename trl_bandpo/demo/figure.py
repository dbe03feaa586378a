"""``figure.png``: reward, entropy, clip rate and the tail share of upper clipping per method (BandPO Figure 3 at
toy scale).

matplotlib is optional: it is imported inside `plot_figure`, which returns False without it.
"""

from __future__ import annotations

import math
from pathlib import Path

from .report import TAIL_P, logged_series, to_float


def _smooth(values, window):
    """Centred moving average over `window` steps (unchanged when the window or the series is too short)."""
    if window <= 1 or len(values) < 3:
        return values
    half = window // 2
    windows = (values[max(0, i - half) : i + half + 1] for i in range(len(values)))
    return [sum(w) / len(w) for w in windows]


def _windowed_tail_share(history, window: int):
    """Tail share of upper clipping pooled over a centred window of steps (weights: each step's upper-clip rate)."""
    steps, shares, weights = [], [], []
    for entry in history:
        share, high = to_float(entry.get("clip_ratio/high_tail_share")), to_float(entry.get("clip_ratio/high_mean"))
        steps.append(int(entry["step"]))
        ok = math.isfinite(share) and math.isfinite(high) and high > 0
        shares.append(share if ok else 0.0)
        weights.append(high if ok else 0.0)
    half = window // 2
    xs, ys = [], []
    for i, step in enumerate(steps):
        lo, hi = max(0, i - half), i + half + 1
        total = sum(weights[lo:hi])
        if total > 0:
            xs.append(step)
            ys.append(sum(w * v for w, v in zip(weights[lo:hi], shares[lo:hi])) / total)
    return xs, ys


def clip_rate_per_generation_batch(history, updates: int):
    """Mean `clip_ratio/region_mean` over the off-policy updates of each generation batch, at the batch's last step.

    Each generation batch is trained on for `updates` optimizer steps; the first runs on the policy that sampled it
    (every ratio is 1, so it clips nothing and logs 0). A per-step curve is therefore a sawtooth that drops to 0 once
    per batch; averaging the other `updates - 1` steps gives one comparable value per batch. With `updates == 1`
    every step is on-policy and nothing is returned.
    """
    rates = {int(e["step"]): to_float(e.get("clip_ratio/region_mean")) for e in history if "step" in e}
    xs, ys = [], []
    for first in range(1, max(rates, default=0) + 1, updates):
        batch = [rates.get(step, math.nan) for step in range(first + 1, first + updates)]  # skip the on-policy one
        batch = [v for v in batch if math.isfinite(v)]
        if batch:
            xs.append(first + updates - 1)
            ys.append(sum(batch) / len(batch))
    return xs, ys


def plot_figure(
    path: Path, histories: dict[str, list[dict]], labels: dict[str, str], steps: int, updates_per_generation: int = 1
) -> bool:
    """The four panels (reward, entropy, clip rate, tail share of upper clipping); False if matplotlib is missing.

    `updates_per_generation` (`steps_per_generation x num_iterations`) groups the clip rate by generation batch.
    """
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    window, pool = max(1, steps // 25), max(2, steps // 10)  # moving average; pooling of the tail share
    panels = [
        ("reward", "training reward (mean over the generation batch)"),
        ("entropy", "entropy (nats/token)"),
        (
            "clip_ratio/region_mean",
            f"clip rate per generation batch (mean of its {updates_per_generation - 1} off-policy updates; "
            "bold: 5 batches)",
        ),
        ("clip_ratio/high_tail_share", f"share of upper clipping on tail tokens (p<{TAIL_P}), {pool}-step pools"),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), constrained_layout=True)
    for ax, (key, title) in zip(axes.flat, panels):
        for index, (method, history) in enumerate(histories.items()):
            color = f"C{index}"
            if key == "clip_ratio/region_mean" and updates_per_generation > 1:
                # the first update on each batch is on-policy (r = 1, nothing clipped): group by batch instead
                xs, ys = clip_rate_per_generation_batch(history, updates_per_generation)
                ax.plot(xs, ys, color=color, alpha=0.25, linewidth=0.8)
                ax.plot(xs, _smooth(ys, 5), color=color, linewidth=1.8, label=labels[method])
                continue
            if key == "clip_ratio/high_tail_share":
                # a step's share rests on a handful of clipped tokens: pool the counts over a window instead
                xs, ys = _windowed_tail_share(history, pool)
                ax.plot(xs, ys, color=color, linewidth=1.8, label=labels[method])
                continue
            xs, ys = logged_series(history, key)
            if not xs:
                continue
            k = 3 if key == "reward" else window
            ax.plot(xs, ys, color=color, alpha=0.25, linewidth=0.8)
            ax.plot(xs, _smooth(ys, k), color=color, linewidth=1.8, label=labels[method])
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=9)
    fig.suptitle("trl-bandpo demo: toy addition, tiny Qwen2 on CPU (faint: per step, bold: moving average)", size=11)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True

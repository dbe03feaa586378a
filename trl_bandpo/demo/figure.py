"""``figure.png``: reward, entropy, clip rate and the tail share of upper clipping per method (BandPO Figure 3 at
toy scale).

matplotlib is optional: it is imported inside `plot_figure`, which returns False without it.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from .report import TAIL_P, logged_series, metrics_frame


def _centred(series: pd.Series, window: int):
    """Centred moving windows of ``2 * (window // 2) + 1`` steps, shorter at both ends."""
    return series.rolling(2 * (window // 2) + 1, center=True, min_periods=1)


def _smooth(values, window):
    """Centred moving average over `window` steps (unchanged when the window or the series is too short)."""
    if window <= 1 or len(values) < 3:
        return values
    return _centred(pd.Series(values, dtype=float), window).mean().tolist()


def _windowed_tail_share(history, window: int):
    """Tail share of upper clipping pooled over a centred window of steps (weights: each step's upper-clip rate)."""
    frame = metrics_frame(history).reindex(columns=["step", "clip_ratio/high_tail_share", "clip_ratio/high_mean"])
    share, high = frame["clip_ratio/high_tail_share"], frame["clip_ratio/high_mean"]
    weight = high.where((high > 0) & share.notna(), 0.0)
    total = _centred(weight, window).sum()
    keep = total > 0
    pooled = _centred((weight * share).fillna(0.0), window).sum() / total
    return frame["step"][keep].astype(int).tolist(), pooled[keep].tolist()


def clip_rate_per_generation_batch(history, updates: int):
    """Mean `clip_ratio/region_mean` over the off-policy updates of each generation batch, at the batch's last step.

    Each generation batch is trained on for `updates` optimizer steps; the first runs on the policy that sampled it
    (every ratio is 1, so it clips nothing and logs 0). A per-step curve is therefore a sawtooth that drops to 0 once
    per batch; averaging the other `updates - 1` steps gives one comparable value per batch. With `updates == 1`
    every step is on-policy and nothing is returned.
    """
    frame = metrics_frame(history).reindex(columns=["step", "clip_ratio/region_mean"]).dropna()
    frame = frame[(frame["step"] - 1) % updates != 0]  # skip the on-policy first update of each batch
    means = frame.groupby((frame["step"] - 1) // updates)["clip_ratio/region_mean"].mean()
    return [int(batch + 1) * updates for batch in means.index], means.tolist()


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
    # moving average; pooling of the tail share
    window, pool = max(1, steps // 25), max(2, steps // 10)
    panels = [
        ("reward", "training reward (mean over the generation batch)"),
        ("entropy", "entropy (nats/token)"),
        ("clip_ratio/region_mean", f"clip rate per generation batch (mean of its {updates_per_generation - 1} "
                                   "off-policy updates; bold: 5 batches)"),
        ("clip_ratio/high_tail_share", f"share of upper clipping on tail tokens (p<{TAIL_P}), {pool}-step pools"),
    ]  # fmt: skip
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), constrained_layout=True)
    for ax, (key, title) in zip(axes.flat, panels):
        for index, (method, history) in enumerate(histories.items()):
            smooth, faint = 3 if key == "reward" else window, True
            if key == "clip_ratio/region_mean" and updates_per_generation > 1:
                # the first update on each batch is on-policy (r = 1, nothing clipped): group by batch instead
                xs, ys = clip_rate_per_generation_batch(history, updates_per_generation)
                smooth = 5
            elif key == "clip_ratio/high_tail_share":
                # a step's share rests on a handful of clipped tokens: pool the counts over a window instead
                xs, ys = _windowed_tail_share(history, pool)
                smooth, faint = 1, False
            else:
                xs, ys = logged_series(history, key)
            if not xs:
                continue
            if faint:
                ax.plot(xs, ys, color=f"C{index}", alpha=0.25, linewidth=0.8)
            ax.plot(xs, _smooth(ys, smooth), color=f"C{index}", linewidth=1.8, label=labels[method])
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=9)
    fig.suptitle("trl-bandpo demo: toy addition, tiny Qwen2 on CPU (faint: per step, bold: moving average)", size=11)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True

"""Count metrics in the trainer: numerators and denominators summed over processes and accumulation steps, divided
once at logging (docs/metrics.md, "How values are aggregated").
"""

from __future__ import annotations

from collections import defaultdict

import torch

__all__ = ["CountMetrics"]


class CountMetrics:
    """Mixin for `GRPOTrainer` subclasses: `_add_counts(mode, {name: (num, den)})` accumulates, `log` divides."""

    @property
    def _count_metrics(self) -> dict:
        if not hasattr(self, "_count_metrics_store"):
            self._count_metrics_store = {mode: defaultdict(lambda: [0.0, 0.0]) for mode in ("train", "eval")}
        return self._count_metrics_store

    def _add_counts(self, mode: str, counts: dict) -> None:
        stacked = torch.stack([torch.stack([num.double(), den.double()]) for num, den in counts.values()])
        totals = self.accelerator.reduce(stacked, reduction="sum").tolist()  # one collective for all of them
        accumulated = self._count_metrics[mode]
        for name, (num, den) in zip(counts, totals):
            accumulated[name][0] += num
            accumulated[name][1] += den

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        for name, (num, den) in self._count_metrics[mode].items():
            self._metrics[mode][name] = [num / den if den > 0 else float("nan")]
        self._count_metrics[mode].clear()
        super().log(logs, start_time)

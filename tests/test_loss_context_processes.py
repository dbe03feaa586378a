"""The loss API's cross-process context in a real 2-process CPU run (gloo): a loss that declares `all_reduce` sees the
sum over both processes (the same as one process holding both micro-batches), and M2PO, as AReaL computes it, masks
each process's micro-batch on its own tokens alone (docs/policy-losses.md, "Masking trust regions")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from loss_context_run import globally_centred, tokens  # noqa: E402

from trl_bandpo.core.losses import clip_bounds, clipped_surrogate_loss  # noqa: E402


def _m2po_keep_by_hand(m2: list[float], threshold: float) -> int:
    """How many of the largest AReaL's M2PO masks: the first k with mean(rest) < threshold, else all but one."""
    ordered = sorted(m2, reverse=True)
    for k in range(len(ordered)):
        if sum(ordered[k:]) / (len(ordered) - k) < threshold:
            return k
    return len(ordered) - 1


@pytest.mark.slow
def test_two_processes_reduce_what_a_loss_declares_and_m2po_stays_per_process(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29631",
               str(Path(__file__).parent / "scripts" / "loss_context_run.py"), str(tmp_path)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"rank{k}.pt") for k in (0, 1)]
    assert [rank["world"] for rank in ranks] == [2, 2]
    both = [tokens(k) for k in (0, 1)]
    # all_reduce: each rank's loss is the one-process loss over both micro-batches' tokens
    union = torch.cat([lr for lr, _ in both]), torch.cat([mask for _, mask in both])
    expected = globally_centred(*union[:1], torch.ones(6, 1, dtype=torch.float64), 0.0, 1e30, mask=union[1],
                                all_reduce=lambda t: t)  # fmt: skip
    for k, rank in enumerate(ranks):
        torch.testing.assert_close(rank["globally_centred"], expected[3 * k : 3 * k + 3])
    # M2PO: per process, the count AReaL masks on this rank's own counted tokens (not on the union's)
    for k, (log_ratio, mask) in enumerate(both):
        m2 = log_ratio[mask > 0].square().tolist()
        dropped = _m2po_keep_by_hand(m2, 0.04)
        surrogate = clipped_surrogate_loss(log_ratio, torch.ones(3, 1, dtype=torch.float64), *clip_bounds(log_ratio))
        kept = (ranks[k]["m2po"] == surrogate) & (mask > 0) & (surrogate != 0)
        assert int(((mask > 0) & ~kept).sum()) == dropped, (k, dropped)
    union_m2 = union[0][union[1] > 0].square().tolist()
    per_process = [_m2po_keep_by_hand(lr[mask > 0].square().tolist(), 0.04) for lr, mask in both]
    assert sum(per_process) != _m2po_keep_by_hand(union_m2, 0.04)  # the data tells per-process from global apart

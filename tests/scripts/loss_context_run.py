"""Run by tests/test_loss_context_processes.py with 2 CPU processes (torch.distributed.run, gloo): each rank calls the
trainers' policy-term path (`PolicyTerm._with_context`, with `PolicyTerm._all_reduce` over the real process group)
on its own tokens, for M2PO and for a loss that declares `all_reduce`, and writes what it got to
`<output_dir>/rank<k>.pt`."""

import os
import sys
import types

import torch
from accelerate import Accelerator

from trl_bandpo.core.loss_registry import PolicyLossSpec, policy_loss_spec, register_policy_loss
from trl_bandpo.training.policy_term import PolicyTerm


def tokens(rank: int):
    """Rank k's micro-batch: 3 sequences of 5 tokens, the last two positions of sequence 2 padding."""
    generator = torch.Generator().manual_seed(rank)
    log_ratio = (torch.randn(3, 5, generator=generator) * (0.1 + 0.4 * rank)).double()
    mask = torch.ones(3, 5)
    mask[2, 3:] = 0
    return log_ratio, mask


def globally_centred(log_ratio, advantages, lower, upper, *, mask, all_reduce):
    """A loss that needs the whole batch across processes: masks the tokens whose (log r)^2 is above the mean over
    every process's counted tokens."""
    m2 = log_ratio.detach().square()
    totals = all_reduce(torch.stack([(m2 * mask).sum(), mask.sum()]))
    keep = (m2 <= totals[0] / totals[1]) & (mask > 0)
    return torch.where(keep, -advantages * log_ratio.exp(), 0.0)


def main(output_dir):
    accelerator = Accelerator(cpu=True)
    register_policy_loss(PolicyLossSpec("globally_centred", lambda old_logps: (0.0, 1e30), globally_centred))
    rank = accelerator.process_index
    log_ratio, mask = tokens(rank)
    out = {"world": accelerator.num_processes}
    for name in ("m2po", "globally_centred"):
        spec = policy_loss_spec(name)
        kwargs = dict(threshold=0.04) if name == "m2po" else {}
        term = types.SimpleNamespace(_policy=spec, _policy_loss_kwargs=kwargs, accelerator=accelerator)
        term._all_reduce = types.MethodType(PolicyTerm._all_reduce, term)
        lower, upper = (0.8, 1.2) if name == "m2po" else (0.0, 1e30)
        args = (log_ratio, torch.ones(3, 1, dtype=torch.float64), lower, upper, mask, torch.zeros_like(log_ratio))
        out[name] = PolicyTerm._with_context(term, spec.loss, *args, None)
    torch.save(out, os.path.join(output_dir, f"rank{rank}.pt"))
    accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])

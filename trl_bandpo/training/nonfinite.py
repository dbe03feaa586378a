"""Nothing trains on NaN in silence: the rewards of every generation batch, the loss of every micro-step (a flag summed
over processes) and the gradient norm of every optimizer step (transformers' `_get_grad_norm`) are checked;
`on_nonfinite` says what then happens (docs/training.md, "Non-finite losses and gradients")."""

from __future__ import annotations

import math
import numbers
import warnings

import torch
from transformers import Trainer
from trl.trainer.utils import is_async_callable

if not hasattr(Trainer, "_get_grad_norm"):  # transformers < 5.3 computes the norm inline: no hook to check it
    raise ImportError("trl-bandpo needs transformers >= 5.3 (Trainer._get_grad_norm); pip install -U transformers")


class NonFiniteTrainingError(FloatingPointError):
    """A training step's rewards, loss or gradient norm are NaN or infinite (with `on_nonfinite="stop"`)."""


def first_nonfinite(quantities: dict, mask=None) -> str:
    """`"<name> (<k> of <n> values, e.g. nan)"` for the first tensor of `quantities` holding a NaN or inf (counted
    where `mask` keeps a token, when it is shaped alike), or "none of <names>" when every one is finite."""
    for name, value in quantities.items():
        if not torch.is_tensor(value):
            continue
        bad = ~torch.isfinite(value.detach())
        if mask is not None and bad.shape == mask.shape:
            bad = bad & (mask > 0)
        if bool(bad.any()):
            example = value.detach()[bad].flatten()[0].item()
            return f"{name} ({int(bad.sum())} of {bad.numel()} values, e.g. {example})"
    return f"none of {', '.join(quantities)}"


def numbers_only(func, index: int, notes: dict):
    """`func`, a reward function (sync or async), with each value it returns that is None or no number (a string)
    kept in `notes[row, index]`, for the message, and the latter replaced by inf (TRL would fail converting it)."""

    def as_numbers(rewards):
        rewards = list(rewards)
        for row, value in enumerate(rewards):
            if value is None or not (isinstance(value, numbers.Real) or getattr(value, "shape", None) == ()):
                notes[row, index], rewards[row] = value, None if value is None else math.inf
        return rewards

    async def awaited(**kwargs):
        return as_numbers(await func(**kwargs))

    return awaited if is_async_callable(func) else lambda **kwargs: as_numbers(func(**kwargs))


def unusable_rewards(rewards: dict, where: str) -> str:
    """What is wrong with a completion's `rewards` (reward function name -> value): each value no finite number."""
    named = [
        f"{name!r} returned {value!r}"
        for name, value in rewards.items()
        if not (isinstance(value, float) and math.isfinite(value))
    ]
    return (
        f"reward function {', '.join(named)} for {where}: no finite advantage follows (a completion needs a finite "
        "reward from at least one reward function, None or NaN being none, and none infinite or no number)"
    )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's shard of a DTensor (FSDP2's parameters and gradients; collectives refuse DTensor flags), or
    the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class NonFiniteGuard:
    """Mixin for our trainers (`PolicyTerm` subclasses): the checks of the module docstring."""

    _nonfinite_step: str | None = None  # what went non-finite in this optimizer step's micro-steps ("skip")
    _dropped_rows: torch.Tensor | None = None  # this process's rows whose group `_calculate_rewards` dropped ("skip")

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """GRPOTrainer's rewards `(all processes' completions, reward functions)`, each function's `numbers_only`,
        checked (docs/training.md): a group with an unusable reward stops the run or, `on_nonfinite="skip"`, is
        dropped: its rewards become NaN, which TRL leaves out of every mean and spread, its tokens are masked out."""
        funcs, notes = self.reward_funcs, {}
        self.reward_funcs = [
            f if isinstance(f, torch.nn.Module) else numbers_only(f, i, notes) for i, f in enumerate(funcs)
        ]
        try:
            rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        finally:
            self.reward_funcs = funcs
        bad, self._dropped_rows = rewards.isinf().any(1) | rewards.isnan().all(1), None
        if bool(bad.any()):
            row = int(bad.nonzero()[0, 0])
            local = row - self.accelerator.process_index * len(prompts)
            values = [notes.get((local, i), value) for i, value in enumerate(rewards[row].tolist())]
            completion = f"{completions[local]!r:.200}" if 0 <= local < len(prompts) else "on another process"
            where = f"completion {row} ({completion}) at optimizer step {self.state.global_step}"
            self._nonfinite(unusable_rewards(dict(zip(self.reward_func_names, values)), where), "its group is dropped")
            group = self.num_generations if self.model.training else self.num_generations_eval
            dropped = bad.view(-1, group).any(1).repeat_interleave(group)
            rewards[dropped] = math.nan
            self._dropped_rows = dropped.view(-1, len(prompts))[self.accelerator.process_index]
        return rewards

    def _check_finite_loss(self, loss, mask=None, **quantities) -> None:
        """Called by the patched loss methods with the loss of one micro-step and what it is made of, in the order
        they are computed. A no-op in evaluation and where every process's loss is finite (one host read)."""
        if not self.model.training:
            return
        local = (~torch.isfinite(loss.detach())).any().float().reshape(1)
        if not bool(self.accelerator.reduce(local, reduction="sum")):
            return
        where = f"first non-finite quantity: {first_nonfinite(quantities, mask)}" if quantities else "TRL's loss_type"
        where = where if bool(local) else "on another process"
        self._nonfinite(
            f"the loss of a micro-step is {loss.detach().float().sum().item()} with policy_loss="
            f"{self.policy_loss!r} at optimizer step {self.state.global_step} ({where})"
        )

    def train(self, *args, **kwargs):
        """Trainer's `train`, then the parameters checked (a last update can make them non-finite with no loss after
        it to show it): non-finite ones raise, whatever `on_nonfinite`, so a run never ends with them and status 0."""
        output = super().train(*args, **kwargs)
        params = {name: _local(p) for name, p in self.model.named_parameters()}
        local = torch.stack([(~torch.isfinite(p.detach())).any() for p in params.values()]).any().float().reshape(1)
        if bool(self.accelerator.reduce(local, reduction="sum")):
            raise NonFiniteTrainingError(
                f"training with policy_loss={self.policy_loss!r} ended with non-finite parameters ("
                f"{first_nonfinite(params) if bool(local) else 'on another process'}) after optimizer step "
                f"{self.state.global_step}: the last update made them so. Lower the learning rate and resume from an "
                "earlier checkpoint."
            )
        return output

    def _get_grad_norm(self, model, grad_norm=None):
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        found, self._nonfinite_step = self._nonfinite_step, None
        norm = float(grad_norm) if grad_norm is not None else 0.0
        if found is None and math.isfinite(norm):
            return grad_norm
        if found is None:
            grads = {name: _local(p.grad) for name, p in model.named_parameters() if p.grad is not None}
            found = (
                f"the gradient norm is {norm} with policy_loss={self.policy_loss!r} at optimizer step "
                f"{self.state.global_step} though every loss was finite (first non-finite gradient: "
                f"{first_nonfinite(grads)})"
            )
        self._nonfinite(found, "this optimizer update is skipped")
        model.zero_grad(set_to_none=True)  # the optimizer skips a parameter without a gradient
        return grad_norm

    def _nonfinite(self, what: str, skipped: str | None = None) -> None:
        """Stop, or warn that `skipped` (`on_nonfinite="skip"`), or without it, skip this optimizer step's update."""
        if self.policy_args.on_nonfinite == "stop":
            raise NonFiniteTrainingError(
                f"{what}. Training stops before the update (on_nonfinite='stop'): lower the learning rate, check the "
                "rewards and the loss's hyper-parameters (docs/policy-losses.md), or set on_nonfinite='skip' to drop "
                "such updates."
            )
        if skipped:
            warnings.warn(f"{what}: {skipped} (on_nonfinite='skip').", RuntimeWarning, 2)
        else:
            self._nonfinite_step = self._nonfinite_step or what

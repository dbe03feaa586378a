"""The policy term both trainers share (`PolicyTerm`, a mixin for `GRPOTrainer` and `AsyncGRPOTrainer`): the
selected loss with its hyper-parameters, read before TRL's constructor runs, its bounds, its per-token loss and its
count metrics, summed over processes and accumulation steps and divided once at logging (docs/metrics.md).
"""

from __future__ import annotations

import os
import warnings
from collections import defaultdict

import torch

from ..core.losses import policy_loss_spec
from ..core.metrics import clip_counts
from .configs import is_library_file, policy_settings, user_frame, user_stacklevel
from .library_noise import LIBRARY_FUTURE_WARNINGS, library_noise_filtered
from .trl_patches import check_trl_base

#: The largest log-prob accepted from an inference engine: above it a token's probability exceeds 1 by more than
#: rounding.
LOGPROB_TOLERANCE = 1e-3


def check_engine_logprobs(logps, mask, where: str) -> None:
    """The log-probs an inference engine returned for sampled tokens are log-probabilities: at the positions `mask`
    keeps, none is above `LOGPROB_TOLERANCE` (NaN, a token the engine could not score, passes: it is masked later).
    Else a `ValueError` naming `where`, how many and the largest: training on them would be silently wrong."""
    logps, mask = torch.as_tensor(logps), torch.as_tensor(mask)
    bad = (logps > LOGPROB_TOLERANCE) & (mask > 0)
    if bool(bad.any()):
        raise ValueError(
            f"{where}: {int(bad.sum())} sampled token(s) have a log-prob above 0 (a probability above 1; the largest "
            f"is {logps[bad].max().item():.4g}), so they are no log-probabilities of the sampled tokens: check the "
            "engine's logprobs mode (processed_logprobs) and what the rollout function returns."
        )


def check_model_name(model) -> None:
    """A model given by name is a hub id or a local folder: a path that does not exist is named as such (the hub
    would answer "Repo id must be in the form ..." for it)."""
    if isinstance(model, (str, os.PathLike)):
        model = os.fspath(model)
        if not os.path.isdir(model) and (os.path.isabs(model) or model.startswith(".") or model.count("/") > 1):
            raise ValueError(
                f"model {model!r} is no folder here (it does not exist): give a model folder or a hub id "
                "(`trl-bandpo tiny-model PATH` makes a tiny local one)."
            )


class PolicyTerm:
    """Mixin for TRL trainers whose per-token policy term is the registered loss `policy_args.policy_loss`.

    Subclasses set `config_class` (our config of the trainer, whose defaults a config of TRL's family takes) and
    `trl_config_class` (the TRL config family the trainer accepts).
    """

    config_class: type
    trl_config_class: type

    def _setup_policy_term(self, model, args):
        """`args`, or the default config when it is None (as TRL names it: `<model>-<method>`); sets `policy_args`
        and the selected loss with its hyper-parameters. Called before TRL's constructor: bad settings fail before
        any model loads."""
        check_trl_base(type(self), stacklevel=user_stacklevel())
        check_model_name(model)
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = self.config_class(f"{name.split('/')[-1]}-{self.config_class.__name__.removesuffix('Config')}")
        self.policy_args = policy_settings(type(self).__name__, args, self.config_class, self.trl_config_class)
        self.policy_loss = self.policy_args.policy_loss
        self._policy = policy_loss_spec(self.policy_loss)
        self._policy_bound_kwargs, self._policy_loss_kwargs = self._policy.kwargs_from_config(self.policy_args)
        return args

    def _call_with_warnings_at_the_callers_line(self, function, *args, **kwargs):
        """`function(*args, **kwargs)` (TRL's constructor), its warnings and those of the libraries it calls
        attributed to the user's line (the first frame outside TRL, transformers and us): a user sees where in their
        script a warning comes from."""
        caught = []
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                return function(*args, **kwargs)
        finally:
            frame, _ = user_frame()
            for record in caught:
                if str(record.message) in LIBRARY_FUTURE_WARNINGS:
                    continue  # transformers' own deprecations of what TRL calls: nothing for the user to act on
                if is_library_file(record.filename):
                    registry = frame.f_globals.setdefault("__warningregistry__", {})
                    module = frame.f_globals.get("__name__")
                    where = dict(filename=frame.f_code.co_filename, lineno=frame.f_lineno, module=module)
                    warnings.warn_explicit(record.message, record.category, registry=registry, **where)
                else:
                    warnings.warn_explicit(record.message, record.category, record.filename, record.lineno)

    # -- the policy term -------------------------------------------------------------------------------------------

    def train(self, *args, **kwargs):
        with library_noise_filtered():
            return super().train(*args, **kwargs)

    def _policy_bounds(self, old_logps: torch.Tensor, radius=None):
        """`(lower, upper)` of the selected loss for these old log-probs (floats for fixed bounds); `radius`, when
        given, replaces the configured Band radius (per-token radii of the adaptive radius)."""
        kwargs = self._policy_bound_kwargs if radius is None else {**self._policy_bound_kwargs, "radius": radius}
        return self._policy.bounds(old_logps, **kwargs)

    def _per_token_policy_loss(self, log_ratio, advantages, lower, upper, mask, old_logps, segment_id=None):
        """The one place the policy term differs from TRL's: the registered loss on TRL's tensors, with the
        `CONTEXT` it declares (`mask` `(B, T)`; the asynchronous trainer's flat tokens seen as one row per sample)."""
        return self._with_context(self._policy.loss, log_ratio, advantages, lower, upper, mask, old_logps, segment_id)

    def _with_context(self, function, log_ratio, advantages, lower, upper, mask, old_logps, segment_id, metrics=False):
        kwargs, declared = self._policy_loss_kwargs, self._policy.context
        if metrics or declared:
            context = {"mask": mask, "old_logps": old_logps, "all_reduce": self._all_reduce}
            kwargs = {**kwargs, **{key: context[key] for key in declared if key != "mask" or not metrics}}
        tensors = (log_ratio, advantages, lower, upper) + ((mask,) if metrics else ())
        if segment_id is None or not declared:
            return function(*tensors, **kwargs)
        rows = SampleRows(segment_id)  # packed tokens (N,) -> one padded row per sample (S, L), and back
        # a None hyper-parameter stays None; only the mask (None when packed) becomes the padded rows' mask
        kwargs = {
            key: rows.unpack(value) if key == "mask" or value is not None else None for key, value in kwargs.items()
        }
        out = function(*(rows.unpack(value) for value in tensors), **kwargs)
        return out if metrics else out[rows.row, rows.column]

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(tensor, reduction="sum")

    # -- count metrics ---------------------------------------------------------------------------------------------

    def _policy_counts(self, old_logps, ratio, log_ratio, advantages, lower, upper, mask, segment_id=None) -> dict:
        """The count metrics of docs/metrics.md against the bounds in force, and the selected loss's own."""
        with torch.no_grad():
            lower_t, upper_t = (torch.as_tensor(bound, device=ratio.device) for bound in (lower, upper))
            counts = clip_counts(old_logps, ratio, advantages, lower_t, upper_t, mask)
            if self._policy.metrics is not None:
                counts.update(self._with_context(self._policy.metrics, log_ratio.detach(), advantages, lower, upper,
                                                 mask, old_logps, segment_id, metrics=True))  # fmt: skip
        return counts

    def _add_counts(self, mode: str, counts: dict) -> None:
        """Sum `{name: (numerator, denominator)}` over processes (one collective) into this logging window."""
        stacked = torch.stack([torch.stack([num.double(), den.double()]) for num, den in counts.values()])
        totals = self.accelerator.reduce(stacked, reduction="sum").tolist()
        window = self._count_window(mode)
        for name, (num, den) in zip(counts, totals):
            window[name][0] += num
            window[name][1] += den

    def _count_window(self, mode: str) -> dict:
        if not hasattr(self, "_count_windows"):
            self._count_windows = {key: defaultdict(lambda: [0.0, 0.0]) for key in ("train", "eval")}
        return self._count_windows[mode]

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        prefix = "eval_" if mode == "eval" else ""  # as TRL names its metrics in evaluation
        window = self._count_window(mode)
        # None where nothing was counted, as TRL logs an empty metric (JSON loggers fail on NaN)
        counts = {prefix + name: num / den if den > 0 else None for name, (num, den) in window.items()}
        window.clear()
        super().log({**logs, **counts}, start_time)


class SampleRows:
    """The asynchronous trainer's packed loss tokens `(N,)`, tagged with their sample (`segment_id`, in order), as one
    right-padded row per sample `(S, L)`: a loss that declares `mask` sees samples as the synchronous trainer does."""

    def __init__(self, segment_id: torch.Tensor):
        count = int(segment_id.max()) + 1 if segment_id.numel() else 0
        starts = torch.zeros(count + 1, dtype=torch.long, device=segment_id.device)
        starts[1:] = torch.bincount(segment_id, minlength=count).cumsum(0)
        order = segment_id.argsort(stable=True)
        self.row = segment_id
        self.column = torch.empty_like(segment_id)
        self.column[order] = torch.arange(segment_id.numel(), device=segment_id.device) - starts[segment_id[order]]
        self.shape = (count, int(self.column.max()) + 1 if segment_id.numel() else 0)
        self.mask = self.unpack(torch.ones_like(segment_id, dtype=torch.bool))

    def unpack(self, value):
        """A tensor of one value per token `(N,)` as `(S, L)` (0 / False at padding); anything else as it is."""
        if not torch.is_tensor(value) or value.shape != self.row.shape:
            return self.mask if value is None else value
        rows = value.new_zeros(self.shape)
        rows[self.row, self.column] = value
        return rows

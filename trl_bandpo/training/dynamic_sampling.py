"""Dynamic sampling (DAPO's `filter_groups`, docs/extensions.md): drop prompt groups whose rewards all agree and
generate more prompts until the generation batch is full; when the rounds run out, dropped groups fill the batch with
their tokens masked out. All processes run the same number of rounds, so the collectives inside generation stay in
step; each process's generation batch must hold whole groups. Image inputs are split per row and merged back with
TRL's own helpers (`split_pixel_values_by_grid`), as TRL splits a generation batch into micro-batches.
"""

from __future__ import annotations

import torch
from trl.trainer.utils import split_pixel_values_by_grid, unsplit_pixel_values_by_grid

# Keys of GRPOTrainer's generation output, by how they are padded when outputs of several rounds are merged.
_PROMPT_KEYS = {"prompt_ids": "pad", "prompt_mask": 0}
_COMPLETION_KEYS = {
    "completion_ids": "pad",
    "completion_mask": 0,
    "tool_mask": 1,
    "old_per_token_logps": 0.0,
    "ref_per_token_logps": 0.0,
    "sampling_per_token_logps": 0.0,
    "importance_sampling_ratio": 1.0,
    "old_per_token_entropies": 0.0,
}
_ROW_KEYS = {"advantages"}
_SCALAR_KEYS = {"num_items_in_batch"}
_COUNT_KEYS = {"num_images", "num_tiles"}  # lists, one count per row
_SEQUENCE_KEYS = {"token_type_ids", "mm_token_type_ids"}  # per token of prompt + completion, 0 at padding


def group_has_signal(advantages: torch.Tensor, num_generations: int) -> torch.Tensor:
    """`(N // num_generations,)` booleans: whether each consecutive group of completions has a non-zero advantage
    (all advantages of a group are 0 exactly when its rewards agree)."""
    return (advantages.reshape(-1, num_generations) != 0).any(dim=1)


def select_rows(output: dict, rows: torch.Tensor) -> dict:
    """The rows `rows` (a 1-D index tensor) of a generation output: its per-completion tensors, and its images'
    tensors (concatenated over images, tiles or rows), each row's found by TRL's `split_pixel_values_by_grid`."""
    selected = {}
    for key, value in split_pixel_values_by_grid(output).items():
        if key in _SCALAR_KEYS:
            selected[key] = value
        elif isinstance(value, list):  # num_images and, split, each row's images
            selected[key] = [value[i] for i in rows.tolist()]
        elif torch.is_tensor(value) and value.dim() > 0:
            selected[key] = value[rows.to(value.device)]
        else:
            raise ValueError(f"dynamic sampling cannot split the generation output's {key!r}.")
    return unsplit_pixel_values_by_grid(selected)


def _pad_to(tensor: torch.Tensor, length: int, value, left: bool) -> torch.Tensor:
    missing = length - tensor.shape[1]
    if missing <= 0:
        return tensor
    filler = torch.full((tensor.shape[0], missing), value, dtype=tensor.dtype, device=tensor.device)
    return torch.cat([filler, tensor] if left else [tensor, filler], dim=1)


def merge_generation_outputs(parts: list[dict], pad_token_id: int) -> dict:
    """Concatenate generation outputs along the batch: prompts left-padded, completions right-padded to a common
    length (pad token, mask 0, log-probs 0, ratios 1), per-token type ids as their tokens; image tensors and counts
    concatenated. `num_items_in_batch` is left to the caller (it is global)."""
    keys = set(parts[0])
    for part in parts[1:]:
        if set(part) != keys:
            raise ValueError(f"generation outputs differ in their keys: {sorted(keys)} vs {sorted(part)}.")
    merged = {}
    for key in sorted(keys):
        values = [part[key] for part in parts]
        if key in _SCALAR_KEYS:
            continue
        if key in _PROMPT_KEYS or key in _COMPLETION_KEYS:
            left = key in _PROMPT_KEYS
            pad = {**_PROMPT_KEYS, **_COMPLETION_KEYS}[key]
            pad = pad_token_id if pad == "pad" else pad
            if values[0].dim() == 2 and values[0].shape[1] == 1 and key == "importance_sampling_ratio":
                merged[key] = torch.cat(values)  # sequence-level ratios: one column
                continue
            length = max(v.shape[1] for v in values)
            merged[key] = torch.cat([_pad_to(v, length, pad, left) for v in values])
        elif key in _SEQUENCE_KEYS:  # the prompt's part left-padded, the completion's right-padded
            cuts = [part["prompt_ids"].shape[1] for part in parts]
            prompt, completion = max(cuts), max(v.shape[1] - cut for v, cut in zip(values, cuts))
            merged[key] = torch.cat([torch.cat([_pad_to(v[:, :cut], prompt, 0, True),
                                                _pad_to(v[:, cut:], completion, 0, False)], 1)
                                     for v, cut in zip(values, cuts)])  # fmt: skip
        elif key in _COUNT_KEYS and isinstance(values[0], list):
            merged[key] = sum(values, [])
        elif key in _ROW_KEYS or torch.is_tensor(values[0]) and values[0].dim() > 0:  # rows, or images, tiles
            merged[key] = torch.cat(values)
        else:
            raise ValueError(f"dynamic sampling cannot merge the generation output's {key!r}.")
    return merged


class DynamicSampling:
    """Mixin for `PolicyLossTrainer`: `_generate_with_dynamic_sampling`, one generation batch with DAPO's group filter,
    each round one `_generate_once` (GRPOTrainer's generation)."""

    def _mask_rows(self, output: dict, rows: torch.Tensor) -> dict:
        """A generation output with the tokens of `rows` (booleans) masked out, `num_items_in_batch` recounted."""
        output["completion_mask"] = output["completion_mask"] * ~rows.to(output["completion_mask"].device)[:, None]
        loss_mask = output["completion_mask"] * output.get("tool_mask", 1)
        output["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum()
        return output

    def _dynamic_sampling_prompts(self, count: int) -> list:
        """`count` fresh prompts for this process, each repeated `num_generations` times (a generation batch)."""
        if not hasattr(self, "_extra_prompt_generator"):
            self._extra_prompt_generator = torch.Generator().manual_seed(
                self.args.seed + 7919 * (1 + self.accelerator.process_index)
            )
        indices = torch.randint(len(self.train_dataset), (count,), generator=self._extra_prompt_generator).tolist()
        return [self.train_dataset[i] for i in indices for _ in range(self.num_generations)]

    def _generate_with_dynamic_sampling(self, inputs):
        group_size = self.num_generations
        if len(inputs) % group_size or any(
            inputs[start]["prompt"] != inputs[start + k]["prompt"]
            for start in range(0, len(inputs), group_size)
            for k in range(1, group_size)
        ):
            raise ValueError(
                "dynamic sampling needs each process's generation batch to hold whole prompt groups: set "
                "per_device_train_batch_size x steps_per_generation to a multiple of num_generations."
            )
        wanted = len(inputs) // group_size
        kept, dropped, generated, rounds = [], [], 0, 0
        batch = inputs
        while True:
            output = self._generate_once(batch)
            rounds += 1
            signal = group_has_signal(output["advantages"], group_size)
            generated += signal.numel()
            rows = torch.arange(signal.numel() * group_size).reshape(-1, group_size)
            for g, has_signal in enumerate(signal.tolist()):
                (kept if has_signal else dropped).append(select_rows(output, rows[g]))
            missing = torch.tensor(float(max(0, wanted - len(kept))), device=self.accelerator.device)
            # every process runs the collective: all stop together
            all_full = self.accelerator.reduce(missing, reduction="sum").item() == 0
            if all_full or rounds > self.policy_args.dynamic_sampling_max_rounds:
                break
            batch = self._dynamic_sampling_prompts(wanted)
        groups = kept[:wanted]
        output = merge_generation_outputs(groups + dropped[: wanted - len(groups)], self._tokenizer.pad_token_id)
        # rounds ran out: the dropped groups that fill the batch keep its shapes, but their tokens do not count
        output = self._mask_rows(output, torch.arange(len(output["completion_mask"])) >= len(groups) * group_size)
        counts = torch.tensor([rounds, generated, generated - len(kept), len(groups), wanted], dtype=torch.float64)
        totals = self.accelerator.reduce(counts.to(self.accelerator.device), reduction="sum").tolist()
        metrics = self._metrics["train"]
        metrics["dynamic_sampling/rounds"].append(rounds)
        metrics["dynamic_sampling/dropped_group_share"].append(totals[2] / max(totals[1], 1.0))
        metrics["dynamic_sampling/filled_share"].append(totals[3] / max(totals[4], 1.0))
        return output

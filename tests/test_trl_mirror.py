"""Our `_compute_loss` is TRL's, verbatim outside the fenced blocks (docs/upgrading-trl.md).

`PolicyLossTrainer._compute_loss` mirrors the installed `GRPOTrainer._compute_loss`; each change of ours sits between
a `# trl-bandpo: <why>` line and a `# trl-bandpo end` line. This test diffs the two methods with every fenced block
folded into one placeholder line: every difference must be a fenced block, standing in for exactly the TRL lines
listed below (nothing, for a block that only adds). A TRL release that edits any other line of the method, or the
lines a block replaces, fails here with the diff to port.
"""

from __future__ import annotations

import difflib
import inspect

from trl import GRPOTrainer

from trl_bandpo.training.trainer import PolicyLossTrainer

OPEN, CLOSE = "# trl-bandpo:", "# trl-bandpo end"

# TRL 1.16's per-`loss_type` policy terms, which our one call to the registered loss replaces.
POLICY_TERMS = """\
        if self.loss_type == "cispo":
            clamped_ratios = torch.clamp(coef_1, max=self.epsilon_high).detach()
            per_token_loss = -clamped_ratios * advantages * per_token_logps
        elif self.loss_type in ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"]:
            coef_2 = torch.clamp(coef_1, 1 - self.epsilon_low, 1 + self.epsilon_high)
            # Two-sided clipping
            if self.args.delta is not None:
                coef_1 = torch.clamp(coef_1, max=self.args.delta)

            per_token_loss1 = coef_1 * advantages
            per_token_loss2 = coef_2 * advantages
            per_token_loss = -torch.min(per_token_loss1, per_token_loss2)
        elif self.loss_type == "sapo":
            temperatures = torch.where(advantages > 0, self.args.sapo_temperature_pos, self.args.sapo_temperature_neg)
            soft_coef_1 = torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures
            per_token_loss = -soft_coef_1 * advantages
        elif self.loss_type == "vespo":
            phi_seq = self.get_gamma_weights(
                advantages=advantages,
                log_ratio_per_token=log_ratio,
                mask=mask,
                importance_sampling_ratio=inputs.get("importance_sampling_ratio"),
                k_pos=self.args.vespo_k_pos,
                lambda_pos=self.args.vespo_lambda_pos,
                k_neg=self.args.vespo_k_neg,
                lambda_neg=self.args.vespo_lambda_neg,
            )
            per_token_loss = -phi_seq * advantages * per_token_logps
        else:
            raise ValueError(f"Unknown loss type: {self.loss_type}")"""

# The TRL 1.16 lines each fenced block stands for, in the order of the blocks ("" for a block that only adds).
REPLACED = [
    "",  # delegation of TRL's own loss types
    "",  # non-finite old log-probs
    POLICY_TERMS,
    # the clip ratios against 1 -/+ epsilon
    "            is_low_clipped = (coef_1 < 1 - self.epsilon_low) & (advantages < 0)\n"
    "            is_high_clipped = (coef_1 > 1 + self.epsilon_high) & (advantages > 0)",
    "",  # count metrics
]


def fold_fences(lines: list[str]) -> tuple[list[str], int]:
    """`lines` with each fenced block replaced by one placeholder line, and the number of blocks. A lint suppression
    (`  # noqa: ...`, for TRL names that only TRL's removed branches define) is not a change."""
    folded, blocks, inside = [], 0, False
    for line in lines:
        line = line.split("  # noqa: ")[0]
        text = line.strip()
        if text.startswith(OPEN):
            assert not inside, f"nested fence: {line!r}"
            inside = True
        elif text == CLOSE:
            assert inside, f"fence closed twice: {line!r}"
            inside = False
            folded.append(f"<trl-bandpo block {blocks}>")
            blocks += 1
        elif not inside:
            folded.append(line)
    assert not inside, "a fence is never closed"
    return folded, blocks


def test_fold_fences_finds_blocks_and_keeps_the_rest():
    lines = ["a", "    # trl-bandpo: why", "    x = 1", "    # trl-bandpo end", "b  # noqa: F821"]
    assert fold_fences(lines) == (["a", "<trl-bandpo block 0>", "b"], 1)


def assert_mirrors(theirs_fn, ours_fn, replaced: list[str], what: str) -> None:
    """`ours_fn`'s source equals `theirs_fn`'s outside its fenced blocks, each block standing for exactly the TRL
    lines `replaced` lists for it (in order; "" for a block that only adds); else the diff to port."""
    theirs = inspect.getsource(theirs_fn).splitlines()
    ours, blocks = fold_fences(inspect.getsource(ours_fn).splitlines())
    assert blocks == len(replaced), f"{blocks} fenced blocks, the test lists {len(replaced)}"
    diff = "\n".join(difflib.unified_diff(theirs, ours, "trl", "trl_bandpo (fences folded)", lineterm=""))
    stands_for = {}
    matcher = difflib.SequenceMatcher(None, theirs, ours, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        placeholders = [line for line in ours[j1:j2] if line.startswith("<trl-bandpo block")]
        assert ours[j1:j2] == placeholders and len(placeholders) == 1, (
            f"TRL's {what} and ours differ outside a fenced block: port these lines\n{diff}"
        )
        stands_for[placeholders[0]] = "\n".join(theirs[i1:i2])
    for index, expected in enumerate(replaced):
        got = stands_for.get(f"<trl-bandpo block {index}>", "")
        assert got == expected, (
            f"fenced block {index} no longer stands for the TRL lines it replaced; TRL now has there:\n{got}\n"
            f"\nfull diff:\n{diff}"
        )


def test_compute_loss_is_trl_verbatim_outside_the_fences():
    assert_mirrors(GRPOTrainer._compute_loss, PolicyLossTrainer._compute_loss, REPLACED, "_compute_loss")

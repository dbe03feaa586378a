r"""Offline CPU demo: GRPO, Clip-Higher, BandPO and DGPO on a toy arithmetic task, the papers' Figure 3 at toy scale.

``trl-bandpo demo`` (or ``python -m trl_bandpo.demo``) needs no network, no GPU and no downloaded weights. It

1. builds a tiny Qwen2 causal LM (hidden 128, 2 layers, 0.34M parameters) and the character tokenizer of
   `trl_bandpo.tiny_model`, and gives it a short supervised warm start (plain torch, a few hundred steps) on
   two-operand addition ``"a+b="`` -> ``"<a+b>"`` with operands in ``[0, max_operand)``. The warm start stops once
   answers sampled at temperature 1 are right ``--warmup-target`` (40%) of the time on a probe of training problems:
   often enough for group-relative rewards to carry signal, rarely enough that there is entropy to lose or keep.
   (The model learns addition abruptly: after a fixed 450 steps, held-out accuracy ranged from 39% to 73% over
   seeds 0-2; a target makes seeds comparable.) Held-out problems (never trained on, by SFT or RL) measure
   generalisation. The warm-started model is cached in ``<output-dir>/warmstart/`` and reused by reruns with the
   same task, size and seed;
2. trains a copy of that model with RL for each method, same seed, same prompts, same hyper-parameters, only the
   per-token policy term differs:

   ============  ==============================================================================================
   ``grpo``      ``policy_loss="clip"``, ε− = ε+ = 0.2
   ``clip_higher`` ``policy_loss="clip"``, ε− = 0.2, ε+ = 0.28 (DAPO's Clip-Higher)
   ``bandpo``    ``policy_loss="band"``, KL trust region of radius ``--band-radius`` (default 0.02), upper bound
                 capped at 10 (``band_upper_max``, as the BandPO authors trained)
   ``dgpo``      ``policy_loss="dgpo"``, n = 1, m = 2, ε = 0.2/0.2
   any other     a name of `trl_bandpo.POLICY_LOSSES` (``relaxed_band``, ``dcpo``, ``gppo``, ``ce_gppo``, ``aspo``,
                 ``band``, ``clip``...) with the ε of SPEC §3 for it (0.2/0.28 for ``relaxed_band``, 0.16/0.2 for
                 ``dcpo``, 0.2/0.2 otherwise)
   ============  ==============================================================================================

   The reward is 1 for the exact answer and 0 otherwise. Every generation batch is reused for
   ``steps_per_generation × num_iterations`` optimizer steps (default 4 × 2), with a learning rate large enough
   that the ratios move within those steps: clipping is active, which is what the methods differ on;
3. writes to ``--output-dir`` (default ``demo_output/``): ``metrics.csv`` (one row per method and optimizer step,
   every value of ``trainer.state.log_history``), ``figure.png`` (reward, entropy, overall clip rate
   ``clip_ratio/region_mean``, and the share of upper-side clipping that falls on tail tokens p < 0.2,
   ``clip_ratio/high_tail_share``, one line per method, i.e. BandPO's Figure 3 at toy scale), ``results.json``
   (the numbers behind the table), and ``summary.md``: per method the held-out accuracy (greedy, and sampled at
   temperature 1) on problems never seen in training, the final and mean entropy, clip rates and tail share, and
   one automatically computed observation per comparison with GRPO. The table is printed at the end.

Why δ = 0.02 for BandPO here. With a KL trust region, the Band interval at p = 0.5 is [0.80, 1.20] for
δ = KL(Bern(0.5) ‖ Bern(0.6)) ≈ 0.0204, i.e. exactly GRPO's ε = 0.2 interval. With δ = 0.02 BandPO is thus as
tight as GRPO for mid-probability tokens, tighter for confident ones (p = 0.9: [0.92, 1.06]) and wider for tail
tokens (p = 0.1: [0.51, 1.70]; p = 0.01: [0.05, 4.43]): the comparison isolates the probability-aware *shape* of the
bounds, not a mere widening. The paper's δ = 0.05 (tuned for lr 1e-6 on billion-parameter models) gives
[0.69, 1.31] at p = 0.5 and is wider than GRPO's interval for every p below about 0.8, so a difference from GRPO
would mix "wider" with "probability-aware". Pass ``--band-radius 0.05`` to run the paper's value.

What the demo shows is measured, not asserted: the observations are computed from this run's numbers, with one
seed at toy scale, and can go either way. The same run, same seed and same machine gives the same numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import random
import sys
import time
import warnings
from pathlib import Path
from typing import Any

__all__ = ["main", "METHOD_PRESETS", "DEFAULT_METHODS", "build_parser", "make_problems", "correctness_reward"]

#: The four methods of the papers' Figure 3 comparison, in plotting order.
DEFAULT_METHODS = ("grpo", "clip_higher", "bandpo", "dgpo")

#: Named methods: display label and the `PolicyLossConfig` fields that define them. BandPO's radius comes from
#: ``--band-radius``.
METHOD_PRESETS: dict[str, dict[str, Any]] = {
    "grpo": {"label": "GRPO", "policy_loss": "clip", "epsilon": 0.2, "epsilon_high": 0.2},
    "clip_higher": {"label": "Clip-Higher", "policy_loss": "clip", "epsilon": 0.2, "epsilon_high": 0.28},
    "bandpo": {
        "label": "BandPO",
        "policy_loss": "band",
        "band_divergence": "kl",
        "band_upper_max": 10.0,
        "epsilon": 0.2,
        "epsilon_high": 0.2,
    },
    "dgpo": {"label": "DGPO", "policy_loss": "dgpo", "epsilon": 0.2, "epsilon_high": 0.2, "dgpo_n": 1, "dgpo_m": 2.0},
}
# ε of SPEC §3 for the other policy losses, when run by their own name.
_OTHER_EPSILONS = {"relaxed_band": (0.2, 0.28), "dcpo": (0.16, 0.2)}

#: Tail tokens: old-token probability below this (BandPO Figure 3(b); `trainer.TAIL_PROBABILITY`).
TAIL_P = 0.2

_CACHE_VERSION = 1
_PROBE_SIZE = 128  # training problems sampled once at T=1 to decide when the warm start stops
_PROBE_EVERY = 10  # warm-start steps between probes
_SUMMARY_COLUMNS = (
    ("method", "method"),
    ("policy_loss", "policy loss"),
    ("heldout_acc_greedy", "held-out acc (greedy)"),
    ("heldout_acc_sampled", "held-out acc (T=1)"),
    ("train_reward_last", "train reward (last 25%)"),
    ("entropy_final", "entropy final"),
    ("entropy_mean", "entropy mean"),
    ("clip_rate_mean", "clip rate"),
    ("clip_high_mean", "upper clip rate"),
    ("tail_share", "tail share of upper clip (p<0.2)"),
)


# ----------------------------------------------------------------------------------------------------------------
# Task
# ----------------------------------------------------------------------------------------------------------------


def make_problems(max_operand: int, num_prompts: int, num_eval: int, seed: int):
    """Split the ``max_operand²`` problems ``a+b=`` into disjoint training prompts and held-out problems.

    Returns two lists of ``{"prompt": "a+b=", "answer": "<a+b>"}``: `num_prompts` training problems (0 = all the
    ones not held out) and `num_eval` held-out ones. The split depends only on `seed`.
    """
    pairs = [(a, b) for a in range(max_operand) for b in range(max_operand)]
    random.Random(seed).shuffle(pairs)
    if num_eval >= len(pairs):
        raise ValueError(f"--num-eval ({num_eval}) must be below the number of problems ({len(pairs)}).")
    held_out, train = pairs[:num_eval], pairs[num_eval:]
    if num_prompts:
        if num_prompts > len(train):
            raise ValueError(
                f"--num-prompts ({num_prompts}) exceeds the {len(train)} problems left after holding out {num_eval}; "
                f"raise --max-operand or lower --num-eval."
            )
        train = train[:num_prompts]
    as_rows = lambda ps: [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in ps]  # noqa: E731
    return as_rows(train), as_rows(held_out)


def correctness_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion (stripped) is exactly the answer, else 0.0."""
    return [1.0 if _text(c).strip() == str(a) else 0.0 for c, a in zip(completions, answer)]


def _text(completion) -> str:
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):  # conversational
        return str(completion[-1].get("content", ""))
    return str(completion)


# ----------------------------------------------------------------------------------------------------------------
# Warm start (supervised, plain torch) and evaluation
# ----------------------------------------------------------------------------------------------------------------


def _encode_sft_batch(tokenizer, rows):
    import torch

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    sequences, labels = [], []
    for row in rows:
        prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        completion = tokenizer(row["answer"], add_special_tokens=False)["input_ids"] + [eos]
        sequences.append(prompt + completion)
        labels.append([-100] * len(prompt) + completion)
    length = max(map(len, sequences))
    input_ids = torch.full((len(rows), length), pad, dtype=torch.long)
    label_ids = torch.full((len(rows), length), -100, dtype=torch.long)
    attention = torch.zeros((len(rows), length), dtype=torch.long)
    for i, (seq, lab) in enumerate(zip(sequences, labels)):  # right padding: positions stay 0..len-1
        input_ids[i, : len(seq)] = torch.tensor(seq)
        label_ids[i, : len(lab)] = torch.tensor(lab)
        attention[i, : len(seq)] = 1
    return input_ids, attention, label_ids


def warm_start(train_rows, path: Path, args) -> tuple[Path, bool, dict]:
    """Supervised warm start of a fresh tiny model on `train_rows`, saved to `path`; reused when cached.

    Trains with AdamW on the answer tokens (prompt tokens masked) until the sampled accuracy on a fixed probe of
    training problems reaches ``args.warmup_target`` or ``args.warmup_steps`` steps are done. Returns
    ``(path, reused, meta)``; `meta` holds the steps done and the probe accuracy. The cache key is every setting
    that changes the weights.
    """
    import torch

    from .tiny_model import build_tiny_model, build_tiny_tokenizer

    key = {
        "version": _CACHE_VERSION,
        "seed": args.seed,
        "max_operand": args.max_operand,
        "num_prompts": args.num_prompts,
        "num_eval": args.num_eval,
        "warmup_steps": args.warmup_steps,
        "warmup_target": args.warmup_target,
        "warmup_lr": args.warmup_lr,
        "warmup_batch_size": args.warmup_batch_size,
        "hidden_size": args.hidden_size,
        "num_layers": args.num_layers,
    }
    meta_path = path / "demo_warmstart.json"
    if not args.no_cache and meta_path.is_file() and (path / "config.json").is_file():
        try:
            meta = json.loads(meta_path.read_text())
            if meta.get("key") == key:
                return path, True, meta
        except (OSError, ValueError):
            pass

    _seed_everything(args.seed)
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, hidden_size=args.hidden_size, num_layers=args.num_layers, seed=args.seed)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.warmup_lr, weight_decay=0.0)
    warmup = max(1, args.warmup_steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    rng = random.Random(args.seed)
    probe = random.Random(args.seed + 1).sample(train_rows, min(len(train_rows), _PROBE_SIZE))
    max_new_tokens = _max_new_tokens(args.max_operand)
    start, loss, steps, probe_acc = time.time(), float("nan"), 0, float("nan")
    bar = _tqdm(total=args.warmup_steps, desc="warm start (SFT)", disable=args.quiet)
    for steps in range(1, args.warmup_steps + 1):
        rows = [train_rows[rng.randrange(len(train_rows))] for _ in range(args.warmup_batch_size)]
        input_ids, attention, labels = _encode_sft_batch(tokenizer, rows)
        out = model(input_ids=input_ids, attention_mask=attention, labels=labels)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        loss = out.loss.item()
        bar.update(1)
        if args.warmup_target > 0 and steps % _PROBE_EVERY == 0:
            # stop at a target sampled accuracy, so every seed starts RL from a comparable point
            probe_acc = evaluate_accuracy(model, tokenizer, probe, samples=1, seed=args.seed + steps,
                                          max_new_tokens=max_new_tokens, greedy=False)["sampled"]  # fmt: skip
            bar.set_postfix(loss=f"{loss:.3f}", acc=f"{probe_acc:.2f}", refresh=False)
            if probe_acc >= args.warmup_target:
                break
    bar.close()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    meta = {"key": key, "steps": steps, "final_loss": loss, "probe_accuracy": probe_acc, "seconds": time.time() - start}
    meta_path.write_text(json.dumps(meta, indent=2))
    return path, False, meta


def evaluate_accuracy(
    model, tokenizer, rows, *, samples: int, seed: int, max_new_tokens: int, greedy: bool = True, batch_size: int = 512
):
    """Accuracy on `rows`: greedy (unless `greedy=False`), and the mean over `samples` samples per problem at
    temperature 1 (0 = skip), drawn under a fixed `seed` without touching the global RNG state."""
    import torch

    model_was_training = model.training
    model.eval()
    tokenizer.padding_side = "left"
    answers = [row["answer"] for row in rows]

    def run(prompts, do_sample):
        texts = []
        for i in range(0, len(prompts), batch_size):
            enc = tokenizer(prompts[i : i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
            enc = {k: v.to(model.device) for k, v in enc.items()}
            # pure sampling at temperature 1 (top_k=0: no top-k filter), as TRL samples during training
            sampling = {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0} if do_sample else {}
            out = model.generate(
                **enc,
                **sampling,
                max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
            texts += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        return texts

    prompts = [row["prompt"] for row in rows]
    with torch.no_grad():
        greedy = correctness_reward(run(prompts, False), answers) if greedy else []
        sampled = []
        if samples > 0:
            with _fork_rng(seed):
                sampled = correctness_reward(run(prompts * samples, True), answers * samples)
    model.train(model_was_training)
    acc = sum(sampled) / len(sampled) if sampled else float("nan")
    return {
        "greedy": sum(greedy) / len(greedy) if greedy else float("nan"),
        "sampled": acc,
        # binomial standard error of the sampled accuracy (at least that of one success in n)
        "sampled_se": math.sqrt(max(acc * (1 - acc), 1.0 / len(sampled)) / len(sampled)) if sampled else float("nan"),
        "n_problems": len(rows),
        "n_samples": len(sampled),
    }


# ----------------------------------------------------------------------------------------------------------------
# RL runs
# ----------------------------------------------------------------------------------------------------------------


def method_settings(name: str, band_radius: float) -> dict[str, Any]:
    """`PolicyLossConfig` fields (and ``label``) for a method name: a preset or any `POLICY_LOSSES` name."""
    from .losses import POLICY_LOSSES

    if name in METHOD_PRESETS:
        settings = dict(METHOD_PRESETS[name])
    elif name in POLICY_LOSSES:
        eps_low, eps_high = _OTHER_EPSILONS.get(name, (0.2, 0.2))
        settings = {"label": name, "policy_loss": name, "epsilon": eps_low, "epsilon_high": eps_high}
    else:
        raise ValueError(
            f"unknown method {name!r}: choose among {list(METHOD_PRESETS)} or a policy loss of {list(POLICY_LOSSES)}."
        )
    if settings["policy_loss"] in ("band", "relaxed_band"):
        settings["band_radius"] = band_radius
    return settings


def _train_one(settings, model_path, train_rows, run_dir, args, bar, max_new_tokens):
    from datasets import Dataset
    from transformers import PrinterCallback, ProgressCallback, TrainerCallback

    from .configs import PolicyLossConfig
    from .trainer import PolicyLossTrainer

    label = settings["label"]
    fields = {k: v for k, v in settings.items() if k != "label"}
    batch = args.prompts_per_generation * args.num_generations  # completions per generation batch
    config = PolicyLossConfig(
        output_dir=str(run_dir),
        seed=args.seed,
        data_seed=args.seed,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=1,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        per_device_train_batch_size=batch // args.steps_per_generation,
        gradient_accumulation_steps=1,
        steps_per_generation=args.steps_per_generation,
        num_generations=args.num_generations,
        num_iterations=args.num_iterations,
        max_completion_length=max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        beta=0.0,
        loss_type="dapo",
        **fields,
    )
    dataset = Dataset.from_list(train_rows)

    class _Progress(TrainerCallback):
        def on_step_end(self, args_, state, control, **kwargs):
            bar.update(1)

        def on_log(self, args_, state, control, logs=None, **kwargs):
            logs = logs or {}
            post = {"method": label}
            if logs.get("reward") is not None:
                post["reward"] = f"{logs['reward']:.2f}"
            if logs.get("entropy") is not None:
                post["entropy"] = f"{logs['entropy']:.2f}"
            bar.set_postfix(post, refresh=False)

    _seed_everything(args.seed)
    trainer = PolicyLossTrainer(
        model=str(model_path), reward_funcs=correctness_reward, args=config, train_dataset=dataset
    )
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(_Progress())
    start = time.time()
    trainer.train()
    seconds = time.time() - start
    history = [dict(entry) for entry in trainer.state.log_history if "train_runtime" not in entry]
    return trainer, history, seconds


# ----------------------------------------------------------------------------------------------------------------
# Metrics, summary, figure
# ----------------------------------------------------------------------------------------------------------------


def _finite(value) -> float:
    """A float, NaN for None/missing/non-numeric."""
    if value is None or isinstance(value, bool):
        return float("nan")
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def _series(history, key):
    """(steps, values) of `key` over the logged steps where it is a finite number."""
    steps, values = [], []
    for entry in history:
        value = _finite(entry.get(key))
        if math.isfinite(value):
            steps.append(int(entry["step"]))
            values.append(value)
    return steps, values


def _mean(values):
    values = [v for v in values if math.isfinite(v)]
    return sum(values) / len(values) if values else float("nan")


def _mean_se(values, weights=None) -> tuple[float, float]:
    """(weighted) mean and its standard error, treating the values as independent; NaN when undefined."""
    pairs = [(v, 1.0 if weights is None else w) for v, w in zip(values, weights or values) if math.isfinite(v)]
    pairs = [(v, w) for v, w in pairs if math.isfinite(w) and w > 0]
    total = sum(w for _, w in pairs)
    if not pairs or total <= 0:
        return float("nan"), float("nan")
    mean = sum(v * w for v, w in pairs) / total
    if len(pairs) < 2:
        return mean, float("nan")
    # standard error of a ratio (weighted-mean) estimator; for equal weights this is sd / sqrt(n)
    var = sum((w * (v - mean)) ** 2 for v, w in pairs) / total**2 * len(pairs) / (len(pairs) - 1)
    return mean, math.sqrt(var)


def tail_share_of_upper_clipping(history) -> tuple[float, float, int]:
    """Share of all upper-clipped tokens that were tail tokens (p < 0.2), over the whole run.

    Each step logs ``clip_ratio/high_tail_share`` (tail upper-clipped / upper-clipped tokens of that step) and
    ``clip_ratio/high_mean`` (upper-clipped / all tokens). Averaging the per-step shares would give a step with one
    clipped token the weight of a step with a hundred, so the steps are weighted by their upper-clip rate: with
    equal token counts per step this is exactly (Σ tail upper-clipped) / (Σ upper-clipped). Returns
    ``(share, standard error, steps with upper clipping)``.
    """
    shares, weights = [], []
    for entry in history:
        share, high = _finite(entry.get("clip_ratio/high_tail_share")), _finite(entry.get("clip_ratio/high_mean"))
        if math.isfinite(share) and math.isfinite(high) and high > 0:
            shares.append(share)
            weights.append(high)
    mean, se = _mean_se(shares, weights)
    return mean, se, len(shares)


def summarize_history(history) -> dict[str, float]:
    """The table's training numbers from one method's `log_history` (steps where a value is missing are skipped).

    ``*_final`` is the last logged value, ``*_mean`` the mean over all logged steps, ``*_end`` the mean over the
    last quarter of them (what the observations compare: less noisy than one step), ``*_se`` standard errors.
    """
    _, entropy = _series(history, "entropy")
    _, reward = _series(history, "reward")
    _, region = _series(history, "clip_ratio/region_mean")
    _, high = _series(history, "clip_ratio/high_mean")
    _, low = _series(history, "clip_ratio/low_mean")
    tail, tail_se, tail_steps = tail_share_of_upper_clipping(history)
    quarter = lambda xs: xs[-max(1, len(xs) // 4) :] if xs else []  # noqa: E731
    entropy_end, entropy_end_se = _mean_se(quarter(entropy))
    reward_last, reward_last_se = _mean_se(quarter(reward))
    clip_rate, clip_rate_se = _mean_se(region)
    return {
        "entropy_first": entropy[0] if entropy else float("nan"),
        "entropy_final": entropy[-1] if entropy else float("nan"),
        "entropy_mean": _mean(entropy),
        "entropy_end": entropy_end,
        "entropy_end_se": entropy_end_se,
        "train_reward_first": reward[0] if reward else float("nan"),
        "train_reward_last": reward_last,
        "train_reward_last_se": reward_last_se,
        "clip_rate_mean": clip_rate,
        "clip_rate_mean_se": clip_rate_se,
        "clip_high_mean": _mean(high),
        "clip_low_mean": _mean(low),
        "tail_share": tail,
        "tail_share_se": tail_se,
        "tail_share_steps": tail_steps,
        "logged_steps": len(history),
    }


def write_metrics_csv(path: Path, histories: dict[str, list[dict]]) -> None:
    """One row per (method, logged step); every numeric key of the log history is a column; NaN/None -> empty."""
    keys: list[str] = []
    for history in histories.values():
        for entry in history:
            for key, value in entry.items():
                if key not in ("step",) and key not in keys and (value is None or isinstance(value, (int, float))):
                    keys.append(key)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["method", "step", *keys])
        for method, history in histories.items():
            for entry in history:
                row = [method, int(entry["step"])]
                for key in keys:
                    value = _finite(entry.get(key))
                    row.append(repr(value) if math.isfinite(value) else "")
                writer.writerow(row)


def read_metrics_csv(path: str | Path) -> dict[str, list[dict[str, float]]]:
    """Read `metrics.csv` back: ``{method: [{"step": ..., key: float or nan}, ...]}``."""
    out: dict[str, list[dict[str, float]]] = {}
    with Path(path).open(newline="") as handle:
        for row in csv.DictReader(handle):
            method = row.pop("method")
            out.setdefault(method, []).append({k: (float(v) if v != "" else float("nan")) for k, v in row.items()})
    return out


def _fmt(value, digits=3) -> str:
    value = _finite(value)
    return f"{value:.{digits}f}" if math.isfinite(value) else "n/a"


def _verdict(a, b, se: float, higher: bool) -> str:
    """``yes``/``no`` for "a is higher (lower) than b", flagged when |a - b| is under 2 standard errors."""
    a, b = _finite(a), _finite(b)
    if not (math.isfinite(a) and math.isfinite(b)):
        return "n/a"
    answer = "yes" if (a > b if higher else a < b) else "no"
    if math.isfinite(se) and abs(a - b) < 2 * se:
        answer += ", within noise"
    return answer


def _se_diff(*ses) -> float:
    return math.sqrt(sum(se**2 for se in ses)) if all(math.isfinite(se) for se in ses) else float("nan")


def observations(rows: dict[str, dict], reference: str, warm: dict) -> list[str]:
    """Automatic lines comparing each method with `reference` (and with the warm start), computed from the numbers.

    Nothing here is asserted: each line states the comparison, its yes/no answer on this run and the two values.
    "within noise" marks a difference below two standard errors of this run's measurement (binomial over the
    held-out samples for accuracies; the spread over steps, treated as independent, for training metrics). That is
    measurement noise only: the variation between training runs with different seeds is not measured by one run.
    """
    lines = []
    ref = rows[reference]
    ref_label = ref["method"]

    def verdict(row, other, key, higher):
        a, b = row[key], other[key]
        se = _se_diff(_finite(row.get(f"{key}_se")), _finite(other.get(f"{key}_se")))
        return f"{_verdict(a, b, se, higher)} ({_fmt(a)} vs {_fmt(b)}"

    for name, row in rows.items():
        label = row["method"]
        if name != reference:
            lines += [
                f"{label} kept entropy higher than {ref_label}: {verdict(row, ref, 'entropy_end', True)} over the "
                f"last 25% of steps; last step {_fmt(row['entropy_final'])} vs {_fmt(ref['entropy_final'])})",
                f"{label} put a smaller share of its upper-side clipping on tail tokens (p < {TAIL_P}) than "
                f"{ref_label}: {verdict(row, ref, 'tail_share', False)})",
                f"{label} clipped fewer tokens overall than {ref_label}: {verdict(row, ref, 'clip_rate_mean', False)})",
                f"{label} reached a higher held-out accuracy (T=1) than {ref_label}: "
                f"{verdict(row, ref, 'heldout_acc_sampled', True)})",
            ]
        acc, acc_se = row["heldout_acc_sampled"], _finite(row.get("heldout_acc_sampled_se"))
        improved = _verdict(acc, warm["sampled"], _se_diff(acc_se, _finite(warm.get("sampled_se"))), True)
        lines.append(
            f"{label} improved held-out accuracy (T=1) over the warm start: {improved} ({_fmt(warm['sampled'])} -> "
            f"{_fmt(acc)}); its entropy went from {_fmt(row['entropy_first'])} to {_fmt(row['entropy_end'])} "
            f"(first step -> last 25% of steps)"
        )
    return lines


def markdown_table(rows: dict[str, dict], warm: dict) -> str:
    header = "| " + " | ".join(title for _, title in _SUMMARY_COLUMNS) + " |"
    rule = "|" + "|".join("---" for _ in _SUMMARY_COLUMNS) + "|"
    lines = [header, rule]
    warm_row = {"method": "warm start (no RL)", "policy_loss": "-", "heldout_acc_greedy": warm["greedy"],
                "heldout_acc_sampled": warm["sampled"]}  # fmt: skip
    for row in (warm_row, *rows.values()):
        cells = []
        for key, _ in _SUMMARY_COLUMNS:
            value = row.get(key, float("nan"))
            cells.append(value if isinstance(value, str) else _fmt(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _smooth(values, window):
    if window <= 1 or len(values) < 3:
        return values
    half = window // 2
    windows = (values[max(0, i - half) : i + half + 1] for i in range(len(values)))
    return [sum(w) / len(w) for w in windows]


def _windowed_tail_share(history, window: int):
    """Tail share of upper clipping pooled over a centred window of steps (weights: each step's upper-clip rate)."""
    steps, shares, weights = [], [], []
    for entry in history:
        share, high = _finite(entry.get("clip_ratio/high_tail_share")), _finite(entry.get("clip_ratio/high_mean"))
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


def plot_figure(path: Path, histories: dict[str, list[dict]], labels: dict[str, str], steps: int) -> bool:
    """The four panels (reward, entropy, clip rate, tail share of upper clipping); False if matplotlib is missing."""
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
        ("clip_ratio/region_mean", "clip rate (clip_ratio/region_mean)"),
        ("clip_ratio/high_tail_share", f"share of upper clipping on tail tokens (p<{TAIL_P}), {pool}-step pools"),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), constrained_layout=True)
    for ax, (key, title) in zip(axes.flat, panels):
        for index, (method, history) in enumerate(histories.items()):
            color = f"C{index}"
            if key == "clip_ratio/high_tail_share":
                # a step's share rests on a handful of clipped tokens: pool the counts over a window instead
                xs, ys = _windowed_tail_share(history, pool)
                ax.plot(xs, ys, color=color, linewidth=1.8, label=labels[method])
                continue
            xs, ys = _series(history, key)
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


# ----------------------------------------------------------------------------------------------------------------
# Plumbing
# ----------------------------------------------------------------------------------------------------------------


def _max_new_tokens(max_operand: int) -> int:
    return len(str(2 * (max_operand - 1))) + 2  # the answer's digits, EOS, one spare


def _seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@contextlib.contextmanager
def _fork_rng(seed: int):
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _tqdm(**kwargs):
    from tqdm.auto import tqdm

    return tqdm(dynamic_ncols=True, file=sys.stderr, **kwargs)


@contextlib.contextmanager
def _quiet_libraries():
    """Silence library warnings and progress bars during the demo, and restore the settings afterwards."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        import datasets

        datasets_bars = datasets.is_progress_bar_enabled()
        datasets.disable_progress_bars()
    except (ImportError, AttributeError):
        datasets, datasets_bars = None, False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars:
            transformers.utils.logging.enable_progress_bar()
        if datasets is not None and datasets_bars:
            datasets.enable_progress_bars()


def _method_list(values) -> list[str]:
    names = []
    for value in values:
        for name in str(value).replace(",", " ").split():
            name = name.strip().lower().replace("-", "_")
            if name and name not in names:
                names.append(name)
    if not names:
        raise ValueError("--methods is empty.")
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trl-bandpo demo",
        description=(
            "Offline CPU demo: warm-start a tiny model on toy addition, then train it with GRPO, Clip-Higher, BandPO "
            "and DGPO (same seed, same data) and compare reward, entropy, clip rates and held-out accuracy. "
            "The defaults take about two minutes on 2 idle CPU cores (more on a busy machine)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--methods", nargs="+", default=list(DEFAULT_METHODS), metavar="METHOD",
        help="Methods to compare (space or comma separated): grpo, clip_higher, bandpo, dgpo, or any policy loss "
        "name (relaxed_band, dcpo, gppo, ce_gppo, aspo, band, clip). Observations compare each with the first "
        "method, or with grpo when it is in the list.",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=600, help="RL optimizer steps per method.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the split, the warm start and every RL run.")
    parser.add_argument("--output-dir", default="demo_output", help="Folder for metrics, figure and summary.")
    task = parser.add_argument_group("task and size")
    task.add_argument("--max-operand", type=int, default=20, help="Operands a, b are drawn from [0, max_operand).")
    task.add_argument("--num-prompts", type=int, default=0, help="Training problems (0: all not held out).")
    task.add_argument("--num-eval", type=int, default=100, help="Held-out problems, never trained on.")
    task.add_argument("--eval-samples", type=int, default=8, help="Samples per held-out problem at T=1 (0: none).")
    task.add_argument("--hidden-size", type=int, default=128, help="Hidden size of the tiny Qwen2.")
    task.add_argument("--num-layers", type=int, default=2, help="Layers of the tiny Qwen2.")
    warm = parser.add_argument_group("supervised warm start")
    warm.add_argument("--warmup-steps", type=int, default=800, help="Most SFT steps of the warm start.")
    warm.add_argument(
        "--warmup-target", type=float, default=0.4,
        help="Stop the warm start once sampled (T=1) accuracy on 128 training problems, checked every 10 steps, "
        "reaches this (0: always run --warmup-steps).",
    )  # fmt: skip
    warm.add_argument("--warmup-lr", type=float, default=3e-3, help="Warm-start learning rate (AdamW).")
    warm.add_argument("--warmup-batch-size", type=int, default=64, help="Problems per warm-start step.")
    warm.add_argument("--no-cache", action="store_true", help="Redo the warm start even if a cached one matches.")
    rl = parser.add_argument_group("RL")
    rl.add_argument("--lr", type=float, default=2e-4, help="RL learning rate (AdamW, constant).")
    rl.add_argument("--prompts-per-generation", type=int, default=16, help="Prompts per generation batch.")
    rl.add_argument("--num-generations", type=int, default=8, help="Completions per prompt (GRPO group size).")
    rl.add_argument("--steps-per-generation", type=int, default=4, help="Optimizer steps per pass over a batch.")
    rl.add_argument("--num-iterations", type=int, default=2, help="Passes over each generation batch (>1: off-policy).")
    rl.add_argument("--band-radius", type=float, default=0.02, help="BandPO KL radius δ (see the module docstring).")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (a tiny model gains nothing from more; 0: as is)."
    )
    parser.add_argument("--quiet", action="store_true", help="No progress bars.")
    return parser


def _check_args(args) -> None:
    positive = ("steps", "max_operand", "num_eval", "hidden_size", "num_layers", "warmup_batch_size",
                "prompts_per_generation", "num_generations", "steps_per_generation", "num_iterations")  # fmt: skip
    for name in positive:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}.")
    for name in ("num_prompts", "warmup_steps", "eval_samples", "threads"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}.")
    if args.num_generations < 2:
        raise ValueError("--num-generations must be >= 2 (group-relative advantages).")
    if not 0 <= args.warmup_target <= 1:
        raise ValueError(f"--warmup-target must be in [0, 1], got {args.warmup_target}.")
    if not (args.lr > 0 and args.warmup_lr > 0 and args.band_radius > 0):
        raise ValueError("--lr, --warmup-lr and --band-radius must be > 0.")


def main(argv=None) -> int:
    """Run the demo; returns 0. See the module docstring and ``--help``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.methods = _method_list(args.methods)
        _check_args(args)
        settings = {name: method_settings(name, args.band_radius) for name in args.methods}
        train_rows, eval_rows = make_problems(args.max_operand, args.num_prompts, args.num_eval, args.seed)
        if len(train_rows) < args.prompts_per_generation:
            raise ValueError(
                f"{len(train_rows)} training prompts is fewer than --prompts-per-generation "
                f"{args.prompts_per_generation}."
            )
        if (args.prompts_per_generation * args.num_generations) % args.steps_per_generation:
            raise ValueError(
                "--prompts-per-generation × --num-generations must be divisible by --steps-per-generation."
            )
    except ValueError as err:
        parser.error(str(err))

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    total_start = time.time()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)

    import torch

    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        with _quiet_libraries():
            return _run(args, settings, train_rows, eval_rows, out, total_start)
    finally:
        torch.set_num_threads(threads)


def _run(args, settings, train_rows, eval_rows, out: Path, total_start: float) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    max_new_tokens = _max_new_tokens(args.max_operand)
    say(f"Task: a+b= with a, b < {args.max_operand}; {len(train_rows)} training prompts, {len(eval_rows)} held out.")

    # 1. warm start
    start = time.time()
    model_path, reused, warm_meta = warm_start(train_rows, out / "warmstart", args)
    warm_seconds = time.time() - start
    say(
        f"Warm start {'reused from' if reused else 'saved to'} {model_path}: {warm_meta.get('steps')} SFT steps, "
        f"probe accuracy {_fmt(warm_meta.get('probe_accuracy'))} ({warm_seconds:.1f} s)."
    )
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    base = AutoModelForCausalLM.from_pretrained(model_path)
    warm = evaluate_accuracy(base, tokenizer, eval_rows, samples=args.eval_samples, seed=args.seed,
                             max_new_tokens=max_new_tokens)  # fmt: skip
    del base
    say(f"Warm-start held-out accuracy: greedy {warm['greedy']:.3f}, T=1 {_fmt(warm['sampled'])}.")

    # 2. RL per method
    histories, rows, labels = {}, {}, {}
    bar = _tqdm(total=args.steps * len(settings), desc="RL", disable=args.quiet, unit="step")
    for name, method in settings.items():
        labels[name] = method["label"]
        bar.set_description(f"RL {method['label']}")
        trainer, history, seconds = _train_one(method, model_path, train_rows, out / "runs" / name, args, bar,
                                               max_new_tokens)  # fmt: skip
        model = trainer.accelerator.unwrap_model(trainer.model)
        accuracy = evaluate_accuracy(model, tokenizer, eval_rows, samples=args.eval_samples, seed=args.seed,
                                     max_new_tokens=max_new_tokens)  # fmt: skip
        histories[name] = history
        rows[name] = {
            "method": method["label"],
            "policy_loss": method["policy_loss"],
            "settings": {k: v for k, v in method.items() if k != "label"},
            "heldout_acc_greedy": accuracy["greedy"],
            "heldout_acc_sampled": accuracy["sampled"],
            "heldout_acc_sampled_se": accuracy["sampled_se"],
            "heldout_n_problems": accuracy["n_problems"],
            "heldout_n_samples": accuracy["n_samples"],
            "train_seconds": seconds,
            **summarize_history(history),
        }
        del trainer, model
    bar.close()

    # 3. outputs
    write_metrics_csv(out / "metrics.csv", histories)
    figure = plot_figure(out / "figure.png", histories, labels, args.steps)
    reference = "grpo" if "grpo" in rows else next(iter(rows))
    notes = observations(rows, reference, warm)
    table = markdown_table(rows, warm)
    total_seconds = time.time() - total_start
    settings_line = (
        f"addition a+b, a, b < {args.max_operand}; {len(train_rows)} training prompts, {len(eval_rows)} held-out "
        f"problems ({args.eval_samples} samples each at T=1); tiny Qwen2 (hidden {args.hidden_size}, "
        f"{args.num_layers} layers); warm start {warm_meta.get('steps')} SFT steps (target {args.warmup_target:g}, "
        f"at most {args.warmup_steps}); RL {args.steps} steps per method, "
        f"lr {args.lr:g}, {args.prompts_per_generation} prompts × {args.num_generations} completions per generation, "
        f"{args.steps_per_generation} steps per generation × {args.num_iterations} iterations, loss_type dapo, "
        f"beta 0, temperature 1; BandPO KL δ = {args.band_radius:g}, upper cap 10; seed {args.seed}."
    )
    summary = "\n".join(
        [
            "# trl-bandpo demo: summary",
            "",
            f"Settings: {settings_line}",
            "",
            table,
            "",
            "Columns: held-out accuracy on problems never trained on (greedy, and mean over samples at temperature 1); "
            "train reward = mean reward over the last 25% of generation batches; entropy = TRL's `entropy` (final = "
            "last logged step, mean = over all steps); clip rate = mean of `clip_ratio/region_mean`, upper clip rate "
            "= mean of `clip_ratio/high_mean` (for DGPO these count tokens outside the clip range, whose gradient is "
            "decayed rather than zeroed); tail share = share of all upper-clipped tokens that had p < 0.2 (per-step "
            "`clip_ratio/high_tail_share` weighted by the step's `clip_ratio/high_mean`).",
            "",
            "## Observations (computed from the numbers above; one seed at toy scale, not a test of the papers)",
            "",
            "\"within noise\": the difference is below two standard errors of this run's measurement (held-out "
            "sampling, or step-to-step spread). Seed-to-seed variation of training is not included and is larger: "
            "rerun with other `--seed` values before reading anything into a difference.",
            "",
            *[f"- {line}" for line in notes],
            "",
            f"Figure: {'figure.png' if figure else 'not drawn (matplotlib is not installed: pip install matplotlib)'}. "
            f"Per-step metrics: metrics.csv. Total time {total_seconds:.0f} s "
            f"(warm start {'reused' if reused else f'{warm_seconds:.0f} s'}; "
            + ", ".join(f"{row['method']} {row['train_seconds']:.0f} s" for row in rows.values())
            + ").",
            "",
        ]
    )
    (out / "summary.md").write_text(summary)
    results = {
        "settings": {k: v for k, v in vars(args).items()},
        "warm_start": {
            **warm, "reused": reused, "seconds": warm_seconds, **{k: v for k, v in warm_meta.items() if k != "key"}
        },
        "methods": rows,
        "reference": reference,
        "observations": notes,
        "figure": "figure.png" if figure else None,
        "total_seconds": total_seconds,
    }
    (out / "results.json").write_text(json.dumps(_jsonable(results), indent=2))
    print(summary)
    return 0


def _jsonable(value):
    """Plain JSON: NaN/inf -> null, paths and other objects -> str."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)


if __name__ == "__main__":
    sys.exit(main())

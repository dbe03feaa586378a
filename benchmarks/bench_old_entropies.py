"""Extra cost of the adaptive radius: the old-log-prob pass asked for entropies too (docs/extensions.md).

The adaptive per-token radius needs the old policy's entropies. They come from the pass GRPOTrainer already makes
for the old log-probs, with `compute_entropy=True`: no extra forward, but a softmax-weighted sum over the vocabulary
per token. This script times that pass (TRL's own `_get_per_token_logps_and_entropies`, through our trainer) with
and without entropies, interleaved, and reports medians and their ratio.

    python benchmarks/bench_old_entropies.py                      # CPU, Qwen2-style model, vocab 32k
    python benchmarks/bench_old_entropies.py --device cuda --hidden 1024 --layers 16 --batch 64 --length 1024
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/bench_old_entropies.py` from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def build_trainer(args, workdir: Path):
    from datasets import Dataset
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trl_bandpo import BandPOConfig, BandPOTrainer
    from trl_bandpo.demo.tiny_model import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    config = Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 64), max_position_embeddings=4096,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(workdir / "model")
    tokenizer.save_pretrained(workdir / "model")
    config = BandPOConfig(
        output_dir=str(workdir / "out"), use_cpu=args.device == "cpu", bf16=args.device != "cpu",
        report_to="none", per_device_train_batch_size=args.batch, num_generations=args.batch,
    )  # fmt: skip
    trainer = BandPOTrainer(
        model=str(workdir / "model"), reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=config,
        train_dataset=Dataset.from_list([{"prompt": "1+1="}]),
    )  # fmt: skip
    return trainer


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=256, help="completion tokens per sequence")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(args, Path(tmp))
        model = trainer.model.eval()
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(10, args.vocab, (args.batch, 16 + args.length), generator=g).to(model.device)
        mask = torch.ones_like(ids)
        times = {False: [], True: []}
        with torch.no_grad():
            for repeat in range(args.repeats + 1):
                for entropy in (False, True):
                    if model.device.type == "cuda":
                        torch.cuda.synchronize()
                    start = time.perf_counter()
                    trainer._get_per_token_logps_and_entropies(model, ids, mask, args.length, compute_entropy=entropy)
                    if model.device.type == "cuda":
                        torch.cuda.synchronize()
                    if repeat:  # the first round warms up
                        times[entropy].append(time.perf_counter() - start)
    plain, with_entropy = statistics.median(times[False]), statistics.median(times[True])
    tokens = args.batch * args.length
    print(f"old-log-prob pass, {tokens} tokens, vocab {args.vocab}, hidden {args.hidden} x {args.layers} layers, "
          f"{args.device}, median of {args.repeats}:")  # fmt: skip
    print("| pass | median (ms) | ratio |")
    print("|---|---|---|")
    print(f"| log-probs only | {plain * 1e3:.1f} | 1.00 |")
    print(f"| log-probs + entropies | {with_entropy * 1e3:.1f} | {with_entropy / plain:.2f} |")


if __name__ == "__main__":
    main()

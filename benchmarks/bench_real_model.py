"""Step time of every registered policy loss against `clip` on a real model (SmolLM2-135M-Instruct) on CPU, LoRA and
full fine-tuning, and generation with transformers, vLLM in-process and a vLLM server at the same batch.

``--part steps``: one trainer per policy loss (`trl_bandpo.demo.runs.method_settings`: each loss at the demo's
settings), all sharing one model (LoRA rank 16 on every linear layer, or every weight), each with its own generation
batch of the recipes' micro-batch (8 completions of the chat addition task, forced to 16 tokens, sampled under the
same seed from the same weights: the same tokens for every loss). A step is what a training step does once its batch
is there: forward, the policy loss, backward and an AdamW step (learning rate 0, so that every loss sees the same
weights). Each round times every loss once, each right after or right before a step of `clip` (alternating by
round), in an order shifted from round to round so that every loss comes early, in the middle and late; the table
gives each loss's median and its paired ratio to `clip` (the median over rounds of its step over the adjacent clip
step: a drift of the machine's speed within a round, which a fixed order turns into a bias, cancels out of it). Per
generation batch the Band losses also solve their bounds, once: `benchmarks/bench_band.py` times that.

``--part generation`` (in the vLLM environment, ``.venv-vllm``): 16 completions (4 prompts x 4) forced to 16 tokens,
at temperature 0.7, by ``model.generate``, by a colocated ``vllm.LLM`` (float32, eager) and by a server started with
``trl-bandpo vllm-serve`` through TRL's `VLLMClient`; interleaved rounds, medians.

    python benchmarks/bench_real_model.py --part steps --rounds 5 --out /tmp/steps.md
    .venv-vllm/bin/python benchmarks/bench_real_model.py --part generation --rounds 5 --out /tmp/generation.md
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/bench_real_model.py` from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

MODEL = "smollm2-135m-instruct"
TOKENS, PROMPTS, GENERATIONS = 16, 4, 4  # forced completion length; 4 prompts x 4 completions per generation


def chat_rows():
    from trl_bandpo.demo.task import make_problems

    return make_problems(10, 0, 20, seed=0, chat=True)[0]


def loss_trainer(name: str, model, tokenizer, output_dir: str):
    """A `PolicyLossTrainer` of policy loss `name` at the demo's settings on the shared `model`."""
    from datasets import Dataset

    from trl_bandpo.demo.runs import method_settings
    from trl_bandpo.demo.task import last_number_reward
    from trl_bandpo.training.configs import PolicyLossConfig
    from trl_bandpo.training.trainer import PolicyLossTrainer

    settings = {key: value for key, value in method_settings(name, 0.02).items() if key != "label"}
    config = PolicyLossConfig(
        output_dir=output_dir, use_cpu=True, bf16=False, report_to="none", disable_tqdm=True, save_strategy="no",
        per_device_train_batch_size=PROMPTS * GENERATIONS // 2, steps_per_generation=2, num_generations=GENERATIONS,
        max_completion_length=TOKENS, generation_kwargs={"min_new_tokens": TOKENS}, temperature=0.7, beta=0.0,
        loss_type="dapo", gradient_checkpointing=False, seed=0, **settings,
    )  # fmt: skip
    trainer = PolicyLossTrainer(model=model, reward_funcs=last_number_reward, args=config, processing_class=tokenizer,
                                train_dataset=Dataset.from_list(chat_rows()))  # fmt: skip
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # what TRL's training loop sets
    torch.manual_seed(0)  # the same completions for every loss: same weights, same seed
    rows = [row for row in chat_rows()[:PROMPTS] for _ in range(GENERATIONS)]  # as TRL's sampler repeats them
    batch = trainer._generate_and_score_completions(rows)
    half = {key: value[: PROMPTS * GENERATIONS // 2] if torch.is_tensor(value) and value.dim() else value
            for key, value in batch.items()}  # fmt: skip
    return trainer, half


def time_step(trainer, inputs, optimizer) -> float:
    start = time.perf_counter()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def steps_part(args) -> list[str]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_bandpo.core.losses import POLICY_LOSSES
    from trl_bandpo.data.models import resolve_model

    folder = resolve_model(MODEL)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    losses = [name for name in args.losses.split(",") if name] or list(POLICY_LOSSES)
    lines = [
        "| fine-tuning | policy loss | step ms (median) | ratio of medians to clip | paired ratio to clip |",
        "|---|---|---:|---:|---:|",
    ]
    for mode in args.modes.split(","):
        base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        if mode == "lora":
            lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
            base = get_peft_model(base, lora)
        optimizer = torch.optim.AdamW([p for p in base.parameters() if p.requires_grad], lr=0.0, weight_decay=0.0)
        with tempfile.TemporaryDirectory() as tmp:
            names = dict.fromkeys(["clip", *losses])
            trainers = {name: loss_trainer(name, base, tokenizer, f"{tmp}/{name}") for name in names}
            times = {name: [] for name in trainers}
            ratios = {name: [] for name in trainers}
            for trainer, inputs in trainers.values():  # one untimed step each: allocators, autograd
                time_step(trainer, inputs, optimizer)
            order = [name for name in trainers if name != "clip"]
            for round_ in range(args.rounds):
                shift = round_ * len(order) // args.rounds  # each loss early, middle and late in some round
                for name in order[shift:] + order[:shift]:
                    # clip's step right before or after (alternating by round), so that a drift of the machine's
                    # speed within a round cancels out of the paired ratio
                    pair = (name, "clip") if round_ % 2 else ("clip", name)
                    spent = {which: time_step(*trainers[which], optimizer) for which in pair}
                    ratios[name].append(spent[name] / spent["clip"])
                    for which, seconds in spent.items():
                        times[which].append(seconds)
                print(f"{mode}: round {round_ + 1}/{args.rounds} done", flush=True)
        clip = statistics.median(times["clip"])
        for name in losses:
            median = statistics.median(times[name])
            paired = statistics.median(ratios[name]) if name != "clip" else 1.0
            lines.append(f"| {mode} | {name} | {1e3 * median:.0f} | {median / clip:.3f} | {paired:.3f} |")
            print(lines[-1], flush=True)
    return lines


def generation_part(args) -> list[str]:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.generation.vllm_client import VLLMClient
    from vllm import LLM, SamplingParams

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "real_vllm"))
    from vllm_tier import serve

    from trl_bandpo.data.models import resolve_model

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB per engine: else each sizes its cache from the RAM
    folder = str(resolve_model(MODEL))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "left"
    texts = [tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
             for row in chat_rows()[:PROMPTS]]  # fmt: skip
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(model=folder, dtype="float32", enforce_eager=True, max_model_len=256, seed=0)
    params = SamplingParams(n=GENERATIONS, temperature=0.7, max_tokens=TOKENS, min_tokens=TOKENS)

    def by_transformers():
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            model.generate(**batch, do_sample=True, temperature=0.7, top_k=0, max_new_tokens=TOKENS,
                           min_new_tokens=TOKENS, num_return_sequences=GENERATIONS)  # fmt: skip

    def in_process():
        llm.generate([{"prompt_token_ids": prompt} for prompt in ids], params, use_tqdm=False)

    with tempfile.TemporaryDirectory() as tmp, serve(folder, Path(tmp) / "server.log") as server:
        client = VLLMClient(base_url=server.base_url, connection_timeout=60)

        def by_server():
            client.generate(ids, n=GENERATIONS, temperature=0.7, max_tokens=TOKENS,
                            generation_kwargs={"min_tokens": TOKENS})  # fmt: skip

        ways = {"transformers generate": by_transformers, "vLLM in-process": in_process, "vLLM server": by_server}
        times = {name: [] for name in ways}
        for way in ways.values():
            way()  # warm-up
        for _ in range(args.rounds):
            for name, way in ways.items():
                start = time.perf_counter()
                way()
                times[name].append(time.perf_counter() - start)
    base = statistics.median(times["transformers generate"])
    lines = ["| generation | median ms | ratio to transformers |", "|---|---:|---:|"]
    for name, values in times.items():
        lines.append(f"| {name} | {1e3 * statistics.median(values):.0f} | {statistics.median(values) / base:.2f} |")
        print(lines[-1], flush=True)
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["steps", "generation"], required=True)
    parser.add_argument("--modes", default="lora,full", help="steps: lora, full or both")
    parser.add_argument("--losses", default="", help="steps: comma-separated policy losses (default: all)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timed rounds (medians over them)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", default=None, help="also write the Markdown table here")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.threads < 0 or not set(args.modes.split(",")) <= {"lora", "full"}:
        parser.error("--rounds must be >= 1, --threads >= 0, --modes lora and/or full")
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    lines = steps_part(args) if args.part == "steps" else generation_part(args)
    header = (f"`python benchmarks/bench_real_model.py {' '.join(argv if argv is not None else sys.argv[1:])}`: "
              f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, torch "
              f"{torch.__version__}, {time.perf_counter() - started:.0f} s")  # fmt: skip
    table = "\n".join([header, "", *lines]) + "\n"
    print(table)
    if args.out:
        Path(args.out).write_text(table, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

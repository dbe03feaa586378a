"""The demo's synthetic task: two-operand addition, its rewards, and accuracy.

Operands are drawn from ``[0, max_operand)``. The ``max_operand²`` problems are split once, by seed, into training
prompts and held-out problems that are never trained on (neither by the warm start nor by RL): accuracy on them
measures generalisation. The tiny model reads ``"a+b="`` and must answer ``"<a+b>"`` exactly (`correctness_reward`).
A pretrained chat model is asked `CHAT_QUESTION` in a user message and is right when the last number of its reply is
the sum (`last_number_reward`): at the start SmolLM2-135M-Instruct knows most small sums but rarely stops at the
answer (about a quarter of its replies end on the right number within 16 tokens), so the reward rewards the format
first, then the sums it gets wrong.
"""

from __future__ import annotations

import math
import random

from ..scoring.answers import completion_text
from ..scoring.rewards import LastNumberReward

#: The user message of the chat task (pretrained models).
CHAT_QUESTION = "What is {a} + {b}? Answer with only the number."


def make_problems(max_operand: int, num_prompts: int, num_eval: int, seed: int, chat: bool = False):
    """Split the ``max_operand²`` problems ``a+b=`` into disjoint training prompts and held-out problems.

    Returns two lists of ``{"prompt": "a+b=", "answer": "<a+b>"}`` (with `chat`, the prompt is the user message
    `CHAT_QUESTION`): `num_prompts` training problems (0 = all the ones not held out) and `num_eval` held-out ones. The
    split depends only on `seed`.
    """
    pairs = [(a, b) for a in range(max_operand) for b in range(max_operand)]
    random.Random(seed).shuffle(pairs)
    if num_eval >= len(pairs):
        raise ValueError(
            f"--num-eval must be below the {len(pairs)} problems of --max-operand {max_operand}, got {num_eval}."
        )
    held_out, train = pairs[:num_eval], pairs[num_eval:]
    if num_prompts:
        if num_prompts > len(train):
            raise ValueError(
                f"--num-prompts must be at most the {len(train)} problems left after holding out --num-eval "
                f"{num_eval} (or raise --max-operand), got {num_prompts}."
            )
        train = train[:num_prompts]

    def prompt(a, b):
        return [{"role": "user", "content": CHAT_QUESTION.format(a=a, b=b)}] if chat else f"{a}+{b}="

    as_rows = lambda ps: [{"prompt": prompt(a, b), "answer": str(a + b)} for a, b in ps]  # noqa: E731
    return as_rows(train), as_rows(held_out)


def max_completion_tokens(max_operand: int) -> int:
    """Tokens a completion may take: the longest answer's digits, EOS, one spare."""
    return len(str(2 * (max_operand - 1))) + 2


def correctness_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion (stripped) is exactly the answer, else 0.0."""
    return [1.0 if completion_text(c).strip() == str(a) else 0.0 for c, a in zip(completions, answer)]


#: 1.0 when the reply's last number is the sum, else 0.0 (`trl_bandpo.scoring.rewards.LastNumberReward`).
last_number_reward = LastNumberReward()


def evaluate_accuracy(model, tokenizer, rows, *, samples: int, seed: int, max_new_tokens: int, greedy: bool = True,
                      batch_size: int = 512, reward=correctness_reward, temperature: float = 1.0):  # fmt: skip
    """Accuracy on `rows` (chat prompts through the tokenizer's chat template), scored by `reward`: greedy (unless
    `greedy=False`), and the mean over `samples` samples per problem at `temperature` (0 = skip), drawn under a fixed
    `seed` without touching the global RNG state."""
    import torch

    model_was_training = model.training
    model.eval()
    tokenizer.padding_side = "left"
    answers = [row["answer"] for row in rows]
    special = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}

    def run(prompts, do_sample):
        # pure sampling at `temperature` (top_k=0: no top-k filter), as TRL samples during training
        sampling = {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0} if do_sample else {}
        texts = []
        for i in range(0, len(prompts), batch_size):
            enc = tokenizer(prompts[i : i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
            enc = enc.to(model.device)
            out = model.generate(**enc, **sampling, **special, max_new_tokens=max_new_tokens)
            texts += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        return texts

    prompts = [
        tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) if isinstance(p, list) else p
        for p in (row["prompt"] for row in rows)
    ]
    with torch.no_grad():
        greedy = reward(run(prompts, False), answers) if greedy else []
        sampled = []
        if samples > 0:
            # the global RNG state is restored afterwards
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                sampled = reward(run(prompts * samples, True), answers * samples)
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

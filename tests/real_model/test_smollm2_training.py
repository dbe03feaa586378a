"""BandPOTrainer and DGPOTrainer on SmolLM2-135M-Instruct with TRL's own generation (transformers, no vLLM): chat
prompts through the model's chat template, completions ended by its eos token, and one LoRA step of each trainer."""

from __future__ import annotations

import math

import torch
from vllm_tier import build_trainer, record_generation_outputs, require_vllm, step_logs

require_vllm()  # the tier runs in .venv-vllm (conftest.py)

IM_END = 2  # SmolLM2's eos, "<|im_end|>": it ends an assistant turn (and pads)
MAX_COMPLETION = 24
SYSTEM_PROMPT = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


def chat_rows():
    from trl_bandpo.demo.task import make_problems

    train, _ = make_problems(10, 8, 20, seed=0, chat=True)  # "What is a + b? Answer with only the number."
    return train


def one_lora_step(name, model_dir, output_dir):
    """One optimizer step of trainer `name` with LoRA (rank 16, every linear layer) on the chat addition task: one
    generation of 2 prompts x 4 completions by transformers' ``generate`` at temperature 0.7."""
    from datasets import Dataset
    from peft import LoraConfig

    from trl_bandpo.demo.task import last_number_reward

    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = build_trainer(
        name, model_dir, output_dir, "colocate", use_vllm=False, reward=last_number_reward,
        dataset=Dataset.from_list(chat_rows()), peft_config=lora, gradient_accumulation_steps=1, num_iterations=1,
        max_steps=1, learning_rate=5e-4, temperature=0.7, max_completion_length=MAX_COMPLETION,
        gradient_checkpointing=False, beta=0.0,
    )  # fmt: skip
    outputs = record_generation_outputs(trainer)
    trainer.train()
    (log,) = step_logs(trainer)
    assert math.isfinite(log["loss"]) and 0.0 <= log["reward"] <= 1.0
    return trainer, outputs, log


def test_bandpo_step_generates_through_the_chat_template_and_stops_at_eos(smollm2_dir, tmp_path):
    trainer, outputs, log = one_lora_step("bandpo", smollm2_dir, tmp_path)
    assert log["bounds/lower_mean"] < 1.0 < log["bounds/upper_mean"]

    tokenizer = trainer.processing_class
    templated = [  # the chat template's ids for each training prompt, computed here from the tokenizer
        tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True) for row in chat_rows()
    ]
    expected = {tuple(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in templated}
    (output,) = outputs
    prompts = [tuple(ids[mask.bool()].tolist()) for ids, mask in zip(output["prompt_ids"], output["prompt_mask"])]
    assert len(prompts) == 8 and set(prompts) <= expected
    assert all(len(set(prompts[k : k + 4])) == 1 for k in (0, 4))  # 4 completions of each prompt
    for ids in prompts:
        text = tokenizer.decode(ids)
        assert text.startswith(SYSTEM_PROMPT) and text.endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert text.count("<|im_start|>") == 3  # system, user, and the assistant's turn it opens

    completions, mask = output["completion_ids"], output["completion_mask"]
    assert completions.shape[1] <= MAX_COMPLETION
    ended = 0
    for ids, row_mask in zip(completions.tolist(), mask.tolist()):
        if IM_END in ids:  # the turn ended: masked up to and including its first eos, nothing after (padding)
            end = ids.index(IM_END) + 1
            ended += 1
            assert row_mask == [1] * end + [0] * (len(ids) - end)
            assert ids[end:] == [tokenizer.pad_token_id] * (len(ids) - end)
            assert "<|im_start|>" not in tokenizer.decode(ids[:end])
        else:  # cut at the length limit
            assert len(ids) == MAX_COMPLETION and row_mask == [1] * MAX_COMPLETION
    # "Answer with only the number.": most replies end within 24 tokens, and then before the row's end
    assert ended >= 4 and any(ids.index(IM_END) < len(ids) - 1 for ids in completions.tolist() if IM_END in ids)
    print(f"\nreplies: {tokenizer.batch_decode(completions, skip_special_tokens=True)}")


def test_dgpo_step(smollm2_dir, tmp_path):
    _, _, log = one_lora_step("dgpo", smollm2_dir, tmp_path)
    # DGPO's regions outside the clip range: empty on the first step, whose ratio is exactly 1 (on-policy)
    fractions = {key: value for key, value in log.items() if key.startswith("dgpo/frac_")}
    assert set(fractions) == {"dgpo/frac_LN", "dgpo/frac_HP", "dgpo/frac_LP", "dgpo/frac_HN"}
    assert all(value == 0.0 for value in fractions.values()), fractions
    assert log["clip_ratio/region_mean"] == 0.0
    assert torch.isfinite(torch.tensor(log["grad_norm"])) and log["grad_norm"] > 0

"""The converted SmolLM2 folder (`trl-bandpo fetch-model`) against the GGUF file it came from, loaded directly by
transformers (``from_pretrained(folder, gguf_file=...)``, the way a user loads a GGUF): same weights, same logits,
same tokenizer, chat template and special tokens."""

from __future__ import annotations

import pytest
import torch
from vllm_tier import require_vllm

require_vllm()  # the tier runs in .venv-vllm (conftest.py)

CONVERSATIONS = [
    [{"role": "user", "content": "What is 3 + 4? Answer with only the number."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime number."}],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello, how can I help?"},
        {"role": "user", "content": "Spell 'café' backwards, then count to 3: 1, 2, 3."},
    ],
]
# Logits of the same float32 weights through the same architecture: bit for bit equal when both forwards run the
# same kernels (measured here: a difference of exactly 0). The tolerance allows for a different summation order
# only (another attention implementation or thread count): float32's relative rounding (6e-8) accumulated over the
# 30 layers stays orders of magnitude below 1e-4 on logits of magnitude ~40, while a weight off by one Q4_1 step
# (the scale d/15 of its block, ~1e-3 here) moves them by more.
LOGITS_ATOL, LOGITS_RTOL = 1e-4, 1e-5


@pytest.fixture(scope="module")
def from_gguf(smollm2_gguf):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = smollm2_gguf.parent, smollm2_gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return model, tokenizer


@pytest.fixture(scope="module")
def converted(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval(), tokenizer


def gguf_metadata(path) -> dict:
    """The GGUF file's own special-token ids, read with the gguf package (not through transformers)."""
    import gguf

    fields = gguf.GGUFReader(str(path)).fields
    read = lambda key: int(fields[key].parts[fields[key].data[0]][0])  # noqa: E731
    keys = {"bos": "tokenizer.ggml.bos_token_id", "eos": "tokenizer.ggml.eos_token_id"}
    keys["pad"] = "tokenizer.ggml.padding_token_id"
    return {name: read(key) for name, key in keys.items()}


def test_the_weights_and_logits_are_the_ggufs(from_gguf, converted):
    (reference, _), (model, tokenizer) = from_gguf, converted
    assert type(model) is type(reference) and model.num_parameters() == reference.num_parameters() == 134_515_008
    expected = reference.state_dict()
    weights = model.state_dict()
    assert weights.keys() == expected.keys()
    assert all(weights[key].dtype == torch.float32 and torch.equal(weights[key], expected[key]) for key in weights)
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    # a plain float32 model, which trains: transformers refuses to train one whose config names GGUF quantization
    assert getattr(model.config, "quantization_config", None) is None and not getattr(model, "is_quantized", False)
    for conversation in CONVERSATIONS:
        ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, return_tensors="pt")
        ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
        with torch.no_grad():
            got, want = model(ids).logits, reference(ids).logits
        print(f"{ids.shape[1]} tokens: max |logit difference| {(got - want).abs().max().item():.3g}")
        torch.testing.assert_close(got, want, atol=LOGITS_ATOL, rtol=LOGITS_RTOL)


def test_the_tokenizer_and_chat_template_are_the_ggufs(from_gguf, converted, smollm2_gguf, smollm2_dir):
    (_, reference), (model, tokenizer) = from_gguf, converted
    assert tokenizer.chat_template == reference.chat_template
    for conversation in CONVERSATIONS:
        for generation_prompt in (True, False):
            text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=generation_prompt)
            assert text == reference.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=generation_prompt
            )
            assert tokenizer(text)["input_ids"] == reference(text)["input_ids"]
    # SmolLM2's ChatML template: its default system prompt, the assistant's turn opened by the generation prompt
    text = tokenizer.apply_chat_template(CONVERSATIONS[0], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    # the special tokens the GGUF file declares: eos <|im_end|> (2), which ends an assistant turn, and padding
    special = gguf_metadata(smollm2_gguf)
    assert special == {"bos": 1, "eos": 2, "pad": 2}
    assert tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 2)
    assert (model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id) == (1, 2, 2)
    generation = model.generation_config
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (1, 2, 2)

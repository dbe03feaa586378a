"""Tiny causal LMs and tokenizers built locally (nothing is downloaded), for offline tests, the CPU demo and notebooks.

The tokenizer is byte-level with no merges (one token per byte) because transformers reloads a saved Qwen2 tokenizer
as its byte-level BPE `Qwen2Tokenizer` whatever the saved class: a plain character vocabulary would lose its spaces
and newlines when TRL reloads the model folder.
"""

from __future__ import annotations

from pathlib import Path

# A ChatML-style template (the one Qwen models use), so conversational datasets work with the tiny model too.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIAL_TOKENS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]


def build_tiny_tokenizer(extra_tokens: tuple[str, ...] = (), chat_template: str = CHAT_TEMPLATE, **special):
    """A byte-level `PreTrainedTokenizerFast` with no merges (one token per byte; 256 + 4 special tokens), with
    pad/unk/ChatML specials and a chat template; it survives `save_pretrained` + `AutoTokenizer.from_pretrained`.
    `extra_tokens`: more special tokens, numbered after the four; `special`: `PreTrainedTokenizerFast`'s special-token
    arguments (`additional_special_tokens`, default `["<|im_start|>"]`; `extra_special_tokens`, ...)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *extra_tokens, *alphabet])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", eos_token="<|im_end|>", bos_token=None,
        **{"additional_special_tokens": ["<|im_start|>"], **special},
    )  # fmt: skip
    tokenizer.chat_template = chat_template
    tokenizer.padding_side = "left"
    return tokenizer


def build_tiny_model(tokenizer, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, seed: int = 0):
    """A randomly initialised Qwen2 causal LM sized for `tokenizer` (about 0.1M parameters by default)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
        max_position_embeddings=512, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def save_tiny_model(path: str | Path, **model_kwargs) -> Path:
    """Build a tiny tokenizer and model and save both to `path` (TRL rebuilds reference models from a path)."""
    path = Path(path)
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, **model_kwargs)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path

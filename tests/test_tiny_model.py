"""The tiny local model and tokenizer used by the tests, the demo and the notebooks."""


def test_tiny_model_tokenizer_survives_reloading_as_trl_does(tmp_path):
    """TRL reloads the model folder with AutoProcessor/AutoTokenizer (a Qwen2Tokenizer for a Qwen2 model): the text
    and the token ids must come back unchanged, spaces and newlines included."""
    from transformers import AutoProcessor, AutoTokenizer

    from trl_bandpo.demo.tiny_model import build_tiny_tokenizer, save_tiny_model

    path = save_tiny_model(tmp_path / "tiny")
    text = "What is 12 + 7?\nAnswer: 19 = \\boxed{19}"
    built = build_tiny_tokenizer()
    for reloaded in (AutoTokenizer.from_pretrained(path), AutoProcessor.from_pretrained(path)):
        ids = reloaded(text)["input_ids"]
        assert ids == built(text)["input_ids"] and len(ids) == len(text.encode())
        assert reloaded.decode(ids) == text
        chat = reloaded.apply_chat_template([{"role": "user", "content": "1 + 1"}], tokenize=False,
                                            add_generation_prompt=True)  # fmt: skip
        assert chat == "<|im_start|>user\n1 + 1<|im_end|>\n<|im_start|>assistant\n"

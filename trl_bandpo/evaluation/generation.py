"""Sampling backends of `trl_bandpo.evaluation.evaluate`: vLLM when installed, else ``transformers.generate``.

`load_generator` loads the model once and returns a function that samples `num_samples` completions for each prompt
of a list, so that `evaluate` can score and save each batch as soon as it is generated.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def render_prompt(tokenizer, prompt: Any, **template_kwargs: Any) -> str:
    """Chat-template text (with the generation prompt) for a conversational prompt; plain text is used as is.
    `template_kwargs` go to ``apply_chat_template`` (e.g. a trainer's ``chat_template_kwargs``)."""
    if isinstance(prompt, str):
        return prompt
    messages = [dict(m) for m in prompt]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **template_kwargs)
    return "\n".join(m["content"] for m in messages) + "\n"


# A generator maps a list of prompts to `num_samples` completions each; the model is loaded once per `evaluate`.
Generator = Callable[[list[Any]], list[list[str]]]


def regroup(flat: Sequence[Any], per_prompt: int, num_samples: int) -> list[list[Any]]:
    """`flat` completions, `per_prompt` of each prompt in turn, as `num_samples` per prompt: with one per prompt
    (greedy decoding, decoded once) it is repeated."""
    return [list(flat[i : i + per_prompt]) * (num_samples // per_prompt) for i in range(0, len(flat), per_prompt)]


def _vllm_generator(model: str, settings: Mapping[str, Any]) -> Generator:
    """One vLLM engine; each call samples `num_samples` completions per prompt (``SamplingParams(n=num_samples)``)."""
    from vllm import LLM, SamplingParams

    num_samples, seed, top_k = settings["num_samples"], settings["seed"], settings.get("top_k")
    llm = LLM(model=model, seed=seed, dtype=settings["dtype"], **dict(settings["vllm_kwargs"]))
    tokenizer, keep = llm.get_tokenizer(), settings.get("truncate_prompt_tokens") or 0
    extra = {} if top_k is None else {"top_k": top_k}  # vLLM's default is no top-k
    per_prompt = 1 if settings["temperature"] == 0 else num_samples  # vLLM refuses n > 1 with greedy decoding
    params = SamplingParams(
        n=per_prompt, temperature=settings["temperature"], top_p=settings["top_p"],
        max_tokens=settings["max_new_tokens"], seed=seed, **extra,
    )  # fmt: skip

    def generate(prompts: list[Any]) -> list[list[str]]:
        # The chat template already writes any BOS token: hand vLLM token ids so it adds none of its own (the last
        # `keep` of them; all for keep 0).
        token_prompts = [
            {"prompt_token_ids": tokenizer(render_prompt(tokenizer, p), add_special_tokens=False)["input_ids"][-keep:]}
            for p in prompts
        ]
        outputs = llm.generate(token_prompts, params)
        return regroup([choice.text for output in outputs for choice in output.outputs], per_prompt, num_samples)

    return generate


def _transformers_generator(model_name_or_path: str, settings: Mapping[str, Any], samples_per_call: int) -> Generator:
    """One model; each call samples with ``model.generate`` (left padding, ``num_return_sequences``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = settings["device"] or ("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(model_name_or_path)
    tokenizer.padding_side = tokenizer.truncation_side = "left"  # a truncated prompt keeps its end
    keep = settings.get("truncate_prompt_tokens")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_name_or_path, dtype=settings["dtype"]).to(device).eval()
    num_samples, temperature, top_p = settings["num_samples"], settings["temperature"], settings["top_p"]
    greedy = temperature == 0  # greedy decoding is deterministic: decode once, repeat
    # Plain temperature / top-p sampling, as vLLM does: override top_k / repetition_penalty that a model's
    # generation_config.json may set (Qwen instruct models ship top_k=20, repetition_penalty=1.05).
    sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": temperature, "top_p": top_p}
    sampling.update(top_k=settings.get("top_k") or 0, repetition_penalty=1.0)  # top_k 0: none
    torch.manual_seed(settings["seed"])

    def generate(prompts: list[Any]) -> list[list[str]]:
        texts = [render_prompt(tokenizer, p) for p in prompts]
        batch = tokenizer(
            texts, return_tensors="pt", padding=True, add_special_tokens=False, truncation=bool(keep), max_length=keep
        ).to(device)
        with torch.inference_mode():
            output = model.generate(
                **batch, max_new_tokens=settings["max_new_tokens"], num_return_sequences=samples_per_call,
                pad_token_id=tokenizer.pad_token_id, **sampling,
            )  # fmt: skip
        new_tokens = output[:, batch["input_ids"].shape[1] :]  # (prompts * samples_per_call, new tokens)
        decoded = tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
        return regroup(decoded, samples_per_call, num_samples)

    return generate


def load_generator(backend: str, model: str, settings: Mapping[str, Any]) -> tuple[Generator, int | None]:
    """Load `model` once on `backend` ("vllm" or "transformers", `resolve_backend`) with `settings` (the fields of
    an `EvalSettings`, plus ``vllm_kwargs``). Returns ``(generate, prompts_per_call)``: `generate` maps a list of at
    most `prompts_per_call` prompts (None: any number; vLLM schedules a whole benchmark itself) to their completions.
    """
    if backend == "vllm":
        return _vllm_generator(model, settings), None
    samples_per_call = 1 if settings["temperature"] == 0 else settings["num_samples"]
    generate = _transformers_generator(model, settings, samples_per_call)
    return generate, max(1, settings["batch_size"] // samples_per_call)


def resolve_backend(backend: str, field: str = "backend") -> str:
    """ "vllm" or "transformers" for the checked `backend` ("auto": vLLM when importable); ValueError naming `field`
    for "vllm" without vLLM installed."""
    installed = importlib.util.find_spec("vllm") is not None
    if backend == "vllm" and not installed:
        raise ValueError(
            f"{field}='vllm' needs vLLM, which is not installed: pip install 'trl-bandpo[vllm]', or use {field} "
            "auto or transformers"
        )
    return ("vllm" if installed else "transformers") if backend == "auto" else backend


class PromptTooLongError(ValueError):
    """A prompt that leaves the model no position to generate in (`check_positions`), found before it loads."""


def check_positions(
    model_config: Any, completion: int | None, prompts: Sequence[Any] = (), tokenizer: Any = None,
    chat_template_kwargs: Mapping[str, Any] | None = None, name: str = "max_completion_length",
    truncate: tuple[str, int | None] | None = None,
) -> None:  # fmt: skip
    """Warn when a prompt (the longest of `prompts`, when `tokenizer` is given) plus `completion` new tokens (the
    setting `name`) exceed the model's `max_position_embeddings`. With `truncate`, the name and value of the setting
    that keeps only the last tokens of each prompt (evaluation's), a prompt that fills every position even so is
    refused (`PromptTooLongError`). `model_config` and `tokenizer` may be the model's folder or Hub id (training and
    ``trl-bandpo eval`` check this before generating); an unreadable one: no check."""
    if isinstance(model_config, (str, os.PathLike)):
        from transformers import AutoConfig

        try:
            model_config = AutoConfig.from_pretrained(model_config)
        except (OSError, ValueError):
            return  # loading the model says why
    text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    positions = getattr(text_config, "max_position_embeddings", None)
    if completion is None or not isinstance(positions, int) or positions < 1:
        return
    prompt, what = 0, f"{name} {completion}"
    if tokenizer is not None and completion < positions and len(prompts):
        from ..data import prompt_lengths

        prompt = max(prompt_lengths(prompts, tokenizer, chat_template_kwargs))
        prompt = min(prompt, truncate[1]) if truncate and truncate[1] else prompt
        what = f"the longest prompt ({prompt} tokens) + {name} {completion}"
        if truncate and prompt >= positions:
            raise PromptTooLongError(
                f"{truncate[0]}: the longest prompt has {prompt} tokens (after truncation, if any), and the model has "
                f"{positions} positions (max_position_embeddings): none is left to generate in. Set {truncate[0]} "
                f"below {positions} to keep only the last tokens of each prompt, or leave the long problems out."
            )
    if prompt + completion <= positions:
        return
    warnings.warn(
        f"{what} = {prompt + completion} tokens exceed the {positions} positions of the model "
        f"(max_position_embeddings): tokens past position {positions} are beyond what the model supports, and "
        f"generating them is slow. Lower {name} (e.g. to {max(1, positions - prompt) if prompt < positions else 32}).",
        stacklevel=2,
    )

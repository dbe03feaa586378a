"""Vision-language models (docs/training.md, "Vision-language models"): both trainers on a tiny Gemma 3 model built
here (a SigLIP vision tower, two text layers, a byte-level tokenizer with Gemma's image tokens), trained on a
conversational dataset with an `image` column. Gemma 3's processor needs no torchvision, and its generation outputs
hold the multimodal keys dynamic sampling must split and merge: `pixel_values` (one entry per image, so not per row
once a row holds several), `num_images`, and `token_type_ids` over the prompt and completion tokens."""

import math

import pytest
import torch
from datasets import Dataset
from PIL import Image
from test_trainers import train_args
from test_trl_parity import DEFAULTS, EPSILON_HIGH, EPSILON_LOW, _assert_parity, _common_args
from trl import GRPOConfig, GRPOTrainer

from trl_bandpo import BandPOConfig, BandPOTrainer, DGPOConfig, DGPOTrainer
from trl_bandpo.demo.tiny_model import build_tiny_tokenizer
from trl_bandpo.training.dynamic_sampling import group_has_signal, merge_generation_outputs, select_rows

IMAGE_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<img>"}
TOKENS_PER_IMAGE = 4  # the vision tower's 2 x 2 patches, one text token each
# ChatML, where an image part of a message is Gemma 3's placeholder (the processor expands it to TOKENS_PER_IMAGE).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<start_of_image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
COLORS = [(220, 20, 20), (20, 200, 40), (30, 30, 210), (230, 210, 20), (120, 20, 160), (240, 240, 240)]
NUM_GENERATIONS = 2


def _build_processor():
    from transformers import Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = build_tiny_tokenizer(tuple(IMAGE_TOKENS.values()), CHAT_TEMPLATE, extra_special_tokens=IMAGE_TOKENS)
    image_processor = Gemma3ImageProcessorPil(size={"height": 28, "width": 28})
    return Gemma3Processor(image_processor, tokenizer, chat_template=CHAT_TEMPLATE, image_seq_length=TOKENS_PER_IMAGE)


def _build_model(tokenizer):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in ("<pad>", "<|im_end|>", *IMAGE_TOKENS.values())}
    config = Gemma3Config(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
            max_position_embeddings=512, sliding_window=512, pad_token_id=ids["<pad>"],
            eos_token_id=ids["<|im_end|>"], bos_token_id=None,
        ),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14),
        mm_tokens_per_image=TOKENS_PER_IMAGE, boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"], image_token_index=ids["<img>"],
    )  # fmt: skip
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config)
    # Gemma 3 starts its image projection at zero (images then change nothing): a random one, so that they do.
    torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.3)
    model.generation_config.pad_token_id = ids["<pad>"]
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    return model


@pytest.fixture(scope="session")
def vlm_dir(tmp_path_factory):
    """A tiny Gemma 3 vision-language model and its processor, saved to a folder (built here, nothing downloaded)."""
    path = tmp_path_factory.mktemp("tiny_gemma3")
    processor = _build_processor()
    _build_model(processor.tokenizer).save_pretrained(path)
    processor.save_pretrained(path)
    return str(path)


def _image(k):
    """A plain image of colour `k`, of a size that varies with `k` (the processor resizes every image to 28 x 28)."""
    return Image.new("RGB", (24 + 5 * k, 18 + 3 * k), COLORS[k % len(COLORS)])


def _prompt(k):
    """A conversational prompt whose length varies with `k` (rounds of dynamic sampling then differ in length)."""
    return [{"role": "user", "content": "What colour is it?" + " Say it." * (k % 3)}]


def image_dataset(rows=6):
    return Dataset.from_list([{"prompt": _prompt(k), "image": _image(k)} for k in range(rows)])


def _text(completion):
    return completion if isinstance(completion, str) else completion[-1]["content"]


def varying_reward(completions, **kwargs):
    """Differs between completions (the tiny model's are random bytes): every group has a signal."""
    return [sum(map(ord, _text(c))) % 7 / 7 for c in completions]


def mostly_constant_reward(completions, prompts, **kwargs):
    """Varying for the prompts saying "Say it." once, constant (a group with no signal) for the others."""
    texts = [" ".join(part.get("text", "") for part in prompt[-1]["content"]) for prompt in prompts]  # image parts
    return [sum(map(ord, _text(c))) % 7 / 7 if text.count("Say") == 1 else 0.5 for c, text in zip(completions, texts)]


def _generation_batch(dataset, indices):
    """What TRL's sampler hands `_generate_and_score_completions`: each row repeated `NUM_GENERATIONS` times."""
    return [dataset[i] for i in indices for _ in range(NUM_GENERATIONS)]


def _image_token_id(trainer):
    return trainer.processing_class.tokenizer.convert_tokens_to_ids(IMAGE_TOKENS["image_token"])


# ------------------------------------------------------------------------------------------------------------------
# Both trainers train on images
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("trainer_class,config_class", [(BandPOTrainer, BandPOConfig), (DGPOTrainer, DGPOConfig)])
def test_trainers_train_on_images(vlm_dir, tmp_path, trainer_class, config_class):
    """Two off-policy steps (ratios away from 1): finite losses, and the weights of the language model and of the
    vision tower move (the images reach the loss's gradient)."""
    args = train_args(config_class, tmp_path, per_device_train_batch_size=4, num_generations=NUM_GENERATIONS,
                      gradient_accumulation_steps=1, max_steps=2, learning_rate=0.05)  # fmt: skip
    trainer = trainer_class(model=vlm_dir, reward_funcs=varying_reward, args=args, train_dataset=image_dataset())
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    moved = {name for name, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[name])}
    assert any("language_model" in name for name in moved), "the language model did not train"
    assert any("vision_tower" in name for name in moved), "the vision tower did not train: no image in the loss"
    assert all("bounds/lower_mean" in entry for entry in trainer.state.log_history[:-1])


# ------------------------------------------------------------------------------------------------------------------
# Parity with GRPOTrainer on images
# ------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def parity_trainers(vlm_dir, tmp_path_factory):
    """BandPOTrainer with `policy_loss="clip"` and TRL's GRPOTrainer, both built from the same folder and settings
    (`test_trl_parity`'s), in training mode."""
    tmp = tmp_path_factory.mktemp("vlm_parity")
    dataset = image_dataset()
    ours = BandPOTrainer(model=vlm_dir, reward_funcs=varying_reward, train_dataset=dataset,
                         args=BandPOConfig(policy_loss="clip", **_common_args(tmp / "ours")))  # fmt: skip
    theirs = GRPOTrainer(model=vlm_dir, reward_funcs=varying_reward, train_dataset=dataset,
                         args=GRPOConfig(**_common_args(tmp / "theirs")))  # fmt: skip
    assert (ours.args.epsilon, ours.args.epsilon_high) == (theirs.args.epsilon, theirs.args.epsilon_high)
    assert (theirs.args.epsilon, theirs.args.epsilon_high) == (EPSILON_LOW, EPSILON_HIGH)
    for trainer in (ours, theirs):
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 2
    return ours, theirs


def _multimodal_kwargs(inputs):
    keys = ("pixel_values", "num_images", "token_type_ids")
    return {key: inputs[key] for key in keys if key in inputs}


def _current_logps(trainer, inputs):
    """The model's log-probs of the completions, by GRPOTrainer's forward with the images."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        logps, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, trainer.model, ids, mask, inputs["completion_ids"].shape[1], **_multimodal_kwargs(inputs)
        )
    return logps


@pytest.fixture(scope="module")
def image_inputs(parity_trainers):
    """A generation output of GRPOTrainer's on four image prompts, with old log-probs spread around the current ones
    (every clip region holds tokens), fixed advantages of both signs and reference log-probs."""
    _, theirs = parity_trainers
    torch.manual_seed(0)
    inputs = theirs._generate_and_score_completions(_generation_batch(theirs.train_dataset, [0, 3]))
    assert inputs["pixel_values"].shape[0] == 4 and inputs["num_images"] == [1, 1, 1, 1]
    logps = _current_logps(theirs, inputs)
    rows, length = logps.shape
    log_ratio = 0.5 * torch.randn(rows, length)
    inputs["advantages"] = torch.tensor([1.3, -0.7, 0.4, -1.1])
    inputs["old_per_token_logps"] = logps - log_ratio
    inputs["ref_per_token_logps"] = logps + 0.2 * torch.randn(rows, length)
    kept, positive = inputs["completion_mask"].bool(), inputs["advantages"][:, None] > 0
    clipped_high = (log_ratio > math.log(1 + EPSILON_HIGH)) & positive & kept
    clipped_low = (log_ratio < math.log(1 - EPSILON_LOW)) & ~positive & kept
    assert clipped_high.any() and clipped_low.any(), "the inputs reach no clip region"
    return inputs


@pytest.mark.parametrize("loss_type,beta", [("grpo", 0.0), ("dapo", 0.0), ("dapo", 0.04), ("dr_grpo", 0.04)])
def test_clip_matches_grpo_trainer_on_images(parity_trainers, image_inputs, loss_type, beta):
    """Loss, every parameter's gradient (the vision tower's included) and TRL's metrics equal GRPOTrainer's on the
    same image batch (tolerances of `test_trl_parity._assert_parity`: loss rtol 1e-6, gradients rtol 1e-5)."""
    ours, theirs = parity_trainers
    loss = _assert_parity(parity_trainers, image_inputs, dict(DEFAULTS, loss_type=loss_type, beta=beta))
    vision_grads = [p.grad for name, p in theirs.model.named_parameters() if "vision_tower" in name]
    assert vision_grads and any(g is not None and g.abs().sum() > 0 for g in vision_grads), "no image in the loss"
    # the images are part of what is compared: other pixels give TRL another loss
    other = dict(image_inputs, pixel_values=image_inputs["pixel_values"].flip(0))
    with torch.no_grad():
        assert not torch.isclose(theirs._compute_loss(theirs.model, other), loss, rtol=1e-4, atol=0)
    ours.model.zero_grad(set_to_none=True)
    theirs.model.zero_grad(set_to_none=True)


# ------------------------------------------------------------------------------------------------------------------
# Band bounds count completion tokens only
# ------------------------------------------------------------------------------------------------------------------


def test_band_counts_completion_tokens_only(vlm_dir, tmp_path):
    """With every completion token's ratio far above any Band upper bound (<= band_upper_max) and a positive
    advantage, every completion token is clipped high, and nothing else is counted: the count metrics' totals are the
    hand count of completion tokens (padding and truncation masked out), never prompt or image tokens."""
    args = train_args(BandPOConfig, tmp_path, per_device_train_batch_size=4, num_generations=NUM_GENERATIONS,
                      gradient_accumulation_steps=1)  # fmt: skip
    trainer = BandPOTrainer(model=vlm_dir, reward_funcs=varying_reward, args=args, train_dataset=image_dataset())
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # what TRL's training loop sets
    torch.manual_seed(0)
    inputs = trainer._generate_and_score_completions(_generation_batch(trainer.train_dataset, [1, 2]))
    # the per-token bounds of the generation batch cover its completion tokens, not its prompts and images
    assert inputs["policy_lower_bound"].shape == inputs["completion_ids"].shape
    image_tokens = int((inputs["prompt_ids"] == _image_token_id(trainer)).sum())
    assert image_tokens == 4 * TOKENS_PER_IMAGE
    inputs["completion_mask"][0, 2:] = 0  # padding and masked-out tokens in the batch
    inputs["completion_mask"][3, 4:] = 0
    completion_tokens = int(inputs["completion_mask"].sum())
    inputs["old_per_token_logps"] = _current_logps(trainer, inputs) - math.log(4 * args.band_upper_max)
    inputs["advantages"] = torch.ones(4)
    trainer._compute_loss(trainer.model, inputs)
    window = trainer._count_window("train")
    assert window["bounds/lower_mean"][1] == window["bounds/upper_mean"][1] == completion_tokens
    assert window["clip_ratio/any_sign_mean"] == [completion_tokens, completion_tokens]
    high = [window[name] for name in window if name.startswith("clip_ratio_by_prob/high/")]
    assert sum(num for num, _ in high) == sum(den for _, den in high) == completion_tokens
    assert completion_tokens < inputs["completion_ids"].numel()  # so masked tokens would have shown


# ------------------------------------------------------------------------------------------------------------------
# Dynamic sampling with images
# ------------------------------------------------------------------------------------------------------------------


def multi_image_dataset():
    """Rows holding one or two images: `pixel_values` then has more entries than the output has rows."""
    rows = [{"prompt": _prompt(k), "images": [_image(k)] + [_image(k + 1)] * (k % 2)} for k in range(4)]
    return Dataset.from_list(rows)


@pytest.fixture(scope="module")
def multi_image_trainer(vlm_dir, tmp_path_factory):
    args = train_args(BandPOConfig, tmp_path_factory.mktemp("multi_image"), per_device_train_batch_size=4,
                      num_generations=NUM_GENERATIONS, gradient_accumulation_steps=1)  # fmt: skip
    trainer = BandPOTrainer(model=vlm_dir, reward_funcs=varying_reward, args=args, train_dataset=multi_image_dataset())
    trainer.model.train()
    return trainer


@pytest.fixture(scope="module")
def generation_outputs(multi_image_trainer):
    """Two generation outputs of GRPOTrainer's (two rounds), each with rows of one and of two images; the second's
    prompts are longer."""
    trainer = multi_image_trainer
    torch.manual_seed(0)
    first = GRPOTrainer._generate_and_score_completions(trainer, _generation_batch(trainer.train_dataset, [0, 1]))
    second = GRPOTrainer._generate_and_score_completions(trainer, _generation_batch(trainer.train_dataset, [2, 3]))
    for output in (first, second):
        assert output["num_images"] == [1, 1, 2, 2] and output["pixel_values"].shape[0] == 6
    assert first["prompt_ids"].shape[1] != second["prompt_ids"].shape[1]
    return first, second


def _rows_by_hand(output, order):
    """The rows `order` of `output`, each row's images found from `num_images` by hand."""
    starts = [0]
    for count in output["num_images"]:
        starts.append(starts[-1] + count)
    expected = {key: value[order] for key, value in output.items() if torch.is_tensor(value) and value.dim() > 0}
    expected["pixel_values"] = torch.cat([output["pixel_values"][starts[i] : starts[i + 1]] for i in order])
    expected["num_images"] = [output["num_images"][i] for i in order]
    return expected


def test_select_and_merge_round_trip_a_multi_image_output(generation_outputs):
    """Splitting a real generation output into its groups and merging them back gives the output; in another group
    order, its rows in that order, each with its own images."""
    output, _ = generation_outputs
    groups = torch.arange(4).reshape(-1, NUM_GENERATIONS)
    for group_order in ([0, 1], [1, 0]):
        parts = [select_rows(output, groups[g]) for g in group_order]
        merged = merge_generation_outputs(parts, pad_token_id=0)
        expected = _rows_by_hand(output, torch.cat([groups[g] for g in group_order]))
        assert merged.keys() == expected.keys() == output.keys() - {"num_items_in_batch"}
        for key, value in expected.items():
            assert torch.equal(merged[key], value) if torch.is_tensor(value) else merged[key] == value, key


def test_merged_rounds_give_each_row_its_log_probs(multi_image_trainer, generation_outputs):
    """Groups of two rounds (different prompt lengths, one or two images per row) merged into one batch: each row's
    completion log-probs, by GRPOTrainer's forward with the images and token types, are those of its own round, and
    the token types still mark exactly the image tokens. A row given another row's images would differ. In float64:
    in float32 extra left padding alone moves a log-prob by up to ~2e-3 (other kernel reductions), in float64 by 0."""
    trainer = multi_image_trainer
    first, second = (dict(output, pixel_values=output["pixel_values"].double()) for output in generation_outputs)
    groups = torch.arange(4).reshape(-1, NUM_GENERATIONS)
    parts = [select_rows(second, groups[1]), select_rows(first, groups[0]), select_rows(second, groups[0])]
    merged = merge_generation_outputs(parts, trainer._tokenizer.pad_token_id)
    sources = [(second, groups[1]), (first, groups[0]), (second, groups[0])]
    assert merged["num_images"] == [2, 2, 1, 1, 1, 1] and merged["pixel_values"].shape[0] == 8
    ids = torch.cat([merged["prompt_ids"], merged["completion_ids"]], 1)
    assert torch.equal(merged["token_type_ids"].bool(), ids == _image_token_id(trainer))
    trainer.model.double()
    try:
        merged_logps = _current_logps(trainer, merged)
        own_logps = [_current_logps(trainer, output)[rows] for output, rows in sources]
        # the check can fail: with the images shifted by one, the first group's log-probs are not its own
        shifted = _current_logps(trainer, dict(merged, pixel_values=merged["pixel_values"].roll(1, 0)))
    finally:
        trainer.model.float()
    length = merged["completion_ids"].shape[1]
    for row, expected in zip(range(0, 6, NUM_GENERATIONS), own_logps):
        mask = merged["completion_mask"][row : row + NUM_GENERATIONS].bool()
        width = expected.shape[1]
        assert not mask[:, width:].any() and width <= length
        got = merged_logps[row : row + NUM_GENERATIONS, :width]
        torch.testing.assert_close(got[mask[:, :width]], expected[mask[:, :width]], rtol=1e-9, atol=1e-9)
    assert not torch.allclose(shifted[:2, : own_logps[0].shape[1]], own_logps[0], atol=1e-3)


class RecordingBandPOTrainer(BandPOTrainer):
    """Keeps every training generation batch (what dynamic sampling hands TRL's split into micro-batches)."""

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.model.training:
            self.recorded = getattr(self, "recorded", []) + [output]
        return output


def test_dynamic_sampling_trains_on_images(vlm_dir, tmp_path):
    """Two prompts in three give groups with no signal: dynamic sampling generates more rounds and merges them; each
    training batch holds whole groups, with a signal unless masked out as filler, its images and token types in step
    with its rows, and training updates the model."""
    args = train_args(BandPOConfig, tmp_path, per_device_train_batch_size=4, num_generations=NUM_GENERATIONS,
                      gradient_accumulation_steps=1, max_steps=3, learning_rate=0.05, dynamic_sampling=True,
                      dynamic_sampling_max_rounds=6)  # fmt: skip
    trainer = RecordingBandPOTrainer(
        model=vlm_dir, reward_funcs=mostly_constant_reward, args=args, train_dataset=image_dataset()
    )
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    rounds = [
        entry["dynamic_sampling/rounds"] for entry in trainer.state.log_history if "dynamic_sampling/rounds" in entry
    ]
    assert len(rounds) == 2 and max(rounds) > 1, "no batch needed a second round: nothing was merged"
    image_token = _image_token_id(trainer)
    for output in trainer.recorded:
        assert output["completion_ids"].shape[0] == 4 and output["num_images"] == [1, 1, 1, 1]
        assert output["pixel_values"].shape[0] == 4
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], 1)
        assert torch.equal(output["token_type_ids"].bool(), ids == image_token)
        counted = output["completion_mask"].reshape(-1, NUM_GENERATIONS, output["completion_mask"].shape[1]).any(-1)
        signal = group_has_signal(output["advantages"], NUM_GENERATIONS)
        assert (signal | ~counted.any(-1)).all(), "a group without signal is trained on"
    assert all(math.isfinite(entry["loss"]) for entry in trainer.state.log_history if "loss" in entry)
    assert any(not torch.equal(p.detach(), before[name]) for name, p in trainer.model.named_parameters())

"""Hardening, round 6, items 5 and 8 (part): rollout log-probs under custom logits processors, sampling keys that
neither sampler reads or values they refuse in `generation_kwargs` and TRL's sampling fields, and the vLLM-only
settings of TRL's importance-sampling correction and off-policy mask without vLLM. Each case failed before its fix.
The references: transformers' own `generate` on a tiny model and `GenerationConfig` (what TRL hands
`generation_kwargs` to without vLLM), vLLM's `SamplingParams` (its rules written out below, and the class itself
where vLLM is installed), and TRL's own off-policy mask."""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path

import pytest
import torch

from trl_bandpo import PolicyLossConfig
from trl_bandpo.training.configs import UnusedSettingWarning

CPU = dict(use_cpu=True, report_to="none")
ROLLOUT = dict(old_logps_source="rollout", use_vllm=True, vllm_importance_sampling_correction=False)
RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "lora" / "qwen2.5-0.5b-instruct_band-kl-0.05.yaml"


def _config(tmp_path, **kwargs):
    return PolicyLossConfig(output_dir=str(tmp_path), **CPU, **kwargs)


# -- 5a. logits processors and their arguments change the engine's log-probs: refused with rollout log-probs --------


@pytest.mark.parametrize(
    "generation_kwargs, named",
    [
        ({"logits_processors": ["my_pkg.processors:NoRepeat"]}, "generation_kwargs['logits_processors']=["),
        ({"extra_args": {"top_p": 0.5}}, "generation_kwargs['extra_args']={'top_p': 0.5}"),
        ({"vllm_xargs": {"ban_token": 7}}, "generation_kwargs['vllm_xargs']={'ban_token': 7}"),  # a server's
        ({"response_format": {"type": "json_object"}}, "generation_kwargs['response_format']="),  # JSON mode
    ],
    ids=["logits_processors", "extra_args", "vllm_xargs", "response_format"],
)
def test_rollout_logps_refuse_logits_processors_and_their_arguments(generation_kwargs, named, tmp_path):
    """A custom logits processor (named per request, or reading its arguments from `extra_args`, which a server
    request spells `vllm_xargs`) and a JSON response format change the logits vLLM samples from and returns the
    log-probs of, as top-p does. Before: accepted with old_logps_source='rollout'."""
    with pytest.raises(ValueError) as error:
        _config(tmp_path, **ROLLOUT, generation_kwargs=generation_kwargs)
    message = str(error.value)
    assert "old_logps_source='rollout' cannot be combined with" in message and named in message
    assert "old_logps_source='trainer'" in message  # the alternative, accepted:
    assert _config(tmp_path, **{**ROLLOUT, "old_logps_source": "trainer"}, generation_kwargs=generation_kwargs)


def test_rollout_logps_accept_empty_processor_arguments(tmp_path):
    config = _config(tmp_path, **ROLLOUT, generation_kwargs={"extra_args": {}, "logits_processors": []})
    assert config.old_logps_source == "rollout"


# -- 5b. sampling keys spelled as neither sampler reads them ---------------------------------------------------------


@pytest.mark.parametrize(
    "key, spelled",
    [("TOP_P", "top_p"), ("top-p", "top_p"), ("Top_K", "top_k"), ("MIN-P", "min_p"), ("Temperature", "temperature"),
     ("TOP-K", "top_k"), ("Repetition_Penalty", "repetition_penalty")],
)  # fmt: skip
@pytest.mark.parametrize("settings", [{}, ROLLOUT], ids=["trainer", "rollout"])
def test_a_sampling_key_spelled_otherwise_is_refused_by_name(key, spelled, settings, tmp_path):
    """transformers' GenerationConfig (TRL's generation without vLLM) keeps such a key as an attribute it never reads:
    the sampler runs with its default. vLLM's SamplingParams has no such field (a TypeError once the model has
    loaded), and its server drops it with a log line. Before: accepted, and with rollout log-probs `TOP_P: 0.5`
    passed the check for truncation."""
    from transformers import GenerationConfig

    value = {"temperature": 0.5, "repetition_penalty": 1.5}.get(spelled, 0.5 if "_p" in spelled else 5)
    default = getattr(GenerationConfig(), spelled)
    assert getattr(GenerationConfig(**{key: value}), spelled) == default != value  # the reference: ignored
    assert getattr(GenerationConfig(**{spelled: value}), spelled) == value
    with pytest.raises(ValueError) as error:
        _config(tmp_path, **settings, generation_kwargs={key: value})
    assert str(error.value) == (
        f"generation_kwargs key {key!r} must be spelled {spelled!r}, the key vLLM and transformers read, got {key!r}."
    )


def test_keys_that_are_not_sampling_keys_are_left_to_the_samplers(tmp_path):
    kwargs = {"max_tokens": 8, "seed": 3, "suppress_tokens": [5], "stop": ["\n"]}
    assert _config(tmp_path, generation_kwargs=kwargs).generation_kwargs == kwargs


# -- 5c. sampling values a sampler refuses ---------------------------------------------------------------------------

# vLLM's rules (SamplingParams._verify_args, vLLM 0.31): top_p in (0, 1]; top_k an integer, 0 (off) or >= 1, and -1
# taken as off too; min_p in [0, 1]; repetition_penalty finite and > 0.
VLLM_ACCEPTS = {
    "top_p": lambda v: isinstance(v, (int, float)) and 0 < v <= 1,
    "top_k": lambda v: isinstance(v, int) and v >= -1,
    "min_p": lambda v: isinstance(v, (int, float)) and 0 <= v <= 1,
    "repetition_penalty": lambda v: isinstance(v, (int, float)) and math.isfinite(v) and v > 0,
}
VALUES = {
    "top_p": [0.0, -0.1, 0.5, 1.0, 1.5, math.nan],
    "top_k": [-5, -2, -1, 0, 1, 40, 2.0],
    "min_p": [-0.1, 0.0, 0.05, 1.0, 1.2],
    "repetition_penalty": [0.0, -1.0, 0.5, 1.0, 1.3, math.inf],
}
CASES = [(name, value) for name, values in VALUES.items() for value in values]


@pytest.mark.parametrize("where", ["field", "generation_kwargs"])
@pytest.mark.parametrize("name, value", CASES, ids=[f"{n}={v}" for n, v in CASES])
def test_sampling_values_are_checked_as_vllm_checks_them(name, value, where, tmp_path):
    """Before: `top_k: -5` (or `top_p: 1.5`) reached vLLM, which refused the request once the model had loaded; in
    `generation_kwargs` it was also taken for "no truncation" by the check of rollout log-probs."""
    settings = {name: value} if where == "field" else {"generation_kwargs": {name: value}}
    label = name if where == "field" else f"generation_kwargs[{name!r}]"
    if VLLM_ACCEPTS[name](value):
        _config(tmp_path, use_vllm=True, **settings)
    else:
        with pytest.raises(ValueError, match=rf"^{re.escape(label)} must be "):
            _config(tmp_path, use_vllm=True, **settings)


@pytest.mark.parametrize("where", ["field", "generation_kwargs"])
@pytest.mark.parametrize("top_k", [-1, 0, 1, 3])
def test_top_k_without_vllm_is_what_transformers_generate_takes(top_k, where, tiny_model_dir, tmp_path):
    """vLLM reads top_k -1 as "off"; transformers' generate (TRL's generation without vLLM) refuses it, 0 is its
    "off". The reference is a real `generate` call with that top_k."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    try:
        model.generate(torch.tensor([[1, 2]]), do_sample=True, top_k=top_k, max_new_tokens=1, pad_token_id=0)
        transformers_accepts = True
    except ValueError:
        transformers_accepts = False
    settings = {"top_k": top_k} if where == "field" else {"generation_kwargs": {"top_k": top_k}}
    if transformers_accepts:
        _config(tmp_path, **settings)
    else:
        label = "top_k" if where == "field" else "generation_kwargs['top_k']"
        with pytest.raises(ValueError, match=rf"^{re.escape(label)} must be 0 or more without use_vllm"):
            _config(tmp_path, **settings)
    _config(tmp_path, use_vllm=True, **settings)  # vLLM takes all four


def test_sampling_checks_agree_with_vllm_itself(tmp_path):
    """Where vLLM is installed (the real-vLLM tier's environment): each value is accepted exactly when vLLM's own
    SamplingParams accepts it."""
    sampling_params = pytest.importorskip("vllm").SamplingParams
    for name, value in CASES:
        try:
            sampling_params(**{name: value})
            vllm_accepts = True
        except Exception:  # vLLM's validation error, or a TypeError
            vllm_accepts = False
        try:
            _config(tmp_path, use_vllm=True, generation_kwargs={name: value})
            ours = True
        except ValueError:
            ours = False
        assert ours == vllm_accepts, (name, value)


# -- 8 (part). TRL's vLLM-only settings without vLLM warn ------------------------------------------------------------


@pytest.mark.parametrize(
    "settings, named",
    [
        (dict(vllm_importance_sampling_mode="token_truncate"), "vllm_importance_sampling_mode='token_truncate'"),
        (dict(vllm_importance_sampling_cap=5.0), "vllm_importance_sampling_cap=5.0"),
        (dict(vllm_importance_sampling_clip_min=0.5), "vllm_importance_sampling_clip_min=0.5"),
        (dict(vllm_importance_sampling_mode="token_mask", use_vllm=True, vllm_importance_sampling_correction=False),
         "vllm_importance_sampling_mode='token_mask'"),
        (dict(vllm_importance_sampling_mode="token_mask", **ROLLOUT), "vllm_importance_sampling_mode='token_mask'"),
    ],
    ids=["mode", "cap", "clip_min", "correction_off", "rollout"],
)  # fmt: skip
def test_importance_sampling_settings_without_the_correction_warn(settings, named, tmp_path):
    """TRL reads them only with use_vllm=True and vllm_importance_sampling_correction=True. Before: silent."""
    with pytest.warns(UnusedSettingWarning, match=rf"{re.escape(named)} has no effect without use_vllm"):
        _config(tmp_path, **settings)
    with warnings.catch_warnings():  # with the correction on, they act
        warnings.simplefilter("error", UnusedSettingWarning)
        on = {k: v for k, v in settings.items() if k.startswith("vllm_importance_sampling_") and "correction" not in k}
        _config(tmp_path, use_vllm=True, **on)


def test_off_policy_mask_without_vllm_or_an_old_policy_has_no_effect_in_trl():
    """TRL's mask compares the policy with `sampling_per_token_logps`, else with the old-policy log-probs, which are
    the current ones detached when TRL makes no old-policy pass: its mask then keeps every sequence, whatever the
    threshold."""
    from trl import GRPOTrainer

    torch.manual_seed(0)
    logps = -torch.rand(4, 6) * 3
    advantages = torch.tensor([[-1.0], [1.0], [-0.5], [0.2]])
    mask = torch.ones(4, 6)
    for threshold in (0.0, 1e-3, 0.5):
        keep = GRPOTrainer.get_off_policy_mask(advantages, logps, logps.detach(), mask, threshold)
        assert torch.equal(keep, torch.ones(4, 1))
    # an old policy that differs (the sampling log-probs 1 nat above the policy's): sequences with A < 0 are dropped
    moved = GRPOTrainer.get_off_policy_mask(advantages, logps, logps + 1.0, mask, 0.5)
    assert moved.flatten().tolist() == [0.0, 1.0, 0.0, 1.0]


@pytest.mark.parametrize(
    "settings, warns",
    [
        (dict(), True),  # gradient_accumulation_steps = steps_per_generation = 1, one iteration: no old pass
        (dict(gradient_accumulation_steps=4), True),  # steps_per_generation follows: still one optimizer step
        (dict(num_iterations=2), False),  # TRL's old-policy pass: 1 % (1 x 2) != 0
        (dict(gradient_accumulation_steps=2, steps_per_generation=4), False),  # 2 % 4 != 0: generations span steps
        (dict(use_vllm=True), False),  # the engine's sampling log-probs
    ],
    ids=["one_step", "accumulated", "iterations", "spanning", "vllm"],
)
def test_off_policy_mask_threshold_without_vllm_warns_when_the_trainer_has_no_old_policy(settings, warns, tmp_path):
    """Before: accepted in silence. With an old-policy pass (TRL makes one when gradient_accumulation_steps is not a
    multiple of steps_per_generation x num_iterations) or vLLM it has an effect, and says nothing."""
    settings = dict(off_policy_mask_threshold=0.5, per_device_train_batch_size=4, num_generations=2, **settings)
    if warns:
        with pytest.warns(UnusedSettingWarning, match=r"off_policy_mask_threshold=0.5 has no effect without use_vllm"):
            _config(tmp_path, **settings)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UnusedSettingWarning)
            _config(tmp_path, **settings)


# -- The recipe entry point: the same values, refused while the recipe is read ---------------------------------------


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--generation_kwargs", '{"TOP_P": 0.5}'], "generation_kwargs key 'TOP_P' must be spelled 'top_p'"),
        (["--top_k", "-5"], "top_k must be an integer >= -1, got -5"),
        (["--top_k", "-1"], "top_k must be 0 or more without use_vllm"),
        (["--vllm_importance_sampling_mode", "token_mask"], "vllm_importance_sampling_mode='token_mask' has no"),
        # 32 completions per generation batch: one optimizer step of 8 per device x 4 accumulated (the recipe's 128
        # span four, and TRL's old-policy pass gives the mask something to compare with)
        (["--generation_batch_size", "32", "--off_policy_mask_threshold", "0.5"],
         "off_policy_mask_threshold=0.5 has no effect"),
    ],
    ids=["spelling", "top_k", "top_k_off", "is_mode", "off_policy_mask"],
)  # fmt: skip
def test_a_recipe_refuses_them_while_it_is_read(flags, named):
    """A LoRA recipe (no vLLM, one optimizer step per generation batch): valid as it is; each flag stops
    `trl-bandpo train` while it reads the recipe, naming the setting (an ignored setting is an error in a recipe)."""
    from trl_bandpo.cli.recipe import ConfigError, parse_args

    argv = ["--config", str(RECIPE), "--use_cpu", "true"]
    assert parse_args(argv)[1].use_vllm is False
    assert parse_args([*argv, "--off_policy_mask_threshold", "0.5"])[1].off_policy_mask_threshold == 0.5
    with pytest.raises(ConfigError, match=re.escape(named)):
        parse_args([*argv, *flags])

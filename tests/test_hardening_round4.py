"""Hardening, round 4 (issue 27): cases a hostile user found silently wrong or unclear, each failing before its fix.
Other items of that round are tested where their subject is (tests/test_config_surfaces.py, test_checkpointing.py,
test_drop_in.py, test_train_entry.py, test_cli.py, test_demo.py, test_tiny_model.py, test_evaluation.py)."""

from __future__ import annotations

import math
import sys
import warnings

import numpy as np
import pytest
import torch

import trl_bandpo.core.loss_registry as registry
from trl_bandpo import BandPOConfig, PolicyLossConfig, policy_loss
from trl_bandpo.training.configs import UnusedSettingWarning


@pytest.fixture
def clean_registry(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_REGISTERED_BY", dict(registry._REGISTERED_BY))


# -- 1. a per-token radius with NaN, 0 or a negative value: the same named error for the Band and DPPO ------------


@pytest.mark.parametrize("bad", [math.nan, 0.0, -0.05, math.inf])
@pytest.mark.parametrize(
    "name, keyword",
    [("band", "radius"), ("relaxed_band", "radius"), ("band_dgpo", "radius"), ("dppo_tv", "radius"),
     ("dppo_kl", "radius"), ("dppo_kl", "radius_low"), ("dppo_tv", "radius_high")],
)  # fmt: skip
def test_a_bad_per_token_radius_is_refused_by_name(name, keyword, bad):
    """Before: DPPO never masked such a token (a NaN comparison is false: p 0.01 -> 0.5 with A > 0 kept the cap's
    weight 20), and the Band gave NaN."""
    old = torch.log(torch.tensor([[0.01, 0.5, 0.9]]))
    logps = torch.log(torch.tensor([[0.5, 0.5, 0.9]]))
    radius = torch.tensor([[bad, 0.05, 0.05]])
    with pytest.raises(
        ValueError, match=rf"^{keyword} must be a finite number > 0 at every token, got a tensor with 1"
    ):
        policy_loss(name, logps, old, torch.tensor([1.0]), **{keyword: radius})


def test_a_good_per_token_radius_still_works_for_dppo():
    old = torch.log(torch.tensor([[0.01, 0.5]]))
    logps = torch.log(torch.tensor([[0.5, 0.5]])).requires_grad_()
    loss = policy_loss("dppo_tv", logps, old, torch.tensor([1.0]), radius=torch.tensor([[0.15, 0.15]]), ratio_cap=20.0)
    loss.sum().backward()
    assert logps.grad[0, 0] == 0  # 0.01 -> 0.5 is past the TV region on the advantage's side: masked


# -- 2. `module:name` is the loss that module registered as `name` ----------------------------------------------------


def test_an_import_path_naming_a_builtin_loss_is_refused(clean_registry):
    with pytest.raises(ValueError, match=r"'json' registered no policy loss named 'band' \('band' is registered by "):
        registry.policy_loss_spec("json:band")


def test_an_import_path_naming_another_loss_of_the_module_is_refused(clean_registry, tmp_path, monkeypatch):
    (tmp_path / "my_band.py").write_text(
        "from trl_bandpo.core.losses import BAND, DUAL_CLIP, PolicyLossSpec, band_policy_bounds, "
        "clipped_surrogate_loss, register_policy_loss\n"
        "spec = PolicyLossSpec('band_v2', band_policy_bounds, clipped_surrogate_loss, (*BAND, DUAL_CLIP))\n"
        "register_policy_loss(spec)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        ValueError, match=r"'my_band' registered no policy loss named 'band'.*registered \['band_v2'\]"
    ):
        registry.policy_loss_spec("my_band:band")
    assert registry.policy_loss_spec("my_band:band_v2").name == "band_v2"
    sys.modules.pop("my_band", None)


def test_a_module_that_registers_then_raises_leaves_no_half_registered_loss(clean_registry, tmp_path, monkeypatch):
    (tmp_path / "broken_loss.py").write_text(
        "from trl_bandpo.core.losses import EPSILON_HIGH, EPSILON_LOW, DUAL_CLIP, PolicyLossSpec, clip_bounds, "
        "clipped_surrogate_loss, register_policy_loss\n"
        "spec = PolicyLossSpec('half', clip_bounds, clipped_surrogate_loss, (EPSILON_LOW, EPSILON_HIGH, DUAL_CLIP))\n"
        "register_policy_loss(spec)\n"
        "raise RuntimeError('the module fails after registering')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for _ in range(2):  # the second attempt reports the module's own error again, not "already registered"
        with pytest.raises(ValueError, match="cannot import 'broken_loss' .*the module fails after registering"):
            registry.policy_loss_spec("broken_loss:half")
        assert "half" not in registry.registered_policy_losses()


# -- 9. unclear or silent cases -----------------------------------------------------------------------------------


def test_the_async_trainer_names_a_model_object_it_cannot_take(tiny_model_dir):
    """Before: `'Qwen2ForCausalLM' object has no attribute 'split'`."""
    pytest.importorskip("trl.experimental.async_grpo")
    from transformers import AutoModelForCausalLM

    from trl_bandpo.training.async_trainer import AsyncBandPOTrainer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(TypeError, match="takes the model as a hub id or a local folder.*got a Qwen2ForCausalLM"):
        AsyncBandPOTrainer(model=model)


@pytest.mark.parametrize(
    "field, value", [("band_radius_min", 0.01), ("band_radius_max", 0.2), ("band_radius_exponent", 2.0)]
)
def test_adaptive_radius_fields_without_band_radius_by_warn(field, value):
    with pytest.warns(
        UnusedSettingWarning, match=rf"{field}={value!r} has no effect without band_radius_by='entropy'"
    ):
        BandPOConfig(output_dir="unused", use_cpu=True, report_to="none", **{field: value})
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnusedSettingWarning)
        BandPOConfig(output_dir="unused", use_cpu=True, report_to="none", band_radius_by="entropy", **{field: value})


@pytest.mark.parametrize("kind", [np.float32, np.float64, np.float16, np.int64])
def test_numpy_numbers_are_numbers(kind):
    """Before: a numpy.float32 radius was refused while numpy.float64 was accepted."""
    args = PolicyLossConfig(output_dir="unused", use_cpu=True, report_to="none", policy_loss="band",
                            band_radius=kind(0.25) if kind is not np.int64 else kind(1))  # fmt: skip
    assert type(args.band_radius) is float
    old = torch.log(torch.tensor([[0.5, 0.1]]))
    policy_loss("band", old, old, torch.tensor([1.0]), radius=kind(0.05) if kind is not np.int64 else kind(1))


def test_engine_log_probs_above_zero_are_refused():
    """A probability above 1 trained silently before; rounding (up to 1e-3) is tolerated, NaN is left for masking."""
    from trl_bandpo.training.policy_term import check_engine_logprobs

    mask = torch.tensor([[1, 1, 1, 0]])
    check_engine_logprobs(torch.tensor([[-0.5, 5e-4, math.nan, 3.0]]), mask, "x")  # the 3.0 is padding
    with pytest.raises(
        ValueError, match=r"^rollout: 1 sampled token\(s\) have a log-prob above 0 .*the largest is 0\.7"
    ):
        check_engine_logprobs(torch.tensor([[-0.5, 0.7, -1.0, 0.0]]), mask, "rollout")
    with pytest.raises(ValueError, match="above 0"):
        check_engine_logprobs(np.array([0.2, -0.1], dtype=np.float32), np.array([1, 1]), "numpy")


def test_an_api_run_shows_no_transformers_deprecation_of_trls_defaults(tiny_model_dir, tmp_path):
    """Issue 27, item 18: four FutureWarnings per API run (TRL's default `gradient_checkpointing=True` and the methods
    TRL calls around it, deprecated in transformers), nothing the user can act on; every other warning still shows."""
    from datasets import Dataset

    from trl_bandpo import BandPOTrainer
    from trl_bandpo.training.library_noise import LIBRARY_FUTURE_WARNINGS

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = BandPOConfig(str(tmp_path), use_cpu=True, report_to="none", max_steps=1, per_device_train_batch_size=4,
                            num_generations=4, max_completion_length=4, save_strategy="no", epsilon=0.3)  # fmt: skip
        trainer = BandPOTrainer(
            model=tiny_model_dir,
            reward_funcs=lambda completions, **kwargs: [float(len(c)) for c in completions],
            args=args,
            train_dataset=Dataset.from_list([{"prompt": "1+1="}] * 8),
        )
        trainer.train()
    messages = [str(record.message) for record in caught]
    assert not [message for message in messages if message in LIBRARY_FUTURE_WARNINGS]
    assert any("epsilon=0.3 has no effect" in message for message in messages)  # ours still shows

"""`old_logps_source="rollout"` (docs/off-policy-and-async.md): the log-probs vLLM sampled each token with are the
old policy of the ratio and of the bounds, and the trainer's old-policy forward pass does not run.

No vLLM on CPU: a stand-in engine returns what vLLM returns to the trainer (completion ids and the sampled tokens'
log-probs), patched in where TRL builds its `VLLMGeneration`, so generation runs TRL's own vLLM branch."""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset
from trl import GRPOTrainer

from trl_bandpo import BandPOConfig, BandPOTrainer, PolicyLossConfig
from trl_bandpo.core.band import band_bounds

PROMPTS = [{"prompt": "1+1="}] * 4 + [{"prompt": "2+3="}] * 4  # one generation batch: 2 prompts x 4


def _reward(completions, **kwargs):
    return [float(len(c) % 3) for c in completions]  # rewards that differ within a group: non-zero advantages


class _SamplingEngine:
    """Stands in for TRL's `VLLMGeneration`: one completion per prompt, of varying length, with a distinct sampling
    log-prob per token (`None`, vLLM's NaN, at the `(row, position)` pairs of `unscored`)."""

    def __init__(self, vocab_size: int, max_tokens: int, unscored=()):
        self.vocab_size, self.max_tokens, self.unscored = vocab_size, max_tokens, set(unscored)
        self.generator = torch.Generator().manual_seed(0)
        self.returned = []  # per call: the per-sequence log-prob lists handed to the trainer

    def sync_weights(self):
        pass

    def generate(self, prompts, images, num_generations, profiler):
        lengths = torch.randint(2, self.max_tokens + 1, (len(prompts),), generator=self.generator).tolist()
        completions = [torch.randint(10, self.vocab_size, (n,), generator=self.generator).tolist() for n in lengths]
        logprobs = [
            [None if (row, t) in self.unscored else -0.05 - 3.0 * torch.rand(1, generator=self.generator).item()
             for t in range(n)]
            for row, n in enumerate(lengths)
        ]  # fmt: skip
        self.returned.append(logprobs)
        return prompts, completions, [[[lp] for lp in seq] for seq in logprobs], None


def _args(tmp_path, **overrides):
    settings = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, steps_per_generation=2,
        gradient_accumulation_steps=1, max_completion_length=6, max_steps=2, learning_rate=1e-2, logging_steps=1,
        report_to="none", save_strategy="no", seed=0, use_cpu=True, use_vllm=True,
        vllm_importance_sampling_correction=False, old_logps_source="rollout",
    )  # fmt: skip
    settings.update(overrides)
    return BandPOConfig(**settings)


def _trainer(tiny_model_dir, tmp_path, monkeypatch, unscored=(), peft_config=None, **overrides):
    import trl.trainer.grpo_trainer as grpo_trainer

    engine = _SamplingEngine(vocab_size=64, max_tokens=6, unscored=unscored)
    monkeypatch.setattr(grpo_trainer, "VLLMGeneration", lambda **kwargs: engine)  # what use_vllm=True builds
    trainer = BandPOTrainer(
        model=tiny_model_dir,
        reward_funcs=_reward,
        args=_args(tmp_path, **overrides),
        train_dataset=Dataset.from_list(PROMPTS * 2),
        peft_config=peft_config,
    )
    engine.vocab_size = trainer.model.config.vocab_size
    trainer.model.train()
    return trainer, engine


def _count_policy_passes(monkeypatch, trainer) -> list:
    """Record every forward pass of GRPOTrainer's `_get_per_token_logps_and_entropies` through the policy model."""
    calls = []
    original = GRPOTrainer._get_per_token_logps_and_entropies

    def spy(self, model, *args, **kwargs):
        if model is trainer.model:
            calls.append(kwargs.get("compute_entropy", False))
        return original(self, model, *args, **kwargs)

    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", spy)
    return calls


def _engine_logps(engine, shape) -> torch.Tensor:
    """The engine's log-probs of the last call as a `(B, T)` tensor, right-padded with 0 (NaN where it gave None)."""
    expected = torch.zeros(shape)
    for row, seq in enumerate(engine.returned[-1]):
        expected[row, : len(seq)] = torch.tensor([float("nan") if lp is None else lp for lp in seq])
    return expected


# ------------------------------------------------------------------------------------------------------------------
# Config: what "rollout" needs and refuses, each error naming the fields
# ------------------------------------------------------------------------------------------------------------------


def _config(tmp_path, **kwargs):
    return PolicyLossConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **kwargs)


def test_default_is_the_trainers_pass(tmp_path):
    assert _config(tmp_path).old_logps_source == "trainer"


@pytest.mark.parametrize(
    "settings,names",
    [
        (dict(), ["old_logps_source", "use_vllm"]),
        (dict(use_vllm=True), ["old_logps_source", "vllm_importance_sampling_correction"]),
        (
            dict(
                use_vllm=True, vllm_importance_sampling_correction=False, policy_loss="band", band_radius_by="entropy"
            ),
            ["old_logps_source", "band_radius_by"],
        ),
    ],
    ids=["without_vllm", "with_vllm_correction", "with_adaptive_radius"],
)
def test_rollout_refusals_name_the_fields(tmp_path, settings, names):
    with pytest.raises(ValueError) as error:
        _config(tmp_path, old_logps_source="rollout", **settings)
    for name in names:
        assert name in str(error.value)


def test_unknown_source_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"old_logps_source must be one of \['trainer', 'rollout'\]"):
        _config(tmp_path, old_logps_source="engine")


def test_rollout_with_vllm_and_no_correction_is_accepted(tmp_path):
    config = _config(tmp_path, old_logps_source="rollout", use_vllm=True, vllm_importance_sampling_correction=False)
    assert config.old_logps_source == "rollout"


# ------------------------------------------------------------------------------------------------------------------
# Generation through TRL's vLLM branch
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("source,passes", [("trainer", 1), ("rollout", 0)])
def test_old_policy_pass_runs_only_for_the_trainer_source(tiny_model_dir, tmp_path, monkeypatch, source, passes):
    """gradient_accumulation_steps=1 < steps_per_generation=2: TRL computes old log-probs by a forward pass of the
    policy ("trainer"); with "rollout" that pass is skipped and the engine's log-probs take its place."""
    trainer, engine = _trainer(tiny_model_dir, tmp_path, monkeypatch, old_logps_source=source)
    calls = _count_policy_passes(monkeypatch, trainer)
    output = trainer._generate_and_score_completions(list(PROMPTS))
    assert len(calls) == passes
    expected = _engine_logps(engine, output["completion_ids"].shape)
    keep = output["completion_mask"].bool()
    if source == "rollout":
        torch.testing.assert_close(output["old_per_token_logps"][keep], expected[keep], rtol=0, atol=0)
    else:  # the trainer's own log-probs: not the engine's
        assert not torch.allclose(output["old_per_token_logps"][keep], expected[keep])


def test_rollout_ratio_and_bounds_use_the_engines_logps(tiny_model_dir, tmp_path, monkeypatch):
    trainer, engine = _trainer(tiny_model_dir, tmp_path, monkeypatch)
    output = trainer._generate_and_score_completions(list(PROMPTS))
    expected = _engine_logps(engine, output["completion_ids"].shape)
    keep = output["completion_mask"].bool()
    # the bounds, computed once per generation batch, are the Band of the engine's log-probs
    lower, upper = band_bounds(expected, 0.05, "kl", upper_max=10.0)
    torch.testing.assert_close(output["policy_lower_bound"][keep], lower[keep], rtol=0, atol=0)
    torch.testing.assert_close(output["policy_upper_bound"][keep], upper[keep], rtol=0, atol=0)
    # the ratio: the current log-probs minus the engine's
    seen = []
    original = trainer._per_token_policy_loss

    def spy(log_ratio, advantages, lower, upper, mask, old_logps):
        seen.append((log_ratio.detach(), lower, upper, old_logps))
        return original(log_ratio, advantages, lower, upper, mask, old_logps)

    monkeypatch.setattr(trainer, "_per_token_policy_loss", spy)
    trainer.current_gradient_accumulation_steps = 1
    loss = trainer._compute_loss(trainer.model, dict(output))
    assert torch.isfinite(loss) and len(seen) == 1
    ids = torch.cat([output["prompt_ids"], output["completion_ids"]], 1)
    attention = torch.cat([output["prompt_mask"], output["completion_mask"]], 1)
    with torch.no_grad():
        current, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attention, keep.size(1))
    log_ratio, lower_used, upper_used, old_used = seen[0]
    torch.testing.assert_close(log_ratio[keep], (current - expected)[keep], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(old_used[keep], expected[keep], rtol=0, atol=0)  # the losses' `old_logps` context
    assert lower_used is output["policy_lower_bound"] and upper_used is output["policy_upper_bound"]


def test_unscored_tokens_leave_the_loss(tiny_model_dir, tmp_path, monkeypatch):
    """A token vLLM returned NaN for has no old probability: it is masked out of the loss and the normaliser (through
    `tool_mask`, not the attention mask), its old log-prob is a finite placeholder, and it is counted."""
    unscored = {(0, 1), (5, 0)}
    trainer, _ = _trainer(tiny_model_dir, tmp_path, monkeypatch, unscored=unscored, loss_type="dapo")
    output = trainer._generate_and_score_completions(list(PROMPTS))
    completion_mask = output["completion_mask"]
    assert torch.isfinite(output["old_per_token_logps"]).all()
    assert torch.isnan(output["sampling_per_token_logps"][0, 1])  # TRL's own tensor is left as TRL built it
    expected_tool_mask = completion_mask.clone()
    for row, t in unscored:
        expected_tool_mask[row, t] = 0
    assert torch.equal(output["tool_mask"] * completion_mask, expected_tool_mask)
    assert output["num_items_in_batch"].item() == completion_mask.sum().item() - len(unscored)
    num, den = trainer._count_window("train")["sampling/unscored_token_share"]
    assert [num, den] == [len(unscored), completion_mask.sum().item()]
    trainer.current_gradient_accumulation_steps = 1
    loss = trainer._compute_loss(trainer.model, dict(output))
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in trainer.model.parameters() if p.grad is not None)


def test_peft_reference_pass_still_runs(tiny_model_dir, tmp_path, monkeypatch):
    """With a PEFT adapter and beta != 0 the reference log-probs come from the policy model with its adapter off, a
    pass after the old-policy one: only the old-policy pass is skipped."""
    from peft import LoraConfig

    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    trainer, engine = _trainer(tiny_model_dir, tmp_path, monkeypatch, peft_config=peft_config, beta=0.04)
    calls = _count_policy_passes(monkeypatch, trainer)
    output = trainer._generate_and_score_completions(list(PROMPTS))
    assert len(calls) == 1  # the reference pass
    keep = output["completion_mask"].bool()
    assert torch.isfinite(output["ref_per_token_logps"][keep]).all()
    expected = _engine_logps(engine, output["completion_ids"].shape)
    torch.testing.assert_close(output["old_per_token_logps"][keep], expected[keep], rtol=0, atol=0)


def test_training_with_two_iterations_keeps_the_rollout_logps(tiny_model_dir, tmp_path, monkeypatch):
    """num_iterations=2: both passes over the generation batch take the same engine log-probs as the old policy (the
    policy that sampled), and the trainer's forward passes are the loss's only."""
    trainer, engine = _trainer(
        tiny_model_dir, tmp_path, monkeypatch, steps_per_generation=1, num_iterations=2, max_steps=2
    )
    calls = _count_policy_passes(monkeypatch, trainer)
    seen = []
    original = BandPOTrainer._compute_loss

    def spy(self, model, inputs):
        seen.append(inputs["old_per_token_logps"].clone())
        return original(self, model, inputs)

    monkeypatch.setattr(BandPOTrainer, "_compute_loss", spy)
    trainer.train()
    assert len(engine.returned) == 1 and len(seen) == 2
    assert calls == [True, True]  # the two loss passes (with entropies); no old-policy pass
    torch.testing.assert_close(seen[0], seen[1], rtol=0, atol=0)
    returned = sorted(lp for seq in engine.returned[0] for lp in seq)
    kept = sorted(seen[0][seen[0] != 0].tolist())
    assert kept == pytest.approx(returned, abs=1e-6)
    logged = [entry for entry in trainer.state.log_history if "bounds/upper_mean" in entry]
    assert logged and all(entry["sampling/unscored_token_share"] == 0.0 for entry in logged[:1])


@pytest.mark.parametrize("name", ["cppo", "trm", "m2po", "icepop"])
def test_masking_trust_regions_train_on_the_rollout_logps(tiny_model_dir, tmp_path, monkeypatch, name):
    """The losses that see whole sequences (CPPO, TRM, M2PO: through TRL's mask, CPPO also the old log-probs) and
    IcePop train with the engine's log-probs as the old policy."""
    trainer, engine = _trainer(tiny_model_dir, tmp_path, monkeypatch, policy_loss=name, max_steps=2)
    seen = []
    original = trainer._per_token_policy_loss

    def spy(log_ratio, advantages, lower, upper, mask, old_logps):
        seen.append((mask, old_logps))
        return original(log_ratio, advantages, lower, upper, mask, old_logps)

    monkeypatch.setattr(trainer, "_per_token_policy_loss", spy)
    before = {key: p.detach().clone() for key, p in trainer.model.named_parameters()}
    trainer.train()
    returned = torch.tensor([lp for call in engine.returned for seq in call for lp in seq])
    assert len(seen) == 2
    for mask, old_logps in seen:  # the old policy the losses are given: the engine's log-probs
        assert torch.isin(old_logps[mask.bool()], returned).all()
    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(steps) == 2 and all(math.isfinite(entry["loss"]) for entry in steps)
    shares = [entry[f"{name}/masked_share"] for entry in steps]
    # the first step's ratios are against the engine's log-probs of random tokens, far from the model's: each rule
    # masks some (against the trainer's own old log-probs the first step's ratios are about 1: nothing masked)
    assert 0.0 < shares[0] <= 1.0 and 0.0 <= shares[1] <= 1.0
    if name == "cppo":  # it keeps the tokens whose ratio moved against their advantage, and trains on them
        after = dict(trainer.model.named_parameters())
        assert any(not torch.equal(value, after[key]) for key, value in before.items())


def test_skipping_another_pass_is_an_error(tiny_model_dir, tmp_path, monkeypatch):
    """The pass skipped must be the one TRL stores as old log-probs: were it any other (here the PEFT reference pass,
    in a setting where TRL runs no old-policy pass), generation raises instead of training on NaN references."""
    from peft import LoraConfig

    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    trainer, _ = _trainer(
        tiny_model_dir, tmp_path, monkeypatch, peft_config=peft_config, beta=0.04, gradient_accumulation_steps=2
    )  # steps aligned: TRL computes no old log-probs
    original = BandPOTrainer._generate

    def expect_a_pass(self, prompts):
        result = original(self, prompts)
        self._old_pass = {"skip": True, "result": None}
        return result

    monkeypatch.setattr(BandPOTrainer, "_generate", expect_a_pass)
    with pytest.raises(RuntimeError, match="GRPOTrainer's old-policy pass"):
        trainer._generate_and_score_completions(list(PROMPTS))


def test_dynamic_sampling_rounds_keep_the_rollout_logps(tiny_model_dir, tmp_path, monkeypatch):
    """With dynamic sampling each extra round skips its own old-policy pass, and the merged batch's old log-probs are
    the engine's, row by row."""
    trainer, engine = _trainer(tiny_model_dir, tmp_path, monkeypatch, dynamic_sampling=True)
    calls = _count_policy_passes(monkeypatch, trainer)
    output = trainer._generate_and_score_completions(list(PROMPTS))
    assert calls == [] and engine.returned
    returned = [torch.tensor(seq) for call in engine.returned for seq in call]
    keep = output["completion_mask"].bool()
    for row in range(output["completion_ids"].size(0)):
        if keep[row].any():  # a kept group's completion: exactly one of the engine's sequences
            old = output["old_per_token_logps"][row][keep[row]]
            assert any(torch.equal(old, seq) for seq in returned if len(seq) == len(old))


# ------------------------------------------------------------------------------------------------------------------
# Sampling settings under which the engine's log-probs are not the model's (truncation, penalties, ...): refused
# ------------------------------------------------------------------------------------------------------------------

_ROLLOUT = dict(old_logps_source="rollout", use_vllm=True, vllm_importance_sampling_correction=False)
# (settings, the name=value the error must give): TRL's fields, and the same keys in generation_kwargs, which
# override the fields in TRL's vLLM generation.
_DISTORTING = [
    (dict(top_p=0.8), "top_p=0.8"),
    (dict(top_k=20), "top_k=20"),
    (dict(min_p=0.05), "min_p=0.05"),
    (dict(generation_kwargs={"min_tokens": 16}), "generation_kwargs['min_tokens']=16"),
    (dict(generation_kwargs={"top_p": 0.9}), "generation_kwargs['top_p']=0.9"),
    (dict(generation_kwargs={"top_k": 5}), "generation_kwargs['top_k']=5"),
    (dict(generation_kwargs={"min_p": 0.1}), "generation_kwargs['min_p']=0.1"),
    (dict(top_p=1.0, generation_kwargs={"top_p": 0.95}), "generation_kwargs['top_p']=0.95"),
    (dict(repetition_penalty=1.1), "repetition_penalty=1.1"),
    (dict(generation_kwargs={"presence_penalty": 0.5}), "generation_kwargs['presence_penalty']=0.5"),
    (dict(generation_kwargs={"logit_bias": {"5": 2.0}}), "generation_kwargs['logit_bias']={'5': 2.0}"),
    (dict(generation_kwargs={"temperature": 0.7}), "generation_kwargs['temperature']=0.7"),
    # values that are no neutral setting either: a string, NaN (a top_p of '0.8' is refused before, as no number)
    (dict(generation_kwargs={"presence_penalty": "0.5"}), "generation_kwargs['presence_penalty']='0.5'"),
    (dict(generation_kwargs={"min_tokens": float("nan")}), "generation_kwargs['min_tokens']=nan"),
]


@pytest.mark.parametrize("settings,named", _DISTORTING, ids=[named for _, named in _DISTORTING])
def test_rollout_refuses_sampling_that_distorts_the_engines_logps(tmp_path, settings, named):
    """vLLM's sampling log-probs are renormalised over what top-p / top-k / min-p / min_tokens keep (or shifted by
    penalties, biases, another temperature): every ratio would start away from 1. Refused, naming the setting and
    the alternative; the same settings with the trainer's old-policy pass are accepted."""
    with pytest.raises(ValueError) as error:
        _config(tmp_path, **_ROLLOUT, **settings)
    message = str(error.value)
    assert "old_logps_source='rollout'" in message and named in message
    assert "old_logps_source='trainer'" in message  # the alternative
    config = _config(tmp_path, **{**_ROLLOUT, "old_logps_source": "trainer"}, **settings)
    assert config.old_logps_source == "trainer"


def test_rollout_names_every_distorting_setting_at_once(tmp_path):
    with pytest.raises(ValueError) as error:
        _config(tmp_path, **_ROLLOUT, top_p=0.8, top_k=40, generation_kwargs={"min_tokens": 4})
    for named in ("top_p=0.8", "top_k=40", "generation_kwargs['min_tokens']=4"):
        assert named in str(error.value)


@pytest.mark.parametrize(
    "settings",
    [
        dict(top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0),
        dict(min_p=0.0),
        dict(generation_kwargs={"top_k": -1, "min_tokens": 0, "max_tokens": 8, "seed": 3}),
        dict(top_p=0.8, generation_kwargs={"top_p": 1.0}),  # the engine samples with generation_kwargs' top_p
        dict(temperature=0.7, generation_kwargs={"temperature": 0.7}),  # the trainer divides by the same
        dict(generation_kwargs='{"top_k": 0}'),  # a JSON string, as on a command line
    ],
    ids=["neutral_fields", "min_p_zero", "neutral_generation_kwargs", "overridden_top_p", "same_temperature", "json"],
)
def test_rollout_accepts_sampling_without_distortion(tmp_path, settings):
    assert _config(tmp_path, **_ROLLOUT, **settings).old_logps_source == "rollout"


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--top_p", "0.8"], "top_p=0.8"),
        (["--top_k", "20"], "top_k=20"),
        (["--min_p", "0.05"], "min_p=0.05"),
        (["--generation_kwargs", '{"min_tokens": 16}'], "generation_kwargs['min_tokens']=16"),
    ],
    ids=["top_p", "top_k", "min_p", "min_tokens"],
)
def test_a_recipe_with_rollout_logps_refuses_truncated_sampling(tmp_path, flags, named):
    """A paper recipe with its `old_logps_source: rollout` line uncommented (a valid run, tests/test_recipes.py) and
    one truncating sampling setting: `trl-bandpo train` stops while reading it, naming the setting."""
    from pathlib import Path

    from trl_bandpo.cli.recipe import ConfigError, parse_args

    source = Path(__file__).resolve().parents[1] / "recipes" / "bandpo" / "qwen2.5-3b-instruct_band-kl-0.05.yaml"
    recipe = tmp_path / source.name
    text = source.read_text()
    assert text.count("# old_logps_source: rollout  #") == 1 and "\ntop_p: 1.0\n" in text
    recipe.write_text(text.replace("# old_logps_source: rollout  #", "old_logps_source: rollout  #"))
    argv = ["--config", str(recipe), "--use_cpu", "true"]
    assert parse_args(argv)[1].old_logps_source == "rollout"  # valid as it is
    with pytest.raises(ConfigError) as error:
        parse_args([*argv, *flags])
    assert named in str(error.value) and "old_logps_source='trainer'" in str(error.value)
    # in the recipe itself rather than on the command line
    recipe.write_text(recipe.read_text().replace("\ntop_p: 1.0\n", "\ntop_p: 0.8\n"))
    with pytest.raises(ConfigError, match="top_p=0.8"):
        parse_args(argv)

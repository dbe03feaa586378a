"""Real (tiny) training runs of BandPOTrainer and DGPOTrainer on CPU, configuration errors, bound reuse, metric
aggregation, LoRA, and a 2-process DeepSpeed ZeRO-3 run through `accelerate launch`."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset

import trl_bandpo.core.losses
from trl_bandpo import BandPOConfig, BandPOTrainer, DGPOConfig, DGPOTrainer, PolicyLossConfig, PolicyLossTrainer

SCRIPTS = Path(__file__).parent / "scripts"


def addition_dataset():
    return Dataset.from_list([{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(4) for b in range(4)])


def shaped_reward(completions, answer, **kwargs):
    """Correctness plus a length term, so that rewards differ within a group from the first step."""
    return [float(c.strip().startswith(a)) + 0.05 * len(c) for c, a in zip(completions, answer)]


def train_args(config_class, output_dir, **overrides):
    kwargs = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=6,
        num_iterations=2,  # off-policy: ratios move away from 1 on the second pass
        gradient_accumulation_steps=2,
        max_steps=3,
        learning_rate=0.1,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    kwargs.update(overrides)
    return config_class(**kwargs)


def run_training(trainer_class, config_class, model, output_dir, **overrides):
    trainer = trainer_class(
        model=model,
        reward_funcs=shaped_reward,
        args=train_args(config_class, output_dir, **overrides),
        train_dataset=addition_dataset(),
    )
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    after = dict(trainer.model.named_parameters())
    changed = [name for name, value in before.items() if not torch.equal(value, after[name].detach())]
    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    return trainer, changed, steps


def logged(steps, key):
    return [entry[key] for entry in steps if entry.get(key) is not None]


@pytest.fixture(scope="module")
def bandpo_run(tiny_model_dir, tmp_path_factory):
    return run_training(
        BandPOTrainer, BandPOConfig, tiny_model_dir, tmp_path_factory.mktemp("bandpo"), band_radius=0.02, beta=0.01
    )


@pytest.fixture(scope="module")
def dgpo_run(tiny_model_dir, tmp_path_factory):
    return run_training(DGPOTrainer, DGPOConfig, tiny_model_dir, tmp_path_factory.mktemp("dgpo"), dgpo_n=2)


def test_bandpo_trains_and_logs_band_metrics(bandpo_run):
    trainer, changed, steps = bandpo_run
    assert trainer.args.policy_loss == "band"
    assert changed, "no parameter moved"
    assert len(steps) == 3 and all(math.isfinite(entry["loss"]) for entry in steps)
    # Band bounds: mean lower in (0, 1), mean upper in (1, upper_max]; these are tokens' own bounds, not constants
    lower, upper = logged(steps, "bounds/lower_mean"), logged(steps, "bounds/upper_mean")
    assert lower and all(0.0 < v < 1.0 for v in lower)
    assert upper and all(1.0 < v <= 10.0 for v in upper)
    region = logged(steps, "clip_ratio/region_mean")
    assert max(region) > 0.0, "off-policy passes should clip some tokens"
    assert all(0.0 <= v <= 1.0 for v in logged(steps, "clip_ratio/high_tail_share"))
    buckets = [k for k in steps[-1] if k.startswith("clip_ratio_by_prob/")]
    assert len(buckets) == 10
    assert all(math.isfinite(v) for v in logged(steps, "kl"))


def test_dgpo_trains_and_logs_region_metrics(dgpo_run):
    trainer, changed, steps = dgpo_run
    assert trainer.args.policy_loss == "dgpo" and trainer.args.dgpo_n == 2
    assert changed
    assert all(math.isfinite(entry["loss"]) for entry in steps)
    outside = [e["dgpo/frac_LN"] + e["dgpo/frac_HP"] for e in steps]
    assert max(outside) > 0.0, "the second pass over each batch should put tokens outside the clip range"
    for entry in steps:
        fractions = sum(entry[f"dgpo/frac_{r}"] for r in ("LN", "HP", "LP", "HN"))
        assert 0.0 <= fractions <= 1.0
        # docs/policy-losses.md: LN weights r^(n+1)/(1-eps)^n < 1 - eps; HP weights (1+eps)^(1/m) r^((m-1)/m) > 1 + eps
        if entry.get("dgpo/weight_LN_mean") is not None:
            assert 0.0 < entry["dgpo/weight_LN_mean"] < 0.8
        if entry.get("dgpo/weight_HP_mean") is not None:
            assert entry["dgpo/weight_HP_mean"] > 1.2
        # DGPO's clip-ratio metrics count its LN / HP tokens; TRL's names average the 2 micro-steps' rates (a mean
        # of means, kept for parity with GRPOTrainer) while ours divide summed counts, so they agree only roughly.
        assert entry["clip_ratio/low_mean"] == pytest.approx(entry["dgpo/frac_LN"], abs=0.05)
        assert entry["clip_ratio/high_mean"] == pytest.approx(entry["dgpo/frac_HP"], abs=0.05)
        assert (entry["clip_ratio/low_mean"] > 0) == (entry["dgpo/frac_LN"] > 0)


@pytest.mark.parametrize(
    "name,metrics",
    [
        ("cppo", ["cppo/masked_share"]),
        ("trm", ["trm/masked_share", "trm/sequence_masked_share"]),
        ("m2po", ["m2po/masked_share", "m2po/m2", "m2po/m2_kept"]),
        ("icepop", ["icepop/masked_share", "icepop/masked_low_share", "icepop/masked_high_share"]),
    ],
    ids=["cppo", "trm", "m2po", "icepop"],
)
def test_masking_trust_regions_train_and_log_their_metrics(tiny_model_dir, tmp_path, name, metrics):
    """CPPO, TRM and M2PO (which see whole sequences or the micro-batch through TRL's mask) and IcePop train."""
    trainer, changed, steps = run_training(
        PolicyLossTrainer, PolicyLossConfig, tiny_model_dir, tmp_path, policy_loss=name, max_steps=2
    )
    assert trainer.args.policy_loss == name
    assert changed, "no parameter moved"
    assert len(steps) == 2 and all(math.isfinite(entry["loss"]) for entry in steps)
    for key in metrics:
        values = logged(steps, key)
        assert len(values) == 2, key
        assert all(0.0 <= v <= 1.0 for v in values) if "share" in key else all(v >= 0.0 for v in values), key


def test_lora_bandpo_trains_only_adapters(tiny_model_dir, tmp_path):
    from peft import LoraConfig

    trainer = BandPOTrainer(
        model=tiny_model_dir,
        reward_funcs=shaped_reward,
        args=train_args(BandPOConfig, tmp_path, max_steps=2),
        train_dataset=addition_dataset(),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    trainable = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    trainer.train()
    params = dict(trainer.model.named_parameters())
    assert any(not torch.equal(value, params[name].detach()) for name, value in trainable.items())
    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert all(math.isfinite(entry["loss"]) for entry in steps)
    assert logged(steps, "bounds/upper_mean")


def test_bounds_computed_once_per_generation_batch(tiny_model_dir, tmp_path, monkeypatch):
    """Band bounds depend only on the old log-probs: one solve per generation batch, reused by every micro-step
    and every iteration over it (here 2 accumulation steps x 2 iterations = 4 loss calls per solve)."""
    calls = []
    original = trl_bandpo.core.losses.solve_band

    def counting_band_bounds(old_logps, *args, **kwargs):
        calls.append(tuple(old_logps.shape))
        return original(old_logps, *args, **kwargs)

    monkeypatch.setattr(trl_bandpo.core.losses, "solve_band", counting_band_bounds)
    trainer, _, _ = run_training(BandPOTrainer, BandPOConfig, tiny_model_dir, tmp_path, max_steps=4)
    generation_batches = (
        4
        * trainer.args.gradient_accumulation_steps
        // (trainer.args.steps_per_generation * trainer.args.num_iterations)
    )
    assert len(calls) == generation_batches == 2
    assert calls[0][0] == trainer.args.generation_batch_size  # the whole generation batch at once


def test_count_metrics_are_not_means_of_means(tiny_model_dir, tmp_path):
    trainer = BandPOTrainer(
        model=tiny_model_dir,
        reward_funcs=shaped_reward,
        args=train_args(BandPOConfig, tmp_path),
        train_dataset=addition_dataset(),
    )
    trainer.model.train()
    # two micro-steps: 1 of 1 tail token clipped, then 0 of 3
    trainer._add_counts("train", {"clip_ratio/high_tail_share": (torch.tensor(1.0), torch.tensor(1.0))})
    trainer._add_counts("train", {"clip_ratio/high_tail_share": (torch.tensor(0.0), torch.tensor(3.0))})
    trainer.log({})
    assert trainer.state.log_history[-1]["clip_ratio/high_tail_share"] == pytest.approx(0.25)  # not 0.5


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(policy_loss="band_kl"), "policy_loss"),
        (dict(band_radius=0.0), "radius"),
        (dict(band_radius=float("nan")), "radius"),
        (dict(band_divergence="wasserstein"), "divergence"),
        (dict(band_upper_max=0.5), "upper_max"),
        (dict(band_solver="cuda"), "solver"),
        (dict(dgpo_n=1.5), "dgpo_n"),
        (dict(dgpo_n=0), "dgpo_n"),
        (dict(dgpo_m=0.5), "dgpo_m"),
        (dict(ce_gppo_beta1=-1.0), "ce_gppo_beta1"),
        (dict(aspo_c_pos=0.5), "aspo_c_pos"),
        (dict(policy_loss="band", loss_type="cispo"), "loss_type"),
        (dict(policy_loss="dgpo", loss_type="sapo"), "loss_type"),
        (dict(policy_loss="dgpo", delta=10.0), "delta"),
        (dict(epsilon=1.5), "epsilon"),
        (dict(policy_loss="band", band_solver="triton", band_divergence="tv"), "band_solver"),
    ],
)
def test_config_rejects_bad_values_at_construction(tmp_path, kwargs, field):
    with pytest.raises(ValueError, match=field):
        PolicyLossConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where no CUDA device exists")
def test_config_rejects_triton_solver_without_cuda(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="band_solver='triton' cannot run here"):
        BandPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", band_solver="triton")


def test_config_defaults_and_relax(tmp_path):
    band = BandPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    assert (band.policy_loss, band.band_divergence, band.band_radius) == ("band", "kl", 0.05)
    assert (band.band_solver, band.band_upper_max) == ("auto", 10.0)
    dgpo = DGPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    assert (dgpo.policy_loss, dgpo.dgpo_n, dgpo.dgpo_m) == ("dgpo", 1, 2.0)
    # Relaxed Band is selected by its name only: no flag rewrites policy_loss behind the user's back
    relaxed = BandPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", policy_loss="relaxed_band")
    assert relaxed.policy_loss == "relaxed_band"
    with pytest.raises(TypeError, match="band_relax"):
        BandPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", band_relax=True)
    # any policy loss runs in either trainer's config
    assert DGPOConfig(output_dir=str(tmp_path), use_cpu=True, policy_loss="band").policy_loss == "band"


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("accelerate") is None
    and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "accelerate")),
    reason="accelerate CLI not installed",
)
def test_zero3_two_processes_bandpo(tiny_model_dir, tmp_path):
    pytest.importorskip("deepspeed")
    accelerate = shutil.which("accelerate") or os.path.join(os.path.dirname(sys.executable), "accelerate")
    command = [
        accelerate, "launch", "--config_file", str(SCRIPTS / "zero3_cpu.yaml"), "--main_process_port", "29617",
        str(SCRIPTS / "zero3_bandpo_run.py"), tiny_model_dir, str(tmp_path),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"log_history_rank{k}.json").read_text()) for k in (0, 1)]
    assert all(rank["world"] == 2 and rank["deepspeed"] for rank in ranks)
    steps = [[e for e in rank["log_history"] if "loss" in e] for rank in ranks]
    assert steps[0] and len(steps[0]) == len(steps[1])
    for entry0, entry1 in zip(*steps):
        for key in ("bounds/upper_mean", "clip_ratio/region_mean", "clip_ratio/high_tail_share", "entropy"):
            assert entry0.get(key) == pytest.approx(entry1.get(key), nan_ok=True), key
        assert 1.0 < entry0["bounds/upper_mean"] <= 10.0


# The per-token loss inside the trainer equals the pure API on the same tensors, exactly. Hyper-parameters are mapped
# from the config by hand here (not through the registry), so a wrong config-to-keyword mapping fails too; each case
# names the tokens its own hyper-parameters act on, `(ratio, advantages, lower, upper) -> {what: mask}`, and the
# inputs hold some of each (else a hyper-parameter the trainer dropped would pass unnoticed).
POLICY_TERM_CASES = {
    "band": (
        dict(band_radius=0.03, band_upper_max=4.0, delta=3.0, epsilon=0.1, band_solver="torch"),
        lambda a: dict(radius=0.03, divergence="kl", upper_max=4.0, solver="torch", delta=3.0),
        # the dual clip changes a token's loss where its ratio is above delta and, with A < 0, above the upper bound,
        # or, with A > 0, where the upper bound is above delta (Band bounds reach upper_max = 4 here)
        lambda r, adv, lower, upper: {
            "dual clip (A < 0)": (adv < 0) & (r > 3.0) & (r > upper),
            "dual clip (A > 0)": (adv > 0) & (r > 3.0) & (upper > 3.0),
        },
    ),
    "dgpo": (
        dict(dgpo_n=2, dgpo_m=3.0, epsilon=0.15, epsilon_high=0.25),
        lambda a: dict(n=2, m=3.0, epsilon_low=0.15, epsilon_high=0.25),
        lambda r, adv, lower, upper: {"n (LN)": (adv < 0) & (r < lower), "m (HP)": (adv > 0) & (r > upper)},
    ),
    "aspo": (
        dict(aspo_c_pos=2.0, aspo_c_neg=4.0, epsilon=0.2),
        lambda a: dict(c_pos=2.0, c_neg=4.0, epsilon_low=0.2, epsilon_high=0.2),
        lambda r, adv, lower, upper: {"c_pos": (adv > 0) & (r < 1 / 2.0), "c_neg": (adv < 0) & (r > 4.0)},
    ),
    "icepop": (
        dict(icepop_low=0.3, icepop_high=2.0, epsilon=0.1),
        lambda a: dict(low=0.3, high=2.0, epsilon_low=0.1, epsilon_high=0.1),
        # kept here, masked at the defaults [0.5, 5]; masked here, kept at the defaults
        lambda r, adv, lower, upper: {"low": (r >= 0.3) & (r < 0.5), "high": (r > 2.0) & (r <= 5.0)},
    ),
    # A token's fate depends on its sequence (CPPO, TRM) or the micro-batch (M2PO), not on its own ratio: instead of
    # naming tokens, the test checks that each hyper-parameter at its default changes the loss of some kept token.
    # (the tiny model gives these random tokens probabilities of about 0.01: CPPO's budget on |q - p| is as small)
    "cppo": (
        dict(cppo_delta=0.003, cppo_w_min=0.5, cppo_delta_b=0.002),
        lambda a: dict(radius=0.003, w_min=0.5, rate_min=0.002),
        None,
    ),
    "trm": (
        dict(trm_divergence="k1", trm_reduce="max", trm_threshold=2.5, epsilon=0.1),
        lambda a: dict(divergence="k1", reduce="max", threshold=2.5, epsilon_low=0.1, epsilon_high=0.1),
        None,
    ),
    "m2po": (
        dict(m2po_threshold=0.5, epsilon=0.1, epsilon_high=0.3),
        lambda a: dict(threshold=0.5, epsilon_low=0.1, epsilon_high=0.3),
        None,
    ),
}


@pytest.mark.parametrize("name", sorted(POLICY_TERM_CASES))
def test_per_token_loss_in_trainer_equals_policy_loss(tiny_model_dir, tmp_path, name):
    from trl_bandpo.core.losses import policy_bounds, policy_loss

    config_overrides, expected_kwargs, acted_on = POLICY_TERM_CASES[name]
    trainer = BandPOTrainer(
        model=tiny_model_dir,
        reward_funcs=shaped_reward,
        args=train_args(BandPOConfig, tmp_path, policy_loss=name, **config_overrides),
        train_dataset=addition_dataset(),
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by train(); the loss is called directly here
    g = torch.Generator().manual_seed(0)
    B, P, T = 4, 3, 5
    vocab = trainer.model.config.vocab_size
    inputs = {
        "prompt_ids": torch.randint(4, vocab, (B, P), generator=g),
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": torch.randint(4, vocab, (B, T), generator=g),
        "completion_mask": torch.tensor([[1] * T, [1] * T, [1, 1, 1, 0, 0], [1] * T]),
        "advantages": torch.tensor([1.5, -0.7, 0.3, -2.0]),
        "num_items_in_batch": torch.tensor(float(B * T)),
    }
    with torch.no_grad():
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        logps, _ = trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention_mask, T)[:2]
    # old log-probs spread so that every region (inside, clipped low/high, saturated) is populated, with a token of
    # each advantage sign far above every upper bound (ratios e^2 and e^3; the Band's upper_max here is 4)
    inputs["old_per_token_logps"] = logps - torch.randn(B, T, generator=g) * 1.5
    inputs["old_per_token_logps"][0, 1] = logps[0, 1] - 2.0
    inputs["old_per_token_logps"][1, 0] = logps[1, 0] - 3.0
    ratio = (logps - inputs["old_per_token_logps"]).exp()
    lower, upper = policy_bounds(name, inputs["old_per_token_logps"], **expected_kwargs(trainer.args))
    advantages, kept = inputs["advantages"][:, None], inputs["completion_mask"].bool()
    regions = {"clipped low": (advantages < 0) & (ratio < lower), "clipped high": (advantages > 0) & (ratio > upper)}
    acted = acted_on(ratio, advantages, lower, upper) if acted_on else {}
    for what, where in {**regions, **acted}.items():
        assert (where & kept).any(), f"no token in {what}: the test would pass without it"

    captured = {}
    original = trainer._per_token_policy_loss

    def capture(log_importance_weights, *args):
        captured["log_ratio"] = log_importance_weights
        captured["loss"] = original(log_importance_weights, *args)
        return captured["loss"]

    trainer._per_token_policy_loss = capture
    trainer._compute_loss(trainer.model, inputs)
    logps = logps.clone().requires_grad_(True)
    # TRL's mask, which the trainer gives the losses that see whole sequences (the others ignore it)
    args = (name, logps, inputs["old_per_token_logps"], inputs["advantages"][:, None], inputs["completion_mask"])
    expected = policy_loss(*args, **expected_kwargs(trainer.args))
    assert captured["loss"].shape == (B, T)
    assert torch.equal(captured["loss"].detach(), expected.detach())
    if acted_on is None:
        for key in expected_kwargs(trainer.args):
            at_default = policy_loss(*args, **{k: v for k, v in expected_kwargs(trainer.args).items() if k != key})
            assert not torch.equal(at_default[kept], expected[kept]), f"{key}: the test would pass without it"
    # and the gradient (the re-weighted losses differ from their forward value only there); log r = log pi - const
    (grad,) = torch.autograd.grad(captured["loss"].sum(), captured["log_ratio"])
    (expected_grad,) = torch.autograd.grad(expected.sum(), logps)
    assert torch.equal(grad, expected_grad)

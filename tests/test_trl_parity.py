"""Parity with TRL: with `policy_loss="clip"` our `_compute_loss` must equal GRPOTrainer's, in loss, gradients and
logged metrics, for every `loss_type` and the features around the policy term. This test is what pins the TRL
range in pyproject.toml: when TRL changes `_compute_loss`, it fails here first."""

import itertools

import pytest
import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from trl_bandpo import PolicyLossConfig, PolicyLossTrainer

# The loss types whose policy term and aggregation run in our `_compute_loss`; TRL's own policy terms (cispo, sapo,
# vespo, luspo) go to GRPOTrainer's method unchanged (`test_trls_own_loss_types_are_delegated`).
LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo"]
B, P, T = 4, 3, 6


def _reward(completions, **kwargs):
    return [0.0] * len(completions)


def _common_args(tmp_path):
    return dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=T,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        epsilon_high=0.28,
    )


@pytest.fixture(scope="module")
def trainers(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parity")
    dataset = Dataset.from_list([{"prompt": "1+1="}] * 4)
    ours = PolicyLossTrainer(
        model=tiny_model_dir,
        reward_funcs=_reward,
        args=PolicyLossConfig(policy_loss="clip", **_common_args(tmp / "ours")),
        train_dataset=dataset,
    )
    theirs = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=_reward,
        args=GRPOConfig(**_common_args(tmp / "theirs")),
        train_dataset=dataset,
    )
    for trainer in (ours, theirs):
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 2
    return ours, theirs


@pytest.fixture(scope="module")
def base_inputs(trainers):
    torch.manual_seed(0)
    ours, _ = trainers
    vocab = ours.model.config.vocab_size
    prompt_ids = torch.randint(4, vocab, (B, P))
    completion_ids = torch.randint(4, vocab, (B, T))
    completion_mask = torch.ones(B, T, dtype=torch.long)
    completion_mask[1, 4:] = 0
    completion_mask[3, 2:] = 0
    with torch.no_grad():
        logps, _, _ = ours._get_per_token_logps_and_entropies(
            ours.model,
            torch.cat([prompt_ids, completion_ids], 1),
            torch.ones(B, P + T, dtype=torch.long),
            T,
        )
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor([1.3, -0.7, 0.4, -1.1]),
        # ratios spread around 1 so every clip region is hit
        "old_per_token_logps": logps + 0.4 * torch.randn(B, T),
        "ref_per_token_logps": logps + 0.2 * torch.randn(B, T),
        "sampling_per_token_logps": logps + 0.3 * torch.randn(B, T),
        "importance_sampling_ratio": torch.empty(B, T).uniform_(0.5, 1.5),
        "num_items_in_batch": completion_mask.sum().float() * 2,
    }


def _configure(trainer, settings):
    for name, value in settings.items():
        if hasattr(trainer.args, name):
            object.__setattr__(trainer.args, name, value)
        setattr(trainer, name, value)
    trainer._entropy_bonus_enabled = trainer.entropy_coef != 0.0 or trainer.use_adaptive_entropy
    trainer._metrics["train"].clear()
    trainer.model.zero_grad(set_to_none=True)


def _run(trainer, inputs):
    loss = trainer._compute_loss(trainer.model, dict(inputs))
    loss.backward()
    grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    metrics = {key: list(values) for key, values in trainer._metrics["train"].items()}
    return loss.detach(), grads, metrics


def _assert_parity(trainers, base_inputs, settings, drop=()):
    ours, theirs = trainers
    inputs = {k: v for k, v in base_inputs.items() if k not in drop}
    results = []
    for trainer in (ours, theirs):
        _configure(trainer, settings)
        results.append(_run(trainer, inputs))
    (loss_a, grads_a, metrics_a), (loss_b, grads_b, metrics_b) = results
    assert torch.isfinite(loss_b)
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-6, atol=1e-7)
    assert grads_a.keys() == grads_b.keys() and grads_b
    for name in grads_b:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-5, atol=1e-7, msg=name)
    missing = set(metrics_b) - set(metrics_a)
    assert not missing, f"metrics TRL logs and we do not: {missing}"
    for key in metrics_b:
        assert metrics_a[key] == pytest.approx(metrics_b[key], rel=1e-6, abs=1e-7, nan_ok=True), key
    assert ours.entropy_coef == theirs.entropy_coef


DEFAULTS = dict(
    beta=0.0,
    delta=None,
    importance_sampling_level="token",
    use_vllm=False,
    vllm_importance_sampling_correction=False,
    off_policy_mask_threshold=None,
    top_entropy_quantile=1.0,
    entropy_coef=0.0,
    use_adaptive_entropy=False,
    use_bias_correction_kl=False,
)


@pytest.mark.parametrize("loss_type,beta,vllm_is", list(itertools.product(LOSS_TYPES, [0.0, 0.04], [False, True])))
def test_parity_loss_types(trainers, base_inputs, loss_type, beta, vllm_is):
    settings = dict(DEFAULTS, loss_type=loss_type, beta=beta)
    settings.update(use_vllm=vllm_is, vllm_importance_sampling_correction=vllm_is)
    _assert_parity(trainers, base_inputs, settings)


@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "vespo", "luspo"])
def test_trls_own_loss_types_are_delegated(trainers, base_inputs, loss_type, monkeypatch):
    """Loss types with their own policy term run GRPOTrainer's `_compute_loss` itself, on the same inputs, and our
    policy term, bounds and count metrics stay out of it."""
    ours, _ = trainers
    calls = []
    trl_compute_loss = GRPOTrainer._compute_loss

    def spy(self, model, inputs):
        calls.append(inputs)
        return trl_compute_loss(self, model, inputs)

    def never(*args, **kwargs):
        raise AssertionError("our policy term ran for a TRL loss type")

    monkeypatch.setattr(GRPOTrainer, "_compute_loss", spy)
    monkeypatch.setattr(ours, "_per_token_policy_loss", never)
    _configure(ours, dict(DEFAULTS, loss_type=loss_type, beta=0.04))
    inputs = dict(base_inputs)
    loss = ours._compute_loss(ours.model, inputs)
    assert len(calls) == 1 and calls[0] is inputs and torch.isfinite(loss)
    assert not any(key.startswith(("bounds/", "clip_ratio_by_prob/")) for key in ours._metrics["train"])


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("delta", [None, 1.5])
def test_parity_importance_level_and_dual_clip(trainers, base_inputs, loss_type, level, delta):
    settings = dict(DEFAULTS, loss_type=loss_type, importance_sampling_level=level, delta=delta, beta=0.04)
    _assert_parity(trainers, base_inputs, settings)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
@pytest.mark.parametrize(
    "feature",
    [
        dict(off_policy_mask_threshold=0.05),
        dict(top_entropy_quantile=0.5),
        dict(entropy_coef=0.01),
        dict(use_adaptive_entropy=True, entropy_coef=0.01),
        dict(beta=0.04, use_bias_correction_kl=True),
    ],
    ids=["off_policy_mask", "entropy_mask", "entropy_bonus", "adaptive_entropy", "bias_corrected_kl"],
)
def test_parity_features(trainers, base_inputs, loss_type, feature):
    _assert_parity(trainers, base_inputs, dict(DEFAULTS, loss_type=loss_type, **feature))


def test_parity_on_policy_without_old_logps(trainers, base_inputs):
    """Without `old_per_token_logps` (on-policy TRL), both use the detached current log-probs: ratio 1."""
    _assert_parity(trainers, base_inputs, dict(DEFAULTS, loss_type="dapo"), drop=("old_per_token_logps",))


def test_parity_eval_mode(trainers, base_inputs):
    ours, theirs = trainers
    for trainer in trainers:
        trainer.model.eval()
    try:
        for trainer in (ours, theirs):
            _configure(trainer, dict(DEFAULTS, loss_type="dapo"))
        with torch.no_grad():
            loss_a = ours._compute_loss(ours.model, dict(base_inputs))
            loss_b = theirs._compute_loss(theirs.model, dict(base_inputs))
        torch.testing.assert_close(loss_a, loss_b)
        assert ours._metrics["eval"]["entropy"] == pytest.approx(theirs._metrics["eval"]["entropy"])
    finally:
        for trainer in trainers:
            trainer.model.train()
            trainer._metrics["eval"].clear()

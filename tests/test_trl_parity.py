"""Parity with TRL: with `policy_loss="clip"` our `_compute_loss` must equal GRPOTrainer's, in loss, gradients and
logged metrics, for every `loss_type` and the features around the policy term. This test is what pins the TRL
range in pyproject.toml: when TRL changes `_compute_loss`, it fails here first."""

import itertools
import math

import pytest
import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from trl_bandpo import PolicyLossConfig, PolicyLossTrainer
from trl_bandpo.core.losses import policy_loss_spec

# The loss types whose policy term and aggregation run in our `_compute_loss`; TRL's own policy terms (cispo, sapo,
# vespo, luspo) go to GRPOTrainer's method unchanged (`test_trls_own_loss_types_are_delegated`).
LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo"]
B, P, T = 4, 3, 6
ADVANTAGES = torch.tensor([1.3, -0.7, 0.4, -1.1])
EPSILON_LOW, EPSILON_HIGH = 0.2, 0.28
#: TRL's dual clip in the dual-clip parity tests: above `1 + EPSILON_HIGH`, as TRL recommends.
DELTA = 1.5
#: The settings our trainer reads when it is built (its loss's hyper-parameters): the trainers are built with them in
#: their config (the fixtures); `_configure` refuses to change them afterwards, which our trainer would not see.
READ_AT_CONSTRUCTION = frozenset(policy_loss_spec("clip").config_fields)


def _reward(completions, **kwargs):
    return [0.0] * len(completions)


def _common_args(tmp_path, **config):
    return dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=T,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        epsilon=EPSILON_LOW,
        epsilon_high=EPSILON_HIGH,
        **config,
    )


def _build_trainers(model_dir, tmp, **config):
    """Our trainer with `policy_loss="clip"` and TRL's GRPOTrainer, both built with `config` in their config."""
    dataset = Dataset.from_list([{"prompt": "1+1="}] * 4)
    ours = PolicyLossTrainer(
        model=model_dir,
        reward_funcs=_reward,
        args=PolicyLossConfig(policy_loss="clip", **_common_args(tmp / "ours", **config)),
        train_dataset=dataset,
    )
    theirs = GRPOTrainer(
        model=model_dir,
        reward_funcs=_reward,
        args=GRPOConfig(**_common_args(tmp / "theirs", **config)),
        train_dataset=dataset,
    )
    for trainer in (ours, theirs):
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 2
    return ours, theirs


@pytest.fixture(scope="module")
def trainers(tiny_model_dir, tmp_path_factory):
    return _build_trainers(tiny_model_dir, tmp_path_factory.mktemp("parity"))


@pytest.fixture(scope="module")
def dual_clip_trainers(tiny_model_dir, tmp_path_factory):
    """Both trainers built with TRL's dual clip `delta=DELTA` in their config: ours reads it then, not at each step."""
    return _build_trainers(tiny_model_dir, tmp_path_factory.mktemp("parity_dual_clip"), delta=DELTA)


@pytest.fixture(scope="module")
def inputs_and_logps(trainers):
    """The inputs of `_compute_loss`, and the model's log-probs of their completions (the trainers compute the same:
    no test updates the weights)."""
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
    # log(pi / pi_old) spread around 0 so that every clip region is hit, at both importance-sampling levels
    # (`test_inputs_reach_every_clip_region`): sequence 0 (A > 0) is shifted up, above 1 + epsilon_high as a sequence;
    # sequence 1 (A < 0) has two tokens, and its mean, above log(DELTA): the tokens the dual clip acts on
    log_ratio = -0.4 * torch.randn(B, T)
    log_ratio[0] += 0.5
    log_ratio[1, :4] = torch.tensor([0.9, 0.7, 0.1, 0.3])
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": ADVANTAGES.clone(),
        "old_per_token_logps": logps - log_ratio,
        "ref_per_token_logps": logps + 0.2 * torch.randn(B, T),
        "sampling_per_token_logps": logps + 0.3 * torch.randn(B, T),
        "importance_sampling_ratio": torch.empty(B, T).uniform_(0.5, 1.5),
        "num_items_in_batch": completion_mask.sum().float() * 2,
    }
    return inputs, logps


@pytest.fixture(scope="module")
def base_inputs(inputs_and_logps):
    return inputs_and_logps[0]


@pytest.fixture(scope="module")
def current_logps(inputs_and_logps):
    return inputs_and_logps[1]


def _log_ratios(inputs, logps, level):
    """`log(pi / pi_old)` per token from the inputs alone; at the sequence level every token carries its sequence's
    (the masked mean over its tokens, as GSPO defines it)."""
    log_ratio = logps - inputs["old_per_token_logps"]
    if level == "sequence":
        mask = inputs["completion_mask"]
        log_ratio = ((log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)).expand(B, T)
    return log_ratio


def _clip_regions(inputs, logps, level):
    """The completion tokens in each clip region, counted from the inputs (independently of both trainers): clipped
    low (`r < 1 - epsilon_low`, A < 0) and high (`r > 1 + epsilon_high`, A > 0), and those TRL's dual clip acts on
    (`r > delta`, A < 0: the min picks `delta * A` over the clipped term once delta is above `1 + epsilon_high`)."""
    log_ratio = _log_ratios(inputs, logps, level)
    kept = inputs["completion_mask"].bool()
    advantages = inputs["advantages"][:, None]
    return {
        "low": int(((log_ratio < math.log(1 - EPSILON_LOW)) & (advantages < 0) & kept).sum()),
        "high": int(((log_ratio > math.log(1 + EPSILON_HIGH)) & (advantages > 0) & kept).sum()),
        "dual_clip": int(((log_ratio > math.log(DELTA)) & (advantages < 0) & kept).sum()),
    }


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_inputs_reach_every_clip_region(base_inputs, current_logps, level):
    """The parity tests compare the two trainers on these inputs: each clip region, the dual clip's included, holds
    tokens (else a test passes whether or not that branch is right), and no ratio sits within rounding of a bound."""
    regions = _clip_regions(base_inputs, current_logps, level)
    assert all(regions.values()), regions
    log_ratio = _log_ratios(base_inputs, current_logps, level)[base_inputs["completion_mask"].bool()]
    for bound in (1 - EPSILON_LOW, 1 + EPSILON_HIGH, DELTA):
        assert (log_ratio - math.log(bound)).abs().min() > 1e-3


def _configure(trainer, settings):
    """Apply `settings` (TRL settings both trainers read at each step, and trainer state such as
    `_last_world_entropy`) to a built trainer, from the state it was built in."""
    trainer._last_world_entropy, trainer._entropy_window_stats = float("inf"), None  # the adaptive entropy's, as built
    for name, value in settings.items():
        if name in READ_AT_CONSTRUCTION:  # our trainer read it when built: a later change would reach TRL's alone
            assert getattr(trainer.args, name) == value, f"build the trainers with {name}={value!r} in their config"
            continue
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
    return loss_b


# Every setting a test changes, at the value it is built with (`delta` is read at construction: not here).
DEFAULTS = dict(
    beta=0.0,
    importance_sampling_level="token",
    use_vllm=False,
    vllm_importance_sampling_correction=False,
    off_policy_mask_threshold=None,
    top_entropy_quantile=1.0,
    entropy_coef=0.0,
    use_adaptive_entropy=False,
    entropy_target=0.2,  # TRL's default
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
@pytest.mark.parametrize("delta", [None, DELTA])
def test_parity_importance_level_and_dual_clip(
    trainers, dual_clip_trainers, base_inputs, current_logps, loss_type, level, delta
):
    """GSPO's sequence-level ratio and TRL's dual clip `delta`. Our trainer reads `delta` when it is built, so the
    dual clip runs on trainers built with it in their config, and on inputs holding tokens it acts on."""
    if delta is not None:
        acted_on = _clip_regions(base_inputs, current_logps, level)["dual_clip"]
        assert acted_on > 0, "no token has a ratio above delta with a negative advantage: the dual clip never acts"
    pair = trainers if delta is None else dual_clip_trainers
    settings = dict(DEFAULTS, loss_type=loss_type, importance_sampling_level=level, delta=delta, beta=0.04)
    _assert_parity(pair, base_inputs, settings)


# Each feature: (the settings that turn it on, the settings without it). The adaptive entropy bonus applies only after
# a step whose entropy was at or below `entropy_target` (TRL's `_last_world_entropy`); the tiny model's (~5.5) is above
# the default target (0.2): "gated" checks that the bonus stays off and the coefficient goes down, "applied" starts
# from a step at the target and raises the target above the entropy, so the bonus applies and the coefficient goes up.
FEATURES = {
    "off_policy_mask": (dict(off_policy_mask_threshold=0.05), {}),
    "entropy_mask": (dict(top_entropy_quantile=0.5), {}),
    "entropy_bonus": (dict(entropy_coef=0.01), {}),
    "adaptive_entropy_gated": (dict(use_adaptive_entropy=True, entropy_coef=0.01), {}),
    "adaptive_entropy_applied": (
        dict(use_adaptive_entropy=True, entropy_coef=0.01, entropy_target=10.0, _last_world_entropy=0.0),
        {},
    ),
    "bias_corrected_kl": (dict(beta=0.04, use_bias_correction_kl=True), dict(beta=0.04)),
}


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_parity_features(trainers, base_inputs, loss_type, feature):
    with_feature, without = FEATURES[feature]
    loss_with = _assert_parity(trainers, base_inputs, dict(DEFAULTS, loss_type=loss_type, **with_feature))
    # the feature acts on these inputs: TRL's loss (or, gated, its entropy coefficient) is not what it is without it
    _, theirs = trainers
    coefficient = theirs.entropy_coef
    _configure(theirs, dict(DEFAULTS, loss_type=loss_type, **without))
    loss_without, _, _ = _run(theirs, base_inputs)
    if feature == "adaptive_entropy_gated":
        assert torch.equal(loss_with, loss_without) and coefficient < with_feature["entropy_coef"]
    else:
        assert not torch.isclose(loss_with, loss_without, rtol=1e-4, atol=0), f"{feature} does not act here"
    if feature == "adaptive_entropy_applied":
        assert coefficient > with_feature["entropy_coef"]


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

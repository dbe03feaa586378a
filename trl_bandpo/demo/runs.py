"""The compared methods (the `trl_bandpo.demo` docstring lists them) and one RL run per method with
`PolicyLossTrainer`."""

from __future__ import annotations

import time
from typing import Any

from .task import correctness_reward

#: The four methods of the papers' Figure 3 comparison, in plotting order.
DEFAULT_METHODS = ("grpo", "clip_higher", "bandpo", "dgpo")

#: Named methods: display label and the `PolicyLossConfig` fields that define them. The Band radius (and DPPO's) comes
#: from ``--band-radius``.
_BAND_KL = {"band_divergence": "kl", "band_upper_max": 10.0}
METHOD_PRESETS: dict[str, dict[str, Any]] = {
    "grpo": {"label": "GRPO", "policy_loss": "clip", "epsilon": 0.2, "epsilon_high": 0.2},
    "clip_higher": {"label": "Clip-Higher", "policy_loss": "clip", "epsilon": 0.2, "epsilon_high": 0.28},
    "bandpo": {"label": "BandPO", "policy_loss": "band", **_BAND_KL},
    "dgpo": {"label": "DGPO", "policy_loss": "dgpo", "epsilon": 0.2, "epsilon_high": 0.2, "dgpo_n": 1, "dgpo_m": 2.0},
    # Extensions beyond both papers (docs/extensions.md)
    "adaptive_band": {"label": "Adaptive Band", "policy_loss": "band", **_BAND_KL, "band_radius_by": "entropy",
                      "band_radius_exponent": 1.0},
    # DPPO-Binary-KL (arXiv:2602.04879; docs/band-and-dppo.md), C = 10,000 as its authors
    "dppo": {"label": "DPPO-KL", "policy_loss": "dppo_kl", "dppo_ratio_cap": 10000.0},
    "band_dgpo": {"label": "Band x DGPO", "policy_loss": "band_dgpo", **_BAND_KL, "dgpo_n": 1, "dgpo_m": 2.0},
    # Masking trust regions (docs/policy-losses.md) at their authors' defaults, CPPO's δ the paper's for dense models
    "cppo": {"label": "CPPO", "policy_loss": "cppo", "cppo_delta": 0.15},
    "trm": {"label": "TRM", "policy_loss": "trm"},
    "m2po": {"label": "M2PO", "policy_loss": "m2po"},
    "icepop": {"label": "IcePop", "policy_loss": "icepop"},
}  # fmt: skip
# ε of the other policy losses when run by their own name, as in the BandPO paper's baselines (Section 6.1);
# 0.2/0.2 for the ones not listed.
_OTHER_EPSILONS = {"relaxed_band": (0.2, 0.28), "dcpo": (0.16, 0.2)}


def method_settings(name: str, band_radius: float) -> dict[str, Any]:
    """`PolicyLossConfig` fields (and ``label``) for a method name: a preset or any `POLICY_LOSSES` name."""
    from ..core.losses import POLICY_LOSSES, policy_loss_spec

    if name in METHOD_PRESETS:
        settings = dict(METHOD_PRESETS[name])
    elif name in POLICY_LOSSES:
        settings = {"label": name, "policy_loss": name}
        # only where the loss reads them (else it warns)
        if "epsilon" in policy_loss_spec(name).config_fields:
            settings["epsilon"], settings["epsilon_high"] = _OTHER_EPSILONS.get(name, (0.2, 0.2))
    else:
        raise ValueError(
            f"unknown method {name!r}: choose among {list(METHOD_PRESETS)} or a policy loss of {list(POLICY_LOSSES)}."
        )
    if settings["policy_loss"] in ("band", "relaxed_band", "band_dgpo"):
        settings["band_radius"] = band_radius
    if settings["policy_loss"] == "dppo_kl":
        settings["dppo_kl_radius"] = band_radius
    # radii from delta / 4 to 4 delta, as the extension recipes
    if settings.get("band_radius_by") == "entropy":
        settings["band_radius_min"], settings["band_radius_max"] = band_radius / 4, band_radius * 4
    return settings


def method_config(settings, run_dir, args, max_new_tokens, **overrides):
    """The `PolicyLossConfig` of one method's RL run: its `settings` (a `method_settings` result) on the demo's
    shared hyper-parameters (`args`: seed, steps, learning rate, batch shape), ``output_dir`` `run_dir` (nothing is
    saved there), completions of at most `max_new_tokens`, then `overrides`. Built before the warm start, so that any
    value the config refuses stops the demo at once."""
    from ..training.configs import PolicyLossConfig

    # completions per generation batch
    batch = args.prompts_per_generation * args.num_generations
    fields = dict(
        output_dir=str(run_dir), use_cpu=True, report_to="none", disable_tqdm=True, save_strategy="no",
        logging_steps=1, seed=args.seed, data_seed=args.seed, max_steps=args.steps, learning_rate=args.lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        per_device_train_batch_size=batch // args.steps_per_generation, gradient_accumulation_steps=1,
        steps_per_generation=args.steps_per_generation, num_generations=args.num_generations,
        num_iterations=args.num_iterations, max_completion_length=max_new_tokens, temperature=args.temperature,
        top_p=1.0, beta=0.0, loss_type="dapo", **{k: v for k, v in settings.items() if k != "label"},
    )  # fmt: skip
    return PolicyLossConfig(**(fields | overrides))


def lora_config(rank: int):
    """The pretrained model's adapters: LoRA of rank `rank` (alpha 2 rank) on every linear layer."""
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", task_type="CAUSAL_LM")


def train_method(config, label, model_path, train_rows, bar, reward=None, callbacks=(), peft_config=None):
    """Train the model at `model_path` (with `peft_config`'s adapters, if given) with RL on `train_rows` (``prompt``,
    ``answer``) under `config` (a `method_config`), rewarded by `reward` (default `correctness_reward`) with
    `callbacks` added, advancing `bar` once per optimizer step (showing `label`, the reward and the entropy). Returns
    ``(trainer, its log_history without the final train_runtime entry, training seconds)``."""
    from datasets import Dataset
    from transformers import PrinterCallback, ProgressCallback, TrainerCallback, set_seed

    from ..training.trainer import PolicyLossTrainer

    class _Progress(TrainerCallback):
        def on_step_end(self, args_, state, control, **kwargs):
            bar.update(1)

        def on_log(self, args_, state, control, logs=None, **kwargs):
            shown = {key: f"{logs[key]:.2f}" for key in ("reward", "entropy") if (logs or {}).get(key) is not None}
            bar.set_postfix({"method": label, **shown}, refresh=False)

    set_seed(config.seed)
    trainer = PolicyLossTrainer(
        model=str(model_path),
        reward_funcs=reward or correctness_reward,
        args=config,
        train_dataset=Dataset.from_list(train_rows),
        peft_config=peft_config,
    )
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    for callback in (_Progress(), *callbacks):
        trainer.add_callback(callback)
    start = time.time()
    trainer.train()
    seconds = time.time() - start
    history = [dict(entry) for entry in trainer.state.log_history if "train_runtime" not in entry]
    return trainer, history, seconds

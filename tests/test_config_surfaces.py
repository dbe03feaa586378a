"""Every surface that takes our settings refuses the same values: the synchronous config, the asynchronous config
(`AsyncPolicyLossConfig`), a project's own `GRPOConfig` given to a trainer, and a recipe (sync and async), each before
any model loads, naming the field. The checks have one owner each (docs/architecture.md, "Each setting has one
owner"); this file holds every surface to it."""

from __future__ import annotations

import math

import pytest
import torch
from trl import GRPOConfig

from trl_bandpo.cli.recipe import ConfigError, parse_args
from trl_bandpo.core.checks import shown
from trl_bandpo.training.configs import PolicyLossConfig

pytest.importorskip("trl.experimental.async_grpo")

# (field, value, policy_loss that reads the field): a value every config family must refuse.
BAD = [
    ("learning_rate", -1.0, "clip"),
    ("learning_rate", math.nan, "clip"),
    ("learning_rate", [1e-6], "clip"),
    ("max_completion_length", 0, "clip"),
    ("max_completion_length", -5, "clip"),
    ("band_radius", -0.1, "band"),
    ("band_radius", math.nan, "band"),
    ("band_radius", True, "band"),
    ("band_radius", torch.tensor(0.05), "band"),
    ("band_divergence", lambda u: u - 1 - torch.log(u), "band"),
    ("band_divergence", "kullback", "band"),
    ("band_upper_max", 0.5, "band"),
    ("band_solver", "cuda", "band"),
    ("dgpo_n", 0, "dgpo"),
    ("dgpo_n", 1.5, "dgpo"),
    ("dgpo_m", 0.5, "dgpo"),
    ("epsilon", 1.5, "clip"),
    ("epsilon_high", -0.1, "clip"),
    ("delta", 0.5, "clip"),
    ("dppo_ratio_cap", 3.5e38, "dppo_kl"),  # beyond float32: the first loss would overflow
    ("dppo_ratio_cap", 0.5, "dppo_kl"),
    ("dppo_kl_radius", 0.0, "dppo_kl"),
    # issue 33: TRL fields that failed after the model loaded, integers beyond any tensor, finite values beyond
    # float32 or too small to act
    ("temperature", 0.0, "clip"),
    ("temperature", -1.0, "clip"),
    ("per_device_train_batch_size", 0, "clip"),
    ("gradient_accumulation_steps", 0, "clip"),
    ("seed", -1, "clip"),
    ("num_generations", 0, "clip"),
    ("output_dir", "", "clip"),
    ("learning_rate", 10**400, "clip"),
    ("max_steps", 10**400, "clip"),
    ("dgpo_n", 10**400, "dgpo"),
    ("band_radius", 1e-40, "band"),
    ("spo_epsilon", 1e-16, "spo"),
    ("ipo_kl_tau", 3.4e38, "ipo"),
    ("ce_gppo_beta1", 3.5e38, "ce_gppo"),
    ("aspo_c_pos", 3.5e38, "aspo"),
    ("on_nonfinite", "continue", "clip"),
    ("policy_loss", "nope", None),
]
IDS = [f"{field}={shown(value)}"[:40] for field, value, _ in BAD]


def _config(family: str, tmp_path, **fields):
    base = {"output_dir": str(tmp_path), "use_cpu": True, "report_to": "none", **fields}
    if family == "sync":
        return PolicyLossConfig(**base)
    from trl_bandpo.training.async_trainer import AsyncPolicyLossConfig

    return AsyncPolicyLossConfig(**base)


@pytest.mark.parametrize("family", ["sync", "async"])
@pytest.mark.parametrize("field, value, loss", BAD, ids=IDS)
def test_both_config_families_refuse_the_same_values(family, field, value, loss, tmp_path):
    fields = {field: value} if loss is None else {"policy_loss": loss, field: value}
    with pytest.raises(ValueError, match=field):
        _config(family, tmp_path, **fields)


@pytest.mark.parametrize("field, value, loss", [case for case in BAD if case[0] != "policy_loss"], ids=IDS[:-1])
def test_a_project_config_given_to_a_trainer_is_refused_alike(field, value, loss, tmp_path):
    """A plain `GRPOConfig` lacks our fields: the TRL fields it has are checked as ours; our own fields cannot be set
    on it (they take the trainer's defaults), so only the TRL fields are tried here."""
    if field not in GRPOConfig.__dataclass_fields__:
        pytest.skip(f"{field} is no GRPOConfig field")
    from trl_bandpo import BandPOTrainer, DGPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    setattr(args, field, value)
    trainer_class = DGPOTrainer if loss == "dgpo" else BandPOTrainer
    with pytest.raises(ValueError, match=field):
        trainer_class(model="no/model-is-loaded-before-this", reward_funcs=lambda **kwargs: [], args=args)


def _yaml(value) -> str | None:
    """The YAML spelling of a value, or None when a recipe cannot hold it (a function, a tensor)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and math.isnan(value):
        return ".nan"
    if value == "":
        return '""'
    if isinstance(value, (int, float, str, list)):
        return repr(value) if not isinstance(value, str) else value
    return None


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync-recipe", "async-recipe"])
@pytest.mark.parametrize("field, value, loss", BAD, ids=IDS)
def test_recipes_refuse_the_same_values(asynchronous, field, value, loss, tmp_path):
    spelled = _yaml(value)
    if spelled is None:
        pytest.skip("a recipe cannot hold this value")
    lines = ["model_name_or_path: m", "dataset_name: d.jsonl", "use_cpu: true", "bf16: false", f"{field}: {spelled}"]
    if loss is not None:
        lines.append(f"policy_loss: {loss}")
    if asynchronous:
        lines.append("async_rollouts: true")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=field):
        parse_args(["--config", str(recipe)])

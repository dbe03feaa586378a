"""Trainer patchers (Unsloth and the like) that replace TRL's loss path are refused by name, before a model loads.

Unsloth (`import unsloth`, or `PatchFastRL`) compiles a rewrite of `trl.trainer.grpo_trainer.GRPOTrainer`, named
`UnslothGRPOTrainer` (subclass of `_UnslothGRPOTrainer`) in a module of its compile cache, with its own `compute_loss`,
and rebinds `trl.GRPOTrainer`, `trl.trainer.GRPOTrainer` and `trl.trainer.grpo_trainer.GRPOTrainer` to it. Imported
before trl_bandpo, our trainers would subclass that class and its `compute_loss` would never reach our policy loss.
Unsloth needs a GPU, so the subprocess test below rebinds the names the same way with a stand-in class; what runs
under the real Unsloth is not tested here (docs/upgrading-trl.md says so).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types
import warnings

import pytest
from trl import GRPOTrainer

from trl_bandpo import AsyncBandPOTrainer, BandPOConfig, BandPOTrainer, DGPOTrainer
from trl_bandpo.training.trl_patches import LOSS_PATH

# Run in a fresh interpreter: the stand-in rewrite is bound into TRL's namespaces before trl_bandpo is imported.
UNSLOTH_FIRST = textwrap.dedent(
    """
    import sys, types, warnings
    import trl, trl.trainer, trl.trainer.grpo_trainer

    cache = types.ModuleType("unsloth_compiled_cache.UnslothGRPOTrainer")
    cache.GRPOTrainer = trl.trainer.grpo_trainer.GRPOTrainer
    exec(
        "class _UnslothGRPOTrainer(GRPOTrainer):\\n"
        "    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):\\n"
        "        raise AssertionError('the stand-in loss ran')\\n"
        "class UnslothGRPOTrainer(_UnslothGRPOTrainer):\\n"
        "    pass\\n",
        vars(cache),
    )
    sys.modules[cache.__name__] = cache
    sys.modules["unsloth"] = types.ModuleType("unsloth")
    trl.GRPOTrainer = trl.trainer.GRPOTrainer = trl.trainer.grpo_trainer.GRPOTrainer = cache.UnslothGRPOTrainer

    from trl_bandpo import {trainer}
    from trl_bandpo.training.trl_patches import check_trl_base
    try:
        check_trl_base({trainer})
    except TypeError as error:
        print("REFUSED:", error)
    else:
        print("ACCEPTED")
    """
)


@pytest.mark.parametrize("trainer", ["BandPOTrainer", "DGPOTrainer"])
def test_unsloth_imported_first_is_refused_by_name(trainer):
    result = subprocess.run(
        [sys.executable, "-c", UNSLOTH_FIRST.replace("{trainer}", trainer)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    line = result.stdout.strip().splitlines()[-1]
    assert line.startswith("REFUSED:"), result.stdout
    for part in (trainer, "unsloth_compiled_cache.UnslothGRPOTrainer.UnslothGRPOTrainer", "Unsloth", "before"):
        assert part in line, line


def _foreign(name):
    """A function as another library's module would define it."""
    namespace = {"__name__": "some_patcher.fast_grpo"}
    exec(f"def {name}(self, *args, **kwargs):\n    raise AssertionError('patched')", namespace)  # noqa: S102
    return namespace[name]


def _trl_class_defining(trainer, method):
    return next((cls for cls in trainer.__mro__ if cls.__module__.startswith("trl.") and method in vars(cls)), None)


@pytest.mark.parametrize(
    ("trainer", "method"),
    [(t, m) for t in (BandPOTrainer, DGPOTrainer, AsyncBandPOTrainer) for m in LOSS_PATH if _trl_class_defining(t, m)],
)
def test_a_loss_method_replaced_on_trls_class_is_refused_before_the_model_loads(trainer, method, monkeypatch):
    trl_base = _trl_class_defining(trainer, method)
    monkeypatch.setattr(trl_base, method, _foreign(method))
    with pytest.raises(TypeError) as error:  # the model folder does not exist: the check runs before it is read
        trainer(model="/nonexistent/model", args=None)
    message = str(error.value)
    assert f"{trainer.__name__} is built on {trl_base.__module__}.{trl_base.__name__}" in message
    assert f"{method} from some_patcher.fast_grpo" in message


def test_a_users_subclass_may_override_the_loss_path(tiny_model_dir, tmp_path):
    class MyTrainer(BandPOTrainer):
        def compute_loss(self, *args, **kwargs):
            return super().compute_loss(*args, **kwargs)

    def reward(completions, **kwargs):
        return [0.0] * len(completions)

    from datasets import Dataset

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no unsloth: nothing to say
        MyTrainer(
            model=tiny_model_dir, reward_funcs=reward, train_dataset=Dataset.from_dict({"prompt": ["1+1="] * 4}),
            args=BandPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2,
                              max_completion_length=4, report_to=[], use_cpu=True),
        )  # fmt: skip


def test_unsloth_imported_after_us_warns_at_the_users_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "unsloth", types.ModuleType("unsloth"))
    assert GRPOTrainer in BandPOTrainer.__mro__
    with pytest.warns(UserWarning, match="unsloth is imported: BandPOTrainer runs TRL's own") as caught:
        with pytest.raises(ValueError, match="is no folder here"):  # the warning comes first, then the model check
            BandPOTrainer(model="/nonexistent/model")
    assert caught[0].filename == __file__

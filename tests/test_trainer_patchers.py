"""Trainer patchers (Unsloth and the like) that replace TRL's loss path are refused by name, before a model loads.

Unsloth (`import unsloth`, or `PatchFastRL`) compiles a rewrite of `trl.trainer.grpo_trainer.GRPOTrainer`, named
`UnslothGRPOTrainer` (subclass of `_UnslothGRPOTrainer`) in a module of its compile cache, with its own `compute_loss`,
and rebinds `trl.GRPOTrainer`, `trl.trainer.GRPOTrainer` and `trl.trainer.grpo_trainer.GRPOTrainer` to it. Imported
before trl_bandpo, our trainers would subclass that class and its `compute_loss` would never reach our policy loss.
Unsloth needs a GPU, so the subprocess test below rebinds the names the same way with a stand-in class; what runs
under the real Unsloth is not tested here (docs/upgrading-trl.md says so). A patcher that wraps or replaces a method
under TRL's names (`functools.wraps` copies `__module__`, `__qualname__` and `__doc__`) is refused by the code that
runs: each function of its `__wrapped__` chain must have its code in TRL, transformers or trl_bandpo.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import subprocess
import sys
import textwrap
import types
import warnings

import pytest
import trl
from trl import GRPOTrainer
from trl.experimental.async_grpo import AsyncGRPOTrainer
from trl.extras.profiling import profiling_decorator

from trl_bandpo import AsyncBandPOTrainer, BandPOConfig, BandPOTrainer, DGPOTrainer
from trl_bandpo.training import async_trainer
from trl_bandpo.training import trainer as sync_trainer
from trl_bandpo.training.trl_patches import LOSS_PATH, TRLPatchError, check_trl_base, patch_method

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


# -- patchers that keep TRL's names ---------------------------------------------------------------------------------


def _pass_through(method):
    """A patcher's wrapper that only calls TRL's method, under TRL's names."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        return method(*args, **kwargs)

    return wrapper


def _instead(method):
    """A patcher's replacement of TRL's method that never calls it, under TRL's names."""

    @functools.wraps(method)
    def replacement(self, *args, **kwargs):
        raise AssertionError("the patcher's loss ran")

    return replacement


@pytest.mark.parametrize(
    ("trainer", "method"),
    [(t, m) for t in (BandPOTrainer, DGPOTrainer, AsyncBandPOTrainer) for m in LOSS_PATH if _trl_class_defining(t, m)],
)
def test_a_pass_through_wrapper_under_trls_names_is_refused_by_its_code(trainer, method, monkeypatch):
    """Applied after our import (on TRL's class, our trainers already defined): refused when the trainer is built,
    naming the wrapper's own qualname, module and file, though its `__module__` and `__qualname__` are TRL's."""
    trl_base = _trl_class_defining(trainer, method)
    wrapper = _pass_through(getattr(trl_base, method))
    assert wrapper.__module__.startswith("trl.") and wrapper.__qualname__ == f"{trl_base.__name__}.{method}"
    monkeypatch.setattr(trl_base, method, wrapper)
    with pytest.raises(TypeError) as error:
        trainer(model="/nonexistent/model", args=None)
    message = str(error.value)
    assert f"{trainer.__name__} is built on {trl_base.__module__}.{trl_base.__name__}" in message
    assert f"{method} from {__name__} (_pass_through.<locals>.wrapper in {__file__})" in message


def test_a_replacement_inside_trls_own_decorator_is_refused(monkeypatch):
    """TRL's `profiling_decorator` (code in TRL) around a patcher's replacement: every function of the
    `__wrapped__` chain is looked at, not only the outermost."""
    original = inspect.unwrap(GRPOTrainer.compute_loss)
    monkeypatch.setattr(GRPOTrainer, "compute_loss", profiling_decorator(_instead(original)))
    with pytest.raises(TypeError, match=r"compute_loss from .*_instead\.<locals>\.replacement in "):
        check_trl_base(BandPOTrainer)


def test_trls_own_methods_and_ours_are_accepted():
    """The installed TRL (its `profiling_decorator` wrappers included) and our patched methods pass the check."""
    assert inspect.unwrap(GRPOTrainer.compute_loss) is not GRPOTrainer.compute_loss  # TRL wraps it itself
    for trainer in (BandPOTrainer, DGPOTrainer, AsyncBandPOTrainer):
        check_trl_base(trainer)


# Run in a fresh interpreter: the patcher wraps a method of TRL's class in place before trl_bandpo is imported.
PATCHER = """
import functools
from trl.trainer.grpo_trainer import GRPOTrainer

def timed(method):
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        return method(*args, **kwargs)
    return wrapper

GRPOTrainer.{method} = timed(GRPOTrainer.{method})
"""
PATCHER_FIRST = """
import sys
sys.path.insert(0, {folder!r})
import fast_patcher
try:
    from trl_bandpo import BandPOTrainer
    BandPOTrainer(model="/nonexistent/model")
except Exception as error:
    print(f"{{type(error).__name__}}: {{error}}")
"""


@pytest.mark.parametrize("method", ["compute_loss", "_compute_loss"])
def test_a_pass_through_wrapper_imported_before_us_is_refused_naming_it(method, tmp_path):
    """`compute_loss` wrapped: refused when the trainer is built. `_compute_loss` wrapped (the method we patch at
    import): one `TRLPatchError` at import naming the wrapper, not a TRL version problem or a renamed variable."""
    patcher = tmp_path / "fast_patcher.py"
    patcher.write_text(PATCHER.format(method=method))
    script = PATCHER_FIRST.format(folder=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    line = result.stdout.strip().splitlines()[-1]
    wrapper = f"fast_patcher (timed.<locals>.wrapper in {patcher})"
    if method == "compute_loss":
        assert line.startswith("TypeError: BandPOTrainer is built on trl.trainer.grpo_trainer.GRPOTrainer"), line
        assert f"compute_loss from {wrapper}" in line, line
    else:
        assert line.startswith("TRLPatchError: trl-bandpo cannot patch GRPOTrainer._compute_loss of TRL "), line
        patcher_text = "GRPOTrainer._compute_loss is no TRL code but a trainer patcher's replacement or wrapper of it"
        assert f"{patcher_text}, {wrapper}, not a TRL version problem" in line, line
        assert "not tested with" not in line and "did TRL" not in line, line


@pytest.mark.parametrize(
    ("cls", "name", "patches"),
    [(GRPOTrainer, "_compute_loss", sync_trainer.COMPUTE_LOSS_PATCHES),
     (AsyncGRPOTrainer, "compute_loss", async_trainer.COMPUTE_LOSS_PATCHES)],
)  # fmt: skip
def test_patching_a_wrapped_or_rebound_method_names_the_patcher(cls, name, patches, tmp_path, monkeypatch):
    """A pass-through wrapper of the method we patch, a method rebound from a patcher's class onto TRL's, and TRL's
    name rebound to a patcher's class (as Unsloth does): each is one `TRLPatchError` naming the patcher's function,
    its module and file, not a TRL version."""
    path = tmp_path / "fast_grpo.py"
    path.write_text(
        "class FastGRPOTrainer:\n"
        f"    def {name}(self, model, inputs, *args, **kwargs):\n"
        "        return fused_grpo_loss(model, inputs)\n"
    )
    spec = importlib.util.spec_from_file_location("fast_grpo", path)
    spec.loader.exec_module(fast_grpo := importlib.util.module_from_spec(spec))
    rebound = type("FastGRPOTrainer", (cls,), {name: vars(fast_grpo.FastGRPOTrainer)[name]})
    where = f"fast_grpo (FastGRPOTrainer.{name} in {path})"
    cases = [
        (cls, _pass_through(getattr(cls, name)), f"{__name__} (_pass_through.<locals>.wrapper in {__file__})"),
        (cls, vars(fast_grpo.FastGRPOTrainer)[name], where),
        (rebound, None, where),
    ]
    for owner, replacement, origin in cases:
        with monkeypatch.context() as patched:
            if replacement is not None:
                patched.setattr(cls, name, replacement)
            with pytest.raises(TRLPatchError) as error:
                patch_method(owner, name, patches)
        message = str(error.value)
        assert f"trl-bandpo cannot patch {owner.__name__}.{name} of TRL {trl.__version__}: " in message
        assert f"trainer patcher's replacement or wrapper of it, {origin}, not a TRL version problem" in message
        assert "not tested with" not in message

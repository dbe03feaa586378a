"""Our changes to TRL's loss methods are patches applied at import to the installed TRL's source
(`trl_bandpo.training.trl_patches`, docs/upgrading-trl.md): each applies exactly once, the result is readable
(tracebacks, `inspect.getsource`, `trl-bandpo patched-source`), a patch whose target is missing fails at import with
one error naming the TRL version, the method and the patch, and the package carries no passage of TRL's code.
The parity tests (tests/test_trl_parity.py, tests/test_async_trainer.py) check what the patched methods compute."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path

import pytest
import trl
from trl import GRPOTrainer

from trl_bandpo.training import trainer as sync_trainer
from trl_bandpo.training.trl_patches import PATCHED_METHODS, Patch, TRLPatchError, patch_method

REPO = Path(__file__).resolve().parents[1]


def _methods():
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    from trl_bandpo.training import async_trainer

    return [
        (GRPOTrainer, "_compute_loss", sync_trainer.COMPUTE_LOSS_PATCHES),
        (AsyncGRPOTrainer, "compute_loss", async_trainer.COMPUTE_LOSS_PATCHES),
    ]


@pytest.mark.parametrize("index", [0, 1], ids=["GRPOTrainer._compute_loss", "AsyncGRPOTrainer.compute_loss"])
def test_every_patch_applies_once_and_only_our_lines_change(index):
    """The patched method is TRL's: every line of TRL's source outside the statements a patch replaces is there, in
    TRL's order, and each patch's code is in."""
    cls, name, patches = _methods()[index]
    source = textwrap.dedent(inspect.getsource(getattr(cls, name)))
    lines = source.splitlines()
    replaced = set()  # line numbers of the statements a patch replaces (a whole `if` chain for a compound one)
    for node in ast.walk(ast.parse(source)):
        first = " ".join(lines[node.lineno - 1].split()) if isinstance(node, ast.stmt) else ""
        if any(p.where == "replace" and first.startswith(p.target) for p in patches):
            replaced.update(range(node.lineno - 1, node.end_lineno))
    theirs = [lines[i].strip() for i in range(len(lines)) if i not in replaced and lines[i].strip()]
    ours = [line.strip() for line in inspect.getsource(PATCHED_METHODS[f"{cls.__name__}.{name}"]).splitlines()]
    position = 0
    for line in theirs:
        assert line in ours[position:], f"TRL's line is missing or out of order in the patched method: {line}"
        position = ours.index(line, position) + 1
    for patch in patches:
        assert all(line.strip() in ours for line in patch.code.splitlines()), patch.name


def test_the_patched_source_shows_in_tracebacks_and_getsource(monkeypatch):
    """A failure inside the patched `_compute_loss` shows its line; `inspect.getsource` gives the patched text."""
    function = PATCHED_METHODS["GRPOTrainer._compute_loss"]
    source = inspect.getsource(function)
    assert "self._per_token_policy_loss(log_importance_weights, advantages, lower, upper)" in source
    filename = function.__code__.co_filename
    assert filename.startswith(f"<trl-bandpo: GRPOTrainer._compute_loss of TRL {trl.__version__}")

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(sync_trainer.PolicyLossTrainer, "_loss_bounds", stop)
    fake = sync_trainer.PolicyLossTrainer.__new__(sync_trainer.PolicyLossTrainer)
    monkeypatch.setattr(fake, "_get_per_token_logps_and_entropies", stop, raising=False)
    try:
        inputs = dict.fromkeys(("prompt_ids", "prompt_mask", "completion_ids", "completion_mask"))
        function(fake, None, inputs)
    except Exception:  # noqa: BLE001 - whatever it raises first, the traceback must show the patched lines
        shown = traceback.format_exc()
    assert 'File "<trl-bandpo: GRPOTrainer._compute_loss' in shown
    assert "input_ids = torch.cat([prompt_ids, completion_ids], dim=1)" in shown  # the line text, from linecache


def test_the_command_prints_the_patched_methods():
    out = subprocess.run(
        [sys.executable, "-m", "trl_bandpo.cli", "patched-source"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "def _compute_loss(self, model, inputs):" in out.stdout and "def compute_loss(self, model" in out.stdout
    assert "self._per_token_policy_loss(log_importance_weights, advantages, lower, upper)" in out.stdout
    assert "Warning" not in out.stderr, out.stderr  # only the methods: no import notices around them


def test_a_missing_target_fails_at_import_naming_the_version_method_and_patch(tmp_path):
    """TRL's source with one targeted statement edited (as a TRL release might): importing the trainer fails with one
    error naming the TRL version, the method, the patch and docs/upgrading-trl.md; nothing falls back to TRL's
    loss."""
    code = (
        "import inspect\n"
        "original = inspect.getsource\n"
        "def edited(obj):\n"
        "    text = original(obj)\n"
        "    if getattr(obj, '__qualname__', '') == 'GRPOTrainer._compute_loss':\n"
        "        text = text.replace('is_low_clipped =', 'is_low_clip_share =')\n"
        "    return text\n"
        "inspect.getsource = edited\n"
        "from trl_bandpo import BandPOTrainer\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("trl_bandpo.training.trl_patches.TRLPatchError: ")
    assert f"GRPOTrainer._compute_loss of TRL {trl.__version__}" in last
    assert "'low clip ratio'" in last and "0 times" in last and "docs/upgrading-trl.md" in last


def test_a_target_found_twice_or_no_source_is_the_same_error(tmp_path, monkeypatch):
    source = "class Fake:\n    def method(self):\n        x = 1\n        x = 1\n        return x\n"
    (tmp_path / "fake_trl_module.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    import fake_trl_module

    twice = Patch("double", "a test", target="x = 1", code="x = 2")
    with pytest.raises(TRLPatchError, match=r"Fake.method of TRL .*'double'.*found its target 2 times"):
        patch_method(fake_trl_module.Fake, "method", (twice,))
    once = Patch("once", "a test", target="return x", code="return 10 * x")
    assert patch_method(fake_trl_module.Fake, "method", (once,))(None) == 10

    namespace = {"__name__": "fake_trl_module"}
    exec(source, namespace)  # noqa: S102 - a class whose source is nowhere (as a TRL installed without .py files)
    with pytest.raises(TRLPatchError, match="its source is not installed"):
        patch_method(namespace["Fake"], "method", (once,))


def test_the_package_carries_no_passage_of_trls_code():
    """No three consecutive lines of the installed TRL (statements or comments of 20 characters or more) appear
    consecutively in trl_bandpo: what we change in TRL's methods is in patches, not in copies. (Single lines such as
    a method's signature, an API call or a one-line fact may coincide.)"""
    trl_root = Path(trl.__file__).parent

    def runs(path: Path) -> set[tuple[str, ...]]:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines()]
        lines = [line for line in lines if len(line) >= 20]
        return {tuple(lines[i : i + 3]) for i in range(len(lines) - 2)}

    theirs = set().union(*(runs(path) for path in trl_root.rglob("*.py")))
    carried = {
        str(path.relative_to(REPO)): sorted(runs(path) & theirs) for path in (REPO / "trl_bandpo").rglob("*.py")
    }
    carried = {path: found for path, found in carried.items() if found}
    assert not carried, carried

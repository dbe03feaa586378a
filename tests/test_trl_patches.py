"""Our changes to TRL's loss methods are patches applied at import to the installed TRL's source
(`trl_bandpo.training.trl_patches`, docs/upgrading-trl.md): each applies exactly once, the result is readable
(tracebacks, Python's own handler's too, `inspect.getsource`, `trl-bandpo patched-source`), a patch whose target is
missing, or whose code reads a name TRL no longer defines, fails at import with one error naming the TRL version, the
method and the patch, a TRL outside the tested range (pyproject.toml's pin) warns, and the package carries no passage
of TRL's code.
The parity tests (tests/test_trl_parity.py, tests/test_async_trainer.py) check what the patched methods compute."""

from __future__ import annotations

import ast
import inspect
import linecache
import os
import subprocess
import sys
import textwrap
import traceback
import warnings
from pathlib import Path

import pytest
import trl
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from trl import GRPOTrainer

from trl_bandpo.training import trainer as sync_trainer
from trl_bandpo.training import trl_patches
from trl_bandpo.training.trl_patches import PATCHED_METHODS, TESTED_TRL, Patch, TRLPatchError, patch_method

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def patched_dir(tmp_path, monkeypatch):
    """The folder the patched source files are written to in these tests (never the user's cache)."""
    folder = tmp_path / "patched"
    monkeypatch.setenv(trl_patches.PATCHED_DIR_ENV, str(folder))
    return folder


RETURNS_1 = "class Fake:\n    def method(self):\n        return 1\n"


def _fake_class(tmp_path, monkeypatch, module: str, source: str):
    """Class `Fake` of a module `module` whose source is `source` (a stand-in for a TRL class)."""
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module, raising=False)
    return __import__(module).Fake


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
    assert "per_token_loss = self._per_token_policy_loss(\n" in source
    assert "log_importance_weights, advantages, lower, upper, mask, old_per_token_logps\n" in source
    filename = function.__code__.co_filename  # a file in the cache (or, if unwritable, a name linecache knows)
    assert Path(filename).name.startswith(f"GRPOTrainer._compute_loss-trl-{trl.__version__}-") or filename.startswith(
        f"<trl-bandpo: GRPOTrainer._compute_loss of TRL {trl.__version__}"
    )

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
    assert f'File "{filename}"' in shown
    assert "input_ids = torch.cat([prompt_ids, completion_ids], dim=1)" in shown  # the line text, from linecache


def test_the_command_prints_the_patched_methods():
    out = subprocess.run(
        [sys.executable, "-m", "trl_bandpo.cli", "patched-source"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "def _compute_loss(self, model, inputs):" in out.stdout and "def compute_loss(self, model" in out.stdout
    assert "per_token_loss = self._per_token_policy_loss(\n" in out.stdout
    assert "log_importance_weights, advantages, lower, upper, mask, old_per_token_logps\n" in out.stdout
    assert "log_ratio, advantages, lower, upper, None, old_log_probs, segment_id\n" in out.stdout
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


# -- a patch reading a name TRL no longer defines ------------------------------------------------------------------


def test_a_patch_reading_a_renamed_variable_fails_at_import_naming_it(tmp_path, monkeypatch):
    """TRL renames a variable our patch reads, the patch's target still there: one `TRLPatchError` from
    `patch_method`, naming the TRL version, the method, the patch and the name, not a NameError at the first step."""
    source = (
        "import math\n\n\nclass Fake:\n    def method(self, log_ratio, advantages):\n"
        "        ratio = math.exp(log_ratio)  # TRL's `coef_1`, renamed\n"
        "        is_low_clipped = ratio < 0.8\n        return is_low_clipped\n"
    )
    fake = _fake_class(tmp_path, monkeypatch, "fake_trl_renamed", source)
    low = Patch("low clip ratio", "a test", target="is_low_clipped =", code="is_low_clipped = coef_1 < lower")
    bound = Patch("bound", "a test", target="is_low_clipped =", code="lower = abs(advantages) * 0.5", where="before")
    with pytest.raises(TRLPatchError) as error:
        patch_method(fake, "method", (low, bound))
    message = str(error.value)
    assert f"Fake.method of TRL {trl.__version__}" in message and "'low clip ratio'" in message
    assert "'coef_1'" in message and "'lower'" not in message and "docs/upgrading-trl.md" in message
    # what it may read: the method's parameters and variables, another patch's, its module's names, builtins
    fixed = Patch("low clip ratio", "a test", target="is_low_clipped =", code="is_low_clipped = ratio < lower")
    assert patch_method(fake, "method", (fixed, bound))(None, 0.0, -1.0) is False


def test_the_real_patches_read_only_names_the_patched_methods_define(monkeypatch):
    """Every name our patches read exists in the installed TRL's method (re-applied here); a TRL renaming `coef_1`
    fails in `patch_method` naming the patch."""
    monkeypatch.setattr(trl_patches, "PATCHED_METHODS", {})
    for cls, name, patches in _methods():
        patch_method(cls, name, patches)
    original = inspect.getsource

    def renamed(obj):
        return original(obj).replace("coef_1", "ratio")

    monkeypatch.setattr(inspect, "getsource", renamed)
    with pytest.raises(TRLPatchError, match=r"_compute_loss of TRL .*'low clip ratio'.*reads 'coef_1'"):
        patch_method(GRPOTrainer, "_compute_loss", sync_trainer.COMPUTE_LOSS_PATCHES)


# -- the TRL range -------------------------------------------------------------------------------------------------


def test_the_tested_range_is_pyprojects_pin():
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [Requirement(text) for text in dependencies if Requirement(text).name == "trl"]
    assert pin.specifier == SpecifierSet(TESTED_TRL)


@pytest.mark.parametrize("version", ["1.17.0", "1.15.2", "2.0.0", "1.17.0.dev0"])
def test_a_trl_outside_the_tested_range_warns_naming_both(version):
    with pytest.warns(UserWarning) as caught:
        trl_patches.check_trl_version(version)
    assert len(caught) == 1
    assert f"TRL {version} is installed" in str(caught[0].message) and TESTED_TRL in str(caught[0].message)


@pytest.mark.parametrize("version", ["1.16.0", "1.16.3", "1.16.1.dev0"])
def test_a_trl_inside_the_tested_range_does_not_warn(version):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trl_patches.check_trl_version(version)


def test_the_version_warning_comes_once_at_import():
    code = (
        "import warnings, trl\n"
        "trl.__version__ = '1.17.0'\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import trl_bandpo.training.trainer, trl_bandpo.training.async_trainer\n"
        "print(sum('TRL 1.17.0 is installed' in str(w.message) for w in caught))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "1"


# -- the patched source on disk ------------------------------------------------------------------------------------


def test_pythons_own_handler_shows_the_patched_line(patched_dir):
    """An exception escaping the patched `_compute_loss` at one of our lines, printed by the interpreter's default
    handler (which reads source lines from disk, not from `linecache`): the line is shown."""
    code = (
        "import types, torch\n"
        "from trl_bandpo.training import trainer\n"
        "from trl_bandpo.training.trl_patches import PATCHED_METHODS\n"
        "def fail(*args):\n"
        "    raise RuntimeError('stopped')\n"
        "fake = types.SimpleNamespace(\n"
        "    aux_loss_enabled=False, top_entropy_quantile=1.0, _finite_old_logps=fail,\n"
        "    _get_per_token_logps_and_entropies=lambda *a, **k: (torch.zeros(1, 2), torch.zeros(1, 2), None),\n"
        ")\n"
        "ids = torch.zeros(1, 2, dtype=torch.long)\n"
        "inputs = dict(prompt_ids=ids, prompt_mask=ids, completion_ids=ids, completion_mask=ids, "
        "advantages=torch.zeros(1))\n"
        "PATCHED_METHODS['GRPOTrainer._compute_loss'](fake, None, inputs)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "RuntimeError: stopped" in out.stderr, out.stderr[-3000:]
    (path,) = patched_dir.glob(f"GRPOTrainer._compute_loss-trl-{trl.__version__}-*.py")
    assert f'File "{path}", line ' in out.stderr
    assert "    old_per_token_logps = self._finite_old_logps(old_per_token_logps, per_token_logps)\n" in out.stderr


def test_the_source_file_is_checked_and_rewritten_whole(tmp_path, monkeypatch, patched_dir):
    """A file left with other content (a truncated write, an edit) is not trusted: it is rewritten, and no temporary
    file stays behind."""
    fake = _fake_class(tmp_path, monkeypatch, "fake_trl_cached", RETURNS_1)
    patch = Patch("two", "a test", target="return 1", code="return 2")
    path = Path(patch_method(fake, "method", (patch,)).__code__.co_filename)
    assert path.parent == patched_dir and path.name.startswith(f"Fake.method-trl-{trl.__version__}-")
    expected = path.read_text()
    assert expected == "def method(self):\n    return 2\n"
    path.write_text(expected[:10])
    function = patch_method(fake, "method", (patch,))
    assert function.__code__.co_filename == str(path) and path.read_text() == expected and function(None) == 2
    assert os.listdir(patched_dir) == [path.name]


def test_an_unwritable_cache_falls_back_to_linecache(tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(trl_patches.PATCHED_DIR_ENV, str(tmp_path / "a-file" / "patched"))  # cannot be created
    fake = _fake_class(tmp_path, monkeypatch, "fake_trl_readonly", RETURNS_1)
    function = patch_method(fake, "method", (Patch("two", "a test", target="return 1", code="return 2"),))
    assert function(None) == 2
    assert function.__code__.co_filename == f"<trl-bandpo: Fake.method of TRL {trl.__version__}, patched>"
    assert linecache.getline(function.__code__.co_filename, 2) == "    return 2\n"
    assert "return 2" in inspect.getsource(function)

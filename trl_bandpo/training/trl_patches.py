"""TRL methods whose bodies we must change, built at import from the installed TRL's own source plus our patches.

`GRPOTrainer._compute_loss` and `AsyncGRPOTrainer.compute_loss` compute the policy term inline, with no smaller hook.
`patch_method` reads the installed method's source, applies our `Patch`es (each located by the first line of the
statement it acts on, found exactly once) and compiles the result in a copy of TRL's module namespace. Any failure (a
target not found once, no installed source, a name our code reads that the method no longer defines) is a
`TRLPatchError` at import: we never fall back to TRL's loss unchanged. The generated source is written to
`$TRL_BANDPO_PATCHED_DIR` (default `$XDG_CACHE_HOME/trl_bandpo/patched`) so tracebacks and `inspect.getsource` show
it; docs/upgrading-trl.md says what to do when a patch no longer applies.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import hashlib
import inspect
import linecache
import os
import sys
import tempfile
import textwrap
import warnings
from dataclasses import dataclass

import transformers
import trl
from packaging.specifiers import SpecifierSet

#: The TRL releases trl-bandpo is tested with: pyproject.toml's pin (tests/test_trl_patches.py checks they are equal).
TESTED_TRL = ">=1.16.0,<1.17"
#: The folder for the patched methods' source files (default `$XDG_CACHE_HOME/trl_bandpo/patched`).
PATCHED_DIR_ENV = "TRL_BANDPO_PATCHED_DIR"

#: `"Class.method" -> the patched function`, for `trl-bandpo patched-source` and the tests.
PATCHED_METHODS: dict[str, object] = {}
#: The file names the patched methods are compiled under (library code, for warnings that point at the user's line).
PATCHED_FILES: set[str] = set()


class TRLPatchError(ImportError):
    """The installed TRL's method cannot be patched (a target not found exactly once, a name read gone, no source)."""


@dataclass(frozen=True)
class Patch:
    """One change to a TRL method: `name` and `why` (named in errors); `target`, the start of the first line of the
    statement it acts on (spacing ignored; a compound statement's whole chain of branches); `code`, our unindented
    statements ("" deletes the target); `where`: `"replace"` the target, or insert `"before"` / `"after"` it."""

    name: str
    why: str
    target: str
    code: str
    where: str = "replace"


#: The clip-ratio statements of both trainers' loss methods, measured against the bounds in force, not 1 -/+ epsilon.
CLIP_RATIO_PATCHES = tuple(
    Patch(
        f"{side} clip ratio",
        f"the clip ratios are measured against the bounds in force, not 1 {sign} epsilon",
        target=f"is_{side}_clipped =",
        code=f"is_{side}_clipped = (coef_1 {op} torch.as_tensor({bound}, device=coef_1.device)) & (advantages {op} 0)",
    )
    for side, sign, op, bound in (("low", "-", "<", "lower"), ("high", "+", ">", "upper"))
)


def check_trl_version(version: str) -> None:
    """Warn if TRL `version` is outside `TESTED_TRL` (called once, at import, with the installed TRL's)."""
    if not SpecifierSet(TESTED_TRL).contains(version, prereleases=True):
        warnings.warn(
            f"trl-bandpo is tested with TRL {TESTED_TRL}, but TRL {version} is installed: its patched loss methods "
            "may not reproduce TRL's (docs/upgrading-trl.md)",
            stacklevel=2,
        )


check_trl_version(trl.__version__)


#: The methods of TRL's trainers our policy term runs in: a trainer patcher that redefines or wraps one (Unsloth's
#: rewrite of `GRPOTrainer`, whose `compute_loss` computes its own loss) may train without our policy loss. A wrapper
#: that only calls TRL's method is refused too: nothing tells it from one that changes what runs.
LOSS_PATH = ("compute_loss", "_compute_loss", "_get_per_token_logps_and_entropies")
#: The folders of the packages whose code may run on the loss path: ours, TRL's and transformers'.
_LIBRARY_FOLDERS = tuple(
    os.path.dirname(package.__file__) + os.sep for package in (sys.modules["trl_bandpo"], trl, transformers)
)


def _foreign_code(function):
    """The first function of `function`'s `__wrapped__` chain whose code's file is not TRL's, transformers', ours or
    a method we patched (`functools.wraps` copies TRL's names, not its code), or None."""

    def library(function) -> bool:
        filename = getattr(getattr(function, "__code__", None), "co_filename", "")
        return filename.startswith(_LIBRARY_FOLDERS) or filename in PATCHED_FILES

    innermost = inspect.unwrap(function, stop=lambda wrapper: not library(wrapper))
    return None if library(innermost) else innermost


def _origin(function) -> str:
    """Where `function` really comes from: the module whose globals it runs in, its code's own name and file."""
    module = getattr(function, "__globals__", {}).get("__name__", type(function).__module__)
    code = getattr(function, "__code__", None)
    return f"{module} ({getattr(code, 'co_qualname', code.co_name)} in {code.co_filename})" if code else module


def check_trl_base(trainer: type, stacklevel: int = 1) -> None:
    """Refuse `trainer` (one of ours, or a user's subclass) if a loss-path function of its classes from ours down
    runs code that is not TRL's or ours (`_foreign_code`); warn if Unsloth is imported without having replaced them
    (not tested with our trainers). `stacklevel`: the caller's, for the warning."""
    ours = next(i for i, cls in enumerate(trainer.__mro__) if cls.__module__.startswith("trl_bandpo."))
    for base in trainer.__mro__[ours:]:
        found = {name: _foreign_code(vars(base)[name]) for name in LOSS_PATH if name in vars(base)}
        foreign = [f"{name} from {_origin(function)}" for name, function in found.items() if function is not None]
        if foreign or "unsloth" in f"{base.__module__}.{base.__name__}".lower():
            raise TypeError(
                f"{trainer.__name__} is built on {base.__module__}.{base.__name__} "
                f"({', '.join(foreign) or 'a rewrite of TRL'}), not on TRL's own trainer: a trainer patcher such as "
                "Unsloth replaced or wrapped TRL's loss path, so our policy loss may never run. Import trl_bandpo "
                "before the patcher if it rebinds TRL's names (as Unsloth does), else train without it or with its "
                "own trainer."
            )
    if "unsloth" in sys.modules:
        warnings.warn(
            f"unsloth is imported: {trainer.__name__} runs TRL's own GRPOTrainer loss path with our policy loss, but "
            "Unsloth's patches to models and TRL's functions are not tested with trl-bandpo (docs/upgrading-trl.md).",
            stacklevel=stacklevel + 1,
        )


def _normalised(text: str) -> str:
    return " ".join(text.split())


def _statements(tree: ast.AST) -> list[ast.stmt]:
    function = tree.body[0]
    return [node for node in ast.walk(function) if isinstance(node, ast.stmt) and node is not function]


def _bound_names(tree: ast.AST) -> set[str]:
    """The names `tree` binds: parameters, assignment targets, definitions, imports, `except ... as` names."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(getattr(node, "name", None), str):
            names.add((getattr(node, "asname", None) or node.name).split(".")[0])
    return names


def _source_file(label: str, source: str) -> str | None:
    """A file holding `source` (Python's own traceback printer reads lines from disk), written atomically, or None
    if its folder cannot be written."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    folder = os.environ.get(PATCHED_DIR_ENV) or os.path.join(cache, "trl_bandpo", "patched")
    path = os.path.join(folder, f"{label}-{hashlib.sha256(source.encode()).hexdigest()[:12]}.py")
    with contextlib.suppress(OSError, UnicodeDecodeError), open(path, encoding="utf-8", newline="") as file:
        if file.read() == source:
            return path
    try:
        os.makedirs(folder, exist_ok=True)
        descriptor, temporary = tempfile.mkstemp(suffix=".tmp", dir=folder)
    except OSError:
        return None
    try:  # a temporary file renamed once complete: a process killed mid-write leaves no truncated `path`
        with open(descriptor, "w", encoding="utf-8", newline="") as file:
            file.write(source)
        os.replace(temporary, path)
        return path
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        return None


def patch_method(cls: type, name: str, patches: tuple[Patch, ...]):
    """`cls.name` (a TRL method) with `patches` applied, compiled in a copy of its module's namespace."""
    where = f"{cls.__name__}.{name} of TRL {trl.__version__}"
    method = getattr(cls, name)
    help_text = "see docs/upgrading-trl.md (did TRL change it? a TRL version this trl-bandpo was not tested with?)"
    if (foreign := _foreign_code(method)) is not None:  # what we read is a patcher's code, or runs in its namespace
        help_text = (
            f"{cls.__name__}.{name} is no TRL code but a trainer patcher's replacement or wrapper of it, "
            f"{_origin(foreign)}, not a TRL version problem: train without that patcher, or import trl_bandpo "
            "before it if it rebinds TRL's names as Unsloth does (docs/upgrading-trl.md)"
        )
    try:
        source = textwrap.dedent(inspect.getsource(method))
    except (OSError, TypeError) as error:
        raise TRLPatchError(
            f"trl-bandpo cannot patch {where}: its source is not installed ({error}); reinstall TRL from a wheel "
            f"that ships its .py files; {help_text}."
        ) from None
    lines = source.splitlines(keepends=True)
    statements = _statements(ast.parse(source))
    edits = []
    for patch in patches:
        key = _normalised(patch.target)
        found = [node for node in statements if _normalised(lines[node.lineno - 1]).startswith(key)]
        if len(found) != 1:
            raise TRLPatchError(
                f"trl-bandpo cannot patch {where}: patch {patch.name!r} ({patch.why}) found its target "
                f"{len(found)} times instead of once: {patch.target!r}; {help_text}."
            )
        edits.append((found[0], patch))
    for node, patch in sorted(edits, key=lambda edit: edit[0].lineno, reverse=True):
        code = textwrap.indent(textwrap.dedent(patch.code).strip("\n") + "\n", " " * node.col_offset)
        code_lines = code.splitlines(keepends=True) if patch.code.strip() else []
        start, end = node.lineno - 1, node.end_lineno
        start, end = {"before": (start, start), "after": (end, end)}.get(patch.where, (start, end))
        lines[start:end] = code_lines
    patched = "".join(lines)
    namespace = dict(method.__globals__)  # the module that defines it (TRL's, or a patcher's rewrite)
    known = _bound_names(ast.parse(patched)) | namespace.keys() | vars(builtins).keys()
    for patch in patches:
        code = ast.parse(textwrap.dedent(patch.code))
        read = {node.id for node in ast.walk(code) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
        if read - known:
            raise TRLPatchError(
                f"trl-bandpo cannot patch {where}: patch {patch.name!r} ({patch.why}) reads "
                f"{', '.join(map(repr, sorted(read - known)))}, which the patched method does not define; "
                f"{help_text}."
            )
    label = f"{cls.__name__}.{name}-trl-{trl.__version__}"
    filename = _source_file(label, patched) or f"<trl-bandpo: {where}, patched>"
    linecache.cache[filename] = (len(patched), None, patched.splitlines(keepends=True), filename)
    PATCHED_FILES.add(filename)
    exec(compile(patched, filename, "exec"), namespace)  # noqa: S102 - TRL's own source, with our patches
    function = namespace[name]
    PATCHED_METHODS[f"{cls.__name__}.{name}"] = function
    return function

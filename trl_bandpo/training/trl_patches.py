"""TRL methods whose bodies we must change, built at import from the installed TRL's own source plus our patches.

TRL's `GRPOTrainer._compute_loss` and `AsyncGRPOTrainer.compute_loss` compute the policy term inline, with no smaller
hook. This package carries no copy of them: `patch_method` reads the installed method's source (`inspect.getsource`),
applies our `Patch`es, each located by the statement it acts on (the statement whose first line starts with the patch's
key, on the parsed source; each key must be found exactly once), compiles the result in a copy of the namespace of
TRL's module, and returns the function. A patch whose target is not found exactly once, or a TRL installed without its
sources, is one `TRLPatchError` at import naming the TRL version, the method and the patch: we never fall back to
running TRL's loss unchanged.

The generated source is registered with `linecache` under a name like
``<trl-bandpo: GRPOTrainer._compute_loss of TRL 1.16.0, patched>``, so tracebacks, debuggers and `inspect.getsource`
show its lines; `trl-bandpo patched-source` prints each patched method. docs/upgrading-trl.md says what to do when
a patch no longer applies.
"""

from __future__ import annotations

import ast
import inspect
import linecache
import sys
import textwrap
from dataclasses import dataclass

__all__ = ["PATCHED_METHODS", "Patch", "TRLPatchError", "patch_method"]

#: `"Class.method" -> the patched function`, for `trl-bandpo patched-source` and the tests.
PATCHED_METHODS: dict[str, object] = {}


class TRLPatchError(ImportError):
    """The installed TRL's method cannot be patched (a target not found exactly once, or no source)."""


@dataclass(frozen=True)
class Patch:
    """One change to a TRL method.

    Attributes:
        name: what it changes, in a few words (named in errors).
        why: one sentence on why the change is needed.
        target: the start of the first line of the statement it acts on, as TRL writes it, as short as identifies
            it (spacing is ignored): `is_low_clipped =`, or `if self.loss_type == "cispo":` for a compound statement,
            whose whole chain of branches is then the statement.
        code: our statements (unindented), or "" to delete the target.
        where: `"replace"` the target, or insert the code `"before"` / `"after"` it.
    """

    name: str
    why: str
    target: str
    code: str
    where: str = "replace"


def _normalised(text: str) -> str:
    return " ".join(text.split())


def _statements(tree: ast.AST) -> list[ast.stmt]:
    function = tree.body[0]
    return [node for node in ast.walk(function) if isinstance(node, ast.stmt) and node is not function]


def patch_method(cls: type, name: str, patches: tuple[Patch, ...]):
    """`cls.name` (a TRL method) with `patches` applied, compiled in a copy of its module's namespace."""
    import trl

    where = f"{cls.__name__}.{name} of TRL {trl.__version__}"
    help_text = "see docs/upgrading-trl.md (a TRL version this trl-bandpo was not tested with?)"
    try:
        source = textwrap.dedent(inspect.getsource(getattr(cls, name)))
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
        if patch.where == "before":
            end = start
        elif patch.where == "after":
            start = end
        lines[start:end] = code_lines
    patched = "".join(lines)
    filename = f"<trl-bandpo: {where}, patched>"
    linecache.cache[filename] = (len(patched), None, patched.splitlines(keepends=True), filename)
    namespace = dict(vars(sys.modules[cls.__module__]))
    exec(compile(patched, filename, "exec"), namespace)  # noqa: S102 - TRL's own source, with our patches
    function = namespace[name]
    PATCHED_METHODS[f"{cls.__name__}.{name}"] = function
    return function

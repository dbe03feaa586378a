"""The package's structure (docs/architecture.md): imports flow one way, no cycles (lazy imports included), one
concern per module, a light core, and the README's set-up commands."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "trl_bandpo"

# Layer of each folder (the first part of a module's dotted name below `trl_bandpo`): a module may import only its own
# layer or lower ones. The package root (`trl_bandpo/__init__.py`) is the public surface and may import anything.
LAYERS = {
    "version": 0,
    "core": 0,
    "kernels": 1,
    "training": 2,
    "scoring": 3,
    "data": 4,
    "evaluation": 5,
    "demo": 6,
    "cli": 7,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def resolve(current: str, is_package: bool, node: ast.ImportFrom | ast.Import) -> list[str]:
    """Package-relative names (`""` = the root) that an import statement pulls in."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names if a.name.split(".")[0] == "trl_bandpo"]
        return [name.removeprefix("trl_bandpo").lstrip(".") for name in names]
    if node.level == 0:
        if not (node.module or "").startswith("trl_bandpo"):
            return []
        base = node.module.removeprefix("trl_bandpo").lstrip(".")
    else:
        parts = current.split(".") if current else []
        if not is_package:
            parts = parts[:-1]
        parts = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
        base = ".".join([*parts, *([node.module] if node.module else [])])
    names = [base]
    known = modules()
    for alias in node.names:  # `from . import kernels` imports the submodule `kernels`
        candidate = f"{base}.{alias.name}" if base else alias.name
        if candidate in known:
            names.append(candidate)
    return names


def import_graph() -> dict[str, set[str]]:
    known = modules()
    graph = {}
    for name, path in known.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges = set()
        for node in ast.walk(tree):  # every import, at module level or inside functions (lazy)
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in resolve(name, path.name == "__init__.py", node):
                    while target and target not in known:  # `from .x import name` where x is a module
                        target = target.rpartition(".")[0]
                    if target != name:
                        edges.add(target)
        graph[name] = edges
    return graph


def layer(name: str) -> int | None:
    top = name.split(".")[0]
    return LAYERS.get(top)


def test_every_module_has_a_layer():
    missing = [name for name in modules() if name and layer(name) is None]
    assert not missing, f"modules without a layer in LAYERS (add them, and to docs/architecture.md): {missing}"


def test_imports_flow_one_way():
    graph = import_graph()
    upward = []
    for source, targets in graph.items():
        if not source:
            continue  # the package root re-exports
        for target in targets:
            if not target:
                upward.append(f"{source} imports the package root")
            elif layer(target) > layer(source):
                upward.append(f"{source} (layer {layer(source)}) imports {target} (layer {layer(target)})")
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    graph = import_graph()
    state, stack, cycles = {}, [], []

    def visit(node):
        state[node] = "active"
        stack.append(node)
        for target in graph.get(node, ()):
            if state.get(target) == "active":
                cycles.append(stack[stack.index(target) :] + [target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[node] = "done"

    for node in graph:
        if node not in state:
            visit(node)
    assert not cycles, f"import cycles: {cycles}"


def test_import_graph_sees_lazy_and_relative_imports():
    """The checker itself: it must see a lazy import inside a function and `from . import x`."""
    graph = import_graph()
    assert "kernels" in graph[""]  # `from . import kernels` in __init__
    assert "kernels.band_kl" in graph["kernels"]  # imported inside a function
    assert "core.band" in graph["kernels.band_kl"]


def test_light_core_imports():
    """`import trl_bandpo` and the trainers load neither matplotlib nor math-verify (nor its LaTeX parser)."""
    code = (
        "import sys\n"
        "import trl_bandpo\n"
        "from trl_bandpo import BandPOTrainer, DGPOTrainer, BandPOConfig\n"
        "import trl_bandpo.scoring.rewards, trl_bandpo.data, trl_bandpo.evaluation, trl_bandpo.demo\n"
        "heavy = [m for m in ('matplotlib', 'math_verify', 'latex2sympy2_extended') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "", f"imported at import time: {out.stdout.strip()}"


def test_no_reference_to_files_outside_the_repository():
    """Code, tests and docs never cite the internal brief or anything outside the repository."""
    offenders = []
    for path in [*REPO.glob("trl_bandpo/**/*.py"), *REPO.glob("tests/**/*.py"), *REPO.glob("docs/*.md"),
                 *REPO.glob("*.md"), *REPO.glob("recipes/**/*"), *REPO.glob("benchmarks/*"),
                 *REPO.glob("notebooks/*.ipynb")]:  # fmt: skip
        if path.is_file() and path != Path(__file__).resolve():
            text = path.read_text(errors="replace")
            if "SPEC" in text.replace("SPECIAL", "") or "../shared" in text:
                offenders.append(str(path.relative_to(REPO)))
    assert not offenders, offenders


def test_ruff_is_clean():
    """The lint and format configuration in pyproject.toml holds for the whole repository."""
    ruff = Path(sys.executable).parent / "ruff"
    if not ruff.exists():
        if os.environ.get("CI"):  # the README's test command installs the dev extra: CI must run the linter
            pytest.fail("ruff is not installed in CI: the dev extra should have installed it")
        pytest.skip("ruff is not installed (it comes with the dev extra)")
    out = subprocess.run([str(ruff), "check", "--no-cache", str(REPO)], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stdout[-4000:]
    # formatting too: `ruff format .` from the repository root fixes what this reports
    out = subprocess.run([str(ruff), "format", "--check", str(REPO)], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stdout[-4000:]

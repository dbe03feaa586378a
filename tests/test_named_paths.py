"""Every `trl_bandpo.…` dotted path that README.md, docs/, recipes/ and the notebooks show a user imports, and every
name their `from trl_bandpo… import …` lines import exists (a module moved or a name removed fails here, not in a
user's notebook)."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = [
    REPO / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
    *sorted((REPO / "recipes").rglob("*.yaml")),
    *sorted((REPO / "recipes").rglob("*.md")),
    *sorted((REPO / "notebooks").glob("*.ipynb")),
]
DOTTED = re.compile(r"\btrl_bandpo(?:\.[A-Za-z_]\w*)+")
FROM_IMPORT = re.compile(r"^\s*from\s+(trl_bandpo(?:\.\w+)*)\s+import\s+(\([^)]*\)|[^\n#]+)", re.MULTILINE)


def text_of(source: Path) -> str:
    """A page's text; a notebook's code and markdown cells joined."""
    if source.suffix == ".ipynb":
        return "\n".join("".join(cell["source"]) for cell in json.loads(source.read_text())["cells"])
    return source.read_text()


def named_paths(text: str) -> set[str]:
    """Dotted paths written out, plus `module.name` for each name of a `from module import a, b as c` line."""
    paths = set(DOTTED.findall(text))
    for module, names in FROM_IMPORT.findall(text):
        for name in names.strip("()").replace("\n", " ").split(","):
            name = name.split(" as ")[0].strip()
            if name:
                paths.add(f"{module}.{name}")
    return paths


def resolve(dotted: str):
    """Imports the longest module prefix of `dotted`, then gets the remaining parts as attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as error:
            if error.name is None or not ".".join(parts[:cut]).startswith(error.name):
                raise  # a module that exists but fails to import is a failure, not a shorter prefix
            continue
        for attribute in parts[cut:]:
            obj = getattr(obj, attribute)
        return obj
    raise ModuleNotFoundError(dotted)


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_named_trl_bandpo_path_imports(source):
    missing = []
    for dotted in sorted(named_paths(text_of(source))):
        try:
            resolve(dotted)
        except (ImportError, AttributeError) as error:
            missing.append(f"{dotted} ({type(error).__name__}: {error})")
    assert not missing, f"{source.relative_to(REPO)} names paths that do not import: {missing}"


def test_the_sources_name_paths_at_all():
    """The scan finds what the pages show (an empty scan would pass everything)."""
    everything = set().union(*(named_paths(text_of(source)) for source in SOURCES))
    for expected in ("trl_bandpo.BandPOTrainer", "trl_bandpo.cli.train", "trl_bandpo.evaluation.EvalSettings"):
        assert expected in everything


def test_the_checker_can_fail():
    text = "from trl_bandpo import BandPOTrainer, NoSuchTrainer as X\nsee `trl_bandpo.core.no_such_module.f`"
    assert named_paths(text) == {
        "trl_bandpo.BandPOTrainer",
        "trl_bandpo.NoSuchTrainer",
        "trl_bandpo.core.no_such_module.f",
    }
    resolve("trl_bandpo.BandPOTrainer")
    with pytest.raises(AttributeError):
        resolve("trl_bandpo.NoSuchTrainer")
    with pytest.raises(AttributeError):
        resolve("trl_bandpo.core.no_such_module.f")


TEST_FILE = re.compile(r"\btests/[\w/]+\.py\b")


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_named_test_file_exists(source):
    missing = sorted({name for name in TEST_FILE.findall(text_of(source)) if not (REPO / name).is_file()})
    assert not missing, f"{source.relative_to(REPO)} names test files that do not exist: {missing}"


def test_the_signature_check_is_where_upgrading_trl_says():
    """docs/upgrading-trl.md names the test that compares our constructors with GRPOTrainer's: that file does."""
    row = next(
        line for line in text_of(REPO / "docs" / "upgrading-trl.md").splitlines() if "compares the signatures" in line
    )
    named = TEST_FILE.findall(row)
    assert named, row
    for name in named:
        text = (REPO / name).read_text()
        assert "inspect.signature" in text and "GRPOTrainer" in text, name

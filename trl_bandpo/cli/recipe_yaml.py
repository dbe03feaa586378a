"""Reading a recipe file: YAML whose duplicate keys are errors and whose syntax errors come with a hint.

PyYAML keeps the last of two equal keys without a word; a recipe that sets `learning_rate` twice would silently train
with the second value, so `read_recipe_yaml` rejects it, naming the key and both lines.
"""

from __future__ import annotations

import os
import re

import yaml

from .errors import ConfigError

__all__ = ["read_recipe_yaml", "syntax_hints"]

_MERGE_TAG = "tag:yaml.org,2002:merge"
# `key:value` (no space after the colon; a URL-like `key://...` is left alone).
_MISSING_SPACE = re.compile(r"^\s*(?:-\s+)?([A-Za-z_][\w.-]*):(?![\s/])(\S.*)$")
# `--key value` / `--key=value` / `-k value`: command-line syntax written in the file.
_FLAG_SYNTAX = re.compile(r"^\s*(--?[A-Za-z_][\w-]*)(?:[ =](.*))?$")
_GENERAL_HINT = (
    "A recipe is a YAML mapping with one `key: value` per line: a space after the colon, spaces (never tabs) for "
    "indentation, lists as `[a, b]`, no command-line flags (`--key value`)."
)


class _DuplicateKeyError(yaml.MarkedYAMLError):
    """A mapping that repeats a key (PyYAML would keep the last value)."""

    def __init__(self, key, first_line: int, node: yaml.Node):
        super().__init__(problem=f"duplicate key {key!r}", problem_mark=node.start_mark)
        self.key, self.first_line, self.line = key, first_line, node.start_mark.line + 1


class _RecipeLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` whose mappings reject a repeated key (at any depth; `<<` merge keys may override)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE_TAG:
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node.start_mark.line + 1)
                except TypeError:  # an unhashable key: SafeLoader reports it itself
                    continue
                if first != key_node.start_mark.line + 1:
                    raise _DuplicateKeyError(key, first, key_node)
        return super().construct_mapping(node, deep=deep)


def syntax_hints(text: str) -> list[str]:
    """Likely causes of a YAML syntax error (or of a recipe that is no mapping), one line each, with line numbers:
    tabs, ``key:value`` without the space, ``--key value`` command-line syntax."""
    hints = []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.split(" #", 1)[0].rstrip()
        if not stripped or stripped.lstrip().startswith("#"):
            continue
        if "\t" in line[: len(line) - len(line.lstrip())]:
            hints.append(f"line {number} is indented with a tab: YAML indentation takes spaces only.")
        elif flag := _FLAG_SYNTAX.match(stripped):
            name = flag.group(1).lstrip("-").replace("-", "_")
            value = (flag.group(2) or "").strip() or "<value>"
            hints.append(
                f"line {number} `{stripped.strip()}` is command-line syntax: in a recipe write `{name}: {value}`."
            )
        elif missing := _MISSING_SPACE.match(stripped):
            hints.append(
                f"line {number} `{stripped.strip()}` has no space after the colon: write "
                f"`{missing.group(1)}: {missing.group(2)}`."
            )
    return hints


def _with_hints(message: str, text: str) -> str:
    hints = syntax_hints(text)
    lines = [message, *(f"Hint: {hint}" for hint in hints), _GENERAL_HINT if not hints else ""]
    return "\n".join(line for line in lines if line)


def read_recipe_yaml(path: str | os.PathLike):
    """The parsed content of a recipe file (None when empty), with duplicate keys and syntax errors as `ConfigError`.

    Args:
        path: the recipe.

    Raises:
        ConfigError: for an unreadable file, a YAML syntax error (with the file, the line and a hint at the likely
            cause), a key repeated in one mapping (naming the key and both lines), or content that is no mapping.
    """
    where = repr(os.fspath(path))
    try:
        with open(path) as handle:
            text = handle.read()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read recipe {where}: {err}") from None
    loader = _RecipeLoader(text)
    loader.name = os.fspath(path)  # error marks name the file, not "<unicode string>"
    try:
        recipe = loader.get_single_data()
    except _DuplicateKeyError as err:
        raise ConfigError(
            f"duplicate key {err.key!r} in recipe {where} (lines {err.first_line} and {err.line}): YAML would keep "
            "only the last value silently. Keep one of them."
        ) from None
    except yaml.YAMLError as err:
        raise ConfigError(_with_hints(f"recipe {where} is not valid YAML: {err}", text)) from None
    finally:
        loader.dispose()
    if recipe is not None and not isinstance(recipe, dict):
        raise ConfigError(_with_hints(f"recipe {where} must be a YAML mapping of field: value.", text))
    return recipe

r"""Final answers of math completions: extraction of the last ``\boxed{...}`` and cheap normalisation.

Pure Python, linear time, no `math_verify`: what the rewards (`trl_bandpo.rewards`) and the dataset loaders
(`trl_bandpo.data`) need before any symbolic comparison.

* `completion_text` and `extract_boxed_answer` read the answer: the argument of the *last* ``\boxed{...}``
  (or ``\fbox{...}``, or ``\boxed 42``) of a completion.
* `is_admissible` rejects answers not worth verifying: empty, longer than `MAX_ANSWER_CHARS`, or nested deeper
  than `MAX_BRACE_DEPTH` braces.
* `canonical_text` is a light LaTeX normal form (``\dfrac``/``\text{}``/spacing/``$``, leading zeros of integers,
  case): answers with equal normal forms are equal without any sympy work.
* `gold_alternatives` turns a ground truth (string, number, list of alternatives, worked solution) into LaTeX
  strings.
"""

from __future__ import annotations

import math
import re
from typing import Any

__all__ = [
    "MAX_ANSWER_CHARS",
    "MAX_BRACE_DEPTH",
    "brace_depth",
    "canonical_text",
    "completion_text",
    "extract_boxed_answer",
    "gold_alternatives",
    "is_admissible",
]

MAX_ANSWER_CHARS = 1000  # longest boxed answer we try to verify (real answers are well under 300 characters)
MAX_BRACE_DEPTH = 16  # deepest brace nesting we try to verify (\frac{\sqrt{..}}{..} is depth 2)

_BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def completion_text(completion: Any) -> str:
    """The text of one completion: a string, or a conversation ``[{"role": ..., "content": ...}, ...]`` (last message).

    Content given as a list of parts (``[{"type": "text", "text": ...}]``) is joined; anything else gives ``""``.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    if isinstance(completion, (list, tuple)) and completion:
        message = completion[-1]
        content = message.get("content") if isinstance(message, dict) else message
        if isinstance(content, str):
            return content
        if isinstance(content, (list, tuple)):
            parts = [p.get("text", "") if isinstance(p, dict) else p for p in content]
            return "".join(p for p in parts if isinstance(p, str))
    return ""


def _braced_argument(text: str, open_pos: int) -> str | None:
    """Content of the brace group opening at ``text[open_pos] == "{"``; None when it never closes."""
    depth = 0
    i = open_pos
    n = len(text)
    while i < n:
        char = text[i]
        if char == "\\":  # an escaped character (\{, \}, \\) never opens or closes a group
            i += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[open_pos + 1 : i]
        i += 1
    return None


def extract_boxed_answer(text: Any) -> str | None:
    r"""The argument of the last ``\boxed``/``\fbox`` in ``text``, or None when there is none or it is malformed.

    Handles nested braces (``\boxed{\frac{1}{2}}`` -> ``\frac{1}{2}``), escaped braces, and the brace-less form
    ``\boxed 42`` (argument up to the next whitespace or ``$``). A last box that never closes (a truncated
    completion) gives None: the answer is incomplete, earlier boxes are not used instead.
    """
    if not isinstance(text, str):
        return None
    last = None
    for match in _BOX_COMMAND.finditer(text):
        last = match
    if last is None:
        return None
    pos = last.end()
    n = len(text)
    while pos < n and text[pos] in " \t":
        pos += 1
    if pos < n and text[pos] == "{":
        return _braced_argument(text, pos)
    if pos > last.end():  # "\boxed 42": the command takes one space-delimited token
        token = re.match(r"[^\s$]+", text[pos : pos + MAX_ANSWER_CHARS + 1])
        return token.group(0) if token else None
    return None


def brace_depth(text: str) -> int:
    """Deepest nesting of unescaped braces in ``text``."""
    depth = deepest = 0
    i = 0
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if char == "{":
            depth += 1
            deepest = max(deepest, depth)
        elif char == "}":
            depth -= 1
        i += 1
    return deepest


def is_admissible(answer: str | None) -> bool:
    """Whether an extracted answer is worth verifying (non-empty, within the length and nesting caps)."""
    return (
        answer is not None
        and bool(answer.strip())
        and len(answer) <= MAX_ANSWER_CHARS
        and brace_depth(answer) <= MAX_BRACE_DEPTH
    )


_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mathit|mbox|operatorname)\s*\{([^{}]*)\}")
_IGNORABLE = re.compile(r"\\left(?![a-zA-Z])|\\right(?![a-zA-Z])|\\[,;:! ]|\\(?:quad|qquad)(?![a-zA-Z])|\s+|\$")


def canonical_text(answer: str) -> str:
    r"""A light normal form for the pure-string check: equal normal forms imply equal answers.

    Drops ``$``, spacing commands, whitespace, ``\left``/``\right``; unwraps ``\text{..}``-like commands; maps
    ``\dfrac``/``\tfrac`` to ``\frac``; lowercases; strips a trailing period; and writes integers without leading
    zeros (``007`` -> ``7``).
    """
    text = _TEXT_WRAPPER.sub(r"\1", answer)
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = _IGNORABLE.sub("", text).rstrip(".").lower()
    if re.fullmatch(r"[+-]?\d{1,1000}", text):
        sign = "-" if text.startswith("-") else ""
        digits = text.lstrip("+-").lstrip("0") or "0"
        text = ("" if digits == "0" else sign) + digits
    return text


def gold_alternatives(solution: Any) -> list[str]:
    r"""Ground-truth answer(s) as LaTeX strings: numbers are formatted, lists are alternatives, ``$`` are dropped.

    A gold answer that contains ``\boxed{..}`` (a full worked solution) is reduced to its last boxed argument.
    """
    if solution is None or isinstance(solution, bool):
        return []
    if isinstance(solution, (list, tuple)):
        return [alt for item in solution for alt in gold_alternatives(item)]
    if isinstance(solution, float):
        if not math.isfinite(solution):
            return []
        text = repr(int(solution)) if solution.is_integer() else repr(solution)
    elif isinstance(solution, int):
        text = str(solution)
    elif isinstance(solution, str):
        text = solution
    else:
        return []
    if _BOX_COMMAND.search(text):
        text = extract_boxed_answer(text) or ""
    text = re.sub(r"(?<!\\)\$", "", text).strip()
    return [text] if text else []

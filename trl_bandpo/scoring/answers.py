r"""Final answers of math completions: extraction of the last ``\boxed{...}`` and cheap normalisation.

Pure Python, linear time, no `math_verify`: what the rewards (`trl_bandpo.scoring.rewards`), the scorers and the
dataset loaders (`trl_bandpo.data`) need before any symbolic comparison. `extract_boxed_answer` reads the answer,
`is_admissible` rejects answers not worth verifying, `canonical_text` is the normal form of the pure-string check,
`plain_text` / `answer_form` / `gold_forms` write answers in the spelling `math_verify` reads (docs/evaluation.md,
"Other spellings of an answer"), and `gold_alternatives` turns a ground truth into strings.
"""

from __future__ import annotations

import decimal
import functools
import logging
import math
import numbers
import re
import unicodedata
from collections.abc import Sequence
from typing import Any

MAX_ANSWER_CHARS = 1000  # longest boxed answer we try to verify (real answers are well under 300 characters)
MAX_BRACE_DEPTH = 16  # deepest brace nesting we try to verify (\frac{\sqrt{..}}{..} is depth 2)
MAX_GOLD_DIGITS = 20_000  # longest integer ground truth we write out (a longer one has no usable gold answer)
MAX_GOLD_CHARS = 20_000  # longest ground-truth string we read (a longer one is not read: every answer is wrong)

_BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_BARE_ARGUMENT = re.compile(r"[^\s$]*")  # the argument of "\boxed 42"


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


def _braces(text: str, start: int = 0):
    """(position, depth after it) of each unescaped brace from `start` (``\\{``, ``\\}``, ``\\\\`` are escapes)."""
    depth, i = 0, start
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 1
        elif char in "{}":
            depth += 1 if char == "{" else -1
            yield i, depth
        i += 1


def _braced_argument(text: str, open_pos: int) -> str | None:
    """Content of the brace group opening at ``text[open_pos] == "{"``; None when it never closes."""
    return next((text[open_pos + 1 : i] for i, depth in _braces(text, open_pos) if depth == 0), None)


def contains_box(text: str) -> bool:
    r"""Whether `text` has a ``\boxed`` or ``\fbox`` command (closed, empty or not)."""
    return _BOX_COMMAND.search(text) is not None


def extract_boxed_answer(text: Any) -> str | None:
    r"""The argument of the last outermost ``\boxed``/``\fbox`` in ``text``; None without one, or for a malformed one.

    Handles nested braces (``\boxed{\frac{1}{2}}`` -> ``\frac{1}{2}``), escaped braces, and the brace-less form
    ``\boxed 42`` (argument up to the next whitespace or ``$``). A box inside a box is part of the outer box's
    argument: ``\boxed{\boxed{2}+1}`` gives ``\boxed{2}+1`` (see `unwrap_boxes`), not ``2``. A last box that never
    closes (a truncated completion) gives None: the answer is incomplete, earlier boxes are not used instead.
    Linear time: each box is scanned once, and the search goes on after its end.
    """
    if not isinstance(text, str):
        return None
    answer, pos, n = None, 0, len(text)
    while True:
        command = _BOX_COMMAND.search(text, pos)
        if command is None:
            return answer
        pos = command.end()
        while pos < n and text[pos] in " \t":
            pos += 1
        if pos < n and text[pos] == "{":
            answer = _braced_argument(text, pos)
            if answer is None:  # never closes: everything after it is inside this unfinished box
                return None
            pos += len(answer) + 2
        elif pos > command.end():  # "\boxed 42": the command takes one space-delimited token
            token = _BARE_ARGUMENT.match(text, pos).group(0)
            answer = token or None
            pos += len(token)
        else:
            answer = None  # "\boxed" followed by anything else: no argument


def unwrap_boxes(answer: str) -> str:
    r"""`answer` without the ``\boxed``/``\fbox`` commands inside it: ``\boxed{2}+1`` -> ``{2}+1``.

    A box inside the answer is a wrapper, not a value: the command goes and its argument stays, as a brace group (a
    group does not change what `math_verify` or the strict grader read: ``{2}+1`` is 3, ``{a+b}^2`` stays a square).
    """
    return re.sub(r"\\(?:boxed|fbox)(?![A-Za-z])[ \t]*", "", answer) if "box" in answer else answer


def brace_depth(text: str) -> int:
    """Deepest nesting of unescaped braces in ``text``."""
    return max([0, *(depth for _, depth in _braces(text))])


def is_admissible(answer: str | None) -> bool:
    """Whether an extracted answer is worth verifying (non-empty, within the length and nesting caps)."""
    return (
        answer is not None
        and bool(answer.strip())
        and len(answer) <= MAX_ANSWER_CHARS
        and brace_depth(answer) <= MAX_BRACE_DEPTH
    )


# Tokens of the normal form: a text-like command with its braced argument (one token, kept verbatim: spaces inside
# text are meaningful), a control word, a control symbol (``\,``, ``\{``, ``\ ``), a run of whitespace, one character.
_TEXT_COMMAND = re.compile(r"\\(?:text[a-z]*|[mh]box|math(?:rm|bf|it|sf|tt)|operatorname)\s*(?=\{)")
_TOKEN = re.compile(r"\\[A-Za-z]+|\\.|\s+|.", re.DOTALL)
# Characters (and control symbols) next to which whitespace does not change what math_verify reads (checked in the
# tests). Not the comma (``1, 000`` is a pair, ``1,000`` a thousand), the period, letters or digits (``1 2``, ``12``).
_SPACE_NEUTRAL = frozenset("+-*/=<>()[]{}^_|") | {"\\{", "\\}", "\\|"}
_DELIMITERS = frozenset("()[]|") | {"\\{", "\\}", "\\|"}  # what \left and \right may be dropped before
_SAME_COMMAND = {"\\dfrac": "\\frac", "\\tfrac": "\\frac"}


def canonical_text(answer: str) -> str:
    r"""A conservative normal form for the pure-string check: equal normal forms are equal answers for `math_verify`.

    It is the shortcut that accepts an answer without `math_verify`, so it only performs rewrites checked not to change
    a verdict (false positives are the worst error of a reward: the policy learns to produce them). It drops
    unescaped ``$``; writes ``\dfrac``/``\tfrac`` as ``\frac``; drops ``\left``/``\right`` before a bracket or bar;
    drops whitespace next to an operator or bracket (``+ - * / = < > ( ) [ ] { } ^ _ |``) or before a command, and
    collapses the rest to one space (``1 2`` stays apart from ``12``, ``\pi r`` from ``\pir``); and writes an integer
    without leading zeros or ``+`` sign (``007`` -> ``7``, ``-0`` -> ``0``). Case, commas, periods, spacing commands
    (``\,``, ``\;``) and the insides of ``\text{..}``-like commands are kept as they are: `math_verify` reads
    ``\Alpha`` and ``\alpha``, ``1, 000`` and ``1,000``, ``7.`` and ``7``, ``\text{pi}`` and ``pi`` differently.
    Each rule is checked against `math_verify` by ``tests/test_rewards_normal_form.py``.
    """
    tokens = [_SAME_COMMAND.get(t, t) for t in _tokens(answer) if t != "$"]
    kept: list[str] = []
    for token in reversed(tokens):  # backwards: the token after a \left is known when it is reached
        if token in ("\\left", "\\right"):
            following = next((t for t in reversed(kept) if not t.isspace()), "")
            if following in _DELIMITERS:
                continue
        kept.append(token)
    kept.reverse()
    out: list[str] = []
    for i, token in enumerate(kept):
        if token.isspace():
            before = out[-1] if out else ""
            after = kept[i + 1] if i + 1 < len(kept) else ""
            neutral = before in _SPACE_NEUTRAL or after in _SPACE_NEUTRAL or after.startswith("\\")
            if neutral or not before or not after or after.isspace():
                continue
            token = " "
        out.append(token)
    text = "".join(out)
    if re.fullmatch(r"[+-]?\d+", text):
        digits = text.lstrip("+-").lstrip("0") or "0"
        text = ("-" if text.startswith("-") and digits != "0" else "") + digits
    return text


def _tokens(text: str) -> list[str]:
    tokens, pos = [], 0
    while pos < len(text):
        command = _TEXT_COMMAND.match(text, pos) if text[pos] == "\\" else None
        argument = _braced_argument(text, command.end()) if command else None
        end = command.end() + len(argument) + 2 if argument is not None else _TOKEN.match(text, pos).end()
        tokens.append(text[pos:end])
        pos = end
    return tokens


# Invisible characters `plain_text` drops (soft hyphen, zero-width spaces and joiners, direction marks, variation
# selectors, byte-order mark, tag characters, ...). Not U+2061-U+2064 (invisible times, plus, ...): each stands for an
# operator, and dropping it would join ``2\u20623`` (2 times 3) into ``23``.
_INVISIBLE = re.compile(
    "[\u00ad\u034f\u061c\u180e\u200b-\u200f\u202a-\u202e\u2060\u2066-\u206f\ufe00-\ufe0f\ufeff"
    "\U000e0001\U000e0020-\U000e007f\U000e0100-\U000e01ef]"
)
_MISREAD_BY_NFKC = ("<super>", "<sub>", "<fraction>")  # compatibility mappings that change what a character means
_GROUP_BEFORE = re.compile(r"(?:[\^_]|\\[A-Za-z]+)\s*$")  # a fraction here must be one group: 2^{\frac{1}{2}}
# A whole answer that is a number written in groups of three digits, one separator throughout: ``1 000``,
# ``-12\,345.5``; ``1 2``, ``1, 000`` (a pair) and ``1,000`` (`math_verify` reads it as 1000 already) do not match.
_DIGIT_GROUPS = re.compile(r"(?:[+\-\u2212] ?)?[0-9]{1,3}( |\\[,:; ]|~)[0-9]{3}(?:\1[0-9]{3})*(?:\.[0-9]+)?")


@functools.lru_cache(maxsize=4096)
def _misread_by_nfkc(char: str) -> bool:
    """Whether NFKC changes what `char` means: a superscript or subscript (``2³`` would read ``23``), a vulgar
    fraction (``3½`` would read ``31⁄2``), a Roman numeral (``Ⅻ`` would read ``XII``, letters), or a character whose
    compatibility form contains one (``㎡`` would read ``m2``)."""
    decomposition = unicodedata.decomposition(char)
    if unicodedata.category(char) == "Nl" or decomposition.startswith(_MISREAD_BY_NFKC):
        return True
    return any(_misread_by_nfkc(chr(int(code, 16))) for code in decomposition.split() if not code.startswith("<"))


def _vulgar_fraction(char: str) -> tuple[str, str] | None:
    """Numerator and denominator of a vulgar fraction character (``½`` -> ``("1", "2")``); None for anything else."""
    if not unicodedata.decomposition(char).startswith("<fraction>"):
        return None
    numerator, _, denominator = unicodedata.normalize("NFKC", char).partition("\u2044")
    digits = numerator + denominator
    return (numerator, denominator) if numerator and denominator and digits.isascii() and digits.isdigit() else None


def plain_text(text: str) -> str:
    r"""`text` in plain characters, as `math_verify` reads them; ASCII text is returned unchanged.

    Invisible characters are dropped (not the invisible operators U+2061-U+2064); compatibility characters take their
    NFKC form (``１２`` -> ``12``), except those whose meaning NFKC changes (`_misread_by_nfkc`), which stay as
    written; a vulgar fraction is a ``\frac`` (``½`` -> ``\frac{1}{2}``, braced after ``^``, ``_`` or a command).
    Each rewrite gives the ASCII spelling of the same answer (``tests/test_rewards_normal_form.py`` checks this).
    """
    if text.isascii():
        return text
    text = _INVISIBLE.sub("", text)
    pieces, start = [], 0
    for i, char in enumerate(text):
        if char.isascii() or not _misread_by_nfkc(char):
            continue
        pieces.append(unicodedata.normalize("NFKC", text[start:i]))
        start = i + 1
        fraction = _vulgar_fraction(char)
        if fraction is None:
            pieces.append(char)
            continue
        written = f"\\frac{{{fraction[0]}}}{{{fraction[1]}}}"
        before = next((piece for piece in reversed(pieces) if piece.strip()), "")
        pieces.append("{" + written + "}" if _GROUP_BEFORE.search(before) else written)
    pieces.append(unicodedata.normalize("NFKC", text[start:]))
    return "".join(pieces)


def answer_form(text: str) -> str:
    r"""An answer as `math_verify` is given it: `plain_text`, box commands inside dropped (`unwrap_boxes`), and a
    whole answer that is a number written in groups of three digits joined (``1 000``, ``1\,000``, ``1~000`` ->
    ``1000``; `math_verify` reads ``1 000`` as 1·000 = 0). ``1 2``, ``1, 000`` (a pair) and ``x = 1 000`` stay."""
    text = unwrap_boxes(plain_text(text)).strip()
    groups = _DIGIT_GROUPS.fullmatch(text)
    return text.replace(groups.group(1), "") if groups else text


def gold_forms(gold: str) -> list[str]:
    r"""The forms of one gold answer that `math_verify` compares answers with: its `answer_form`, and, when it ends
    with a period (``3.``, ``x = 2.``; not ``...``), also that form without the period, so that ``3`` is right for
    the gold ``3.`` while ``3.`` stays right too. An answer's own final period is kept (`math_verify` reads ``7.``
    apart from ``7``). Empty forms are dropped."""
    text = plain_text(gold).strip()
    forms = [text, text[:-1]] if re.search(r"[^.\\]\.$", text) else [text]
    return [form for form in dict.fromkeys(answer_form(form) for form in forms) if form]


def gold_alternatives(solution: Any, as_written: bool = False, max_chars: int | None = MAX_GOLD_CHARS) -> list[str]:
    r"""Ground-truth answer(s) as strings: a list or tuple holds alternatives, numbers are written out.

    A string longer than `max_chars` is not read (reading it would cost time in proportion to its length, and no
    admissible answer is that long); a shorter one is kept `as_written`, or else reduced to its last boxed argument
    when it has a box (a worked solution; box commands inside it dropped, see `unwrap_boxes`), with unescaped ``$``
    and surrounding whitespace dropped. Integral floats are written as integers, and integers exactly in decimal,
    also beyond Python's limit on integer-to-string conversion (4300 digits), up to `MAX_GOLD_DIGITS` digits. A
    longer integer, a non-finite float, None, a bool or any other type gives no alternative (every answer to it
    scores wrong).
    """
    if isinstance(solution, (list, tuple)):
        return [alt for item in solution for alt in gold_alternatives(item, as_written, max_chars)]
    if isinstance(solution, str):
        if max_chars is not None and len(solution) > max_chars:
            return []
        if as_written:
            return [solution]
        text = unwrap_boxes(extract_boxed_answer(solution) or "") if contains_box(solution) else solution
        text = re.sub(r"(?<!\\)\$", "", text).strip()
        return [text] if text else []
    if isinstance(solution, float):
        text = (repr(int(solution)) if solution.is_integer() else repr(solution)) if math.isfinite(solution) else None
    elif isinstance(solution, numbers.Integral) and not isinstance(solution, bool):  # int, numpy integers
        text = _integer_text(int(solution))
    else:
        return []
    return [] if text is None else [text]


def paired(completions: Sequence[Any], solutions: Sequence[Any]) -> zip:
    """The (completion, solution) pairs of a batch; ValueError unless there is one solution per completion."""
    if len(completions) != len(solutions):
        raise ValueError(
            f"completions and solutions must have the same length, got {len(completions)} and {len(solutions)}"
        )
    return zip(completions, solutions)


def is_oversized_gold(solution: Any) -> bool:
    """Whether `solution` (or one of its alternatives) is a string longer than `MAX_GOLD_CHARS` (not read)."""
    if isinstance(solution, str):
        return len(solution) > MAX_GOLD_CHARS
    return isinstance(solution, (list, tuple)) and any(is_oversized_gold(item) for item in solution)


def warn_oversized_golds(logger: logging.Logger, rule: str, oversized: int, rows: int) -> None:
    """Warn that `oversized` of `rows` gold answers are strings longer than `MAX_GOLD_CHARS` (not read)."""
    if oversized:
        logger.warning(
            "%s: %d of %d rows have a gold answer longer than %d characters, which is not read (their answers "
            "score wrong unless another alternative matches)", rule, oversized, rows, MAX_GOLD_CHARS,
        )  # fmt: skip


def _integer_text(value: int) -> str | None:
    """Exact decimal digits of `value` (None beyond `MAX_GOLD_DIGITS`), without ``str``'s 4300-digit limit."""
    if value.bit_length() > (MAX_GOLD_DIGITS + 1) * math.log2(10):
        return None
    if value.bit_length() < 2000:  # under 603 digits: within any limit `sys.set_int_max_str_digits` accepts (>= 640)
        return str(value)
    text = str(decimal.Decimal(value))  # exact: building a Decimal from an int never rounds, nor has that limit
    return text if len(text.lstrip("-")) <= MAX_GOLD_DIGITS else None

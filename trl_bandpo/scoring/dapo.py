r"""The DAPO / Minerva answer check: the ``Answer: ...`` line of a completion, compared as a normalised string.

This is the rule of verl's ``math_dapo`` reward (``verl.utils.reward_score.math_dapo``), which the BandPO authors
trained with on DAPO-Math-17k. It is pure Python: no `math_verify`, no sympy, no process, linear time.

What `dapo_correct` does, in order:

1. Keep the last `WINDOW_CHARS` (300) characters of the completion (Python characters, i.e. code points).
2. Take the *last* match of `ANSWER_PATTERN`, ``(?i)Answer\s*:\s*([^\n]+)``: case-insensitive, so ``answer:``
   and ``Final Answer:`` count; the ``\s*`` runs may cross newlines (``"Answer:\n42"`` reads ``42``); the
   answer is the rest of that line. No match: wrong.
3. Normalise that answer and the gold answer with `normalize_final_answer` (below) and compare the two strings
   for exact equality. There is no numeric or symbolic equivalence: ``0.5`` and ``\frac{1}{2}`` differ.

`normalize_final_answer` (the Minerva normalisation, Lewkowycz et al. 2022, as ``math_dapo`` implements it):

1. keep the text after the last ``=`` (``x = 5`` -> `` 5``);
2. apply `SUBSTITUTIONS` in order, each to every occurrence (``"an "`` and ``"a "`` go anywhere, also inside a
   word: ``"pizza pie"`` -> ``"pizzpie"``; then every space goes; ``mbox`` becomes ``text``; ``\text{and}``
   becomes a comma; ``\text{m}`` becomes an empty ``\text{}``);
3. delete every occurrence of each of `REMOVED_EXPRESSIONS`, in order (unit words, ``\ldots``, ``\text{}``,
   degree signs, ``\;``, ...), also inside other words (``"5 km"`` -> ``"5"``, ``"skmy"`` -> ``"sy"``);
4. on each line, when two ``$`` occur, keep only the text between the first two, wrapped in ``$``;
5. unwrap ``\text{..}``, ``\textbf{..}`` and ``\overline{..}`` (up to the first ``}``) and ``\boxed{..}`` (up to
   the last ``}``);
6. expand shorthand: ``frac`` followed by two characters that do not start with ``{`` gets braces (``\frac12``
   -> ``\frac{1}{2}``; spaces are already gone, so ``\frac 1 2`` too), and ``sqrt`` followed by one such character
   (``\sqrt2`` -> ``\sqrt{2}``);
7. delete every ``$``;
8. when the text without commas is all digits (`str.isdigit`), delete the commas (``1,000`` -> ``1000``);
9. strip surrounding whitespace.

Surprising cases that we reproduce on purpose, because they are what the policy was rewarded for:

* a trailing period stays: ``Answer: 42.`` is wrong for the gold ``42`` (only ``.$`` loses its period);
* ``\dfrac{1}{2}`` is wrong for the gold ``\frac{1}{2}`` (``\dfrac`` is not rewritten), ``0.5`` is wrong too;
* ``1,000.5`` keeps its comma (not all digits), while ``1,000`` loses it;
* the shorthand rules also fire inside words and commands (``fraction`` -> ``frac{t}{i}on``,
  ``\dfrac12`` -> ``\dfrac{1}{2}``, ``\sqrt[3]{8}`` -> ``\sqrt{[}3]{8}``), on both sides alike;
* `str.isdigit` accepts Unicode digits such as ``²``, so ``1,²`` loses its comma as in ``math_dapo``.

Deliberate differences: ``math_dapo`` scores a completion without any ``Answer:`` line as if it had answered
``[INVALID]``, which would be correct for a gold answer that normalises to ``[INVALID]``; here a missing answer is
always wrong. A gold string longer than `MAX_GOLD_CHARS` (20,000) characters is not read: every answer to it is
wrong (`score_dapo_completions` warns), where ``math_dapo`` would normalise it (its ``$``-span rule takes time
quadratic in the length of a line: 25 s for 60,000 digits; ours is linear). Real gold answers are a few hundred
characters at most. Gold answers that are not strings (numbers, lists of acceptable alternatives) are accepted too:
numbers are written out as in `trl_bandpo.scoring.answers.gold_alternatives`, and a list is correct when any of its
items is; ``math_dapo`` receives strings only.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

from .answers import MAX_GOLD_CHARS as MAX_GOLD_CHARS  # re-exported: part of this module's interface
from .answers import completion_text, gold_alternatives, is_oversized_gold, paired, warn_oversized_golds

_LOGGER = logging.getLogger(__name__)

WINDOW_CHARS = 300  # only the tail of a completion is read (``math_dapo``: the longest MATH-500 answer is 159 chars)
ANSWER_PATTERN = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

# (before, after) pairs, replaced in this order (the Minerva list, as in ``math_dapo``).
SUBSTITUTIONS: tuple[tuple[str, str], ...] = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
# Deleted wherever they occur, in this order (the Minerva list, as in ``math_dapo``).
REMOVED_EXPRESSIONS: tuple[str, ...] = (
    *"square ways integers dollars mph inches hours km units \\ldots sue points feet minutes digits cents".split(),
    *"degrees cm gm pounds meters meals edges students childrentickets multiples \\text{s} \\text{.}".split(),
    "\\text{\ns}",
    *"\\text{}^2 \\text{}^3".split(),
    "\\text{\n}",
    *'\\text{} \\mathrm{th} ^\\circ ^{\\circ} \\; ,\\! {,} " \\dots'.split(),
)
# Both lists as one sequence of (old, new) string replacements, run in order.
_REPLACEMENTS = (*SUBSTITUTIONS, *((expression, "") for expression in REMOVED_EXPRESSIONS))
# Unwrapped in this order after the two lists, line by line (`.` never crosses a newline, as in the source); \boxed
# is greedy: up to the last closing brace of the line.
_UNWRAPS = [
    re.compile(p) for p in (r"\\text\{(.*?)\}", r"\\textbf\{(.*?)\}", r"\\overline\{(.*?)\}", r"\\boxed\{(.*)\}")
]
_SHORTHANDS = ((re.compile(r"frac([^{])(.)"), r"frac{\1}{\2}"), (re.compile(r"sqrt([^{])"), r"sqrt{\1}"))


def _rewrite_line(line: str) -> str:
    """A line with two ``$`` reduced to ``$`` + the text between the first two + ``$``, then unwrapped (`_UNWRAPS`),
    in linear time (the source's regexes take time quadratic in the length of a line): no unwrap can end after the
    line's last ``}``, so each regex only sees the text up to it."""
    first = line.find("$")
    second = line.find("$", first + 1) if first >= 0 else -1
    line = line if second < 0 else "$" + line[first + 1 : second] + "$"
    for pattern in _UNWRAPS:
        end = line.rfind("}") + 1
        line = pattern.sub(r"\1", line[:end]) + line[end:]
    return line


def normalize_final_answer(answer: str) -> str:
    r"""The Minerva normal form of a final answer, exactly as verl's ``math_dapo`` computes it (see the module).

    Linear time in the length of `answer`. Example: ``normalize_final_answer(r"x = \$1,000 dollars")`` is ``"1000"``.
    """
    text = answer.rpartition("=")[2]  # what follows the last "=" (all of it without one)
    for old, new in _REPLACEMENTS:
        text = text.replace(old, new)
    text = "\n".join(map(_rewrite_line, text.split("\n")))
    for pattern, replacement in _SHORTHANDS:
        text = pattern.sub(replacement, text)
    text = text.replace("$", "")
    digits = text.replace(",", "")  # thousands separators go only when nothing but digits is left
    return (digits if digits.isdigit() else text).strip()


def extract_dapo_answer(text: str) -> str | None:
    """The raw answer of a completion: the last ``Answer: ...`` match within its last `WINDOW_CHARS` characters."""
    if not isinstance(text, str):
        return None
    matches = ANSWER_PATTERN.findall(text[-WINDOW_CHARS:])
    return matches[-1] if matches else None


def dapo_correct(completion: Any, solution: Any) -> bool:
    """Whether a completion (string or conversation) answers `solution` (a string, a number, or a list of
    alternatives) under the ``math_dapo`` rule. Never raises on bad input."""
    try:
        answer = extract_dapo_answer(completion_text(completion))
        if answer is None:
            return False
        predicted = normalize_final_answer(answer)
        return any(normalize_final_answer(gold) == predicted for gold in gold_alternatives(solution, as_written=True))
    except Exception:  # noqa: BLE001 - an unreadable completion or gold answer scores wrong
        return False


def score_dapo_completions(completions: Sequence[Any], solutions: Sequence[Any]) -> list[bool]:
    """`dapo_correct` of each (completion, solution) pair; the two sequences must have the same length.

    A warning says how many rows have a gold string longer than `MAX_GOLD_CHARS` characters (not read).
    """
    pairs = paired(completions, solutions)
    warn_oversized_golds(_LOGGER, "dapo reward", sum(map(is_oversized_gold, solutions)), len(solutions))
    return [dapo_correct(c, s) for c, s in pairs]

r"""String normalisations of verl's ``prime_math`` grader (pure Python, no sympy): see
`trl_bandpo.scoring.strict_grader`.

* `mathd_normalize`: the Hendrycks MATH normalisation (``prime_math.math_normalize``, `hendrycks.normalize`).
* `prm_normalize`: the PRM800K normalisation (``prime_math._normalize``), integer-valued numbers written out exactly
  (`integer_text`).
* `latex_to_text`: our stand-in for ``pylatexenc``'s ``LatexNodes2Text`` (version 2.10), which ``prime_math`` uses
  and this package does not depend on. It reproduces pylatexenc's output for what answers contain (``\frac`` as
  ``a/b``, ``\sqrt`` as ``√(x)``, symbols as Unicode, font macros as their argument, accents as a combining mark),
  and its rule that an unknown macro vanishes (its braced argument stays, as a group) and takes the spaces after it.
"""

from __future__ import annotations

import re
import unicodedata
from decimal import MAX_EMAX, MIN_EMIN, ROUND_DOWN, ROUND_HALF_EVEN, Context, Decimal, localcontext

from .hendrycks import normalize as hendrycks_normalize

_TEXT_ONLY = re.compile(r"^\\text\{(?P<text>.+?)\}$")


def mathd_normalize(answer: str | None) -> str | None:
    """``math_normalize.normalize_answer``: `hendrycks.normalize` of the stripped (and ``\\text``-unwrapped) answer,
    or that answer itself where the normalisation fails."""
    if answer is None:
        return None
    answer = answer.strip()
    match = _TEXT_ONLY.search(answer)
    if match is not None:
        answer = match.group("text").strip()
    try:
        return hendrycks_normalize(answer)
    except ValueError:
        return answer


# --- PRM800K normalisation (prime_math._normalize) ---

_UNITS = "degree cm centimeter meter mile second minute hour day week month year foot feet inch yard liter".split()
_UNIT_PATTERNS = tuple(re.compile(unit + r"(es)?(s)? *(\^[0-9]+)?") for unit in _UNITS)
_FORMATTED_COMMA = re.compile(r"(\d),(\d\d\d)($|\D)")


MAX_INTEGER_DIGITS = 10_000  # longest integer a normal form writes out (a longer one, like "1e99999", stays text)
_NEAR_INTEGER = Decimal("1e-7")  # prime_math's ``_is_int`` tolerance
# Decimal arithmetic on numbers of up to MAX_CHARS digits, exact to far below any tolerance, at any exponent.
EXACT = Context(prec=20_100, Emax=MAX_EMAX, Emin=MIN_EMIN)


def exact_number(value: object) -> Decimal | None:
    """The exact value of an int, or of a string that Python's ``float`` reads as a finite number; else None.

    prime_math reads numbers with ``float``, which rounds beyond 15 digits and overflows to ``inf`` beyond 1e308, so
    that different long integers compare equal; a `Decimal` built from the same text keeps every digit.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        return Decimal(value)
    if not isinstance(value, str):
        return None
    try:
        float(value)  # float's syntax (Decimal alone would also take "_1")
        number = Decimal(value)
    except (ValueError, ArithmeticError):
        return None
    return number if number.is_finite() else None


def integer_text(text: str, truncate: bool = False) -> str | None:
    """The digits of the integer within 1e-7 of the number `text` (prime_math's ``_is_int``), or None.

    Rounded to the nearest integer as ``int(round(float(text)))`` does, or truncated as ``int(float(text))`` does
    (`truncate`), but exactly, at any size up to `MAX_INTEGER_DIGITS` digits (``float`` gives every integer of 17
    or more digits a neighbour's digits, and none beyond 1e308). None for text that is no number, is not within 1e-7
    of an integer, or whose integer is longer than that.
    """
    number = exact_number(text)
    if number is None:  # "inf", "nan": as prime_math, through a float (which is never an integer then)
        return None
    with localcontext(EXACT):
        nearest = number.to_integral_value(rounding=ROUND_HALF_EVEN)
        if abs(number - nearest) > _NEAR_INTEGER or nearest.adjusted() >= MAX_INTEGER_DIGITS:
            return None
        integer = number.to_integral_value(rounding=ROUND_DOWN) if truncate else nearest
    return "0" if integer.is_zero() else format(integer, "f")


def strip_formatted_commas(text: str) -> str:
    """Remove thousands separators (a comma followed by exactly three digits), until nothing changes."""
    while True:
        changed = _FORMATTED_COMMA.sub(r"\1\2\3", text)
        if changed == text:
            return text
        text = changed


def str_is_int(text: str) -> bool:
    return integer_text(strip_formatted_commas(text)) is not None


def is_frac(text: str) -> bool:
    return re.search(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$", text) is not None


def prm_normalize(expr: str | None) -> str | None:
    """``prime_math._normalize`` (the PRM800K grader's normalisation)."""
    if expr is None:
        return None
    match = _TEXT_ONLY.search(expr)
    if match is not None:
        expr = match.group("text")
    for before, after in (("\\%", "%"), ("\\$", "$"), ("$", ""), ("%", ""), (" or ", " , "), (" and ", " , "),
                          ("million", "*10^6"), ("billion", "*10^9"), ("trillion", "*10^12")):  # fmt: skip
        expr = expr.replace(before, after)
    for pattern in _UNIT_PATTERNS:
        expr = pattern.sub("", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if expr[:1] + expr[-1:] == "{}":  # one pair of outer braces
        expr = expr[1:-1]
    expr = re.sub(r",\\! *", "", expr)
    expr = integer_text(expr) or expr  # an integer-valued number written as an integer, exactly
    if "\\" in expr:
        try:
            expr = _latex_answer_to_text(expr)
        except (ValueError, RecursionError):
            pass  # prime_math ignores any error of this step
    expr = re.sub(r"- *", "-", expr)
    expr = re.sub(r"([0-9]) +([0-9])", r"\1+\2", expr)  # a mixed number: "7 3/4" -> "7+3/4"
    expr = expr.lower()
    # only formatted commas remain then
    return integer_text(strip_formatted_commas(expr), truncate=True) or expr


def _latex_answer_to_text(expr: str) -> str:
    """``prime_math._parse_latex``: ``\\frac`` spaced out for mixed numbers, then text, then Unicode to ASCII."""
    expr = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac").replace("\\frac", " \\frac")
    expr = latex_to_text(expr)
    for before, after in (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*")):
        expr = expr.replace(before, after)
    return expr.strip()


# --- LaTeX to text (what pylatexenc 2.10 writes for answer-like LaTeX) ---

_SYMBOLS = {
    "infty": "∞", "cup": "∪", "cap": "∩", "cdot": "·", "times": "×", "div": "÷", "pm": "±", "mp": "∓", "le": "≤",
    "leq": "≤", "ge": "≥", "geq": "≥", "neq": "≠", "approx": "≈", "sim": "∼", "simeq": "≃", "equiv": "≡",
    "cong": "≅", "propto": "∝", "in": "∈", "notin": "∉", "subset": "⊂", "subseteq": "⊆", "supset": "⊃",
    "supseteq": "⊇", "setminus": "∖", "emptyset": "∅", "varnothing": "∅", "circ": "∘", "ldots": "…", "dots": "…",
    "cdots": "⋯", "vdots": "⋮", "ddots": "⋱", "perp": "⊥", "parallel": "∥", "mid": "|", "vert": "|", "lvert": "|",
    "rvert": "|", "Vert": "‖", "langle": "⟨", "rangle": "⟩", "lfloor": "⌊", "rfloor": "⌋", "lceil": "⌈",
    "rceil": "⌉", "to": "→", "rightarrow": "→", "leftarrow": "←", "Rightarrow": "⇒", "Leftrightarrow": "⇔",
    "leftrightarrow": "↔", "mapsto": "↦", "prime": "'", "angle": "∠", "square": "□", "therefore": "∴",
    "forall": "∀", "exists": "∃", "partial": "∂", "nabla": "∇", "sum": "∑", "prod": "∏", "int": "∫", "wedge": "∧",
    "vee": "∨", "oplus": "⊕", "otimes": "⊗", "ast": "∗", "star": "⋆", "bullet": "∙", "ell": "ℓ", "hbar": "ħ",
    "aleph": "ℵ", "backslash": "\\", "textbackslash": "\\", "lbrace": "{", "rbrace": "}", "ll": "≪", "gg": "≫",
    "quad": "  ", "qquad": "    ",
    **{name: name for name in ("sin", "cos", "tan", "arcsin", "arccos", "arctan", "sinh", "cosh", "tanh", "ln",
                               "log", "exp", "max", "min", "sup", "inf", "lim")},
}  # fmt: skip
_CONTROL_SYMBOLS = {",": " ", ";": " ", ":": " ", " ": " ", "!": "", "{": "{", "}": "}", "%": "%", "$": "$",
                    "&": "&", "#": "#", "_": "_", "\\": "\n"}  # fmt: skip
_ACCENTS = {"hat": "\u0302", "bar": "\u0305", "tilde": "\u0303", "dot": "\u0307", "ddot": "\u0308", "vec": "\u20d7"}
_FRACTIONS = ("frac", "nicefrac", "textfrac")
# Macros whose argument is written as it is (None) or in a Unicode mathematical alphabet.
_FONTS = dict.fromkeys(("text", "textrm", "textit", "textbf", "textsc", "textsl", "emph", "mathrm")) | {
    "mathbf": "BOLD", "mathit": "ITALIC", "mathsf": "SANS-SERIF", "mathbb": "DOUBLE-STRUCK", "mathtt": "MONOSPACE",
    "mathcal": "SCRIPT", "mathscr": "SCRIPT", "mathfrak": "FRAKTUR",
}  # fmt: skip
_LETTERLIKE = {
    **{("DOUBLE-STRUCK", c): u for c, u in zip("CHNPQRZ", "ℂℍℕℙℚℝℤ")},
    **{("SCRIPT", c): u for c, u in zip("BEFHILMRego", "ℬℰℱℋℐℒℳℛℯℊℴ")},
    **{("FRAKTUR", c): u for c, u in zip("CHIRZ", "ℭℌℑℜℨ")},
    ("ITALIC", "h"): "ℎ",
}
_SWALLOWED = ("mbox", "texttt", "hspace", "vspace")  # their argument is dropped too
_GREEK_VARIANTS = {
    "epsilon": "ϵ", "varepsilon": "ε", "phi": "ϕ", "varphi": "φ", "vartheta": "ϑ", "varpi": "ϖ", "varrho": "ϱ",
    "varsigma": "ς", "varkappa": "ϰ", "digamma": "ϝ", "lambda": "λ", "Lambda": "Λ",
}  # fmt: skip
_CONTROL_WORD = re.compile(r"\\([A-Za-z]+)\s*")  # a macro name takes the spaces after it


def _greek(name: str) -> str | None:
    if name in _GREEK_VARIANTS:
        return _GREEK_VARIANTS[name]
    try:
        return unicodedata.lookup(f"GREEK {'CAPITAL' if name[:1].isupper() else 'SMALL'} LETTER {name.upper()}")
    except KeyError:
        return None


def latex_to_text(latex: str) -> str:
    r"""Plain text of LaTeX, as pylatexenc's ``LatexNodes2Text().latex_to_text`` writes it (see the module).

    Raises ValueError where pylatexenc fails (a ``\frac``/``\sqrt``/accent missing its argument).
    """
    return _render(latex, 0, closing=False)[0]


def _render(src: str, pos: int, closing: bool) -> tuple[str, int]:
    """Text of `src` from `pos` up to the matching ``}`` (when `closing`) or the end; and the position after it."""
    out, n = [], len(src)
    while pos < n:
        char = src[pos]
        if char == "}":
            if closing:
                return "".join(out), pos + 1
            pos += 1  # an unmatched closing brace vanishes
        elif char == "{":
            inner, pos = _render(src, pos + 1, closing=True)
            out.append(inner)
        elif char == "\\":
            piece, pos = _macro(src, pos)
            out.append(piece)
        elif char == "%":  # a comment, up to the end of the line
            end = src.find("\n", pos)
            pos = n if end < 0 else end + 1
        elif src.startswith("--", pos):  # TeX ligatures: -- and --- are dashes
            dashes = 3 if src.startswith("---", pos) else 2
            out.append("—" if dashes == 3 else "–")
            pos += dashes
        else:
            out.append({"$": "", "~": "\xa0", "&": "   "}.get(char, char))
            pos += 1
    return "".join(out), pos


def _macro(src: str, pos: int, bare: bool = False) -> tuple[str, int]:
    """Text of the macro at `pos` and the position after it; a `bare` macro (itself an argument) takes no arguments."""
    match = _CONTROL_WORD.match(src, pos)
    if match is None:  # a control symbol: \, \{ \\ ...
        symbol = src[pos + 1 : pos + 2]
        return _CONTROL_SYMBOLS.get(symbol, ""), pos + 2
    name, end = match.group(1), match.end()
    if name in _FRACTIONS:
        numerator, after = (None, end) if bare else _argument(src, end)
        denominator, after = (None, after) if numerator is None else _argument(src, after)
        if denominator is None:  # pylatexenc writes its format string and leaves the rest alone
            return "%s/%s", end
        return f"{numerator}/{denominator}", after
    if name == "sqrt":
        if not bare and src.startswith("[", end):  # the degree is dropped
            close = src.find("]", end)
            end = len(src) if close < 0 else close + 1
        radicand, end = (None, end) if bare else _argument(src, end)
        if radicand is None:
            raise ValueError("\\sqrt without its argument")
        return f"√({radicand})", end
    if name in _ACCENTS or name in _FONTS or name in _SWALLOWED:
        argument, end = ("", end) if bare else _argument(src, end)
        if name in _ACCENTS:
            return unicodedata.normalize("NFC", "".join(c + _ACCENTS[name] for c in (argument or " "))), end
        return ("" if name in _SWALLOWED else _font(argument or "", _FONTS[name])), end
    if name in _SYMBOLS:
        return _SYMBOLS[name], end
    return _greek(name) or "", end  # an unknown macro vanishes; a braced group after it is rendered as a group


def _argument(src: str, pos: int) -> tuple[str | None, int]:
    """Text of the macro argument at `pos` (a group, a bare macro or one character); None at the end of `src`."""
    while pos < len(src) and src[pos].isspace():
        pos += 1
    if pos >= len(src):
        return None, pos
    if src[pos] == "{":
        return _render(src, pos + 1, closing=True)
    if src[pos] == "\\":
        return _macro(src, pos, bare=True)
    return src[pos], pos + 1


def _font(text: str, style: str | None) -> str:
    """ASCII letters of `text` in a Unicode mathematical alphabet (``\\mathbb{R}`` -> ``ℝ``), as pylatexenc writes."""
    if style is None:
        return text
    out = []
    for char in text:
        if char.isascii() and char.isalpha():
            case = "CAPITAL" if char.isupper() else "SMALL"
            try:
                char = unicodedata.lookup(f"MATHEMATICAL {style} {case} {char.upper()}")
            except KeyError:  # the letters Unicode had before (the Letterlike Symbols block)
                char = _LETTERLIKE.get((style, char), char)
        out.append(char)
    return "".join(out)

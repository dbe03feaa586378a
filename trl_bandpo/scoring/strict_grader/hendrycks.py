r"""The Hendrycks MATH answer normalisation (``strip_string`` of the MATH benchmark), as verl writes it twice: in
``math_reward`` (`trl_bandpo.scoring.math_reward`) and in ``prime_math.math_normalize`` (`_normalize.mathd_normalize`).

`normalize`, in this order: drop line breaks and ``\!``; ``\\`` -> ``\``; ``tfrac``/``dfrac`` -> ``frac``; drop
``\left``, ``\right``, ``^{\circ}``, ``^\circ`` and ``\$``; units: keep only what precedes a ``\text{ `` (a space
after the brace); drop ``\%``; `` .`` -> `` 0.`` and ``{.`` -> ``{0.``; a leading ``.`` gets a ``0``; ``k = v`` with
a left side of at most 2 characters -> ``v``; ``\sqrtX`` -> ``\sqrt{X}`` (one character); drop spaces;
``\fracXY`` -> ``\frac{X}{Y}`` (one character each; ``\fracX{Y}`` -> ``\frac{X}{Y}``); ``0.5`` -> ``\frac{1}{2}``;
``a/b`` of two integers written plainly -> ``\frac{a}{b}``.

Standard library only: worker processes load this folder by path (`trl_bandpo.scoring.worker_pool`).
"""

from __future__ import annotations

_DROPPED = (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"), ("\\left", ""),
            ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", ""))  # fmt: skip
_UNIT = "\\text{ "


def normalize(text: str) -> str:
    r"""The Hendrycks MATH normal form of `text` (see the module).

    Raises:
        ValueError: where verl's normalisation fails (more than one ``\text{ ``, a ``\sqrt`` or ``\frac`` with nothing
            after it); each caller keeps verl's fallback.
    """
    for old, new in _DROPPED:
        text = text.replace(old, new)
    if _UNIT in text:
        text, *units = text.split(_UNIT)
        if len(units) != 1:
            raise ValueError("more than one \\text{ unit")
    text = text.replace("\\\\%", "").replace("\\%", "")
    text = text.replace(" .", " 0.").replace("{.", "{0.")
    if text.startswith("."):
        text = "0" + text
    sides = text.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        text = sides[1]
    text = _brace_arguments(_brace_arguments(text, "\\sqrt", 1).replace(" ", ""), "\\frac", 2)
    if text == "0.5":
        return "\\frac{1}{2}"
    parts = text.split("/")
    try:  # only integers written plainly ("+1/2", "01/2" stay)
        if len(parts) == 2 and parts == [str(int(part)) for part in parts]:
            return f"\\frac{{{parts[0]}}}{{{parts[1]}}}"
    except ValueError:
        pass
    return text


def _brace_arguments(text: str, command: str, arity: int) -> str:
    """`command` with its first `arity` one-character arguments braced; `text` unchanged when a ``\\frac`` has only
    one character after it."""
    head, *pieces = text.split(command)
    out = [head]
    for piece in pieces:
        if not piece:
            raise ValueError(f"{command} without an argument")
        if piece[0] != "{":
            if len(piece) < arity:
                return text
            braced = 1 if arity == 1 or piece[1] == "{" else 2
            piece = "".join("{" + char + "}" for char in piece[:braced]) + piece[braced:]
        out.append(command + piece)
    return "".join(out)

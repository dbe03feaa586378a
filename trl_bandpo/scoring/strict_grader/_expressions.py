r"""Reading model output as math without executing it: sympy expressions (`read_expression`) and Python numbers
(`python_value`), for the rules of `trl_bandpo.scoring.strict_grader._grade`.

``prime_math`` hands answers to sympy's ``parse_expr`` (which runs ``eval`` on them) and, in one place, to Python's
``eval``. Here the text is parsed by Python's `ast` module (parsing never executes anything) after sympy's token
rules, and the value is built by walking the tree with a whitelist: numbers, a few constants and functions, symbols,
arithmetic, tuples and lists. Anything else raises ValueError. Imports only the standard library at import time.
"""

from __future__ import annotations

import ast
import builtins
import functools
import operator
import re
import unicodedata
import warnings

_NUMBER = r"(?P<num>(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)"
_TOKEN = re.compile(rf"\s*(?:{_NUMBER}|(?P<name>[^\W\d]\w*)|(?P<op>\*\*|//|[-+*/%^()!,\[\]]))")
_FUNCTIONS = ("sqrt", "ln", "log", "exp", "re", "im", "sin", "cos", "tan", "Abs", "factorial")
_CONSTANTS = ("pi", "oo", "nan", "zoo", "E", "I")
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.BitXor: operator.xor,
           ast.BitAnd: operator.and_, ast.BitOr: operator.or_}  # fmt: skip
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Invert: operator.invert}


@functools.lru_cache(maxsize=1)
def _sympy_names() -> frozenset[str]:
    """Names that sympy's parser would not turn into symbols: sympy's namespace and Python's built-in functions."""
    import sympy

    return frozenset(sympy.__all__) | {n for n, v in vars(builtins).items() if callable(v) and not isinstance(v, type)}


def read_expression(text: str, implicit: bool) -> object:
    """The sympy expression of plain-text math, as ``sympy_parser.parse_expr`` reads it, without executing anything.

    `implicit` adds the rules of sympy's ``implicit_multiplication_application`` (``2x``, ``x(1)``, ``sqrt 2``,
    ``xy`` -> ``x*y``, ``ab2`` -> ``2*a*b``), as PRM800K's check uses them; otherwise the text is read with the
    standard rules only (lists allowed). Numbers become exact sympy Integers and Floats, ``n!`` ``factorial(n)``.
    Names in sympy's namespace or Python's built-ins that are not whitelisted raise ValueError, as does anything
    else unsupported.
    """
    import sympy

    namespace, tokens, pos, end = _sympy_names(), [], 0, len(text.rstrip())
    while pos < end:
        match = _TOKEN.match(text, pos)
        if match is None:
            raise ValueError(f"cannot read {text[pos : pos + 10]!r}")
        pos = match.end()
        if match["num"]:
            tokens.append(("num", match["num"]))
        elif match["op"]:
            tokens.append(("op", match["op"]))
        else:
            tokens.extend(_name_tokens(match["name"], implicit, namespace))
    values, source, kinds, pending_close = {}, [], [], False  # placeholder -> value; the Python source; token kinds
    for kind, token in tokens:
        if kind == "op" and token == "!":
            _wrap_factorial(source, kinds)
            continue
        starts = kind in ("num", "sym", "func") or token == "("
        if implicit and starts and kinds and (kinds[-1] in ("num", "sym") or source[-1] == ")"):
            source.append("*")
            kinds.append("op")
        if implicit and kinds and kinds[-1] == "func" and token != "(":
            if kind not in ("num", "sym"):
                raise ValueError("a function applied to something other than a number or a name")
            source.append("(")
            kinds.append("op")
            pending_close = True
        if kind == "op":
            if implicit and token in ",[]":
                raise ValueError("tuples and lists are not expressions")
            source.append(token)
        else:
            placeholder = f"_{kind}{len(values)}"
            values[placeholder] = _value_of(kind, token, sympy)
            source.append(placeholder)
        kinds.append(kind)
        if pending_close and kind in ("num", "sym"):
            source.append(")")
            kinds.append("op")
            pending_close = False
    return _interpret(_parse(" ".join(source)), values)


def _parse(source: str) -> ast.AST:
    """The expression tree of `source` (Python's parser, which runs nothing), without its syntax warnings."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ast.parse(source, mode="eval").body


def _name_tokens(name: str, implicit: bool, namespace: frozenset[str]) -> list[tuple[str, str]]:
    if name in _FUNCTIONS:
        return [("func", name)]
    if name in _CONSTANTS:
        return [("sym", name)]
    if name in namespace:
        raise ValueError(f"{name!r} names a sympy or Python object")
    if not implicit or len(name) == 1 or "_" in name or _is_greek_name(name):
        return [("sym", name)]
    parts = re.findall(r"[0-9]+|[^0-9]", name)  # sympy's split_symbols: one symbol per letter, digit runs as numbers
    return [("num" if part.isdigit() else "sym", part) for part in parts]


def _is_greek_name(name: str) -> bool:
    try:
        unicodedata.lookup("GREEK SMALL LETTER " + name)
        return True
    except KeyError:
        return False


def _value_of(kind: str, token: str, sympy) -> object:
    if kind == "num":
        return sympy.Float(token) if any(c in token for c in ".eE") else sympy.Integer(token)
    if token in ("ln", "Abs"):
        return {"ln": sympy.log, "Abs": sympy.Abs}[token]
    if token in _FUNCTIONS or token in _CONSTANTS:
        return getattr(sympy, token)
    return sympy.Symbol(token)


def _wrap_factorial(source: list[str], kinds: list[str]) -> None:
    """Turn the primary just written (a number, a name, a bracket, a call) into ``factorial(...)``."""
    if not source:
        raise ValueError("a factorial of nothing")
    start = len(source) - 1
    if source[-1] == ")":
        depth = 0
        for start in range(len(source) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(source[start], 0)
            if depth == 0:
                break
        if start > 0 and kinds[start - 1] == "func":
            start -= 1
    elif kinds[-1] not in ("num", "sym"):
        raise ValueError("a factorial of an operator")
    source[start:start] = ["factorial", "("]
    kinds[start:start] = ["func", "op"]
    source.append(")")
    kinds.append("op")


def _interpret(node: ast.AST, values: dict[str, object]) -> object:
    if isinstance(node, ast.Name):
        if node.id == "factorial":
            import sympy

            return sympy.factorial
        return values[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_interpret(node.left, values), _interpret(node.right, values))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_interpret(node.operand, values))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
        if node.func.id != "factorial" and not node.func.id.startswith("_func"):
            raise ValueError("only functions can be called")
        return _interpret(node.func, values)(*(_interpret(arg, values) for arg in node.args))
    if isinstance(node, (ast.Tuple, ast.List)):
        items = [_interpret(item, values) for item in node.elts]
        return items if isinstance(node, ast.List) else tuple(items)
    raise ValueError(f"unsupported syntax: {type(node).__name__}")


def python_value(text: str) -> object:
    """What Python's ``eval`` gives for numeric literals combined by arithmetic, tuples and lists (else ValueError).

    ``prime_math`` evaluates some answers with ``eval``; this computes the same value for the harmless cases without
    executing anything: names, calls, strings and everything else raise ValueError instead.
    """

    def value(node: ast.AST) -> object:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and isinstance(right, int) and abs(right) > 100_000:
                raise ValueError("exponent too large")
            return _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        if isinstance(node, (ast.Tuple, ast.List)):
            items = [value(item) for item in node.elts]
            return items if isinstance(node, ast.List) else tuple(items)
        raise ValueError(f"not evaluated: {type(node).__name__}")

    try:
        return value(_parse(text))
    except (SyntaxError, TypeError, ArithmeticError, RecursionError, MemoryError) as error:
        raise ValueError(str(error)) from None

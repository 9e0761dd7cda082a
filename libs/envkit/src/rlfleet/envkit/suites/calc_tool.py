"""The calculator tool: a tiny, safe arithmetic evaluator.

This file is also the script that runs inside the sandbox (``calc.CALC_TOOL_SCRIPT`` is its text),
so it imports nothing but the standard library and nothing from rlfleet. It reads one expression
from its arguments (or stdin when there are none), prints the result or a single ``error: ...``
line, and exits 1 on error. Errors are observations for the policy, so the evaluator never raises.

Grammar (no names, no attributes, no ``**``, no floats in the input)::

    expr  := term (("+" | "-") term)*
    term  := unary (("*" | "/" | "//" | "%") unary)*
    unary := ("+" | "-") unary | atom
    atom  := INTEGER | "(" expr ")"

Integer arithmetic follows Python; ``/`` is true division. A float result prints as an integer
when it is integral (``6/3`` -> ``2``) and as Python's shortest repr otherwise (``7/2`` -> ``3.5``).
"""

from __future__ import annotations

import math
import sys

MAX_EXPRESSION_CHARS = 200
MAX_DEPTH = 32
# Bounds every intermediate value, so a long product of big literals stays cheap to compute/print.
MAX_MAGNITUDE = 10**60

# A hand-written scanner, not `re`: importing `re` is a third of the script's start-up in the
# sandbox (~8 ms of CPU here), paid on every tool call.
_DIGITS = frozenset("0123456789")
_OPERATORS = frozenset("-+*/%()")


class CalcError(Exception):
    """A problem with the expression; its message becomes the tool observation."""


def evaluate_expression(expression: str) -> str:
    """The result of ``expression`` as text, or ``error: <why>``; never raises."""
    try:
        return format_number(_Parser(_tokenize(expression)).parse())
    except CalcError as exc:
        return f"error: {exc}"


def format_number(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)


def _tokenize(expression: str) -> list[str]:
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalcError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    if "**" in expression:
        raise CalcError("'**' is not supported")
    tokens, pos, end = [], 0, len(expression)
    while pos < end:
        char = expression[pos]
        if char.isspace():
            pos += 1
        elif char in _DIGITS:
            start = pos
            while pos < end and expression[pos] in _DIGITS:
                pos += 1
            tokens.append(expression[start:pos])
        elif expression.startswith("//", pos):
            tokens.append("//")
            pos += 2
        elif char in _OPERATORS:
            tokens.append(char)
            pos += 1
        else:
            raise CalcError(f"unexpected character {char!r}")
    if not tokens:
        raise CalcError("empty expression")
    return tokens


class _Parser:
    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens
        self.pos = 0
        self.depth = 0

    def parse(self) -> int | float:
        value = self.expr()
        if self.pos < len(self.tokens):
            raise CalcError(f"unexpected {self.tokens[self.pos]!r}")
        return value

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise CalcError("unexpected end of expression")
        self.pos += 1
        return token

    def expr(self) -> int | float:
        value = self.term()
        while self.peek() in ("+", "-"):
            op, rhs = self.take(), self.term()
            value = _checked(value + rhs if op == "+" else value - rhs)
        return value

    def term(self) -> int | float:
        value = self.unary()
        while self.peek() in ("*", "/", "//", "%"):
            op, rhs = self.take(), self.unary()
            value = _checked(_apply(op, value, rhs))
        return value

    def unary(self) -> int | float:
        if self.peek() in ("+", "-"):
            op = self.take()
            with _Nesting(self):
                value = self.unary()
            return -value if op == "-" else value
        return self.atom()

    def atom(self) -> int | float:
        token = self.take()
        if token == "(":
            with _Nesting(self):
                value = self.expr()
            if self.peek() != ")":
                raise CalcError("missing ')'")
            self.take()
            return value
        if token.isdigit():
            return _checked(int(token))
        raise CalcError(f"unexpected {token!r}")


class _Nesting:
    """Bounds recursion so deeply nested input is an error line, not a RecursionError."""

    def __init__(self, parser: _Parser) -> None:
        self.parser = parser

    def __enter__(self) -> None:
        self.parser.depth += 1
        if self.parser.depth > MAX_DEPTH:
            raise CalcError(f"nested deeper than {MAX_DEPTH} levels")

    def __exit__(self, *exc: object) -> None:
        self.parser.depth -= 1


def _apply(op: str, lhs: int | float, rhs: int | float) -> int | float:
    if op == "*":
        return lhs * rhs
    if rhs == 0:
        raise CalcError("division by zero")
    if op == "/":
        return lhs / rhs
    return lhs // rhs if op == "//" else lhs % rhs


def _checked(value: int | float) -> int | float:
    if isinstance(value, float) and not math.isfinite(value):
        raise CalcError("result is not a finite number")
    if abs(value) > MAX_MAGNITUDE:
        raise CalcError("number too large")
    return value


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    expression = " ".join(args) if args else sys.stdin.read()
    result = evaluate_expression(expression)
    print(result)
    return 1 if result.startswith("error:") else 0


if __name__ == "__main__":
    sys.exit(main())

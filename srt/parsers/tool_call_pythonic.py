"""The ``pythonic`` tool-call format (Llama 3.2, Llama 3.3, Llama 4): a Python list of calls with
keyword arguments, ``[get_weather(city="Paris", unit="c"), now()]``, anywhere in the output.

Argument values are Python literals (strings, numbers, booleans, None, lists, tuples, dicts; JSON's
``true`` / ``false`` / ``null`` are read too), read from the ``ast`` tree and never evaluated. A
list that is not entirely such calls is content, as is text around the list.
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any

from srt.parsers.tool_call_formats import MarkerParser, Region
from srt.parsers.tool_call_types import JsonContainerScanner, ToolCall

# a list opening with "name(": a call list; "[", "[ name" may still become one
_CALL_START = re.compile(r"\[\s*[A-Za-z_]\w*\s*\(")
_MAYBE_CALL_START = re.compile(r"\[\s*(?:[A-Za-z_]\w*\s*)?")
_JSON_NAMES = {"true": True, "false": False, "null": None}


class _NotLiteral(Exception):
    pass


def _literal(node: ast.expr) -> Any:
    """The JSON-compatible value of a literal node; _NotLiteral for anything else."""
    if isinstance(node, ast.Constant):
        value = node.value
        if value is None or isinstance(value, (str, bool, int)):
            return value
        if isinstance(value, float) and math.isfinite(value):
            return value
        raise _NotLiteral
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        out: dict[str, Any] = {}
        for key, value in zip(node.keys, node.values):
            if key is None:  # {**other}
                raise _NotLiteral
            name = _literal(key)
            if not isinstance(name, str):
                raise _NotLiteral
            out[name] = _literal(value)
        return out
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _NotLiteral
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    raise _NotLiteral


def _call(node: ast.expr) -> ToolCall:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        raise _NotLiteral
    args: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None:  # **kwargs
            raise _NotLiteral
        args[keyword.arg] = _literal(keyword.value)
    return ToolCall(node.func.id, json.dumps(args, ensure_ascii=False))


def parse_pythonic_calls(text: str) -> list[ToolCall] | None:
    """The calls of ``text`` if it is exactly a non-empty Python list of keyword-argument calls
    with literal values; None otherwise (never raises on model output)."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return None
        return [_call(node) for node in tree.body.elts]
    except (_NotLiteral, SyntaxError, ValueError, RecursionError, MemoryError):
        return None


class PythonBracketScanner(JsonContainerScanner):
    """Finds where a bracketed Python expression ends: like JsonContainerScanner, with strings in
    single or double quotes (backslash escapes respected)."""

    def __init__(self) -> None:
        super().__init__()
        self._quote = ""  # the open string's quote character, "" outside strings

    def end(self, text: str, start: int) -> int | None:
        depth, quote, escaped = self._depth, self._quote, self._escaped
        for pos in range(max(self._pos, start), len(text)):
            ch = text[pos]
            if quote:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == quote:
                    quote = ""
            elif ch in "'\"":
                quote = ch
            elif ch in "[{(":
                depth += 1
            elif ch in "]})":
                depth -= 1
                if depth == 0:
                    return pos + 1
        self._pos, self._depth, self._quote, self._escaped = len(text), depth, quote, escaped
        return None


class PythonicToolCallParser(MarkerParser):
    """Python lists of calls, ``[f(a=1, b="x"), g()]``, with content before, between and after
    them. A ``[`` that does not open ``name(`` is content; a call list that does not parse (positional
    arguments, expressions, unbalanced) is content, and so is an unclosed one at the end."""

    name = "pythonic"
    marker = "["
    prompt_format = (
        "To call functions, write a Python list of calls with keyword arguments whose values are "
        'literals:\n[func_name1(param1="value", param2=2), func_name2(param=[1, 2])]'
    )

    def new_scanner(self) -> JsonContainerScanner:
        return PythonBracketScanner()

    def _region(self, text: str, final: bool, scanner: JsonContainerScanner) -> Region | None:
        if _CALL_START.match(text) is None:
            maybe = _MAYBE_CALL_START.match(text)
            if not final and maybe is not None and maybe.end() == len(text):
                return None
            return Region(1, None)
        end = scanner.end(text, 0)
        if end is None:
            return Region(None, None) if final else None
        return Region(end, parse_pythonic_calls(text[:end]))

"""The ``qwen3_coder`` tool-call format (Qwen3-Coder): XML-like calls inside ``<tool_call>`` blocks,

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Parameter values are raw text (one newline after the opening tag and one before the closing tag
are not part of it). Each value is typed by the request's tool schema (`for_tools`): integers,
numbers and booleans are converted, objects and arrays read as JSON, ``null`` as None for
non-string parameters; a value that does not convert, and any parameter the schema does not type,
stays a string. A missing ``</parameter>`` ends the value at the next parameter or at
``</function>``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from srt.parsers.tool_call_formats import MarkerParser, Region
from srt.parsers.tool_call_types import JsonContainerScanner, ToolCall, ToolCallParser, loads_or_none

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>")
_PARAM_END = "</parameter>"
_FUNCTION_END = "</function>"

_STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum"}
_INT_TYPES = {"integer", "int"}
_NUMBER_TYPES = {"number", "float", "double"}
_BOOL_TYPES = {"boolean", "bool"}
_JSON_TYPES = {"object", "array", "dict", "list"}


def _schema_type(schema: Any) -> str | None:
    """The JSON-schema type of a parameter (the first non-null one of a list), lower-cased."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    return kind.lower() if isinstance(kind, str) else None


def typed_value(raw: str, schema: Any) -> Any:
    """``raw`` converted to the type ``schema`` gives it; ``raw`` itself when it does not convert."""
    kind = _schema_type(schema)
    if kind is None or kind in _STRING_TYPES:
        return raw
    text = raw.strip()
    if text.lower() in ("null", "none"):
        return None
    if kind in _INT_TYPES:
        try:
            return int(text)
        except ValueError:
            return raw
    if kind in _NUMBER_TYPES:
        value = loads_or_none(text)
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else raw
    if kind in _BOOL_TYPES:
        return {"true": True, "false": False}.get(text.lower(), raw)
    value = loads_or_none(text)
    if kind in _JSON_TYPES and isinstance(value, (dict, list)):
        return value
    return raw if value is None else value


def _strip_one_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _parameters(inner: str, schemas: dict[str, Any]) -> dict[str, Any] | None:
    """The arguments of a function body (the text between ``<function=...>`` and
    ``</function>``); None if it holds anything but parameters."""
    args: dict[str, Any] = {}
    pos = 0
    while inner[pos:].strip():
        opened = _PARAMETER.match(inner, pos)
        if opened is None:
            return None
        start = opened.end()
        close = inner.find(_PARAM_END, start)
        following = _PARAMETER.search(inner, start)
        if close >= 0 and (following is None or close < following.start()):
            value, pos = inner[start:close], close + len(_PARAM_END)
        else:
            stop = following.start() if following is not None else len(inner)
            value, pos = inner[start:stop], stop
        name = opened.group(1).strip()
        args[name] = typed_value(_strip_one_newline(value), schemas.get(name))
    return args


def parse_function_block(body: str, tools: dict[str, dict[str, Any]]) -> ToolCall | None:
    """The call in a ``<tool_call>`` block's body; None if it is not ``<function=NAME>`` followed
    by parameters and ``</function>`` (whitespace around them allowed)."""
    opened = _FUNCTION.match(body)
    if opened is None:
        return None
    close = body.rfind(_FUNCTION_END)
    if close < opened.end() or body[close + len(_FUNCTION_END) :].strip():
        return None
    name = opened.group(1).strip()
    schemas = tools.get(name, {})
    args = _parameters(body[opened.end() : close], schemas if isinstance(schemas, dict) else {})
    if args is None:
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


class Qwen3CoderToolCallParser(MarkerParser):
    """``<tool_call><function=NAME><parameter=ARG>VALUE</parameter>...</function></tool_call>``
    blocks, any number, with content around them. An unterminated last block is a call if its
    function is complete. Bound to a request's tools by `for_tools` for typed values."""

    name = "qwen3_coder"
    marker = "<tool_call>"
    end_marker = "</tool_call>"
    prompt_format = (
        "To call a function, write:\n<tool_call>\n<function=<function name>>\n"
        "<parameter=<parameter name>>\n<value>\n</parameter>\n</function>\n</tool_call>\n"
        "with one <parameter=...> block per argument (objects and arrays as JSON), and one "
        "<tool_call> block per call."
    )

    def __init__(self, properties: dict[str, dict[str, Any]] | None = None) -> None:
        self._properties = properties or {}  # function name -> its parameters' schemas

    def for_tools(self, tools: list[dict[str, Any]]) -> ToolCallParser:
        properties: dict[str, dict[str, Any]] = {}
        for tool in tools:
            fn = tool.get("function", tool) if isinstance(tool, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                params = fn.get("parameters") or {}
                props = params.get("properties") if isinstance(params, dict) else None
                properties[fn["name"]] = props if isinstance(props, dict) else {}
        return Qwen3CoderToolCallParser(properties)

    def _region(self, text: str, final: bool, scanner: JsonContainerScanner) -> Region | None:
        close = text.find(self.end_marker, len(self.marker))
        if close >= 0:
            end, body = close + len(self.end_marker), text[len(self.marker) : close]
        elif final:
            end, body = len(text), text[len(self.marker) :]
        else:
            return None
        call = parse_function_block(body, self._properties)
        return Region(end, None if call is None else [call])

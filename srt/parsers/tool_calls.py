"""Tool calls in model output: the parser registry, and the helpers the chat layer needs around it.

    TOOL_CALL_PARSERS / create_tool_call_parser   parse free-form output in a model's own call format
                                                  (``--tool-call-parser``; see tool_call_formats.py)
    tool_choice_schema / parse_tool_choice_json   ``tool_choice="required"`` or a named function:
      / ToolChoiceStream                          generation is constrained to a JSON array of calls
                                                  (the schema), and its output read back (whole, or
                                                  streamed: each call once its object is complete)
    render_tools_system_prompt                    tool descriptions + call format, for chat templates
                                                  that do not render ``tools`` themselves

Parser names (aliases share a class): llama3; hermes = qwen25 = qwen; mistral; pythonic; deepseekv3;
deepseekv31; qwen3_coder; gpt-oss (each format's module says what it reads).
"""

from __future__ import annotations

import copy
import json
from typing import Any

from srt.parsers.harmony import HarmonyToolCallParser
from srt.parsers.tool_call_deepseek import DeepSeekV3ToolCallParser, DeepSeekV31ToolCallParser
from srt.parsers.tool_call_formats import (
    HermesToolCallParser,
    Llama3ToolCallParser,
    MistralToolCallParser,
)
from srt.parsers.tool_call_pythonic import PythonicToolCallParser
from srt.parsers.tool_call_qwen3_coder import Qwen3CoderToolCallParser
from srt.parsers.tool_call_types import (
    ContentDelta,
    JsonContainerScanner,
    StreamEvent,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    ToolCallStream,
    calls_from_value,
    loads_or_none,
)
from srt.utils.errors import ConfigError, RequestError

__all__ = [
    "TOOL_CALL_PARSERS",
    "ContentDelta",
    "StreamEvent",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "ToolCallStream",
    "ToolChoiceStream",
    "create_tool_call_parser",
    "parse_tool_choice_json",
    "render_tools_system_prompt",
    "tool_choice_schema",
]

TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    "llama3": Llama3ToolCallParser,
    "hermes": HermesToolCallParser,
    "qwen25": HermesToolCallParser,
    "qwen": HermesToolCallParser,
    "mistral": MistralToolCallParser,
    "pythonic": PythonicToolCallParser,
    "deepseekv3": DeepSeekV3ToolCallParser,
    "deepseekv31": DeepSeekV31ToolCallParser,
    "qwen3_coder": Qwen3CoderToolCallParser,
    "gpt-oss": HarmonyToolCallParser,
}


def create_tool_call_parser(name: str) -> ToolCallParser:
    """The parser registered as ``name``; ConfigError naming the known ones otherwise."""
    cls = TOOL_CALL_PARSERS.get(name)
    if cls is None:
        raise ConfigError(f"unknown tool-call parser {name!r}; choose one of {sorted(TOOL_CALL_PARSERS)}")
    return cls()


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    """The ``function`` part of an OpenAI tool (a bare function dict is accepted as well)."""
    fn = tool.get("function", tool)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestError("each tool needs a function with a string name", param="tools")
    return fn


def tool_choice_schema(tools: list[dict[str, Any]], name: str | None, parallel: bool) -> dict[str, Any]:
    """JSON schema of a constrained tool-choice output: an array of ``{"name", "parameters"}`` calls.

    Each item is one of ``tools`` (only the function ``name`` when given), its ``parameters`` the
    function's parameters schema (``{"type": "object"}`` when it has none). At least one call; at
    most one unless ``parallel``. RequestError if ``name`` is not among the tools.
    """
    functions = [_function(tool) for tool in tools]
    if name is not None:
        functions = [fn for fn in functions if fn["name"] == name]
    if not functions:
        what = f"no tool is named {name!r}" if name is not None else "tools is empty"
        raise RequestError(f"tool_choice needs a tool to call: {what}", param="tool_choice")
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [fn["name"]]},
                "parameters": copy.deepcopy(fn.get("parameters") or {"type": "object"}),
            },
            "required": ["name", "parameters"],
        }
        for fn in functions
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def parse_tool_choice_json(text: str) -> list[ToolCall] | None:
    """The calls of a constrained tool-choice output (see `tool_choice_schema`): a JSON array of
    ``{"name": ..., "parameters": {...}}`` (``"arguments"`` and a single object are accepted too).
    None if the text is not that."""
    return calls_from_value(
        loads_or_none(text), ("parameters", "arguments"), allow_list=True, require_arguments=True
    )


class ToolChoiceStream(ToolCallStream):
    """Streams the calls of a constrained tool-choice output (a JSON array of call objects): each
    call is emitted as soon as its object closes. Output that never forms a call (cut short by
    max_tokens) comes back as content at ``finish``, as `parse_tool_choice_json` would leave it."""

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._search = 0  # the next call object opens at or after this index
        self._start = -1  # where the call object being read opens (-1: none yet)
        self._scanner = JsonContainerScanner()

    def feed(self, delta: str) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        self._buf += delta
        while True:
            if self._start < 0:
                # between calls the grammar allows only "[", ",", "]" and whitespace
                self._start = self._buf.find("{", self._search)
                if self._start < 0:
                    return out
                self._scanner = JsonContainerScanner()
            end = self._scanner.end(self._buf, self._start)
            if end is None:
                return out
            calls = calls_from_value(
                loads_or_none(self._buf[self._start : end]),
                ("parameters", "arguments"),
                allow_list=False,
                require_arguments=True,
            )
            if calls:
                self._emit_calls(out, calls)
            self._search, self._start = end, -1

    def finish(self) -> list[StreamEvent]:
        if self._next_index == 0 and self._buf.strip():
            return [ContentDelta(self._buf)]
        return []


# how the model is told to answer when tool_choice forces a call (the grammar enforces it)
TOOL_CHOICE_PROMPT_FORMAT = (
    'Call functions by answering with a JSON array of calls only: [{"name": <function name>, '
    '"parameters": <its arguments as a JSON object>}]'
)


def render_tools_system_prompt(tools: list[dict[str, Any]], parser: str | None) -> str:
    """A system-prompt text listing ``tools`` and how to call them in ``parser``'s format (None:
    the JSON array of a forced tool choice)."""
    cls = TOOL_CALL_PARSERS.get(parser) if parser is not None else None
    if parser is not None and cls is None:
        raise ConfigError(f"unknown tool-call parser {parser!r}; choose one of {sorted(TOOL_CALL_PARSERS)}")
    lines = ["You can call the following functions, each given as JSON with its parameters' JSON schema:"]
    for tool in tools:
        fn = _function(tool)
        described = {"name": fn["name"], "description": fn.get("description", "")}
        described["parameters"] = fn.get("parameters") or {"type": "object", "properties": {}}
        lines.append(json.dumps(described, ensure_ascii=False))
    if cls is None:
        lines += ["", TOOL_CHOICE_PROMPT_FORMAT]
    else:
        lines += ["", cls.prompt_format, "When no function is needed, answer normally."]
    return "\n".join(lines)

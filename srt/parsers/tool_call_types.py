"""Tool-call parsing: the result and stream-event types, the parser interfaces and the checks that
turn a decoded JSON value into calls.

A call's ``arguments`` is a JSON string, as OpenAI sends it. Calls carry no id: the caller makes one
per call (and per streamed call index).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON object text: json.dumps(args, ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class ContentDelta:
    """Streamed text outside any tool call."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """One piece of streamed call ``index`` (0, 1, ... in output order), OpenAI's streaming shape.

    A call's first delta has its ``name`` and empty ``arguments``; the following ones have
    ``name=None`` and fragments whose concatenation is the call's ``arguments`` string.
    """

    index: int
    name: str | None
    arguments: str


StreamEvent = ContentDelta | ToolCallDelta


class ToolCallStream(ABC):
    """Parses one streamed output: ``feed`` each text delta, then ``finish`` once.

    Content streams as it arrives, except text that may still turn out to be (the start of) a call,
    which is held until decided. At ``finish`` whatever was held and did not become a valid call is
    returned as content, so the stream's content and calls equal ``ToolCallParser.parse`` of the
    whole text (with the content concatenated; ``parse`` gives None for blank content).
    """

    def __init__(self) -> None:
        self._next_index = 0

    @abstractmethod
    def feed(self, delta: str) -> list[StreamEvent]: ...

    @abstractmethod
    def finish(self) -> list[StreamEvent]: ...

    def _emit_calls(self, out: list[StreamEvent], calls: list[ToolCall]) -> None:
        for call in calls:
            out.append(ToolCallDelta(self._next_index, call.name, ""))
            out.append(ToolCallDelta(self._next_index, None, call.arguments))
            self._next_index += 1


class ToolCallParser(ABC):
    """One output format. Stateless: one instance may serve every request."""

    name: ClassVar[str]
    # how the model is told to write calls (used by render_tools_system_prompt)
    prompt_format: ClassVar[str]
    # the format's markers are special tokens: the output must be decoded with them kept
    keeps_special_tokens: ClassVar[bool] = False

    def for_tools(self, tools: list[dict[str, Any]]) -> ToolCallParser:
        """The parser to use for a request offering ``tools`` (OpenAI tool dicts). Formats that
        type arguments by the tools' schemas return a bound copy; the others return ``self``."""
        return self

    @abstractmethod
    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output. Text that is not a valid call, malformed JSON
        included, is content; content is None when blank. Never raises on model output."""

    @abstractmethod
    def stream(self) -> ToolCallStream:
        """A fresh stateful parser for one streamed output."""


def append_content(out: list[StreamEvent], text: str) -> None:
    """Add ``text`` to ``out`` as content, merged into a content delta just before it."""
    if not text:
        return
    if out and isinstance(out[-1], ContentDelta):
        out[-1] = ContentDelta(out[-1].text + text)
    else:
        out.append(ContentDelta(text))


def loads_or_none(text: str) -> Any | None:
    """The JSON value of ``text``, or None when it is not valid JSON (JSON ``null`` reads as None too,
    which no caller accepts as calls)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def call_from_object(obj: Any, arg_keys: tuple[str, ...], *, require_arguments: bool) -> ToolCall | None:
    """The call an object describes: ``{"name": str, <first of arg_keys>: object}``; None if invalid.

    A missing arguments key means ``{}`` unless ``require_arguments``.
    """
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    args: Any = {}
    for key in arg_keys:
        if key in obj:
            args = obj[key]
            break
    else:
        if require_arguments:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def calls_from_value(
    value: Any, arg_keys: tuple[str, ...], *, allow_list: bool, require_arguments: bool
) -> list[ToolCall] | None:
    """Calls from one object or (``allow_list``) a non-empty array of them; None if any is invalid."""
    items = value if allow_list and isinstance(value, list) else [value]
    calls = [call_from_object(item, arg_keys, require_arguments=require_arguments) for item in items]
    if not calls or any(call is None for call in calls):
        return None
    return calls  # type: ignore[return-value]


class JsonContainerScanner:
    """Finds where a JSON array/object ends in text that grows between calls (strings and escapes
    respected, bracket kinds not matched: the JSON decoder judges validity afterwards). One scanner
    serves one container: make a new one for the next."""

    def __init__(self) -> None:
        self._pos = -1
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def end(self, text: str, start: int) -> int | None:
        """End index (exclusive) of the container opening at ``text[start]``, None while it is open.

        Successive calls pass the same ``start`` and the same text, extended; each resumes where the
        last one stopped.
        """
        depth, in_string, escaped = self._depth, self._in_string, self._escaped
        for pos in range(max(self._pos, start), len(text)):
            ch = text[pos]
            if in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif ch in "[{":
                depth += 1
            elif ch in "]}":
                depth -= 1
                if depth == 0:
                    return pos + 1
        self._pos, self._depth, self._in_string, self._escaped = len(text), depth, in_string, escaped
        return None

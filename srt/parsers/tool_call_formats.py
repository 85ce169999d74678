"""The tool-call output formats: llama3 (bare JSON), hermes (``<tool_call>`` blocks), mistral
(``[TOOL_CALLS]`` + JSON array).

Streaming never guesses: a marker format streams content until its marker, holds the call region
until it is complete, then emits the whole call (name, then all of its arguments in one fragment).
Whether a region is a call is decided by the same ``_region`` function in ``parse`` and in the
stream, on the same text, so both give the same content and calls for any chunking.
"""

from __future__ import annotations

import json
from abc import abstractmethod
from typing import ClassVar, NamedTuple

from srt.parsers.markers import NON_SPACE, held_prefix_len, none_if_blank
from srt.parsers.tool_call_types import (
    JsonContainerScanner,
    StreamEvent,
    ToolCall,
    ToolCallParser,
    ToolCallStream,
    append_content,
    call_from_object,
    calls_from_value,
    loads_or_none,
)

_ARG_FORMAT = "<object of argument names and values>"
_ARG_KEYS = ("arguments", "parameters")  # the key the format uses first; the other is accepted


class Region(NamedTuple):
    """A decided call region that starts at a marker.

    end: its length; None means "to the end of the output" (only with ``calls=None``).
    calls: the calls it holds, or None when it is not a valid call (its text is then content).
    """

    end: int | None
    calls: list[ToolCall] | None


class MarkerParser(ToolCallParser):
    """A format whose calls start at ``marker``; text outside call regions is content."""

    marker: ClassVar[str]

    def new_scanner(self) -> JsonContainerScanner:
        """The bracket scanner a region gets (fresh for each region)."""
        return JsonContainerScanner()

    @abstractmethod
    def _region(self, text: str, final: bool, scanner: JsonContainerScanner) -> Region | None:
        """Decide the region at the start of ``text`` (which starts with ``marker``).

        None (only when not ``final``): more text is needed. A decision made on a prefix must hold
        for every extension of it. ``scanner`` is fresh for each region and sees the text grow.
        """

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        content: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while (start := text.find(self.marker, pos)) >= 0:
            content.append(text[pos:start])
            region = self._region(text[start:], True, self.new_scanner())
            assert region is not None
            if region.end is None:
                pos = start
                break
            if region.calls is None:
                content.append(text[start : start + region.end])
            else:
                calls.extend(region.calls)
            pos = start + region.end
        content.append(text[pos:])
        return none_if_blank("".join(content)), calls

    def stream(self) -> ToolCallStream:
        return MarkerStream(self)


class MarkerStream(ToolCallStream):
    def __init__(self, parser: MarkerParser) -> None:
        super().__init__()
        self._parser = parser
        self._held = ""  # text not yet emitted; starts with the marker while in a call region
        self._scanner: JsonContainerScanner | None = None  # set while in a call region
        self._rest_is_content = False

    def feed(self, delta: str) -> list[StreamEvent]:
        self._held += delta
        return self._drain(final=False)

    def finish(self) -> list[StreamEvent]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        marker = self._parser.marker
        while True:
            if self._rest_is_content:
                append_content(out, self._held)
                self._held = ""
                return out
            if self._scanner is None:
                start = self._held.find(marker)
                if start < 0:
                    cut = len(self._held) - (0 if final else held_prefix_len(self._held, marker))
                    append_content(out, self._held[:cut])
                    self._held = self._held[cut:]
                    return out
                append_content(out, self._held[:start])
                self._held = self._held[start:]
                self._scanner = self._parser.new_scanner()
            region = self._parser._region(self._held, final, self._scanner)
            if region is None:
                return out
            self._scanner = None
            if region.end is None:
                self._rest_is_content = True
                continue
            if region.calls is None:
                append_content(out, self._held[: region.end])
            else:
                self._emit_calls(out, region.calls)
            self._held = self._held[region.end :]


class HermesToolCallParser(MarkerParser):
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks (Hermes, Qwen 2.5,
    Qwen 3), any number, with content before, between and after them. An unterminated last block
    is a call if its JSON is one."""

    name = "hermes"
    marker = "<tool_call>"
    end_marker = "</tool_call>"
    prompt_format = (
        "To call a function, write a JSON object with its name and arguments between <tool_call> and "
        "</tool_call> tags:\n"
        f'<tool_call>\n{{"name": <function name>, "arguments": {_ARG_FORMAT}}}\n</tool_call>\n'
        "Write one such block per call; several blocks may follow each other."
    )

    def _region(self, text: str, final: bool, scanner: JsonContainerScanner) -> Region | None:
        close = text.find(self.end_marker, len(self.marker))
        if close >= 0:
            end, body = close + len(self.end_marker), text[len(self.marker) : close]
        elif final:
            end, body = len(text), text[len(self.marker) :]
        else:
            return None
        value = loads_or_none(body)
        return Region(end, calls_from_value(value, _ARG_KEYS, allow_list=False, require_arguments=False))


class MistralToolCallParser(MarkerParser):
    """``[TOOL_CALLS]`` followed by a JSON array of ``{"name": ..., "arguments": {...}}`` (a single
    object is accepted too). Text before the marker is content; an array that is not valid calls
    makes the rest of the output content."""

    name = "mistral"
    marker = "[TOOL_CALLS]"
    prompt_format = (
        "To call functions, write [TOOL_CALLS] followed by a JSON array with one object per call:\n"
        f'[TOOL_CALLS] [{{"name": <function name>, "arguments": {_ARG_FORMAT}}}]'
    )

    def _region(self, text: str, final: bool, scanner: JsonContainerScanner) -> Region | None:
        first = NON_SPACE.search(text, len(self.marker))
        if first is None:
            return Region(None, None) if final else None
        start = first.start()
        if text[start] not in "[{":
            return Region(None, None)
        end = scanner.end(text, start)
        if end is None:
            return Region(None, None) if final else None
        value = loads_or_none(text[start:end])
        calls = calls_from_value(value, _ARG_KEYS, allow_list=True, require_arguments=False)
        return Region(end, calls) if calls is not None else Region(None, None)


PYTHON_TAG = "<|python_tag|>"


def parse_llama3_calls(text: str) -> list[ToolCall] | None:
    """The calls of an output that is entirely JSON call objects (after optional whitespace and
    ``<|python_tag|>``) separated by ``;``; None if any of it is not."""
    body = text.lstrip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :]
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    pos = 0
    while (first := NON_SPACE.search(body, pos)) is not None:
        try:
            obj, pos = decoder.raw_decode(body, first.start())
        except (ValueError, RecursionError):
            return None
        call = call_from_object(obj, ("parameters", "arguments"), require_arguments=True)
        if call is None:
            return None
        calls.append(call)
        sep = NON_SPACE.search(body, pos)
        if sep is None:
            break
        if body[sep.start()] != ";":
            return None
        pos = sep.start() + 1
    return calls or None


class Llama3ToolCallParser(ToolCallParser):
    """Llama 3.x JSON calls: the whole output is ``{"name": ..., "parameters": {...}}`` (or
    ``"arguments"``), or several such objects separated by ``;``, optionally after
    ``<|python_tag|>``. Any other output is content. A streamed output that starts like a call
    (``{`` or the tag) is held to the end, since trailing text would make it all content."""

    name = "llama3"
    prompt_format = (
        "To call a function, reply with only a JSON object of the form "
        f'{{"name": <function name>, "parameters": {_ARG_FORMAT}}}. To call several functions, '
        'separate their objects with "; ". A reply that calls functions holds nothing else.'
    )

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls = parse_llama3_calls(text)
        return (none_if_blank(text), []) if calls is None else (None, calls)

    def stream(self) -> ToolCallStream:
        return _Llama3Stream()


class _Llama3Stream(ToolCallStream):
    _START, _CALLS, _CONTENT = range(3)

    def __init__(self) -> None:
        super().__init__()
        self._state = self._START
        self._held: list[str] = []

    def feed(self, delta: str) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        if self._state == self._CONTENT:
            append_content(out, delta)
            return out
        self._held.append(delta)
        if self._state == self._START:
            head = "".join(self._held)
            stripped = head.lstrip()
            if stripped.startswith(("{", PYTHON_TAG)):
                self._state = self._CALLS
            elif stripped and not PYTHON_TAG.startswith(stripped):
                self._state = self._CONTENT
                self._held = []
                append_content(out, head)
        return out

    def finish(self) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        text = "".join(self._held)
        self._held = []
        calls = parse_llama3_calls(text) if self._state == self._CALLS else None
        if calls is None:
            append_content(out, text)
        else:
            self._emit_calls(out, calls)
        return out

"""gpt-oss's harmony output format: a sequence of messages, each a header then a body,

    <|channel|>analysis<|message|>...<|end|>                                      reasoning
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>
    <|start|>assistant<|channel|>final<|message|>...<|return|>                    the answer

(the recipient ``to=...`` may also sit in the header before ``<|channel|>``). The markers are special
tokens, so outputs are decoded with them kept.

`HarmonyStream` (behind ``--reasoning-parser gpt-oss``, srt/parsers/reasoning.py) returns the analysis bodies as reasoning
and the other bodies as content; a message addressed to ``functions.NAME`` is passed on in content
in one canonical form, ``<|channel|>commentary to=functions.NAME<|message|>ARGS<|call|>``, which
`HarmonyToolCallParser` (``--tool-call-parser gpt-oss``) reads. A header
that finds no ``<|message|>`` within ``MAX_HEADER`` characters is content. Text outside any message is content.
"""

from __future__ import annotations

import re

from srt.parsers.markers import held_prefix_len
from srt.parsers.tool_call_formats import MarkerParser, Region
from srt.parsers.tool_call_types import JsonContainerScanner, call_from_object, loads_or_none

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
_HEADER_STARTS = (START, CHANNEL)
_BODY_ENDS = (END, CALL, RETURN)  # consumed; a new header also ends a body
_MARKERS = (*_HEADER_STARTS, *_BODY_ENDS, MESSAGE)
TOOL_CALL_PREFIX = CHANNEL + "commentary to="

MAX_HEADER = 512

_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


def _earliest(text: str, markers: tuple[str, ...], start: int = 0) -> tuple[int, str]:
    """(index, marker) of the first of ``markers`` in ``text`` from ``start``; (-1, "") if none."""
    best, found = -1, ""
    for marker in markers:
        i = text.find(marker, start)
        if i >= 0 and (best < 0 or i < best):
            best, found = i, marker
    return best, found


def _held(text: str) -> int:
    """How many trailing characters may be the start of a marker."""
    return max(held_prefix_len(text, marker) for marker in _MARKERS)


class HarmonyStream:
    """Splits a harmony output into (reasoning, content): ``feed`` each text delta, then ``finish``
    once; each returns the new (reasoning, content) text. Fed whole, it is the one-shot split."""

    _OUTSIDE, _HEADER, _BODY = range(3)
    _REASONING_BODY, _CONTENT_BODY, _TOOL_BODY = range(3)

    def __init__(self) -> None:
        self._held = ""
        self._mode = self._OUTSIDE
        self._body = self._CONTENT_BODY

    def feed(self, delta: str) -> tuple[str, str]:
        self._held += delta
        return self._drain(final=False)

    def finish(self) -> tuple[str, str]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self._mode == self._OUTSIDE:
                at, _ = _earliest(self._held, _HEADER_STARTS)
                if at < 0:
                    cut = len(self._held) - (0 if final else _held(self._held))
                    content.append(self._held[:cut])
                    self._held = self._held[cut:]
                    break
                content.append(self._held[:at])
                self._held, self._mode = self._held[at:], self._HEADER
            elif self._mode == self._HEADER:
                if not self._read_header(final, content):
                    break
            elif not self._read_body(final, reasoning, content):
                break
        return "".join(reasoning), "".join(content)

    def _read_header(self, final: bool, content: list[str]) -> bool:
        """Classify the message whose header starts ``_held``; False when more text is needed."""
        at = self._held.find(MESSAGE, 0, MAX_HEADER + len(MESSAGE))
        if at < 0:
            if final or len(self._held) >= MAX_HEADER + len(MESSAGE):
                # not a header after all: its opening marker is content, the rest is read again
                opening = next(m for m in _HEADER_STARTS if self._held.startswith(m))
                content.append(opening)
                self._held, self._mode = self._held[len(opening) :], self._OUTSIDE
                return True
            return False
        header, self._held = self._held[:at], self._held[at + len(MESSAGE) :]
        channel = _CHANNEL_NAME.search(header)
        recipient = _RECIPIENT.search(header)
        self._mode = self._BODY
        if recipient is not None and recipient.group(1).startswith("functions."):
            self._body = self._TOOL_BODY
            content.append(f"{TOOL_CALL_PREFIX}{recipient.group(1)}{MESSAGE}")
        elif channel is not None and channel.group(1) == "analysis":
            self._body = self._REASONING_BODY
        else:
            self._body = self._CONTENT_BODY
        return True

    def _read_body(self, final: bool, reasoning: list[str], content: list[str]) -> bool:
        """Pass on the body being read; False when more text is needed."""
        out = reasoning if self._body == self._REASONING_BODY else content
        at, marker = _earliest(self._held, _BODY_ENDS + _HEADER_STARTS)
        if at < 0:
            cut = len(self._held) - (0 if final else _held(self._held))
            out.append(self._held[:cut])
            self._held = self._held[cut:]
            return False
        out.append(self._held[:at])
        if self._body == self._TOOL_BODY:
            content.append(CALL)
        self._held = self._held[at + len(marker) :] if marker in _BODY_ENDS else self._held[at:]
        self._mode = self._OUTSIDE
        return True


class HarmonyToolCallParser(MarkerParser):
    """``--tool-call-parser gpt-oss``: ``<|channel|>commentary to=functions.NAME [<|constrain|>json]
    <|message|>{...}<|call|>`` (the form `HarmonyReasoningParser` passes calls on in). A call
    whose arguments are not a JSON object is content; so is a header cut short."""

    name = "gpt-oss"
    marker = TOOL_CALL_PREFIX
    keeps_special_tokens = True
    prompt_format = (
        "To call a function, write <|channel|>commentary to=functions.<function name> "
        "<|constrain|>json<|message|><object of argument names and values><|call|>"
    )

    def _region(self, text: str, final: bool, scanner: JsonContainerScanner) -> Region | None:
        at = text.find(MESSAGE, len(self.marker))
        if at < 0:
            return Region(None, None) if final else None
        words = text[len(self.marker) : at].replace("<|constrain|>", " ").split()
        start = at + len(MESSAGE)
        if not words or not words[0].startswith("functions.") or words[0] == "functions.":
            return Region(start, None)
        close = text.find(CALL, start)
        if close >= 0:
            end, body = close + len(CALL), text[start:close]
        elif final:
            end, body = len(text), text[start:]
        else:
            return None
        obj = {"name": words[0][len("functions.") :], "arguments": loads_or_none(body)}
        call = call_from_object(obj, ("arguments",), require_arguments=True)
        return Region(end, None if call is None else [call])

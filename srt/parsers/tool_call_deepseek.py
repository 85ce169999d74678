"""DeepSeek's tool-call formats: a block of calls between ``<｜tool▁calls▁begin｜>`` and
``<｜tool▁calls▁end｜>``, each call between ``<｜tool▁call▁begin｜>`` and ``<｜tool▁call▁end｜>``.

    deepseekv3   DeepSeek-V3 (0324): ``function<｜tool▁sep｜>NAME`` then the arguments as JSON in a
                 fenced block, ``\\n```json\\n{...}\\n```;``
    deepseekv31  DeepSeek-V3.1: ``NAME<｜tool▁sep｜>{...}``.

A block decides as one: every call in it must be valid, else the whole block is content. A block cut
short (no closing marker at the end of the output) is calls if the calls in it are complete.
"""

from __future__ import annotations

from abc import abstractmethod

from srt.parsers.markers import NON_SPACE
from srt.parsers.tool_call_formats import MarkerParser, Region
from srt.parsers.tool_call_types import JsonContainerScanner, ToolCall, call_from_object, loads_or_none

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"
_FENCE = "```"


def _call(name: str, arguments: str) -> ToolCall | None:
    name = name.strip()
    return call_from_object(
        {"name": name, "arguments": loads_or_none(arguments)}, ("arguments",), require_arguments=True
    )


class _DeepSeekParser(MarkerParser):
    marker = CALLS_BEGIN

    @abstractmethod
    def _parse_call(self, text: str) -> ToolCall | None:
        """The call between one ``CALL_BEGIN`` and its ``CALL_END`` (exclusive); None if invalid."""

    def _region(self, text: str, final: bool, scanner: JsonContainerScanner) -> Region | None:
        close = text.find(CALLS_END, len(self.marker))
        if close >= 0:
            end, body = close + len(CALLS_END), text[len(self.marker) : close]
        elif final:
            end, body = len(text), text[len(self.marker) :]
        else:
            return None
        return Region(end, self._parse_block(body))

    def _parse_block(self, body: str) -> list[ToolCall] | None:
        calls: list[ToolCall] = []
        pos = 0
        while (first := NON_SPACE.search(body, pos)) is not None:
            if not body.startswith(CALL_BEGIN, first.start()):
                return None
            start = first.start() + len(CALL_BEGIN)
            stop = body.find(CALL_END, start)
            if stop < 0:
                return None
            call = self._parse_call(body[start:stop])
            if call is None:
                return None
            calls.append(call)
            pos = stop + len(CALL_END)
        return calls or None


class DeepSeekV3ToolCallParser(_DeepSeekParser):
    """DeepSeek-V3: ``function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```;`` per call (the fence is
    optional)."""

    name = "deepseekv3"
    prompt_format = (
        "To call functions, write:\n"
        f"{CALLS_BEGIN}{CALL_BEGIN}function{TOOL_SEP}<function name>\n```json\n"
        f"<object of argument names and values>\n```{CALL_END}{CALLS_END}\n"
        f"with one {CALL_BEGIN}...{CALL_END} per call."
    )

    def _parse_call(self, text: str) -> ToolCall | None:
        kind, sep, rest = text.partition(TOOL_SEP)
        if not sep or kind.strip() != "function":
            return None
        name, newline, args = rest.partition("\n")
        if not newline:
            return None
        args = args.strip()
        if args.startswith(_FENCE):
            fence_line, _, args = args.partition("\n")
            if fence_line[len(_FENCE) :].strip() not in ("", "json"):
                return None
            args = args.rstrip()
            if not args.endswith(_FENCE):
                return None
            args = args[: -len(_FENCE)]
        return _call(name, args)


class DeepSeekV31ToolCallParser(_DeepSeekParser):
    """DeepSeek-V3.1: ``NAME<｜tool▁sep｜>{...}`` per call."""

    name = "deepseekv31"
    prompt_format = (
        "To call functions, write:\n"
        f"{CALLS_BEGIN}{CALL_BEGIN}<function name>{TOOL_SEP}<object of argument names and values>"
        f"{CALL_END}{CALLS_END}\nwith one {CALL_BEGIN}...{CALL_END} per call."
    )

    def _parse_call(self, text: str) -> ToolCall | None:
        name, sep, args = text.partition(TOOL_SEP)
        if not sep or "\n" in name.strip():
            return None
        return _call(name, args)

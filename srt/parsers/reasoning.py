"""Reasoning parsers: split a model's output into ``reasoning_content`` and ``content``.

The reasoning section ends at the first ``</think>``. Where it starts depends on the model:

    deepseek-r1  the output starts inside the reasoning (the chat template may already have written
                 ``<think>``); a leading ``<think>`` (after whitespace) is dropped. Without a
                 ``</think>`` the whole output is reasoning.
    qwen3        the output has reasoning only when it starts with ``<think>`` (after whitespace);
                 otherwise it is all content. Without a ``</think>`` the rest is reasoning.
    deepseek-v3  DeepSeek-V3.1 / V3.2 (hybrid thinking): as qwen3.
    qwen3-thinking  Qwen3 thinking-only models (the template opens ``<think>``): as deepseek-r1.

``gpt-oss`` reads the harmony channels instead (srt/parsers/harmony.py): analysis messages are the
reasoning, the rest is content.

Newlines right after ``</think>`` are not part of the content. ``parse(text)`` works on a whole output;
``stream()`` gives a `ReasoningStream` whose deltas concatenate to exactly what ``parse`` returns (an
empty string where ``parse`` gives None): it holds back a possible partial tag at a chunk's end and,
before the output's first non-space character, the leading whitespace.
"""

from __future__ import annotations

from typing import ClassVar

from srt.parsers.harmony import HarmonyStream
from srt.parsers.markers import held_prefix_len
from srt.utils.errors import ConfigError

THINK_START = "<think>"
THINK_END = "</think>"
_AFTER_END_STRIP = "\r\n"


class ReasoningParser:
    """Splits one output into (reasoning_content, content); stateless, one instance may be shared."""

    name: ClassVar[str]
    # True: output without a leading <think> is reasoning up to </think> (deepseek-r1); False: content
    starts_in_reasoning: ClassVar[bool]
    # the format's markers are special tokens: the output must be decoded with them kept
    keeps_special_tokens: ClassVar[bool] = False

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole output; each None when empty."""
        stripped = text.lstrip()
        if stripped.startswith(THINK_START):
            body = stripped[len(THINK_START) :]
        elif self.starts_in_reasoning:
            body = text
        else:
            return None, text or None
        reasoning, end_tag, rest = body.partition(THINK_END)
        if not end_tag:
            return reasoning or None, None
        return reasoning or None, rest.lstrip(_AFTER_END_STRIP) or None

    def stream(self) -> ReasoningStream | HarmonyStream:
        """A fresh stateful splitter for one streamed output."""
        return ReasoningStream(self.starts_in_reasoning)


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek-r1"
    starts_in_reasoning = True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    starts_in_reasoning = False


class DeepSeekV3ReasoningParser(ReasoningParser):
    name = "deepseek-v3"
    starts_in_reasoning = False


class Qwen3ThinkingReasoningParser(ReasoningParser):
    name = "qwen3-thinking"
    starts_in_reasoning = True


class GptOssReasoningParser(ReasoningParser):
    """gpt-oss's harmony channels: analysis is reasoning; final and commentary are content, tool
    calls (to=functions.NAME) passed on for ``--tool-call-parser gpt-oss``."""

    name = "gpt-oss"
    starts_in_reasoning = False
    keeps_special_tokens = True

    def parse(self, text: str) -> tuple[str | None, str | None]:
        stream = self.stream()
        r1, c1 = stream.feed(text)
        r2, c2 = stream.finish()
        return (r1 + r2) or None, (c1 + c2) or None

    def stream(self) -> HarmonyStream:
        return HarmonyStream()


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls
    for cls in (
        DeepSeekR1ReasoningParser,
        Qwen3ReasoningParser,
        DeepSeekV3ReasoningParser,
        Qwen3ThinkingReasoningParser,
        GptOssReasoningParser,
    )
}


def create_reasoning_parser(name: str) -> ReasoningParser:
    """The parser registered as ``name``; ConfigError naming the known ones otherwise."""
    cls = REASONING_PARSERS.get(name)
    if cls is None:
        raise ConfigError(f"unknown reasoning parser {name!r}; choose one of {sorted(REASONING_PARSERS)}")
    return cls()


class ReasoningStream:
    """Splits a streamed output: ``feed(delta)`` and, at the end, ``finish()`` each return
    (reasoning delta, content delta)."""

    # states, in the order an output passes through them
    _START = 0  # before the first non-space character: is there a leading <think>?
    _REASONING = 1  # inside the reasoning, looking for </think>
    _AFTER_END = 2  # after </think>, dropping newlines
    _CONTENT = 3  # everything else is content

    def __init__(self, starts_in_reasoning: bool) -> None:
        self._starts_in_reasoning = starts_in_reasoning
        self._state = self._START
        self._held = ""

    def feed(self, delta: str) -> tuple[str, str]:
        self._held += delta
        return self._drain(final=False)

    def finish(self) -> tuple[str, str]:
        """Flush what was held back; call once, after the last ``feed``."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, str]:
        if self._state == self._START and not self._decide_start(final):
            return "", ""
        reasoning = ""
        if self._state == self._REASONING:
            text = self._held
            end = text.find(THINK_END)
            if end < 0:
                keep = 0 if final else held_prefix_len(text, THINK_END)
                self._held = text[len(text) - keep :]
                return text[: len(text) - keep], ""
            reasoning, self._held = text[:end], text[end + len(THINK_END) :]
            self._state = self._AFTER_END
        if self._state == self._AFTER_END:
            self._held = self._held.lstrip(_AFTER_END_STRIP)
            if not self._held:
                return reasoning, ""
            self._state = self._CONTENT
        content, self._held = self._held, ""
        return reasoning, content

    def _decide_start(self, final: bool) -> bool:
        """Leave the start state once the held text shows whether the output opens with <think>."""
        stripped = self._held.lstrip()
        if stripped.startswith(THINK_START):
            self._held = stripped[len(THINK_START) :]
            self._state = self._REASONING
            return True
        if not final and THINK_START.startswith(stripped):
            return False
        self._state = self._REASONING if self._starts_in_reasoning else self._CONTENT
        return True

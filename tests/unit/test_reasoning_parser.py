"""Reasoning parsers: expected splits of recorded-style outputs, and streaming == parse for every chunking."""

from __future__ import annotations

import random

import pytest

from srt.parsers.reasoning import REASONING_PARSERS, ReasoningParser, create_reasoning_parser
from srt.utils.errors import ConfigError

# (parser, output, reasoning_content, content)
CASES = [
    ("deepseek-r1", "Okay, 2+2 is 4.\n</think>\n\nThe answer is 4.", "Okay, 2+2 is 4.\n", "The answer is 4."),
    ("deepseek-r1", "<think>\nHmm.\n</think>\n\nYes.", "\nHmm.\n", "Yes."),
    ("deepseek-r1", "  \n<think>Hmm.</think>Yes.", "Hmm.", "Yes."),
    ("deepseek-r1", "still thinking, no end tag", "still thinking, no end tag", None),
    ("deepseek-r1", "</think>\n\nOnly an answer.", None, "Only an answer."),
    ("deepseek-r1", "reason</think>\n\n", "reason", None),
    ("deepseek-r1", "a < b </thin k> c </think>\n  indented", "a < b </thin k> c ", "  indented"),
    ("deepseek-r1", "first</think>\nsecond </think> kept", "first", "second </think> kept"),
    ("deepseek-r1", "Überlegung: 日本語 ✓</think>\r\n答え", "Überlegung: 日本語 ✓", "答え"),
    ("deepseek-r1", "", None, None),
    ("deepseek-r1", "  <thi", "  <thi", None),
    ("qwen3", "<think>\nLet me see.\n</think>\n\nParis.", "\nLet me see.\n", "Paris."),
    ("qwen3", "\n\n<think>x</think>y", "x", "y"),
    ("qwen3", "Paris is the capital.", None, "Paris is the capital."),
    ("qwen3", "Paris.</think> not a tag here", None, "Paris.</think> not a tag here"),
    ("qwen3", "<think>never closed", "never closed", None),
    ("qwen3", "<think></think>\n\nDirect answer.", None, "Direct answer."),
    ("qwen3", "  <thinking> is not the tag", None, "  <thinking> is not the tag"),
    ("qwen3", "  <thi", None, "  <thi"),
    ("qwen3", "   ", None, "   "),
    ("qwen3", "", None, None),
    ("deepseek-v3", "<think>Plan.</think>\n\nDone.", "Plan.", "Done."),
    ("deepseek-v3", "Direct answer, no reasoning.", None, "Direct answer, no reasoning."),
    (
        "qwen3-thinking",
        "Thinking without a start tag.\n</think>\n\nParis.",
        "Thinking without a start tag.\n",
        "Paris.",
    ),
    ("qwen3-thinking", "<think>x</think>y", "x", "y"),
    ("qwen3-thinking", "never closed", "never closed", None),
]

_SEEDS = range(5)


def _chunkings(text: str):
    """Every 2-piece split, 1- and 3-character chunks, and seeded random chunk sizes."""
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]
    for size in (1, 3):
        yield [text[i : i + size] for i in range(0, len(text), size)]
    for seed in _SEEDS:
        rng = random.Random(seed)
        chunks, pos = [], 0
        while pos < len(text):
            step = rng.randint(1, 8)
            chunks.append(text[pos : pos + step])
            pos += step
        yield chunks


def _stream(parser: ReasoningParser, chunks: list[str]) -> tuple[str, str]:
    stream = parser.stream()
    reasoning, content = [], []
    for chunk in chunks:
        r, c = stream.feed(chunk)
        reasoning.append(r)
        content.append(c)
    r, c = stream.finish()
    return "".join(reasoning) + r, "".join(content) + c


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_parse(name: str, text: str, reasoning: str | None, content: str | None) -> None:
    assert create_reasoning_parser(name).parse(text) == (reasoning, content)


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_stream_equals_parse_for_every_chunking(
    name: str, text: str, reasoning: str | None, content: str | None
) -> None:
    parser = create_reasoning_parser(name)
    for chunks in _chunkings(text):
        assert _stream(parser, chunks) == (reasoning or "", content or ""), chunks


def test_stream_emits_without_waiting_and_holds_partial_tags() -> None:
    stream = create_reasoning_parser("deepseek-r1").stream()
    assert stream.feed("Let me think") == ("Let me think", "")
    assert stream.feed(" more </thi") == (" more ", "")  # "</thi" may become </think>
    assert stream.feed("nk>\n") == ("", "")  # newlines after </think> are dropped
    assert stream.feed("\nAnswer") == ("", "Answer")
    assert stream.feed(" </think> stays") == ("", " </think> stays")
    assert stream.finish() == ("", "")

    stream = create_reasoning_parser("qwen3").stream()
    assert stream.feed("  <th") == ("", "")  # still possibly <think>
    assert stream.feed("e answer") == ("", "  <the answer")
    assert stream.finish() == ("", "")


def test_registry_names_and_unknown_name() -> None:
    assert set(REASONING_PARSERS) == {"deepseek-r1", "qwen3", "deepseek-v3", "qwen3-thinking", "gpt-oss"}
    with pytest.raises(ConfigError, match="deepseek-r1"):
        create_reasoning_parser("nope")

"""Tool-call parsers: recorded-style outputs of each format, malformed ones (content, never an
exception), streaming == parse for every chunking, and the tool_choice helpers."""

from __future__ import annotations

import json
import random

import pytest

from srt.parsers.tool_calls import (
    TOOL_CALL_PARSERS,
    ContentDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    create_tool_call_parser,
    parse_tool_choice_json,
    render_tools_system_prompt,
    tool_choice_schema,
)
from srt.utils.errors import ConfigError, RequestError

WEATHER = {"city": "Paris", "unit": "celsius"}
NESTED = {"filter": {"tags": ["a", "b]", "{c}"], "range": {"min": 1, "max": 2.5}}, "flag": True, "none": None}
UNICODE = {"city": "Zürich", "note": '日本語 ✓ "quoted" back\\slash'}


def _call(name: str, args: dict) -> ToolCall:
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _hermes_block(name: str, args: object, key: str = "arguments") -> str:
    return f"<tool_call>\n{json.dumps({'name': name, key: args}, ensure_ascii=False)}\n</tool_call>"


def _llama(name: str, args: object, key: str = "parameters") -> str:
    return json.dumps({"name": name, key: args}, ensure_ascii=False)


def _mistral(*calls: tuple[str, object]) -> str:
    return "[TOOL_CALLS] " + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)


def _as_content(name: str, text: str) -> tuple[str, str, str | None, list[ToolCall]]:
    """A case whose whole output is content (None when blank)."""
    return name, text, text if text.strip() else None, []


# (parser, output, content, calls)
HERMES = [
    ("hermes", _hermes_block("get_weather", WEATHER), None, [_call("get_weather", WEATHER)]),
    (
        "qwen25",
        "Let me check both.\n"
        + _hermes_block("get_weather", WEATHER)
        + "\n"
        + _hermes_block("search", NESTED),
        "Let me check both.\n\n",
        [_call("get_weather", WEATHER), _call("search", NESTED)],
    ),
    ("qwen", _hermes_block("lookup", UNICODE) + "\n", None, [_call("lookup", UNICODE)]),
    ("hermes", _hermes_block("now", {}), None, [_call("now", {})]),
    ("hermes", '<tool_call>\n{"name": "now"}\n</tool_call>', None, [_call("now", {})]),
    ("hermes", _hermes_block("f", WEATHER, key="parameters"), None, [_call("f", WEATHER)]),
    ("hermes", "Sure.\n<tool_call>\n" + _llama("f", WEATHER, "arguments"), "Sure.\n", [_call("f", WEATHER)]),
    # malformed: the block is content, the other blocks still count
    (
        "hermes",
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>\n' + _hermes_block("g", WEATHER),
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>\n',
        [_call("g", WEATHER)],
    ),
    ("hermes", 'Hi <tool_call>\n{"name": "f", "argu', 'Hi <tool_call>\n{"name": "f", "argu', []),
    ("hermes", _hermes_block("f", [1, 2]), _hermes_block("f", [1, 2]), []),
    ("hermes", _hermes_block("f", '{"a": 1}'), _hermes_block("f", '{"a": 1}'), []),
    _as_content("hermes", '<tool_call>\n{"name": 5, "arguments": {}}\n</tool_call>'),
    _as_content("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>'),
    _as_content("hermes", "<tool_call>\n[1, 2]\n</tool_call>"),
    _as_content("hermes", "<tool_call></tool_call>"),
    _as_content("hermes", "<tool_call>"),
    ("hermes", "a < b and <tool_c", "a < b and <tool_c", []),
    ("hermes", "no calls at all, <b>html</b>", "no calls at all, <b>html</b>", []),
    _as_content("hermes", ""),
]

LLAMA3 = [
    ("llama3", _llama("get_weather", WEATHER), None, [_call("get_weather", WEATHER)]),
    ("llama3", "<|python_tag|>" + _llama("get_weather", WEATHER), None, [_call("get_weather", WEATHER)]),
    ("llama3", "\n  " + _llama("lookup", UNICODE, "arguments") + "\n", None, [_call("lookup", UNICODE)]),
    (
        "llama3",
        _llama("a", {"q": "x; y"}) + "; " + _llama("b", NESTED) + ";\n",
        None,
        [_call("a", {"q": "x; y"}), _call("b", NESTED)],
    ),
    ("llama3", "The answer is 42.", "The answer is 42.", []),
    ("llama3", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3", '{"name": "f"}', '{"name": "f"}', []),
    ("llama3", _llama("f", {}) + " and more", _llama("f", {}) + " and more", []),
    ("llama3", _llama("f", [1]), _llama("f", [1]), []),
    ("llama3", _llama("f", {}) + " " + _llama("g", {}), _llama("f", {}) + " " + _llama("g", {}), []),
    ("llama3", '{"name": "f", "parameters": {', '{"name": "f", "parameters": {', []),
    ("llama3", '{"name": 3, "parameters": {}}', '{"name": 3, "parameters": {}}', []),
    ("llama3", "<|python_tag|>", "<|python_tag|>", []),
    ("llama3", "<|python", "<|python", []),
    ("llama3", "  <b>bold</b>", "  <b>bold</b>", []),
    ("llama3", "[1, 2]", "[1, 2]", []),
    ("llama3", "  ", None, []),
]

MISTRAL = [
    ("mistral", _mistral(("get_weather", WEATHER)), None, [_call("get_weather", WEATHER)]),
    (
        "mistral",
        "Checking. " + _mistral(("get_weather", WEATHER), ("search", NESTED), ("lookup", UNICODE)),
        "Checking. ",
        [_call("get_weather", WEATHER), _call("search", NESTED), _call("lookup", UNICODE)],
    ),
    ("mistral", '[TOOL_CALLS]{"name": "f", "arguments": {"a": [1]}}', None, [_call("f", {"a": [1]})]),
    ("mistral", '[TOOL_CALLS] [{"name": "now"}] done', " done", [_call("now", {})]),
    ("mistral", "See [1] and [TOOL_C", "See [1] and [TOOL_C", []),
    _as_content("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}]'),
    _as_content("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": "x"}] rest'),
    _as_content("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {}}, {"name": null}]'),
    _as_content("mistral", "[TOOL_CALLS] []"),
    _as_content("mistral", "[TOOL_CALLS] [} then " + _mistral(("f", {}))),  # bad array: the rest is content
    _as_content("mistral", "[TOOL_CALLS] call f please"),
    _as_content("mistral", "[TOOL_CALLS]   "),
    _as_content("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"s": "]}\\""}}'),
]

CASES = HERMES + LLAMA3 + MISTRAL


def _chunkings(text: str):
    """Every 2-piece split, 1- and 3-character chunks, and seeded random chunk sizes."""
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]
    for size in (1, 3):
        yield [text[i : i + size] for i in range(0, len(text), size)]
    for seed in range(5):
        rng = random.Random(seed)
        chunks, pos = [], 0
        while pos < len(text):
            step = rng.randint(1, 12)
            chunks.append(text[pos : pos + step])
            pos += step
        yield chunks


def _collect(events: list) -> tuple[str, list[ToolCall]]:
    """Content and calls of a stream's events, checking OpenAI's delta order on the way."""
    content: list[str] = []
    names: list[str] = []
    args: list[list[str]] = []
    for event in events:
        if isinstance(event, ContentDelta):
            assert event.text
            content.append(event.text)
            continue
        assert isinstance(event, ToolCallDelta)
        if event.name is not None:  # a new call: indexes count up from 0
            assert event.index == len(names) and event.arguments == ""
            names.append(event.name)
            args.append([])
        else:
            assert event.index == len(names) - 1
            args[-1].append(event.arguments)
    return "".join(content), [ToolCall(n, "".join(a)) for n, a in zip(names, args)]


def _stream(parser: ToolCallParser, chunks: list[str]) -> tuple[str, list[ToolCall]]:
    stream = parser.stream()
    events = []
    for chunk in chunks:
        events += stream.feed(chunk)
    events += stream.finish()
    return _collect(events)


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_parse(name: str, text: str, content: str | None, calls: list[ToolCall]) -> None:
    assert create_tool_call_parser(name).parse(text) == (content, calls)


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_stream_equals_parse_for_every_chunking(
    name: str, text: str, content: str | None, calls: list[ToolCall]
) -> None:
    parser = create_tool_call_parser(name)
    for chunks in _chunkings(text):
        streamed_content, streamed_calls = _stream(parser, chunks)
        assert streamed_calls == calls, chunks
        if content is None:
            assert not streamed_content.strip(), chunks
        else:
            assert streamed_content == content, chunks


def test_arguments_are_openai_json_strings() -> None:
    _, calls = create_tool_call_parser("hermes").parse(_hermes_block("lookup", UNICODE))
    assert calls[0].arguments == json.dumps(UNICODE, ensure_ascii=False)
    assert "Zürich" in calls[0].arguments and json.loads(calls[0].arguments) == UNICODE


def test_content_streams_at_once_and_only_a_possible_marker_is_held() -> None:
    stream = create_tool_call_parser("hermes").stream()
    assert stream.feed("Hello wor") == [ContentDelta("Hello wor")]
    assert stream.feed("ld <tool_c") == [ContentDelta("ld ")]
    assert stream.feed('all>\n{"name": "f", "arguments": {"a": 1}}') == []
    assert stream.feed("\n</tool_call>\nbye") == [
        ToolCallDelta(0, "f", ""),
        ToolCallDelta(0, None, '{"a": 1}'),
        ContentDelta("\nbye"),
    ]
    assert stream.finish() == []

    stream = create_tool_call_parser("mistral").stream()
    assert stream.feed("See [") == [ContentDelta("See ")]  # "[" may start [TOOL_CALLS]
    assert stream.feed("1]") == [ContentDelta("[1]")]
    assert stream.feed(' [TOOL_CALLS] [{"name": "f"}') == [ContentDelta(" ")]
    assert stream.feed("]") == [ToolCallDelta(0, "f", ""), ToolCallDelta(0, None, "{}")]

    stream = create_tool_call_parser("llama3").stream()
    assert stream.feed("  ") == []
    assert stream.feed("Hi") == [ContentDelta("  Hi")]
    stream = create_tool_call_parser("llama3").stream()
    assert stream.feed(_llama("f", {})) == []  # held: trailing text would make it content
    assert stream.finish() == [ToolCallDelta(0, "f", ""), ToolCallDelta(0, None, "{}")]


def test_deeply_nested_json_is_content_not_an_exception() -> None:
    deep = "[" * 100_000 + "]" * 100_000
    for name, text in [
        ("hermes", f"<tool_call>{deep}</tool_call>"),
        ("llama3", "{" + '"a":' + deep + "}"),
        ("mistral", "[TOOL_CALLS] " + deep),
    ]:
        assert create_tool_call_parser(name).parse(text) == (text, [])
    assert parse_tool_choice_json(deep) is None


def test_registry_names_aliases_and_unknown_name() -> None:
    assert set(TOOL_CALL_PARSERS) == {
        "llama3", "hermes", "qwen25", "qwen", "mistral", "pythonic", "deepseekv3", "deepseekv31",
        "qwen3_coder", "gpt-oss",
    }  # fmt: skip
    assert TOOL_CALL_PARSERS["qwen25"] is TOOL_CALL_PARSERS["qwen"] is TOOL_CALL_PARSERS["hermes"]
    with pytest.raises(ConfigError, match="hermes"):
        create_tool_call_parser("llama4")


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "description": "The time"}},
]


def test_parse_tool_choice_json() -> None:
    text = json.dumps([{"name": "get_weather", "parameters": WEATHER}, {"name": "now", "parameters": {}}])
    assert parse_tool_choice_json(text) == [_call("get_weather", WEATHER), _call("now", {})]
    assert parse_tool_choice_json(' {"name": "now", "arguments": {}} ') == [_call("now", {})]
    for bad in ["", "[]", "{", '[{"name": "now"}]', '[{"name": 1, "parameters": {}}]', '"now"', "null"]:
        assert parse_tool_choice_json(bad) is None, bad
    assert parse_tool_choice_json('[{"name": "now", "parameters": []}]') is None


def test_tool_choice_schema_shape() -> None:
    schema = tool_choice_schema(TOOLS, None, parallel=True)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    first, second = schema["items"]["anyOf"]
    assert first == {
        "type": "object",
        "properties": {
            "name": {"type": "string", "enum": ["get_weather"]},
            "parameters": TOOLS[0]["function"]["parameters"],
        },
        "required": ["name", "parameters"],
    }
    assert first["properties"]["parameters"] is not TOOLS[0]["function"]["parameters"]  # a copy
    assert second["properties"]["parameters"] == {"type": "object"}

    named = tool_choice_schema(TOOLS, "now", parallel=False)
    assert named["maxItems"] == 1 and len(named["items"]["anyOf"]) == 1
    assert named["items"]["anyOf"][0]["properties"]["name"]["enum"] == ["now"]
    with pytest.raises(RequestError, match="missing"):
        tool_choice_schema(TOOLS, "missing", parallel=False)
    with pytest.raises(RequestError):
        tool_choice_schema([], None, parallel=True)


def test_tool_choice_schema_validates_what_parse_tool_choice_json_reads() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = tool_choice_schema(TOOLS, None, parallel=True)
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "now", "parameters": {}}]
    jsonschema.validate(good, schema)
    assert parse_tool_choice_json(json.dumps(good)) == [
        _call("get_weather", {"city": "Paris"}),
        _call("now", {}),
    ]
    for bad in [
        [],
        [{"name": "get_weather", "parameters": {}}],  # city is required
        [{"name": "other", "parameters": {}}],
        [{"name": "now"}],
    ]:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = tool_choice_schema(TOOLS, "now", parallel=False)
    jsonschema.validate([{"name": "now", "parameters": {}}], single)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "now", "parameters": {}}] * 2, single)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good[:1], single)


@pytest.mark.parametrize("parser", sorted(TOOL_CALL_PARSERS))
def test_render_tools_system_prompt(parser: str) -> None:
    prompt = render_tools_system_prompt(TOOLS, parser)
    assert "get_weather" in prompt and "Current weather in a city" in prompt and '"now"' in prompt
    marker = {
        "llama3": '"parameters"',
        "mistral": "[TOOL_CALLS]",
        "pythonic": "[func_name1(",
        "deepseekv3": "<｜tool▁sep｜>",
        "deepseekv31": "<｜tool▁sep｜>",
        "qwen3_coder": "<function=",
        "gpt-oss": "to=functions.",
    }.get(parser, "<tool_call>")
    assert marker in prompt
    with pytest.raises(ConfigError):
        render_tools_system_prompt(TOOLS, "unknown")


def test_tool_choice_schema_compiles_to_a_grammar() -> None:
    xgrammar = pytest.importorskip("xgrammar")
    for name, parallel in [(None, True), ("get_weather", False)]:
        xgrammar.Grammar.from_json_schema(json.dumps(tool_choice_schema(TOOLS, name, parallel)))

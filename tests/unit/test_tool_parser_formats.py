"""The pythonic, DeepSeek, Qwen3-Coder and gpt-oss (harmony) tool-call formats and the gpt-oss
reasoning split: recorded-style outputs, malformed ones (content, never an exception, no text lost),
streaming == parse for every chunking, and the flag choices."""

from __future__ import annotations

import json

import pytest

from srt.entrypoints.openai.serving_chat import OpenAIServingChat
from srt.parsers.reasoning import create_reasoning_parser
from srt.parsers.tool_calls import TOOL_CALL_PARSERS, ToolCall, create_tool_call_parser
from srt.server_args import ServerArgs
from srt.utils.errors import ConfigError
from tests.unit.test_reasoning_parser import _stream as _reasoning_stream
from tests.unit.test_tool_parsers import NESTED, UNICODE, WEATHER, _call, _chunkings, _stream


def _content(name: str, text: str) -> tuple[str, str, str | None, list[ToolCall]]:
    return name, text, text if text.strip() else None, []


PYTHONIC = [
    ("pythonic", '[get_weather(city="Paris", unit="celsius")]', None, [_call("get_weather", WEATHER)]),
    (
        "pythonic",
        "Let me check. [get_weather(city='Paris', unit=\"celsius\"), search(filter={'tags': ['a', 'b]', "
        "'{c}'], 'range': {'min': 1, 'max': 2.5}}, flag=True, none=None)]",
        "Let me check. ",
        [_call("get_weather", WEATHER), _call("search", NESTED)],
    ),
    (
        "pythonic",
        "[f(a=true, b=null, c=false, d=(1, -2), e=+3)]",
        None,
        [_call("f", {"a": True, "b": None, "c": False, "d": [1, -2], "e": 3})],
    ),  # fmt: skip
    (
        "pythonic",
        "[lookup(city='Zürich', note='日本語 ✓ \"quoted\" back\\\\slash')]",
        None,
        [_call("lookup", UNICODE)],
    ),  # fmt: skip
    ("pythonic", "[now()] done", " done", [_call("now", {})]),
    ("pythonic", 'A [f(x=1)] B [g(y="])")] C', "A  B  C", [_call("f", {"x": 1}), _call("g", {"y": "])"})]),
    ("pythonic", "see [1] and [x] and [ y ]", "see [1] and [x] and [ y ]", []),
    ("pythonic", "[f(1)] then [g(x=1)]", "[f(1)] then ", [_call("g", {"x": 1})]),
    _content("pythonic", "[f(x=1+2)]"),
    _content("pythonic", '[f(x=open("/etc/passwd"))]'),
    _content("pythonic", "[f(**kw)]"),
    _content("pythonic", "[f(x=1), 3]"),
    _content("pythonic", "[f(x=)]"),
    _content("pythonic", "[f(x=1e999)]"),
    _content("pythonic", "[a.b(x=1)]"),
    _content("pythonic", '[f(x="unterminated)]'),
    _content("pythonic", 'Sure [f(x="a"'),
    _content("pythonic", "[get_wea"),
    _content("pythonic", ""),
]

B, E, CB, CE, SEP = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"  # fmt: skip


def _v3(name: str, args: object, fence: bool = True) -> str:
    body = json.dumps(args, ensure_ascii=False)
    return f"{CB}function{SEP}{name}\n" + (f"```json\n{body}\n```" if fence else body) + CE


def _v31(name: str, args: object) -> str:
    return f"{CB}{name}{SEP}{json.dumps(args, ensure_ascii=False)}{CE}"


DEEPSEEK = [
    (
        "deepseekv3",
        f"Sure.\n{B}{_v3('get_weather', WEATHER)}\n{_v3('search', NESTED)}{E}",
        "Sure.\n",
        [_call("get_weather", WEATHER), _call("search", NESTED)],
    ),
    ("deepseekv3", f"{B}{_v3('now', {}, fence=False)}{E} after", " after", [_call("now", {})]),
    (
        "deepseekv3",
        f"{B}{_v3('lookup', UNICODE)}",
        None,
        [_call("lookup", UNICODE)],
    ),  # cut before the end marker
    _content("deepseekv3", f'{B}{CB}function{SEP}f\n```json\n{{"a": 1\n```{CE}{E}'),
    _content("deepseekv3", f'{B}{CB}function{SEP}f\n```json\n{{"a": '),
    _content("deepseekv3", f"{B}{CB}tool{SEP}f\n{{}}{CE}{E}"),
    _content("deepseekv3", f"{B}{_v3('f', [1])}{E}"),
    _content("deepseekv3", f"{B}{_v3('f', {})} junk {E}"),
    ("deepseekv3", f"{B}{_v3('f', 'x')}{E}{B}{_v3('g', {})}{E}", f"{B}{_v3('f', 'x')}{E}", [_call("g", {})]),
    _content("deepseekv3", "text <｜tool▁calls"),
    (
        "deepseekv31",
        f"{B}{_v31('get_weather', WEATHER)}{_v31('lookup', UNICODE)}{E}",
        None,
        [_call("get_weather", WEATHER), _call("lookup", UNICODE)],
    ),
    ("deepseekv31", f"Checking.{B}{_v31('now', {})}{E}", "Checking.", [_call("now", {})]),
    _content("deepseekv31", f"{B}{_v31('f', [1])}{E}"),
    _content("deepseekv31", f"{B}{_v31('', {})}{E}"),
    _content("deepseekv31", f'{B}{CB}f{SEP}{{"a": 1}}'),
]

QC_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "temp": {"type": ["number", "null"]},
                    "metric": {"type": "boolean"},
                    "filters": {"type": "object"},
                    "tags": {"type": "array"},
                    "note": {"description": "untyped"},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "now"}},
]


def _qc(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


_CODE = "def f():\n    return '</tool_call'\n"
# (parser, tools, output, content, calls)
QWEN3_CODER = [
    (
        QC_TOOLS,
        _qc(
            "get_weather",
            city=" Paris",
            days="3",
            temp="-2.5",
            metric="true",
            filters='{"a": [1, 2]}',
            tags='["x", "y"]',
            note="42",
        ),
        None,
        [
            _call(
                "get_weather",
                {
                    "city": " Paris",
                    "days": 3,
                    "temp": -2.5,
                    "metric": True,
                    "filters": {"a": [1, 2]},
                    "tags": ["x", "y"],
                    "note": "42",
                },
            )
        ],
    ),  # fmt: skip
    (
        QC_TOOLS,
        "I'll check.\n" + _qc("now") + "\n" + _qc("get_weather", city=_CODE),
        "I'll check.\n\n",
        [_call("now", {}), _call("get_weather", {"city": _CODE})],
    ),  # fmt: skip
    (
        QC_TOOLS,
        _qc("get_weather", days="three", metric="maybe", temp="null", filters="{bad"),
        None,
        [_call("get_weather", {"days": "three", "metric": "maybe", "temp": None, "filters": "{bad"})],
    ),  # fmt: skip
    (QC_TOOLS, _qc("other", x="5"), None, [_call("other", {"x": "5"})]),  # not among the tools: strings
    (None, _qc("get_weather", days="3"), None, [_call("get_weather", {"days": "3"})]),  # unbound: strings
    (
        QC_TOOLS,
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n2\n</function>",
        None,
        [_call("get_weather", {"city": "Paris", "days": 2})],
    ),  # fmt: skip
    (
        QC_TOOLS,
        "<tool_call>\n<function=f>\njunk<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=f>\njunk<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
        [],
    ),  # fmt: skip
    (
        QC_TOOLS,
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n",
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n",
        [],
    ),
    (
        QC_TOOLS,
        '<tool_call>\n{"name": "f"}\n</tool_call> x',
        '<tool_call>\n{"name": "f"}\n</tool_call> x',
        [],
    ),
    (QC_TOOLS, "a <tool_ca", "a <tool_ca", []),
]

G_CALL = "<|channel|>commentary to=functions.{} <|constrain|>json<|message|>{}<|call|>"
GPT_OSS = [
    ("gpt-oss", G_CALL.format("get_weather", json.dumps(WEATHER)), None, [_call("get_weather", WEATHER)]),
    (
        "gpt-oss",
        "Checking. " + G_CALL.format("a", "{}") + " and " + G_CALL.format("lookup", json.dumps(UNICODE)),
        "Checking.  and ",
        [_call("a", {}), _call("lookup", UNICODE)],
    ),
    ("gpt-oss", '<|channel|>commentary to=functions.f<|message|>{"a": 1}', None, [_call("f", {"a": 1})]),
    _content("gpt-oss", G_CALL.format("f", '{"a": ')),
    _content("gpt-oss", G_CALL.format("f", "[1]")),
    _content("gpt-oss", "<|channel|>commentary to=browser.search<|message|>{}<|call|>"),
    _content("gpt-oss", "<|channel|>commentary to=functions.f <|constrain|>js"),
]

CASES = PYTHONIC + DEEPSEEK + GPT_OSS + [("qwen3_coder", *case) for case in QWEN3_CODER]


def _parser(case: tuple):
    name, *rest = case
    parser = create_tool_call_parser(name)
    if len(rest) == 4:  # qwen3_coder cases carry the request's tools
        tools, *rest = rest
        parser = parser.for_tools(tools) if tools is not None else parser
    return parser, rest


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_parse(case: tuple) -> None:
    parser, (text, content, calls) = _parser(case)
    assert parser.parse(text) == (content, calls)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_stream_equals_parse_for_every_chunking(case: tuple) -> None:
    parser, (text, content, calls) = _parser(case)
    for chunks in _chunkings(text):
        streamed_content, streamed_calls = _stream(parser, chunks)
        assert streamed_calls == calls, chunks
        assert streamed_content == (content or "") or content is None and not streamed_content.strip(), chunks


def test_pathological_inputs_are_content_not_exceptions() -> None:
    deep = "[" * 50_000 + "]" * 50_000
    for name, text in [
        ("pythonic", f"[f(x={deep})]"),
        ("pythonic", "[f(x=" + "(" * 300 + "1" + ")" * 300 + ")]"),
        ("deepseekv31", f'{B}{CB}f{SEP}{{"a": {deep}}}{CE}{E}'),
        ("gpt-oss", G_CALL.format("f", '{"a": ' + deep + "}")),
    ]:
        assert create_tool_call_parser(name).parse(text) == (text, [])


def test_bound_parsers_leave_the_shared_one_untouched() -> None:
    shared = create_tool_call_parser("qwen3_coder")
    bound = shared.for_tools(QC_TOOLS)
    assert bound is not shared and bound.parse(_qc("get_weather", days="3"))[1] == [
        _call("get_weather", {"days": 3})
    ]
    assert shared.parse(_qc("get_weather", days="3"))[1] == [_call("get_weather", {"days": "3"})]
    other = create_tool_call_parser("hermes")
    assert other.for_tools(QC_TOOLS) is other


H_ANALYSIS = "<|channel|>analysis<|message|>User wants weather. Call the tool.<|end|>"
H_TOOL = "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
# (output, reasoning_content, content)
HARMONY = [
    (
        H_ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>",
        "User wants weather. Call the tool.",
        "It is sunny.",
    ),
    (
        H_ANALYSIS + H_TOOL + json.dumps(WEATHER) + "<|call|>",
        "User wants weather. Call the tool.",
        "<|channel|>commentary to=functions.get_weather<|message|>" + json.dumps(WEATHER) + "<|call|>",
    ),
    (
        "<|start|>assistant to=functions.now<|channel|>commentary json<|message|>{}<|call|>",
        None,
        "<|channel|>commentary to=functions.now<|message|>{}<|call|>",
    ),
    ("<|channel|>analysis<|message|>cut short", "cut short", None),
    ("<|channel|>commentary<|message|>Let me look.<|end|>", None, "Let me look."),
    ("plain text, no channels <b>", None, "plain text, no channels <b>"),
    ("<|channel|>analysis", None, "<|channel|>analysis"),
    ("<|channel|>" + "x" * 600 + "<|message|>y", None, "<|channel|>" + "x" * 600 + "<|message|>y"),
    ("<|channel|>analysis<|message|>a<|channel|>final<|message|>b", "a", "b"),
    ("", None, None),
]


@pytest.mark.parametrize(("text", "reasoning", "content"), HARMONY)
def test_gpt_oss_reasoning_split_for_every_chunking(
    text: str, reasoning: str | None, content: str | None
) -> None:
    parser = create_reasoning_parser("gpt-oss")
    assert parser.parse(text) == (reasoning, content)
    for chunks in _chunkings(text):
        assert _reasoning_stream(parser, chunks) == (reasoning or "", content or ""), chunks


def test_gpt_oss_reasoning_then_tool_parser_reads_the_calls() -> None:
    text = H_ANALYSIS + H_TOOL + json.dumps(WEATHER) + "<|call|>"
    tools = create_tool_call_parser("gpt-oss")
    for chunks in _chunkings(text):
        stream = create_reasoning_parser("gpt-oss").stream()
        pieces = [stream.feed(chunk)[1] for chunk in chunks] + [stream.finish()[1]]
        content, calls = _stream(tools, pieces)
        assert calls == [_call("get_weather", WEATHER)] and content == "", chunks
    assert create_reasoning_parser("gpt-oss").keeps_special_tokens and tools.keeps_special_tokens
    assert not create_tool_call_parser("hermes").keeps_special_tokens


def _flag_choices(flag: str) -> list[str]:
    import argparse

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    action = next(a for a in parser._actions if flag in a.option_strings)
    return list(action.choices)


def test_flags_offer_every_registered_parser_and_reject_others(capsys: pytest.CaptureFixture[str]) -> None:
    from srt.parsers.reasoning import REASONING_PARSERS

    assert sorted(_flag_choices("--tool-call-parser")) == sorted(TOOL_CALL_PARSERS)
    assert sorted(_flag_choices("--reasoning-parser")) == sorted(REASONING_PARSERS)
    import argparse

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    for name in ("pythonic", "deepseekv3", "deepseekv31", "qwen3_coder", "gpt-oss"):
        args = ServerArgs.from_cli_args(parser.parse_args(["--tool-call-parser", name]))
        assert args.tool_call_parser == name
    with pytest.raises(SystemExit):
        parser.parse_args(["--tool-call-parser", "llama4"])
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="pythonic"):
        create_tool_call_parser("llama4")


def test_gpt_oss_reasoning_needs_no_grammar_backend() -> None:
    with pytest.raises(ConfigError, match="grammar-backend none"):
        ServerArgs(device="cpu", reasoning_parser="gpt-oss", grammar_backend="llguidance").resolve()
    args = ServerArgs(device="cpu", reasoning_parser="gpt-oss", grammar_backend="none").resolve()
    assert args.reasoning_parser == "gpt-oss"


def test_every_think_tag_reasoning_parser_has_an_after_reasoning_grammar() -> None:
    from srt.constrained.llguidance_backend import REASONING_GRAMMARS
    from srt.parsers.reasoning import REASONING_PARSERS

    assert set(REASONING_GRAMMARS) == set(REASONING_PARSERS) - {"gpt-oss"}


def test_chat_route_types_qwen3_coder_values_and_keeps_harmony_markers() -> None:
    from tests.unit.test_serving_chat_tools import _out, _req, _streamed_message, _StubTM
    from tests.unit.test_serving_chat_tools import _stream as _stream_chat

    chat = OpenAIServingChat(_StubTM(tool_call_parser="qwen3_coder"))
    req = _req(tools=QC_TOOLS)
    assert chat.build_input(req).sampling_params.get("skip_special_tokens") is not False
    text = "Checking.\n" + _qc("get_weather", city="Paris", days="3", metric="false")
    expected = {"city": "Paris", "days": 3, "metric": False}
    msg = chat.build_response(req, [_out(text)])["choices"][0]
    assert msg["finish_reason"] == "tool_calls" and msg["message"]["content"] == "Checking.\n"
    assert json.loads(msg["message"]["tool_calls"][0]["function"]["arguments"]) == expected
    s = _streamed_message(_stream_chat(chat, req, [text[i : i + 7] for i in range(0, len(text), 7)]))
    assert json.loads(s["calls"][0]["arguments"]) == expected and s["content"] == "Checking.\n"

    chat = OpenAIServingChat(_StubTM(tool_call_parser="gpt-oss", reasoning_parser="gpt-oss"))
    req = _req(tools=QC_TOOLS)
    assert chat.build_input(req).sampling_params["skip_special_tokens"] is False
    assert chat.build_input(_req(skip_special_tokens=True)).sampling_params["skip_special_tokens"] is True
    msg = chat.build_response(req, [_out(H_ANALYSIS + H_TOOL + json.dumps(WEATHER) + "<|call|>")])["choices"][
        0
    ]
    assert msg["message"]["reasoning_content"] == "User wants weather. Call the tool."
    assert msg["message"]["content"] is None and msg["finish_reason"] == "tool_calls"
    assert json.loads(msg["message"]["tool_calls"][0]["function"]["arguments"]) == WEATHER

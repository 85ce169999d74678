"""The chat route's tool and reasoning handling without a model: request planning (which tool
mode, which grammar, which errors), the prompt the template sees, and how recorded outputs come
back (whole and streamed)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from srt.entrypoints.openai.protocol import ChatCompletionRequest
from srt.entrypoints.openai.serving_chat import OpenAIServingChat
from srt.utils.errors import RequestError

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


class _StubTM:
    def __init__(self, tool_call_parser=None, reasoning_parser=None, renders_tools=False) -> None:
        self.server_args = SimpleNamespace(
            tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser, enable_cache_report=False
        )
        self.tokenizer = None
        self.model_name = "m"
        self.renders_tools = renders_tools
        self.seen: list[tuple[list[dict[str, Any]], dict[str, Any]]] = []

    def chat_template_renders_tools(self) -> bool:
        return self.renders_tools

    def apply_chat_template(self, messages, **kwargs):
        self.seen.append((messages, kwargs))
        return "PROMPT"


def _req(**body) -> ChatCompletionRequest:
    body.setdefault("messages", [{"role": "user", "content": "weather in Paris?"}])
    return ChatCompletionRequest.model_validate_json(json.dumps(body), strict=True)


def _out(text: str, finish: str = "stop", index: int = 0) -> dict[str, Any]:
    meta = {
        "finish_reason": {"type": finish, "matched": 2} if finish else None,
        "prompt_tokens": 3,
        "completion_tokens": 5,
        "cached_tokens": 0,
    }
    return {"index": index, "text": text, "meta_info": meta, "output_ids": [1]}


def _stream(chat: OpenAIServingChat, req, pieces: list[str]) -> list[dict[str, Any]]:
    async def gen():
        for k, p in enumerate(pieces):
            yield _out(p, "stop" if k == len(pieces) - 1 else None)

    async def collect():
        return [c async for c in chat.stream_chunks(req, gen())]

    return asyncio.run(collect())


def _streamed_message(chunks) -> dict[str, Any]:
    msg: dict[str, Any] = {"content": "", "reasoning_content": "", "calls": {}}
    finish = None
    for c in chunks:
        for ch in c["choices"]:
            d = ch["delta"]
            msg["content"] += d.get("content") or ""
            msg["reasoning_content"] += d.get("reasoning_content") or ""
            for tc in d.get("tool_calls") or []:
                entry = msg["calls"].setdefault(tc["index"], {"name": None, "arguments": "", "id": None})
                fn = tc.get("function") or {}
                if fn.get("name"):
                    entry["name"], entry["id"] = fn["name"], tc["id"]
                entry["arguments"] += fn.get("arguments") or ""
            finish = ch["finish_reason"] or finish
    msg["finish"] = finish
    return msg


def test_required_choice_constrains_to_the_call_schema_and_describes_tools():
    tm = _StubTM()
    chat = OpenAIServingChat(tm)
    obj = chat.build_input(_req(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False))
    schema = json.loads(obj.sampling_params["json_schema"])
    assert schema["type"] == "array" and schema["maxItems"] == 1
    assert schema["items"]["anyOf"][0]["properties"]["name"]["enum"] == ["get_weather"]
    messages, kwargs = tm.seen[-1]
    assert (
        "tools" not in kwargs and messages[0]["role"] == "system" and "get_weather" in messages[0]["content"]
    )
    # a template that renders tools gets them instead
    tm2 = _StubTM(renders_tools=True)
    OpenAIServingChat(tm2).build_input(_req(tools=[WEATHER], tool_choice="required"))
    assert tm2.seen[-1][1]["tools"][0]["function"]["name"] == "get_weather"
    assert tm2.seen[-1][0][0]["role"] == "user"


@pytest.mark.parametrize(
    "body,param",
    [
        ({"tools": [WEATHER]}, "tools"),  # auto without --tool-call-parser
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "required", "regex": "a"}, "tool_choice"),
    ],
)
def test_tool_settings_that_cannot_work_are_rejected(body, param):
    with pytest.raises(RequestError) as e:
        OpenAIServingChat(_StubTM()).build_input(_req(**body))
    assert e.value.param == param


def test_forced_output_becomes_tool_calls_whole_and_streamed():
    chat = OpenAIServingChat(_StubTM())
    req = _req(tools=[WEATHER], tool_choice="required")
    text = '[{"name":"get_weather","parameters":{"city":"Paris"}}]'
    body = chat.build_response(req, [_out(text)])
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {
        "city": "Paris"
    }
    streamed = _streamed_message(_stream(chat, req, [text[i : i + 4] for i in range(0, len(text), 4)]))
    assert streamed["finish"] == "tool_calls" and streamed["content"] == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed["calls"].values()] == [
        ("get_weather", {"city": "Paris"})
    ]
    # cut short by max_tokens: the text comes back as content, never a 500
    cut = chat.build_response(req, [_out(text[:20], "length")])["choices"][0]
    assert cut["message"]["content"] == text[:20] and cut["finish_reason"] == "length"


def test_auto_choice_uses_the_tool_call_parser_and_reasoning_parser():
    chat = OpenAIServingChat(_StubTM(tool_call_parser="hermes", reasoning_parser="qwen3"))
    req = _req(tools=[WEATHER])
    obj = chat.build_input(req)
    assert "json_schema" not in obj.sampling_params
    text = (
        "<think>The user wants weather.</think>\n\nLet me check."
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    msg = chat.build_response(req, [_out(text)])["choices"][0]
    assert msg["finish_reason"] == "tool_calls"
    assert msg["message"]["reasoning_content"] == "The user wants weather."
    assert msg["message"]["content"] == "Let me check."
    assert msg["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    for size in (1, 5, 17):
        s = _streamed_message(_stream(chat, req, [text[i : i + size] for i in range(0, len(text), size)]))
        assert s["reasoning_content"] == "The user wants weather." and s["content"] == "Let me check."
        assert [c["name"] for c in s["calls"].values()] == ["get_weather"] and s["finish"] == "tool_calls"
        assert json.loads(s["calls"][0]["arguments"]) == {"city": "Paris"}
    # malformed call text stays content
    bad = chat.build_response(req, [_out("<tool_call>{not json</tool_call>")])["choices"][0]
    assert bad["finish_reason"] == "stop" and "not json" in bad["message"]["content"]


def test_plain_requests_stream_as_before():
    chat = OpenAIServingChat(_StubTM())
    s = _streamed_message(_stream(chat, _req(), ["Hel", "lo", ""]))
    assert s["content"] == "Hello" and s["finish"] == "stop" and not s["calls"]

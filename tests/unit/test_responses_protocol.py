"""The Responses API without a model: every field of the official client's request either honoured
or rejected by name, the conversion of input items, tools and text formats to the chat request, and
recorded outputs rebuilt as objects and events the official client's types parse."""

from __future__ import annotations

import asyncio
import json
import typing
from types import SimpleNamespace
from typing import Any

import pytest
from openai._types import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent, response_create_params
from pydantic import TypeAdapter

from srt.entrypoints.openai.protocol_responses import (
    REJECTED_FIELDS,
    ResponsesRequest,
    check_fields,
    input_messages,
    to_chat_request,
)
from srt.entrypoints.openai.serving_chat import OpenAIServingChat
from srt.entrypoints.openai.serving_responses import OpenAIServingResponses
from srt.utils.errors import RequestError

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "strict": True,
}
_EVENT = TypeAdapter(ResponseStreamEvent)


class _StubTM:
    def __init__(self, reasoning_parser: str | None = None) -> None:
        self.server_args = SimpleNamespace(
            tool_call_parser=None, reasoning_parser=reasoning_parser, enable_cache_report=False
        )
        self.tokenizer = None
        self.model_name = "m"
        self.seen: list[tuple[list[dict[str, Any]], dict[str, Any]]] = []

    def chat_template_renders_tools(self) -> bool:
        return True

    def apply_chat_template(self, messages, **kwargs):
        self.seen.append((messages, kwargs))
        return "PROMPT"


def _req(**body: Any) -> ResponsesRequest:
    body.setdefault("input", "hi")
    return ResponsesRequest.model_validate_json(json.dumps(body), strict=True)


def _rejects(param: str, **body: Any) -> None:
    with pytest.raises(RequestError) as e:
        to_chat_request(_req(**body))
    assert e.value.param == param, e.value.message


def _sdk_fields() -> list[str]:
    names = list(typing.get_type_hints(response_create_params.ResponseCreateParamsBase))
    return names + list(typing.get_type_hints(response_create_params.ResponseCreateParamsStreaming))


def test_every_sdk_request_field_is_honoured_or_rejected_by_name():
    honoured = set(ResponsesRequest.model_fields)
    for name in set(_sdk_fields()):
        if name in honoured:
            continue
        assert name in REJECTED_FIELDS, f"{name} is neither honoured nor rejected"
        for ok in REJECTED_FIELDS[name]:
            check_fields(_req(**{name: ok}))
        _rejects(name, **{name: {"not": "supported"}})
    _rejects("frobnicate", frobnicate=1)  # a field no version of the API has


@pytest.mark.parametrize(
    "body,param",
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{**WEATHER, "defer_loading": True}]}, "tools[0].defer_loading"),
        ({"tools": [WEATHER]}, "tools[0].strict"),  # strict arguments need a forced call
        (
            {"text": {"format": {"type": "json_schema", "schema": {}, "description": "d"}}},
            "text.format.description",
        ),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"text": {"format": {"type": "grammar"}}}, "text.format"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
        ({"stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]},
            "input[0].content[0].type",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "x"}]}]},
            "input[0].content[0].file_id",
        ),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
        ({"input": []}, "input"),
    ],
)
def test_bad_requests_name_the_field(body, param):
    _rejects(param, **body)


def test_reasoning_effort_reaches_the_template_only_with_a_reasoning_parser():
    with pytest.raises(RequestError) as e:
        OpenAIServingResponses(OpenAIServingChat(_StubTM())).build_input(_req(reasoning={"effort": "low"}))
    assert e.value.param == "reasoning.effort"
    tm = _StubTM("qwen3")
    OpenAIServingResponses(OpenAIServingChat(tm)).build_input(_req(reasoning={"effort": "none"}))
    assert tm.seen[-1][1].items() >= {"reasoning_effort": "none", "enable_thinking": False}.items()


def test_input_items_become_chat_messages():
    items = [
        {"role": "developer", "content": "be brief"},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
        },
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {
            "role": "assistant",
            "content": [{"type": "output_text", "text": "let me check", "annotations": []}],
        },
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {
            "type": "function_call",
            "call_id": "call_2",
            "name": "get_weather",
            "arguments": '{"city": "Rome"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {
            "type": "function_call_output",
            "call_id": "call_2",
            "output": [{"type": "input_text", "text": "rain"}],
        },
    ]
    msgs = input_messages(_req(input=items, instructions="you are srt"))
    assert [m["role"] for m in msgs] == ["system", "developer", "user", "assistant", "tool", "tool"]
    assert msgs[0]["content"] == "you are srt" and msgs[2]["content"] == "a\nb"
    assert msgs[3]["content"] == "let me check"
    assert [c["id"] for c in msgs[3]["tool_calls"]] == ["call_1", "call_2"]
    assert msgs[4] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny", "name": "get_weather"}
    assert msgs[5]["content"] == "rain"
    # and the chat serving renders them (developer as system, arguments as objects)
    tm = _StubTM()
    chat_req = to_chat_request(_req(input=items))
    OpenAIServingChat(tm).build_input(chat_req)
    rendered = tm.seen[-1][0]
    assert rendered[0]["role"] == "system" and rendered[2]["tool_calls"][1]["function"]["arguments"] == {
        "city": "Rome"
    }


def test_tools_tool_choice_and_text_format_map_to_chat():
    chat_req = to_chat_request(
        _req(
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
            parallel_tool_calls=False,
        )
    )
    assert chat_req.tools[0].function.name == "get_weather" and chat_req.tools[0].function.strict is True
    assert chat_req.tool_choice.function.name == "get_weather" and chat_req.parallel_tool_calls is False
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    fmt = {"type": "json_schema", "name": "x", "schema": schema, "strict": True}
    chat_req = to_chat_request(_req(text={"format": fmt}, max_output_tokens=7, temperature=0))
    assert json.loads(chat_req.response_format.to_json_schema()) == schema
    assert chat_req.max_tokens == 7 and chat_req.temperature == 0
    assert (
        to_chat_request(_req(text={"format": {"type": "json_object"}})).response_format.type == "json_object"
    )
    assert to_chat_request(_req(text={"format": {"type": "text"}})).response_format.type == "text"
    lp = to_chat_request(_req(include=["message.output_text.logprobs"], top_logprobs=2))
    assert lp.logprobs and lp.top_logprobs == 2


def _out(text: str, finish: str | None = "stop") -> dict[str, Any]:
    meta = {
        "finish_reason": {"type": finish} if finish else None,
        "prompt_tokens": 3,
        "completion_tokens": 5,
        "cached_tokens": 0,
    }
    return {"index": 0, "text": text, "meta_info": meta, "output_ids": [1]}


def _serve(body: dict[str, Any], pieces: list[str], finish: str = "stop", reasoning: str | None = None):
    """(non-streamed response, streamed events) of the recorded output ``pieces``."""
    serving = OpenAIServingResponses(OpenAIServingChat(_StubTM(reasoning)))
    req = _req(**body)
    chat_req, _ = serving.build_input(req)
    whole = serving.build_response(req, chat_req, [_out("".join(pieces), finish)])
    req = _req(**body, stream=True)
    chat_req, _ = serving.build_input(req)

    async def gen():
        for k, p in enumerate(pieces):
            yield _out(p, finish if k == len(pieces) - 1 else None)

    async def collect():
        return [b async for b in serving.stream(req, chat_req, gen())]

    events = []
    for frame in asyncio.run(collect()):
        head, data = frame.decode().strip().split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        events.append(event)
    return whole, events


def _check_stream(events: list[dict[str, Any]]) -> Response:
    """The events parse as the SDK's typed events, in sequence, and its stream state accepts them;
    returns the final response."""
    state = ResponseStreamState(input_tools=[], text_format=omit)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for e in events:
        state.handle_event(_EVENT.validate_python(e))
    return Response.model_validate(events[-1]["response"])


def test_text_output_whole_and_streamed():
    whole, events = _serve({"metadata": {"k": "v"}}, ["Hel", "lo", "!"])
    resp = Response.model_validate(whole)
    assert resp.status == "completed" and resp.output_text == "Hello!" and resp.metadata == {"k": "v"}
    assert resp.usage.input_tokens == 3 and resp.usage.total_tokens == 8 and resp.id.startswith("resp_")
    final = _check_stream(events)
    assert final.output_text == "Hello!" and final.usage.output_tokens == 5
    kinds = [e["type"] for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds.count("response.output_text.delta") == 3 and kinds[-1] == "response.completed"


def test_length_finish_is_incomplete():
    whole, events = _serve({"max_output_tokens": 2}, ["a", "b"], finish="length")
    for resp in (Response.model_validate(whole), _check_stream(events)):
        assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
        assert resp.output[0].status == "incomplete"
    assert events[-1]["type"] == "response.incomplete"


def test_forced_function_call_whole_and_streamed():
    body = {"tools": [WEATHER], "tool_choice": "required"}
    whole, events = _serve(body, ['[{"name": "get_weather", ', '"arguments": {"city": "Paris"}}]'])
    for resp in (Response.model_validate(whole), _check_stream(events)):
        (call,) = resp.output
        assert (
            call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
        )
        assert json.loads(call.arguments) == {"city": "Paris"}
        assert resp.tools[0].name == "get_weather"
    assert "response.function_call_arguments.done" in [e["type"] for e in events]


def test_reasoning_becomes_a_reasoning_item():
    whole, events = _serve({}, ["<think>hmm", "</think>", "Yes"], reasoning="qwen3")
    for resp in (Response.model_validate(whole), _check_stream(events)):
        assert [o.type for o in resp.output] == ["reasoning", "message"]
        assert resp.output[0].content[0].text == "hmm" and resp.output_text == "Yes"
    assert "response.reasoning_text.delta" in [e["type"] for e in events]


def test_an_abort_mid_stream_is_an_error_event():
    serving = OpenAIServingResponses(OpenAIServingChat(_StubTM()))
    req = _req(stream=True)
    chat_req, _ = serving.build_input(req)

    async def gen():
        yield _out("a", None)
        out = _out("", "abort")
        out["meta_info"]["finish_reason"] = {"type": "abort", "status_code": 503, "message": "shutting down"}
        yield out

    async def collect():
        return [json.loads(b.decode().split("data: ")[1]) async for b in serving.stream(req, chat_req, gen())]

    events = asyncio.run(collect())
    err = _EVENT.validate_python(events[-1])
    assert err.type == "error" and err.message == "shutting down"

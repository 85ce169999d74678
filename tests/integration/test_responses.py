"""POST /v1/responses on the real server (default model, CPU) through the official `openai` client:
text whole and streamed (greedy: the same text), a forced function call, a json_schema text
format, a multi-turn input with a function call's output, the token limit, and bad requests as
400s in OpenAI's error shape."""

from __future__ import annotations

import json

import openai
import pytest
import requests

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "strict": True,
}


@pytest.fixture(scope="module")
def server(default_server):
    return default_server  # tests/integration/conftest.py


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0)


def test_text_whole_and_streamed_agree(client):
    kw = dict(
        model=MODEL,
        input="Name a fruit.",
        instructions="Answer briefly.",
        max_output_tokens=20,
        temperature=0,
    )
    whole = client.responses.create(**kw, metadata={"k": "v"})
    assert whole.status == "completed"  # the stream helper's final response needs response.completed
    assert whole.object == "response" and whole.id.startswith("resp_") and whole.output_text
    assert whole.metadata == {"k": "v"} and whole.output[0].content[0].annotations == []
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    events = list(client.responses.create(**kw, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type in (
        "response.completed",
        "response.incomplete",
    )
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    with client.responses.stream(**kw) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_forced_function_call_matches_the_schema(client):
    jsonschema = pytest.importorskip("jsonschema")
    r = client.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40,
        temperature=0,
    )
    assert r.status == "completed", r
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and all(c.name == "get_weather" and c.call_id for c in calls)
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), WEATHER["parameters"])
    assert r.tools[0].name == "get_weather" and r.tool_choice.name == "get_weather"


def test_json_schema_text_format_validates(client):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    r = client.responses.create(
        model=MODEL,
        input="Describe a person.",
        text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}},
        max_output_tokens=60,
        temperature=0,
    )
    assert r.status == "completed", r
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_multi_turn_with_a_function_call_output(client):
    args = '{"city": "Paris", "unit": "c"}'
    turn = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": args},
        {"type": "function_call_output", "call_id": "call_1", "output": '{"temperature": 21}'},
    ]
    kw = dict(
        model=MODEL,
        tools=[{**WEATHER, "strict": False}],
        tool_choice="none",
        max_output_tokens=10,
        temperature=0,
    )
    r = client.responses.create(input=turn, **kw)
    assert r.status == "completed" or r.status == "incomplete"
    assert r.output[0].type == "message" and r.output_text
    alone = client.responses.create(input=turn[:1], **kw)
    assert r.usage.input_tokens > alone.usage.input_tokens + 10  # the call and its output are in the prompt


def test_max_output_tokens_gives_incomplete(client):
    r = client.responses.create(
        model=MODEL, input="Tell me a long story.", max_output_tokens=3, temperature=0
    )
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"


@pytest.mark.parametrize(
    "body,param",
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}}, None),
        ({"model": "not-served"}, "model"),
    ],
)
def test_bad_requests_are_4xx_in_openai_shape(server, body, param):
    r = requests.post(
        server.url("/v1/responses"), json={"input": "hi", "max_output_tokens": 4, **body}, timeout=60
    )
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param


def test_sse_framing_names_each_event(server):
    r = requests.post(
        server.url("/v1/responses"),
        json={"input": "hi", "max_output_tokens": 3, "stream": True},
        stream=True,
        timeout=60,
    )
    frames = [f for f in r.text.split("\n\n") if f]
    for f in frames:
        head, data = f.split("\n")
        assert head == "event: " + json.loads(data.removeprefix("data: "))["type"]
    assert frames[-1].startswith("event: response.incomplete")

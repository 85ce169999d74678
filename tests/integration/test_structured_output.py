"""Constrained decoding through the real server (default model): response_format json_schema and
json_object on both OpenAI routes, regex / ebnf / json_schema on /generate, bad grammars as 400s,
constrained requests batched with free ones (whose outputs must not change)."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests

MODEL = "SmolLM2-135M-Instruct"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["engineer", "artist", "doctor"]},
        "skills": {
            "type": "array",
            "items": {"type": "string", "maxLength": 15},
            "minItems": 1,
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 15}, "zip": {"type": "integer"}},
            "required": ["city", "zip"],
        },
        "score": {"type": "number", "minimum": 0, "maximum": 10},
    },
    "required": ["name", "age", "role", "skills", "address", "score"],
}


@pytest.fixture(scope="module")
def server(default_server):
    return default_server  # tests/integration/conftest.py


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0)


def generate(server, **body):
    return requests.post(server.url("/generate"), json=body, timeout=300)


def test_chat_json_schema_outputs_validate(client):
    jsonschema = pytest.importorskip("jsonschema")
    prompts = ["Describe a person.", "Invent a character for a story.", "Give me a doctor's profile."]

    def one(i: int):
        return client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompts[i % len(prompts)]}],
            max_tokens=200,
            temperature=0.7 if i % 2 else 0,
            seed=i,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        )

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(one, range(6)))
    for r in results:
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_completion_json_object_and_stream(client):
    r = client.completions.create(
        model=MODEL,
        prompt="A JSON object about a cat:",
        max_tokens=80,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},  # not in the client's completions API
    )
    assert isinstance(json.loads(r.choices[0].text), dict)
    chunks = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "A JSON object about a dog."}],
        max_tokens=80,
        temperature=0,
        stream=True,
        response_format={"type": "json_object"},
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict)


def test_generate_regex_and_ebnf(server):
    pattern = r"[A-Z][a-z]+, [0-9]{4}"
    r = generate(
        server,
        text=["The city and year:", "Name a town and a year:"],
        sampling_params={"regex": pattern, "temperature": 0, "max_new_tokens": 30},
    )
    assert r.status_code == 200, r.text
    for out in r.json():
        assert re.fullmatch(pattern, out["text"]), out["text"]
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
    r = generate(
        server,
        text="Is the sky blue? Answer:",
        sampling_params={"ebnf": 'root ::= " yes" | " no"', "temperature": 0, "max_new_tokens": 10},
    )
    assert r.status_code == 200 and r.json()["text"] in (" yes", " no"), r.text


def test_unconstrained_outputs_unchanged_next_to_constrained(server):
    free = {"temperature": 0, "max_new_tokens": 24}
    alone = generate(server, text="The capital of France is", sampling_params=free).json()["text"]
    with ThreadPoolExecutor(3) as pool:
        futs = [
            pool.submit(generate, server, text="Numbers:", sampling_params={"regex": "[0-9 ]{5,40}", **free}),
            pool.submit(generate, server, text="The capital of France is", sampling_params=free),
            pool.submit(
                generate, server, text="{", sampling_params={"json_schema": json.dumps(PERSON), **free}
            ),
        ]
        outs = [f.result() for f in futs]
    assert all(o.status_code == 200 for o in outs)
    assert outs[1].json()["text"] == alone


@pytest.mark.parametrize(
    "params,field",
    [
        ({"json_schema": "{broken"}, "json_schema"),
        ({"regex": "(unclosed"}, "regex"),
        ({"ebnf": "root ::= ("}, "ebnf"),
        ({"regex": "a+", "json_schema": "{}"}, "regex"),
    ],
)
def test_bad_grammars_are_400_naming_the_field(server, params, field):
    r = generate(server, text="x", sampling_params={"max_new_tokens": 4, **params})
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]


def test_openai_bad_response_format_is_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "bogus"}},
            },
        )
    assert "response_format" in str(e.value) or "json_schema" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "x"}},
        )


@pytest.mark.parametrize(
    "field,value",
    [
        ("functions", [{"name": "f", "parameters": {}}]),
        ("audio", {"voice": "alloy"}),
        ("modalities", ["audio"]),
        ("prediction", {"type": "content", "content": "x"}),
        ("store", True),
    ],
)
def test_known_unsupported_fields_are_400(server, field, value):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value}
    r = requests.post(server.url("/v1/chat/completions"), json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_unknown_fields_are_refused_and_harmless_values_accepted(server):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "store": False,
        "service_tier": "auto",
    }
    r = requests.post(server.url("/v1/chat/completions"), json=body, timeout=60)
    assert r.status_code == 200, r.text
    r = requests.post(server.url("/v1/chat/completions"), json={**body, "some_future_field": 1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "some_future_field"
    assert r.json()["error"]["code"] == "unknown_field"


# ---------------------------------------------------------------- tools
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 30}},
            "required": ["zone"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_calls(calls, allowed: dict[str, dict]):
    jsonschema = pytest.importorskip("jsonschema")
    assert calls
    for c in calls:
        assert c.type == "function" and c.id and c.function.name in allowed
        jsonschema.validate(json.loads(c.function.arguments), allowed[c.function.name])


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_time"}}],
    ids=["required", "named"],
)
def test_forced_tool_calls_validate(client, tool_choice):
    params = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    if isinstance(tool_choice, dict):
        params = {"get_time": params["get_time"]}
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice=tool_choice,
        max_tokens=120,
        temperature=0,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    _check_calls(choice.message.tool_calls, params)
    # streamed: the same calls, as OpenAI's tool_calls deltas
    chunks = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice=tool_choice,
        max_tokens=120,
        temperature=0,
        stream=True,
    )
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    finish = None
    for c in chunks:
        for ch in c.choices:
            for d in ch.delta.tool_calls or []:
                if d.function.name:
                    names[d.index] = d.function.name
                args[d.index] = args.get(d.index, "") + (d.function.arguments or "")
            finish = ch.finish_reason or finish
    assert finish == "tool_calls"
    streamed = [(names[i], json.loads(args[i])) for i in sorted(names)]
    whole = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert streamed == whole


def test_tool_choice_errors(server):
    def post(**extra):
        body = {"model": MODEL, "messages": ASK, "max_tokens": 8, **extra}
        return requests.post(server.url("/v1/chat/completions"), json=body, timeout=60)

    r = post(tools=[WEATHER])  # auto, and this server has no --tool-call-parser
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    r = post(tool_choice="required")
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
    r = post(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    assert r.status_code == 400 and "nope" in r.json()["error"]["message"], r.text
    r = post(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
    r = post(tools=[WEATHER], tool_choice="none")
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text


def test_tool_call_history_renders(client):
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=16, temperature=0
    )
    assert r.choices[0].message.content

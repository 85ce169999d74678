"""What a bad request body costs the HTTP process: every list and dict of every request model
stops at its first bad item (no error per item, no union member validated item by item), and the
error message shows a bounded part of what it got.

Before, a 1 MiB prompt of token ids ending in a string gave 1,000,001 errors (1.3 GiB and 5 s of
the event loop's CPU) and a 68 MB message; /generate's msgspec decoder already stopped at once."""

from __future__ import annotations

import inspect
import json
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from srt.entrypoints.http.serving import _MAX_ERRORS, _validation_message
from srt.entrypoints.openai import protocol, protocol_embedding, protocol_responses

N = 200_000


def _models() -> list[type[BaseModel]]:
    found = []
    for module in (protocol, protocol_embedding, protocol_responses):
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseModel) and obj.__module__ == module.__name__:
                found.append(obj)
    return found


def _collections(schema: Any, path: str = "") -> list[tuple[str, dict]]:
    """Every list and dict schema inside a pydantic core schema (with where it is)."""
    out = []
    if isinstance(schema, dict):
        if schema.get("type") in ("list", "dict"):
            out.append((path, schema))
        for k, v in schema.items():
            out += _collections(v, f"{path}.{k}" if path else str(k))
    elif isinstance(schema, list):
        for i, v in enumerate(schema):
            out += _collections(v, f"{path}[{i}]")
    return out


def _items_cannot_fail(schema: dict) -> bool:
    """A JSON object's values typed Any (its keys are strings anyway): no item can be bad."""
    keys = schema.get("keys_schema", {"type": "str"})
    return (
        schema["type"] == "dict"
        and keys.get("type") == "str"
        and schema.get("values_schema", {}).get("type") == "any"
    )


@pytest.mark.parametrize("model", _models(), ids=lambda m: m.__name__)
def test_every_collection_of_every_request_model_stops_at_its_first_bad_item(model):
    collections = _collections(model.__pydantic_core_schema__)
    slow = [where for where, s in collections if not s.get("fail_fast") and not _items_cannot_fail(s)]
    assert not slow, f"{model.__name__}: lists/dicts validated item by item at {slow}"


def _json(**body: Any) -> str:
    return json.dumps(body)


IDS = [1] * N
BAD = [
    (protocol.CompletionRequest, _json(model="m", prompt=[*IDS, "a"]), "prompt"),
    (protocol.CompletionRequest, _json(model="m", prompt=[[1.5]] * N), "prompt"),
    (protocol.CompletionRequest, _json(model="m", prompt="x", stop=IDS), "stop"),
    (
        protocol.CompletionRequest,
        _json(model="m", prompt="x", logit_bias={str(i): "a" for i in range(N)}),
        "logit_bias",
    ),
    (protocol.ChatCompletionRequest, _json(model="m", messages=[{}] * N), "messages"),
    (
        protocol.ChatCompletionRequest,
        _json(model="m", messages=[{"role": "user", "content": [{}] * N}]),
        "messages",
    ),
    (protocol.DetokenizeRequest, _json(tokens=["a"] * N), "tokens"),
    (protocol_embedding.EmbeddingRequest, _json(model="m", input=[*IDS, "a"]), "input"),
    (protocol_embedding.ScoreRequest, _json(query="q", items=[1.5] * N), "items"),
    (protocol_responses.ResponsesRequest, _json(model="m", input=IDS), "input"),
]


@pytest.mark.parametrize(
    "model, body, param", BAD, ids=[f"{m.__name__}-{p}-{i}" for i, (m, _, p) in enumerate(BAD)]
)
def test_a_body_of_many_bad_items_gives_a_few_errors_and_a_short_message(model, body, param):
    with pytest.raises(ValidationError) as info:
        model.model_validate_json(body, strict=True)
    assert info.value.error_count() <= 4  # at most one per member of a union
    message, first = _validation_message(info.value)
    assert first == param and len(message) < 1000, message[:2000]


def test_a_long_valid_token_id_prompt_still_parses():
    req = protocol.CompletionRequest.model_validate_json(_json(model="m", prompt=IDS), strict=True)
    assert req.prompt == [1] * N


def test_a_message_names_a_bounded_number_of_errors_and_shows_values_cut():
    names = ("temperature", "top_p", "n", "max_tokens", "seed", "presence_penalty", "frequency_penalty", "top_k",
             "min_p", "logprobs", "echo")  # fmt: skip
    with pytest.raises(ValidationError) as info:
        protocol.CompletionRequest.model_validate_json(
            _json(model="m", prompt="x", **dict.fromkeys(names, "x")), strict=True
        )
    message, _ = _validation_message(info.value)
    assert info.value.error_count() > _MAX_ERRORS
    assert message.count(": Input should") == _MAX_ERRORS
    assert message.endswith(f"and {info.value.error_count() - _MAX_ERRORS} more")
    with pytest.raises(ValidationError) as info:
        protocol.CompletionRequest.model_validate_json(_json(model="m", prompt=[True] * 1000), strict=True)
    message, _ = _validation_message(info.value)
    assert "(1000 items)" in message and len(message) < 1000

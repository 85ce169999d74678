"""The OpenAPI document at GET /openapi.json, made to describe what the routes really do.

The routes read their bodies by hand (`serving.parse_body`, `GenerateReqInput.from_json`) so that
errors come back in OpenAI's shape; FastAPI therefore sees no body and no error answers. This
module completes its document once, when first asked:

- request bodies: the JSON schema of each route's request type (`BODIES`: pydantic models through
  ``model_json_schema``, msgspec structs through ``msgspec.json.schema_components``), their nested
  types hoisted into ``components/schemas``; /generate's ``sampling_params`` as `SamplingParams`;
- responses: every operation may answer ``4XX`` and ``503`` with OpenAI's error body
  (``ErrorResponse``); routes that stream or answer text declare those media types too
  (`_MEDIA`);
- ``model``: the names this server always accepts, as an enum (LoRA adapters, loaded and
  unloaded at run time, are not pinned: ``"<served>:<adapter>"`` and ``"<adapter>"`` are accepted
  while the adapter is loaded; any other name is a 404);
- links: the tokens of POST /tokenize feed POST /detokenize (a stateful fuzzer follows them).

A POST route whose body is not in `BODIES` and not in `NO_BODY` is a gap the tests report.
"""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from srt.entrypoints.openai.protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    ProfileRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    UpdateWeightsFromDiskRequest,
)
from srt.entrypoints.openai.protocol_embedding import (
    EmbeddingRequest,
    EncodeRequest,
    RerankRequest,
    ScoreRequest,
)
from srt.entrypoints.openai.protocol_responses import ResponsesRequest
from srt.managers.tokenizer.generate_input import GenerateReqInput
from srt.sampling.sampling_params import SamplingParams

_REF = "#/components/schemas/{name}"

BODIES: dict[str, Any] = {
    "/generate": GenerateReqInput,
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/encode": EncodeRequest,
    "/v1/rerank": RerankRequest,
    "/v1/score": ScoreRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    "/abort_request": AbortRequest,
    "/start_profile": ProfileRequest,
    "/update_weights_from_disk": UpdateWeightsFromDiskRequest,
    "/load_lora_adapter": LoadLoRAAdapterRequest,
    "/unload_lora_adapter": UnloadLoRAAdapterRequest,
}
# (request type, field) -> the type its dict (or list of dicts) is checked against
_FREE_FORM: dict[tuple[str, str], Any] = {("GenerateReqInput", "sampling_params"): SamplingParams}
# POST routes that read no body
NO_BODY = frozenset({"/flush_cache", "/stop_profile"})

# one server-sent event: ``data:`` a JSON chunk (or ``[DONE]``), ``event:`` where the route names it
_SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}},
}
_SSE = {"text/event-stream": {"schema": _SSE_EVENT}}
_TEXT = {"text/plain": {"schema": {"type": "string"}}}
# extra success media types: (path, method) -> content
_MEDIA: dict[tuple[str, str], dict[str, Any]] = {
    **{(p, "post"): _SSE for p in ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses")},
    ("/metrics", "get"): _TEXT,
    ("/flush_cache", "get"): _TEXT,
    ("/flush_cache", "post"): _TEXT,
    ("/", "get"): {"text/html": {"schema": {"type": "string"}}},
    ("/web/{name}", "get"): {
        t: {"schema": {"type": "string"}} for t in ("text/html", "text/javascript", "text/css")
    },
}
_EMPTY_OK = frozenset({"/health", "/health_generate"})  # 200 with no body

_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "integer", "null"]},
            },
        }
    },
}
_ERROR_RESPONSE = {
    "description": "OpenAI's error body",
    "content": {"application/json": {"schema": {"$ref": _REF.format(name="ErrorResponse")}}},
}


def _schema_of(tp: Any, components: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of request type ``tp``; its nested definitions go into ``components``."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        schema = tp.model_json_schema(ref_template=_REF.format(name="{model}"))
        components.update(schema.pop("$defs", {}))
        return schema
    (schema,), defs = msgspec.json.schema_components([tp], ref_template=_REF)
    components.update(defs)
    return schema


def _type_free_form_fields(components: dict[str, Any]) -> None:
    """Fields a request type declares as a plain dict but checks against a type of its own."""
    for (owner, field), tp in _FREE_FORM.items():
        prop = components.get(owner, {}).get("properties", {}).get(field)
        if prop is None:
            continue
        name = tp.__name__
        components.setdefault(name, _schema_of(tp, components))
        ref = {"$ref": _REF.format(name=name)}
        prop["anyOf"] = [ref, {"type": "array", "items": ref}, {"type": "null"}]


def _add_body(op: dict[str, Any], tp: Any, components: dict[str, Any]) -> None:
    name = tp.__name__
    if name not in components:
        schema = _schema_of(tp, components)  # a msgspec struct's own schema is among its components
        components.setdefault(name, schema)
    op["requestBody"] = {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": _REF.format(name=name)}}},
    }


def _complete_responses(path: str, method: str, op: dict[str, Any]) -> None:
    responses = op.setdefault("responses", {})
    ok = responses.setdefault("200", {"description": "Successful Response"})
    if path in _EMPTY_OK:
        ok.pop("content", None)
    else:
        ok.setdefault("content", {"application/json": {"schema": {}}}).update(_MEDIA.get((path, method), {}))
    responses.setdefault("4XX", _ERROR_RESPONSE)
    responses.setdefault("503", _ERROR_RESPONSE)


def _add_links(paths: dict[str, Any]) -> None:
    ok = paths.get("/tokenize", {}).get("post", {}).get("responses", {}).get("200")
    if ok is not None and "/detokenize" in paths:
        ok["links"] = {
            "Detokenize": {
                "operationId": paths["/detokenize"]["post"]["operationId"],
                "requestBody": {"tokens": "$response.body#/tokens"},
            }
        }


def _pin_model_names(components: dict[str, Any], names: list[str]) -> None:
    """Narrow every request's ``model`` to the names this server serves (others answer 404)."""
    for schema in components.values():
        prop = schema.get("properties", {}).get("model")
        if prop is None:
            continue
        nullable = prop.get("type") == "null" or any(x.get("type") == "null" for x in prop.get("anyOf", ()))
        pinned = {"enum": [*names, *([None] if nullable else [])]}
        schema["properties"]["model"] = {k: v for k, v in prop.items() if k in ("title", "default")} | pinned


def build_openapi(app: FastAPI) -> dict[str, Any]:
    """The app's OpenAPI document with bodies, error answers and links filled in (cached)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    components["ErrorResponse"] = _ERROR_SCHEMA
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            if method == "post" and path in BODIES:
                _add_body(op, BODIES[path], components)
            _complete_responses(path, method, op)
    _type_free_form_fields(components)
    ctx = getattr(app.state, "ctx", None)
    if ctx is not None:
        _pin_model_names(components, sorted(ctx.model_names))
    _add_links(doc["paths"])
    app.openapi_schema = doc
    return doc


def install_openapi(app: FastAPI) -> None:
    app.openapi = lambda: build_openapi(app)  # type: ignore[method-assign]

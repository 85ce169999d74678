"""OpenAI-compatible routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses,
GET /v1/models.

Each request body is validated strictly (`serving.parse_body`), its ``model`` checked against the
served names (404 ``model_not_found`` otherwise), turned into a `GenerateReqInput` by the OpenAI
serving object and run by `serving.serve` (SSE with ``"stream": true``).

LoRA: ``model`` ``"<served>:<adapter>"`` (SGLang's syntax) or ``"<adapter>"`` (vLLM's), or the
``lora_path`` field (SGLang's, ``extra_body`` in the openai client), select a loaded adapter
(`ServerContext.request_adapter`); the response's ``model`` is the one the request sent.
/v1/models lists the base model, then each loaded adapter (``root`` its path, ``parent`` the
served name).
"""

from __future__ import annotations

from functools import partial

from fastapi import APIRouter, Request
from fastapi.responses import Response

from srt.entrypoints.http.deps import Ctx, ServerContext
from srt.entrypoints.http.serving import parse_body, serve
from srt.entrypoints.openai.common import error_response, json_response
from srt.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    reject_unsupported_fields,
)
from srt.entrypoints.openai.protocol_responses import ResponsesRequest
from srt.entrypoints.openai.serving_chat import OpenAIServingChat
from srt.entrypoints.openai.serving_completions import OpenAIServingCompletion
from srt.entrypoints.openai.serving_responses import OpenAIServingResponses

router = APIRouter()

_Serving = OpenAIServingCompletion | OpenAIServingChat


async def _serve_openai(
    request: Request, ctx: ServerContext, req: CompletionRequest | ChatCompletionRequest, serving: _Serving
) -> Response:
    if (not_found := ctx.model_not_found(req.model)) is not None:
        return not_found
    reject_unsupported_fields(req)
    obj = serving.build_input(req)
    obj.lora_path = ctx.request_adapter(req.model, req.lora_path)
    return await serve(
        request, ctx.tm, obj, partial(serving.build_response, req), partial(serving.stream, req)
    )


@router.post("/v1/completions")
async def v1_completions(request: Request, ctx: Ctx) -> Response:
    req = await parse_body(request, CompletionRequest)
    return await _serve_openai(request, ctx, req, ctx.completions)


@router.post("/v1/chat/completions")
async def v1_chat_completions(request: Request, ctx: Ctx) -> Response:
    req = await parse_body(request, ChatCompletionRequest)
    return await _serve_openai(request, ctx, req, ctx.chat)


@router.post("/v1/responses")
async def v1_responses(request: Request, ctx: Ctx) -> Response:
    """OpenAI's Responses API, stateless (`srt.entrypoints.openai.serving_responses`)."""
    req = await parse_body(request, ResponsesRequest)
    if (not_found := ctx.model_not_found(req.model)) is not None:
        return not_found
    serving = OpenAIServingResponses(ctx.chat)
    chat_req, obj = serving.build_input(req)
    obj.lora_path = ctx.request_adapter(req.model, req.lora_path)
    build, stream = partial(serving.build_response, req, chat_req), partial(serving.stream, req, chat_req)
    return await serve(request, ctx.tm, obj, build, stream)


def _model_cards(ctx: ServerContext) -> dict[str, dict[str, object]]:
    """The model cards of /v1/models by id: the served model, then each loaded LoRA adapter."""
    tm = ctx.tm

    def card(name: str, root: str, parent: str | None) -> dict[str, object]:
        return {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "srt",
            "root": root,
            "parent": parent,
            "max_model_len": tm.context_len,
        }

    cards = {tm.model_name: card(tm.model_name, tm.server_args.model_path or tm.model_name, None)}
    for name, path in ctx.lora.adapters.items():
        cards[name] = card(name, path, tm.model_name)
    return cards


@router.get("/v1/models")
async def v1_models(ctx: Ctx) -> Response:
    return json_response({"object": "list", "data": list(_model_cards(ctx).values())})


@router.get("/v1/models/{model:path}")
async def v1_model(model: str, ctx: Ctx) -> Response:
    """One model's card (OpenAI's "retrieve model"): any name the ``model`` field of a request
    takes (the served name, "default", the model path, an adapter, "<served>:<adapter>") gives the
    card of what it runs; anything else is a 404 ``model_not_found``."""
    cards = _model_cards(ctx)
    served, adapter = ctx.lora.select(model, ctx.model_names)
    name = ctx.tm.model_name if adapter is None else adapter
    if not served or name not in cards:
        known = ", ".join(map(repr, cards))
        return error_response(
            f"the model {model!r} does not exist; this server serves {known}",
            404,
            param="model",
            code="model_not_found",
        )
    return json_response(cards[name])

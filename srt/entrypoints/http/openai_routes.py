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
from srt.entrypoints.openai.common import json_response
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


@router.get("/v1/models")
async def v1_models(ctx: Ctx) -> Response:
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

    base = card(tm.model_name, tm.server_args.model_path or tm.model_name, None)
    adapters = [card(name, path, tm.model_name) for name, path in ctx.lora.adapters.items()]
    return json_response({"object": "list", "data": [base, *adapters]})

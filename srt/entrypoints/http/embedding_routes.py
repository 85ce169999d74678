"""Embedding and scoring routes: POST /v1/embeddings, /encode, /v1/rerank, /v1/score.

Bodies are validated strictly (`serving.parse_body`); the /v1 routes check ``model`` against
the served names (404 ``model_not_found``; a LoRA adapter too: these routes run the base model).
Each request runs until the client disconnects (then it is aborted). The work is
`srt.entrypoints.openai.serving_embedding` and `srt.entrypoints.openai.serving_score`.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from srt.entrypoints.http.deps import Ctx
from srt.entrypoints.http.serving import parse_body, until_disconnect
from srt.entrypoints.openai.common import json_response
from srt.entrypoints.openai.protocol_embedding import (
    EmbeddingRequest,
    EncodeRequest,
    RerankRequest,
    ScoreRequest,
)
from srt.entrypoints.openai.serving_embedding import create_embeddings, encode_request
from srt.entrypoints.openai.serving_score import create_rerank, create_score

router = APIRouter()


@router.post("/v1/embeddings")
async def v1_embeddings(request: Request, ctx: Ctx) -> Response:
    req = await parse_body(request, EmbeddingRequest)
    if (not_found := ctx.model_not_found(req.model, adapters=False)) is not None:
        return not_found
    return json_response(await until_disconnect(request, create_embeddings(ctx.tm, req)))


@router.post("/encode")
async def encode(request: Request, ctx: Ctx) -> Response:
    req = await parse_body(request, EncodeRequest)
    return json_response(await until_disconnect(request, encode_request(ctx.tm, req)))


@router.post("/v1/rerank")
async def v1_rerank(request: Request, ctx: Ctx) -> Response:
    req = await parse_body(request, RerankRequest)
    if (not_found := ctx.model_not_found(req.model, adapters=False)) is not None:
        return not_found
    return json_response(await until_disconnect(request, create_rerank(ctx.tm, req)))


@router.post("/v1/score")
async def v1_score(request: Request, ctx: Ctx) -> Response:
    req = await parse_body(request, ScoreRequest)
    if (not_found := ctx.model_not_found(req.model, adapters=False)) is not None:
        return not_found
    return json_response(await until_disconnect(request, create_score(ctx.tm, req)))

"""Admin and metrics routes: /flush_cache (GET or POST), POST /abort_request, GET /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from srt.entrypoints.http.deps import Ctx
from srt.entrypoints.http.serving import parse_body
from srt.entrypoints.openai.common import error_response, json_response
from srt.entrypoints.openai.protocol import AbortRequest
from srt.utils.errors import RequestError

router = APIRouter()


@router.post("/flush_cache")
@router.get("/flush_cache")
async def flush_cache(ctx: Ctx) -> Response:
    """Drop the prefix cache; 400 ``cache_busy`` while requests run."""
    out = await ctx.tm.flush_cache()
    if not out.success:
        return error_response(out.message or "cache not flushed", 400, code="cache_busy")
    return PlainTextResponse("Cache flushed." + (f" {out.message}" if out.message else ""))


@router.post("/abort_request")
async def abort_request(request: Request, ctx: Ctx) -> Response:
    """Abort ``rid`` (and its n copies) or, with ``abort_all``, every request."""
    req = await parse_body(request, AbortRequest)
    if not req.rid and not req.abort_all:
        raise RequestError("give a rid, or abort_all: true", param="rid")
    return json_response({"aborted": ctx.tm.abort_request("" if req.abort_all else req.rid)})


@router.get("/metrics")
async def metrics(ctx: Ctx) -> Response:
    """Prometheus text (404 unless --enable-metrics)."""
    if not ctx.tm.server_args.enable_metrics:
        return error_response("metrics are disabled (--enable-metrics)", 404)
    return Response(await ctx.tm.render_metrics(), media_type=CONTENT_TYPE_LATEST)

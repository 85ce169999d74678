"""Admin and metrics routes: /flush_cache (GET or POST), POST /abort_request, GET /metrics,
POST /start_profile, /stop_profile, /update_weights_from_disk, /load_lora_adapter,
/unload_lora_adapter.

    POST /start_profile  {"output_dir"?, "num_steps"?, "activities"?: ["CPU"]}
                         -> {"message", "trace_path"}: a torch profiler runs around the scheduler's
                         steps; the Chrome trace (.json.gz) goes to trace_path on /stop_profile or
                         after num_steps steps (400 when already running)
    POST /stop_profile   -> {"message", "trace_path"} (400 when not running)
    POST /update_weights_from_disk {"model_path", "load_format"?} -> {"success", "message"}: the
                         scheduler lets the admitted requests finish (new ones wait), reloads the
                         weights, flushes the prefix cache, resumes; 400 (old weights kept, the
                         body also carries OpenAI's "error") when the path is missing or the
                         checkpoint's architecture or shapes differ
    POST /load_lora_adapter {"lora_name", "lora_path", "pinned"?}
                         -> {"success", "message", "error_message", "loaded_adapters": {name: path}}
                         (SGLang's shape): requests may name the adapter once it answers; 400 when
                         --enable-lora is off, a field is missing or empty, the name is loaded
                         already, or the scheduler refused the adapter (the body then also carries
                         OpenAI's "error")
    POST /unload_lora_adapter {"lora_name"} -> the same shape; requests naming the adapter are
                         refused from the start; 400 (the adapter kept) while requests use it
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from srt.entrypoints.http.deps import Ctx
from srt.entrypoints.http.serving import parse_body
from srt.entrypoints.openai.common import error_body, error_response, json_response
from srt.entrypoints.openai.protocol import (
    AbortRequest,
    LoadLoRAAdapterRequest,
    ProfileRequest,
    UnloadLoRAAdapterRequest,
    UpdateWeightsFromDiskRequest,
)
from srt.managers.io_struct import LoRAAdapterReqOutput, ProfileReq, ProfileReqOutput
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


def _profile_response(out: ProfileReqOutput) -> Response:
    if not out.success:
        return error_response(out.message, 400, code="profiler_state")
    return json_response({"message": out.message, "trace_path": out.trace_path})


@router.post("/start_profile")
async def start_profile(request: Request, ctx: Ctx) -> Response:
    req = await parse_body(request, ProfileRequest)
    msg = ProfileReq(
        action="start", output_dir=req.output_dir, num_steps=req.num_steps, activities=req.activities
    )
    return _profile_response(await ctx.tm.profile(msg))


@router.post("/stop_profile")
async def stop_profile(ctx: Ctx) -> Response:
    return _profile_response(await ctx.tm.profile(ProfileReq(action="stop")))


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request, ctx: Ctx) -> Response:
    req = await parse_body(request, UpdateWeightsFromDiskRequest)
    out = await ctx.tm.update_weights_from_disk(req.model_path, req.load_format)
    body = {"success": out.success, "message": out.message}
    if out.success:
        return json_response(body)
    return json_response({**body, **error_body(out.message, 400, "model_path", "weights_not_updated")}, 400)


def _lora_response(out: LoRAAdapterReqOutput, param: str) -> Response:
    body = {
        "success": out.success,
        "message": out.message,
        "error_message": None if out.success else out.message,
        "loaded_adapters": dict(out.loaded_adapters),
    }
    if out.success:
        return json_response(body)
    return json_response({**body, **error_body(out.message, 400, param, "lora_not_updated")}, 400)


@router.post("/load_lora_adapter")
async def load_lora_adapter(request: Request, ctx: Ctx) -> Response:
    req = await parse_body(request, LoadLoRAAdapterRequest)
    out = await ctx.lora.load(req.lora_name, req.lora_path, req.pinned)
    return _lora_response(out, "lora_path")


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(request: Request, ctx: Ctx) -> Response:
    req = await parse_body(request, UnloadLoRAAdapterRequest)
    return _lora_response(await ctx.lora.unload(req.lora_name), "lora_name")

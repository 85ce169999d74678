"""SGLang's native routes: POST /generate, GET /health, /health_generate, /get_model_info,
/get_server_info (also under SGLang's newer names /model_info, /server_info), /get_load, /version,
POST /tokenize, /detokenize.

/generate returns the output dict (SGLang's shape, `srt.managers.tokenizer.req_output`) of a single prompt,
or the list of a batch / ``n > 1``; with ``"stream": true`` SSE chunks (each holding the output so
far, or only its new part with ``--incremental-streaming-output``), an error mid-stream as
``{"error": {"message", "type", "code"}}`` and always ``data: [DONE]``. The body is a
`GenerateReqInput` (`GenerateReqInput.from_json`: strict types, 400 naming the field; fields srt
does not know are ignored). /health never needs the API key and turns 503 once a child process died.

    POST /tokenize    {"prompt": str | [str], "add_special_tokens": true}
                      -> {"tokens": [int] | [[int]], "count": int | [int], "max_model_len": int}
    POST /detokenize  {"tokens": [int], "skip_special_tokens": true} -> {"text": str}
                      (400 for ids outside the vocabulary; both 400 under --skip-tokenizer-init)
    GET /get_load     [{"num_reqs", "num_waiting_reqs", "num_tokens", "dp_rank"}] per scheduler
    GET /version      {"version": the srt-engine package version}
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import os
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from srt.entrypoints.http.auth import redacted_args
from srt.entrypoints.http.deps import Ctx
from srt.entrypoints.http.serving import collect, parse_body, serve
from srt.entrypoints.http.sse import sse_stream
from srt.entrypoints.openai.common import error_response, json_response, raise_abort_error
from srt.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from srt.managers.data_parallel.replies import split_dp_state
from srt.managers.tokenizer.generate_input import GenerateReqInput
from srt.managers.tokenizer.pooled_run import PrefillOnly
from srt.utils.errors import SrtError

router = APIRouter()

_HEALTH_GENERATE_TIMEOUT_S = 20.0


def _generate_body(obj: GenerateReqInput, outs: list[dict[str, Any]]) -> Any:
    """The /generate body: raises the error of an output aborted with a status other than 499."""
    for o in outs:
        raise_abort_error(o["meta_info"]["finish_reason"])
    return outs if obj.is_batch or len(outs) > 1 else outs[0]


def _native_error_payload(e: SrtError) -> dict[str, Any]:
    return {"error": {"message": e.message, "type": e.error_type, "code": e.code}}


def _generate_stream(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    return sse_stream(chunks, _native_error_payload)


@router.post("/generate")
async def generate(request: Request, ctx: Ctx) -> Response:
    obj = GenerateReqInput.from_json(await request.body())
    return await serve(request, ctx.tm, obj, partial(_generate_body, obj), _generate_stream)


@router.get("/health")
async def health(ctx: Ctx) -> Response:
    tm = ctx.tm
    if tm.is_healthy:
        return Response(status_code=200)
    return error_response(tm.dead.message if tm.dead else "unhealthy", 503)


@router.get("/health_generate")
async def health_generate(ctx: Ctx) -> Response:
    """200 after a real one-token generation, else 503 with why."""
    tm = ctx.tm
    token = 0
    if tm.tokenizer is not None and tm.tokenizer.bos_token_id is not None:
        token = tm.tokenizer.bos_token_id
    obj = GenerateReqInput(input_ids=[token], sampling_params={"max_new_tokens": 1, "temperature": 0})
    embed = PrefillOnly("last") if tm.server_args.is_embedding else None  # one pooled prefill
    if embed is not None:
        obj.sampling_params = {"max_new_tokens": 0}
    try:
        outs = await asyncio.wait_for(collect(tm.generate(obj, embed)), _HEALTH_GENERATE_TIMEOUT_S)
    except (SrtError, asyncio.TimeoutError) as e:
        return error_response(f"health generation failed: {e!r}", 503)
    reason = outs[0]["meta_info"]["finish_reason"]
    if reason["type"] == "abort":
        return error_response(f"health generation aborted: {reason}", 503)
    return Response(status_code=200)


@router.get("/get_model_info")
@router.get("/model_info")
async def get_model_info(ctx: Ctx) -> Response:
    tm = ctx.tm
    return json_response(
        {
            "model_path": tm.server_args.model_path,
            "tokenizer_path": tm.server_args.tokenizer_path,
            "served_model_name": tm.model_name,
            "is_generation": not tm.server_args.is_embedding,
            "context_len": tm.context_len,
        }
    )


@router.get("/get_server_info")
@router.get("/server_info")
async def get_server_info(ctx: Ctx) -> Response:
    """Resolved server args (keys redacted; ``served_model_name`` the name the OpenAI routes
    accept, which is what SGLang's router registers the worker under), the scheduler's capacity,
    its live state and the process ids."""
    tm = ctx.tm
    try:
        state = await tm.get_internal_state()
    except asyncio.TimeoutError:
        state = {}
    pids = tm.launcher.child_pids if tm.launcher is not None else {}
    states, dp_controller = split_dp_state(state)
    return json_response(
        {
            **redacted_args(tm.server_args),
            "served_model_name": tm.model_name,
            **tm.scheduler_info,
            "internal_states": states,
            "process_pids": {"main": os.getpid(), **pids},
            **({"dp_controller": dp_controller} if dp_controller is not None else {}),
        }
    )


@router.get("/get_load")
async def get_load(ctx: Ctx) -> Response:
    try:
        return json_response(await ctx.tm.get_load())
    except asyncio.TimeoutError:
        return error_response("the scheduler did not report its load in time", 503)


@functools.cache
def srt_version() -> str:
    """The installed srt-engine distribution's version (srt.__version__ when not installed)."""
    try:
        return importlib.metadata.version("srt-engine")
    except importlib.metadata.PackageNotFoundError:
        import srt

        return str(getattr(srt, "__version__", "unknown"))


@router.get("/version")
async def version() -> Response:
    return json_response({"version": srt_version()})


@router.post("/tokenize")
async def tokenize(request: Request, ctx: Ctx) -> Response:
    req = await parse_body(request, TokenizeRequest)
    texts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
    ids = await ctx.tm.tokenize(texts, req.add_special_tokens) if texts else []
    if isinstance(req.prompt, str):
        body: dict[str, Any] = {"tokens": ids[0], "count": len(ids[0])}
    else:
        body = {"tokens": ids, "count": [len(x) for x in ids]}
    return json_response({**body, "max_model_len": ctx.tm.context_len})


@router.post("/detokenize")
async def detokenize(request: Request, ctx: Ctx) -> Response:
    req = await parse_body(request, DetokenizeRequest)
    return json_response({"text": ctx.tm.detokenize(req.tokens, req.skip_special_tokens)})

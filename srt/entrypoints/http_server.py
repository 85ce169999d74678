"""The HTTP server: FastAPI routes over the TokenizerManager, served by uvicorn (uvloop).

Routes
    POST /generate              native (SGLang shape); SSE when "stream": true
    POST /v1/completions        OpenAI completions (SSE streaming)
    POST /v1/chat/completions   OpenAI chat completions (SSE streaming)
    GET  /v1/models             the served model
    GET  /health                200 while every process is alive, else 503 (never needs the API key)
    GET  /health_generate       a real one-token generation
    GET  /get_model_info, /get_server_info (server args + live scheduler state), /metrics
    POST /flush_cache, /abort_request

Client disconnects abort the request at once: non-streaming handlers race the generation against
``http.disconnect`` (a blocking ``receive()``, no polling); streaming responses listen for it in a
task group and cancel the stream, whose generator aborts its rids on the way out.

If a child process dies, in-flight requests fail (503, or an SSE error event when already
streaming), /health turns 503 and the server exits with code 1 (graceful for 2 s, forced at 4 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import signal
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any, TypeVar

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError

from srt.entrypoints.launch import launch_subprocesses
from srt.entrypoints.openai.common import (
    SSE_DONE,
    abort_error,
    error_response,
    json_response,
    srt_error_response,
    sse,
)
from srt.entrypoints.openai.protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
)
from srt.entrypoints.openai.serving_chat import OpenAIServingChat
from srt.entrypoints.openai.serving_completions import OpenAIServingCompletion
from srt.managers.generate_input import GenerateReqInput
from srt.managers.tokenizer_manager import TokenizerManager
from srt.server_args import ServerArgs
from srt.utils.errors import EngineDeadError, RequestError, SrtError

logger = logging.getLogger(__name__)

_M = TypeVar("_M", bound=BaseModel)
_T = TypeVar("_T")
_HEALTH_GENERATE_TIMEOUT_S = 20.0
_GRACEFUL_SHUTDOWN_S = 2
_FORCED_EXIT_S = 4.0


class ClientDisconnected(Exception):
    pass


class DisconnectAwareStreamingResponse(StreamingResponse):
    """A StreamingResponse that always listens for ``http.disconnect`` while streaming and cancels
    the body iterator when it arrives (whatever ASGI spec version the server reports)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async with anyio.create_task_group() as tg:

            async def run_then_cancel(func: Callable[[], Awaitable[None]]) -> None:
                await func()
                tg.cancel_scope.cancel()

            tg.start_soon(run_then_cancel, partial(self.stream_response, send))
            await run_then_cancel(partial(self.listen_for_disconnect, receive))


class ApiKeyMiddleware:
    """Require ``Authorization: Bearer <key>`` on every route but /health (pure ASGI)."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.key = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            auth = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(auth, self.key):
                msg = "missing API key" if not auth else "incorrect API key"
                resp = error_response(
                    f"{msg}: send 'Authorization: Bearer <key>' with the server's --api-key",
                    401,
                    code="invalid_api_key",
                )
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _until_disconnect(request: Request, aw: Awaitable[_T]) -> _T:
    """Await ``aw`` unless the client disconnects first (then cancel it: the request is aborted)."""
    task = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientDisconnected()


def _validation_message(e: ValidationError) -> tuple[str, str | None]:
    errs = e.errors()
    if errs and errs[0]["type"] == "json_invalid":
        return f"malformed JSON body: {errs[0]['msg']}", None
    parts, first = [], None
    for err in errs:
        loc = ".".join(str(x) for x in err["loc"])
        first = first or loc.split(".")[0]
        got = f" (got {err['input']!r})" if "input" in err and not isinstance(err["input"], dict) else ""
        parts.append(f"{loc}: {err['msg']}{got}")
    return "; ".join(parts), first


async def _parse(request: Request, model: type[_M]) -> _M:
    body = await request.body()
    try:
        return model.model_validate_json(body or b"{}", strict=True)
    except ValidationError as e:
        message, param = _validation_message(e)
        raise RequestError(message, param=param, code="invalid_type") from None


async def _prepend(
    first: dict[str, Any], rest: AsyncIterator[dict[str, Any]]
) -> AsyncIterator[dict[str, Any]]:
    yield first
    async for item in rest:
        yield item


def create_app(tm: TokenizerManager) -> FastAPI:
    server_args = tm.server_args
    completions = OpenAIServingCompletion(tm)
    chat = OpenAIServingChat(tm)
    model_names = {tm.model_name, "default"}
    if server_args.model_path:
        model_names.add(server_args.model_path)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await tm.start()
        yield
        await tm.close()

    app = FastAPI(lifespan=lifespan, title="srt", docs_url=None, redoc_url=None)
    if server_args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=server_args.api_key)

    @app.exception_handler(SrtError)
    async def _srt_error(request: Request, e: SrtError) -> Response:
        return srt_error_response(e)

    @app.exception_handler(ClientDisconnected)
    async def _disconnected(request: Request, e: ClientDisconnected) -> Response:
        return Response(status_code=499)

    def check_model(model: str | None) -> None:
        if model is not None and model not in model_names:
            raise _ModelNotFound(model)

    async def serve(
        request: Request,
        obj: GenerateReqInput,
        build: Callable[[list[dict]], Any],
        stream: Callable[[AsyncIterator[dict]], AsyncIterator[bytes]],
    ) -> Response:
        prep = await tm.prepare(obj)
        agen = tm.run(prep)
        if not prep.stream:

            async def collect() -> list[dict[str, Any]]:
                return [o async for o in agen]

            outs = await _until_disconnect(request, collect())
            outs.sort(key=lambda o: o["index"])
            return json_response(build(outs))
        # headers go out with the first chunk: errors before it still get a proper status code
        first = await _until_disconnect(request, agen.__anext__())
        return DisconnectAwareStreamingResponse(stream(_prepend(first, agen)), media_type="text/event-stream")

    # ------------------------------------------------------------------ OpenAI
    @app.post("/v1/completions")
    async def v1_completions(request: Request) -> Response:
        req = await _parse(request, CompletionRequest)
        check_model(req.model)
        obj = completions.build_input(req)
        return await serve(
            request, obj, partial(completions.build_response, req), partial(completions.stream, req)
        )

    @app.post("/v1/chat/completions")
    async def v1_chat_completions(request: Request) -> Response:
        req = await _parse(request, ChatCompletionRequest)
        check_model(req.model)
        obj = chat.build_input(req)
        return await serve(request, obj, partial(chat.build_response, req), partial(chat.stream, req))

    @app.get("/v1/models")
    async def v1_models() -> Response:
        card = {
            "id": tm.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "srt",
            "root": server_args.model_path or tm.model_name,
            "max_model_len": tm.context_len,
        }
        return json_response({"object": "list", "data": [card]})

    # ------------------------------------------------------------------ native
    @app.post("/generate")
    async def generate(request: Request) -> Response:
        req = await _parse(request, GenerateRequest)
        obj = GenerateReqInput(**req.model_dump())

        def build(outs: list[dict[str, Any]]) -> Any:
            for o in outs:
                err = abort_error(o["meta_info"]["finish_reason"])
                if err is not None and err.status_code != 499:
                    raise err
            return outs if obj.is_batch or len(outs) > 1 else outs[0]

        async def stream(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
            try:
                async for c in chunks:
                    yield sse(c)
            except SrtError as e:
                yield sse({"error": {"message": e.message, "type": e.error_type, "code": e.code}})
            yield SSE_DONE

        return await serve(request, obj, build, stream)

    @app.get("/health")
    async def health() -> Response:
        if tm.is_healthy:
            return Response(status_code=200)
        return error_response(tm.dead.message if tm.dead else "unhealthy", 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        token = 0
        if tm.tokenizer is not None and tm.tokenizer.bos_token_id is not None:
            token = tm.tokenizer.bos_token_id
        obj = GenerateReqInput(input_ids=[token], sampling_params={"max_new_tokens": 1, "temperature": 0})

        async def one() -> list[dict[str, Any]]:
            return [o async for o in tm.generate(obj)]

        try:
            outs = await asyncio.wait_for(one(), _HEALTH_GENERATE_TIMEOUT_S)
        except (SrtError, asyncio.TimeoutError) as e:
            return error_response(f"health generation failed: {e!r}", 503)
        if outs[0]["meta_info"]["finish_reason"]["type"] == "abort":
            return error_response(f"health generation aborted: {outs[0]['meta_info']['finish_reason']}", 503)
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def get_model_info() -> Response:
        return json_response(
            {
                "model_path": server_args.model_path,
                "tokenizer_path": server_args.tokenizer_path,
                "served_model_name": tm.model_name,
                "is_generation": True,
                "context_len": tm.context_len,
            }
        )

    @app.get("/get_server_info")
    async def get_server_info() -> Response:
        try:
            state = await tm.get_internal_state()
        except asyncio.TimeoutError:
            state = {}
        pids = tm.launcher.child_pids if tm.launcher is not None else {}
        return json_response(
            {
                **dataclasses.asdict(server_args),
                **tm.scheduler_info,
                "internal_states": [state],
                "process_pids": {"main": os.getpid(), **pids},
            }
        )

    @app.post("/flush_cache")
    @app.get("/flush_cache")
    async def flush_cache() -> Response:
        out = await tm.flush_cache()
        if not out.success:
            return error_response(out.message or "cache not flushed", 400, code="cache_busy")
        return PlainTextResponse("Cache flushed." + (f" {out.message}" if out.message else ""))

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        req = await _parse(request, AbortRequest)
        if not req.rid and not req.abort_all:
            raise RequestError("give a rid, or abort_all: true", param="rid")
        return json_response({"aborted": tm.abort_request("" if req.abort_all else req.rid)})

    @app.get("/metrics")
    async def metrics() -> Response:
        if not server_args.enable_metrics:
            return error_response("metrics are disabled (--enable-metrics)", 404)
        return Response(await tm.render_metrics(), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(_ModelNotFound)
    async def _model_not_found(request: Request, e: _ModelNotFound) -> Response:
        return error_response(
            f"the model {e.model!r} does not exist; this server serves {tm.model_name!r}",
            404,
            param="model",
            code="model_not_found",
        )

    return app


class _ModelNotFound(Exception):
    def __init__(self, model: str) -> None:
        super().__init__(model)
        self.model = model


def launch_server(server_args: ServerArgs, scheduler_entry: Callable[..., None] | None = None) -> int:
    """Launch the processes and serve HTTP until SIGINT/SIGTERM or a child's death.

    Returns the process exit code: 0 after a signal, 1 when a child died or the port was taken.
    Raises `LaunchError` when a child fails at start-up."""
    previous = signal.signal(signal.SIGTERM, _raise_system_exit)  # clean up if killed during launch
    try:
        tm, _ = launch_subprocesses(server_args, scheduler_entry=scheduler_entry)
    finally:
        signal.signal(signal.SIGTERM, previous)
    args = tm.server_args
    exit_code = 0
    config = uvicorn.Config(
        create_app(tm),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        loop="uvloop",
        access_log=args.log_requests,
        timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S,
        timeout_keep_alive=5,
    )
    server = uvicorn.Server(config)

    def on_death(err: EngineDeadError) -> None:
        nonlocal exit_code
        exit_code = 1
        server.should_exit = True

        def force_exit() -> None:
            logger.error("the server did not stop in time after a child died; forcing exit")
            tm.launcher.shutdown()
            os._exit(1)

        timer = threading.Timer(_FORCED_EXIT_S, force_exit)
        timer.daemon = True
        timer.start()

    tm.add_death_callback(on_death)
    # uvicorn handles SIGINT/SIGTERM (graceful shutdown) and re-raises the signal afterwards; make
    # that re-raise a no-op so the children are stopped below and the exit code is 0
    saved = {s: signal.signal(s, _ignore_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
        if not server.started and exit_code == 0:
            exit_code = 1  # e.g. the port is taken (uvicorn logged why)
    finally:
        tm.launcher.shutdown()
        for s, handler in saved.items():
            signal.signal(s, handler)
    logger.info("server stopped (exit code %d)", exit_code)
    return exit_code


def _ignore_signal(signum: int, frame: Any) -> None:
    logger.info("signal %d: stopping", signum)


def _raise_system_exit(signum: int, frame: Any) -> None:
    sys.exit(128 + signum)

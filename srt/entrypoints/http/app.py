"""The app factory: `create_app(tm)` composes the routers over one TokenizerManager.

lifespan          starts the TokenizerManager's receive loop in the serving event loop, loads
                  anyio's asyncio backend (a streamed response's task group would import it on
                  the first stream: 0.7 s on a busy 2-core host, during which that stream's chunks
                  pile up), closes the manager on shutdown
middleware        innermost the request body's bound (`body_limit.BodyLimitMiddleware`:
                  --max-request-body-bytes, 413); the API keys (`auth.ApiKeyMiddleware`:
                  --api-key, --admin-api-key); outermost the graceful drain's (`drain.DrainMiddleware`: in-flight count, 503 while draining;
                  its `DrainState` is ``app.state.drain``)
error handlers    `SrtError` -> OpenAI's error body with its status (429 with Retry-After);
                  `ClientDisconnected` -> 499; routing's 404 / 405 -> OpenAI's error body too
routers           openai_routes, native_routes, admin_routes, embedding_routes (through ``Ctx``);
                  web_routes (the built-in page, unless --disable-web-ui)
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from srt.entrypoints.http import admin_routes, embedding_routes, native_routes, openai_routes, web_routes
from srt.entrypoints.http.auth import ApiKeyMiddleware
from srt.entrypoints.http.body_limit import BodyLimitMiddleware
from srt.entrypoints.http.deps import ServerContext
from srt.entrypoints.http.drain import DrainMiddleware, DrainState
from srt.entrypoints.http.openapi import install_openapi
from srt.entrypoints.http.serving import ClientDisconnected
from srt.entrypoints.http.web_routes import is_public_path
from srt.entrypoints.openai.common import error_response, srt_error_response
from srt.managers.tokenizer.tokenizer_manager import TokenizerManager
from srt.utils.errors import SrtError


async def _srt_error(request: Request, e: SrtError) -> Response:
    return srt_error_response(e)


async def _client_disconnected(request: Request, e: ClientDisconnected) -> Response:
    return Response(status_code=499)


async def _routing_error(request: Request, e: StarletteHTTPException) -> Response:
    """A path no route serves (404) or a method its route does not take (405, with ``Allow``), in
    OpenAI's error shape like every other error (FastAPI's default body is ``{"detail": ...}``)."""
    where = f"{request.method} {request.url.path}"
    if e.status_code == 404:
        message = f"Invalid URL ({where}): no route serves this path"
    elif e.status_code == 405:
        allowed = next((v for k, v in (e.headers or {}).items() if k.lower() == "allow"), "")
        message = f"Method not allowed ({where}); this route takes {allowed or 'another method'}"
    else:
        message = f"{e.detail} ({where})"
    return error_response(message, e.status_code, dict(e.headers or {}) or None)


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    tm = app.state.ctx.tm
    await tm.start()
    async with anyio.create_task_group():
        pass
    yield
    await tm.close()


def create_app(tm: TokenizerManager) -> FastAPI:
    """The FastAPI app serving ``tm`` (not started: the lifespan starts ``tm`` in uvicorn's loop)."""
    app = FastAPI(lifespan=_lifespan, title="srt", docs_url=None, redoc_url=None)
    app.state.ctx = ServerContext.create(tm)
    args = tm.server_args
    app.add_middleware(BodyLimitMiddleware, limit=args.max_request_body_bytes)  # after the keys
    if args.api_key or args.admin_api_key:
        public = None if args.disable_web_ui else is_public_path
        app.add_middleware(
            ApiKeyMiddleware, api_key=args.api_key, admin_api_key=args.admin_api_key, is_public=public
        )
    app.state.drain = DrainState()
    app.add_middleware(DrainMiddleware, state=app.state.drain)  # added last: outermost
    app.add_exception_handler(SrtError, _srt_error)
    app.add_exception_handler(ClientDisconnected, _client_disconnected)
    app.add_exception_handler(StarletteHTTPException, _routing_error)
    for module in (openai_routes, native_routes, admin_routes, embedding_routes):
        app.include_router(module.router)
    if not tm.server_args.disable_web_ui:
        app.include_router(web_routes.router)
    install_openapi(app)  # /openapi.json with the bodies the routes parse by hand
    return app

"""The app factory: `create_app(tm)` composes the routers over one TokenizerManager.

lifespan          starts the TokenizerManager's receive loop in the serving event loop,
                  closes it on shutdown
middleware        ``Authorization: Bearer <--api-key>`` on every path but /health; outermost the
                  graceful drain's (`drain.DrainMiddleware`: in-flight count, 503 while draining;
                  its `DrainState` is ``app.state.drain``)
error handlers    `SrtError` -> OpenAI's error body with its status (429 with Retry-After);
                  `ClientDisconnected` -> 499
routers           openai_routes, native_routes, admin_routes (dependencies through ``Ctx``)
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from srt.entrypoints.http import admin_routes, native_routes, openai_routes
from srt.entrypoints.http.deps import ServerContext
from srt.entrypoints.http.drain import DrainMiddleware, DrainState
from srt.entrypoints.http.serving import ClientDisconnected
from srt.entrypoints.openai.common import error_response, srt_error_response
from srt.managers.tokenizer.tokenizer_manager import TokenizerManager
from srt.utils.errors import SrtError


class ApiKeyMiddleware:
    """Require ``Authorization: Bearer <key>`` on every path but /health (pure ASGI: unknown
    paths answer 401 too)."""

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


async def _srt_error(request: Request, e: SrtError) -> Response:
    return srt_error_response(e)


async def _client_disconnected(request: Request, e: ClientDisconnected) -> Response:
    return Response(status_code=499)


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    tm = app.state.ctx.tm
    await tm.start()
    yield
    await tm.close()


def create_app(tm: TokenizerManager) -> FastAPI:
    """The FastAPI app serving ``tm`` (not started: the lifespan starts ``tm`` in uvicorn's loop)."""
    app = FastAPI(lifespan=_lifespan, title="srt", docs_url=None, redoc_url=None)
    app.state.ctx = ServerContext.create(tm)
    if tm.server_args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=tm.server_args.api_key)
    app.state.drain = DrainState()
    app.add_middleware(DrainMiddleware, state=app.state.drain)  # added last: outermost
    app.add_exception_handler(SrtError, _srt_error)
    app.add_exception_handler(ClientDisconnected, _client_disconnected)
    for module in (openai_routes, native_routes, admin_routes):
        app.include_router(module.router)
    return app

"""Request plumbing shared by the routes: body parsing, disconnect-aware execution, streaming.

Client disconnects abort the request at once: `serve` races a non-streaming generation against
``http.disconnect`` (a blocking ``receive()``, no polling) and raises `ClientDisconnected` (answered
499, nobody reads it); a streaming response (`DisconnectAwareStreamingResponse`) listens for it in
a task group and cancels the stream, whose generator aborts its rids on the way out.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from srt.entrypoints.openai.common import json_response
from srt.managers.tokenizer.generate_input import GenerateReqInput, surrogate_message
from srt.managers.tokenizer.tokenizer_manager import TokenizerManager
from srt.utils.errors import RequestError

_M = TypeVar("_M", bound=BaseModel)
_T = TypeVar("_T")

# builds the JSON body from the outputs sorted by index / turns the output stream into SSE bytes
BuildBody = Callable[[list[dict[str, Any]]], Any]
BuildStream = Callable[[AsyncIterator[dict[str, Any]]], AsyncIterator[bytes]]


class ClientDisconnected(Exception):
    """The client went away before the response was ready (the request is aborted)."""


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


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, aw: Awaitable[_T]) -> _T:
    """Await ``aw`` unless the client disconnects first (then cancel it: the request is aborted,
    and `ClientDisconnected` is raised)."""
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


# a validation message names at most this many errors, and shows at most this much of a value
_MAX_ERRORS = 8
_MAX_REPR = 60


def _short(value: Any) -> str:
    """``value``'s repr, cut to about `_MAX_REPR` characters (a long list or string is echoed by
    its start and its size, never whole)."""
    if isinstance(value, (list, str)) and len(value) > _MAX_REPR // 2:
        head = repr(value[: _MAX_REPR // 6] if isinstance(value, list) else value[: _MAX_REPR // 2])
        what = "items" if isinstance(value, list) else "characters"
        return f"{head[:-1][:_MAX_REPR]}... ({len(value)} {what})"
    text = repr(value)
    return text if len(text) <= _MAX_REPR else text[: _MAX_REPR - 3] + "..."


def _validation_message(e: ValidationError) -> tuple[str, str | None]:
    errs = e.errors(include_url=False)
    if errs and errs[0]["type"] == "json_invalid":
        return f"malformed JSON body: {errs[0]['msg']}", None
    parts, first = [], None
    for err in errs[:_MAX_ERRORS]:
        loc = ".".join(str(x) for x in err["loc"])
        first = first or loc.split(".")[0]
        got = (
            f" (got {_short(err['input'])})" if "input" in err and not isinstance(err["input"], dict) else ""
        )
        parts.append(f"{loc}: {err['msg']}{got}")
    if len(errs) > _MAX_ERRORS:
        parts.append(f"and {len(errs) - _MAX_ERRORS} more")
    return "; ".join(parts), first


async def parse_body(request: Request, model: type[_M]) -> _M:
    """The request body validated as ``model`` (strict); `RequestError` naming every bad field."""
    body = await request.body()
    try:
        return model.model_validate_json(body or b"{}", strict=True)
    except ValidationError as e:
        message, param = _validation_message(e)
        # pydantic's words for a lone surrogate too: "unexpected end of hex escape"
        if param is None and "hex escape" in message and (surrogate := surrogate_message(body)):
            message = f"malformed JSON body: {surrogate}"
        raise RequestError(message, param=param, code="invalid_type") from None


async def _prepend(
    first: dict[str, Any], rest: AsyncIterator[dict[str, Any]]
) -> AsyncIterator[dict[str, Any]]:
    yield first
    async for item in rest:
        yield item


async def collect(agen: AsyncIterator[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every output of ``agen`` (in arrival order)."""
    return [o async for o in agen]


TIMEOUT_HEADER = "x-request-timeout"


def header_timeout(request: Request) -> float | None:
    """The ``X-Request-Timeout`` header in seconds (None when absent; `RequestError` when it is
    not a number: the value is checked like the body's ``timeout``)."""
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return None
    try:
        return float(raw)
    except ValueError:
        raise RequestError(
            f"the X-Request-Timeout header must be a number of seconds, got {raw!r}",
            param="X-Request-Timeout",
        ) from None


async def serve(
    request: Request, tm: TokenizerManager, obj: GenerateReqInput, build: BuildBody, stream: BuildStream
) -> Response:
    """Run ``obj``: a JSON response of ``build(outputs by index)``, or an SSE response of
    ``stream(chunks)``. Errors raised before the first chunk exists (validation, queue full, a
    dead engine) get their own status code: a streaming response's headers go out with it.
    ``obj.timeout`` unset takes the ``X-Request-Timeout`` header (seconds)."""
    if obj.timeout is None:
        obj.timeout = header_timeout(request)
    prep = await tm.prepare(obj)
    agen = tm.run(prep)
    if not prep.stream:
        outs = await until_disconnect(request, collect(agen))
        outs.sort(key=lambda o: o["index"])
        return json_response(build(outs))
    first = await until_disconnect(request, agen.__anext__())
    return DisconnectAwareStreamingResponse(stream(_prepend(first, agen)), media_type="text/event-stream")

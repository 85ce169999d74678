"""The request body's bound (``--max-request-body-bytes``): a body past it is a 413 in OpenAI's
error shape, never read into memory whole.

Every route reads its body whole before parsing it (`serving.parse_body`, /generate's decode), so
without a bound one request of a few GiB, or a few of them at once, would take the HTTP process's
memory before any field is looked at. `BodyLimitMiddleware` (pure ASGI) refuses at once a request
whose ``Content-Length`` is past the bound, without reading its body; a body sent without a length
(chunked) is counted as it arrives, and the read that crosses the bound raises
`PayloadTooLargeError`, which the app's `SrtError` handler answers with the same 413.
"""

from __future__ import annotations

from typing import Any

from srt.entrypoints.openai.common import srt_error_response
from srt.utils.errors import SrtError


class PayloadTooLargeError(SrtError):
    """A request body past ``--max-request-body-bytes`` (HTTP 413)."""

    status_code = 413
    error_type = "invalid_request_error"
    code = "request_too_large"


def _message(limit: int) -> str:
    return (
        f"the request body is larger than the server's --max-request-body-bytes={limit} bytes; "
        "send a smaller one (images can go by URL instead of inline)"
    )


def _content_length(scope: dict[str, Any]) -> int | None:
    """The ``Content-Length`` header's value; None when absent; -1 when it is not a number."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return -1
    return None


class BodyLimitMiddleware:
    """Refuse request bodies of more than ``limit`` bytes with HTTP 413."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None and length > self.limit:
            await srt_error_response(PayloadTooLargeError(_message(self.limit)))(scope, receive, send)
            return
        if length is not None and length >= 0:  # the server reads no more than the header says
            await self.app(scope, receive, send)
            return
        seen = 0

        async def counted() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise PayloadTooLargeError(_message(self.limit))
            return message

        await self.app(scope, counted, send)

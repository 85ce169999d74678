r"""Server-sent events: the one helper every streaming route uses.

A stream of payloads becomes::

    data: <json payload>\n\n          one event per payload, in order
    data: <json error payload>\n\n    if the payloads raise an `SrtError` mid-way (the status line
                                        and headers are already sent: the error travels as an event)
    data: [DONE]\n\n                  always last

Each route picks its error payload: OpenAI's error object for /v1/*, SGLang's for /generate.
Other exceptions (cancellation on client disconnect included) propagate unchanged.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson

from srt.utils.errors import SrtError

SSE_DONE = b"data: [DONE]\n\n"


def sse_event(data: Any) -> bytes:
    """One ``data:`` event of ``data`` as JSON."""
    return b"data: " + orjson.dumps(data) + b"\n\n"


async def sse_stream(
    payloads: AsyncIterator[Any], error_payload: Callable[[SrtError], Any]
) -> AsyncIterator[bytes]:
    """The SSE events of ``payloads`` (module docstring), ending in ``data: [DONE]``."""
    try:
        async for payload in payloads:
            yield sse_event(payload)
    except SrtError as e:
        yield sse_event(error_payload(e))
    yield SSE_DONE

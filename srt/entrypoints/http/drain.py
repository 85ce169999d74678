"""Graceful drain: what the HTTP server does between SIGTERM (or SIGINT) and its exit.

uvicorn's own graceful shutdown closes the listening socket first, so a load balancer sees
refused connections instead of a clean answer. The drain runs *before* uvicorn is told to exit:

    1st signal   `DrainState.draining` turns on: new requests get 503 + ``Retry-After`` in OpenAI's
                 error shape, GET /health answers 503 at once (a load balancer moves away), GET
                 /metrics still answers; the requests in flight (``DrainState.in_flight``: every
                 HTTP request but /health and /metrics, a stream until its last event) go on
    in flight 0  -> uvicorn exits (``should_exit``); the server's exit code is 0
    timeout      after ``--graceful-shutdown-timeout`` s the requests left are aborted (finish
                 reason abort, 503, "the server shut down ..."; a stream ends with its error
                 event), they get a few seconds to send that, then uvicorn exits (exit code 0)
    2nd signal   during the drain: exit at once (uvicorn's force exit; the children are stopped)

`DrainMiddleware` (pure ASGI, outermost) owns the counting and the refusals; `DrainingServer`
(a ``uvicorn.Server``) owns the signals and runs `drain`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any

import uvicorn

from srt.entrypoints.openai.common import error_response
from srt.managers.tokenizer.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)

# paths that are neither counted nor refused while draining (/health answers 503 itself)
_UNCOUNTED = frozenset({"/health", "/metrics"})
# after the aborts, how long the aborted responses get to go out before uvicorn exits
_AFTER_ABORT_S = 5.0
_POLL_S = 0.05
SHUTDOWN_MESSAGE = "the server shut down before the request finished; retry on another replica"


@dataclass(slots=True)
class DrainState:
    """Shared by the middleware and the server (all in the serving event loop)."""

    draining: bool = False
    in_flight: int = 0
    retry_after: int = 5  # the Retry-After of refusals (seconds)


class DrainMiddleware:
    """Count the HTTP requests in flight; while draining refuse new ones (503 + Retry-After) and
    answer /health 503."""

    def __init__(self, app: Any, state: DrainState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] == "/metrics":
            await self.app(scope, receive, send)
            return
        st = self.state
        if st.draining:
            if scope["path"] == "/health":
                resp = error_response("the server is shutting down", 503, code="shutting_down")
            else:
                resp = error_response(
                    "the server is shutting down and accepts no new requests; retry on another replica",
                    503,
                    code="shutting_down",
                    headers={"Retry-After": str(st.retry_after)},
                )
            await resp(scope, receive, send)
            return
        if scope["path"] in _UNCOUNTED:
            await self.app(scope, receive, send)
            return
        st.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            st.in_flight -= 1


async def _until_idle(state: DrainState, deadline: float) -> bool:
    """Wait until nothing is in flight or ``deadline`` (monotonic); True when idle."""
    while state.in_flight > 0 and time.monotonic() < deadline:
        await asyncio.sleep(_POLL_S)
    return state.in_flight == 0


async def drain(state: DrainState, tm: TokenizerManager, timeout: float) -> None:
    """Refuse new requests, let those in flight finish for ``timeout`` seconds, abort the rest
    (and give them a moment to answer). Returns when uvicorn may exit."""
    state.draining = True
    state.retry_after = max(1, math.ceil(timeout))
    logger.info("draining: %d request(s) in flight, waiting up to %g s", state.in_flight, timeout)
    if await _until_idle(state, time.monotonic() + timeout):
        logger.info("drained: every request finished")
        return
    n = tm.abort_all(SHUTDOWN_MESSAGE, 503, "shutdown", retry_after=state.retry_after)
    logger.warning("drain timeout (%g s): aborted %d request(s) still running", timeout, n)
    await _until_idle(state, time.monotonic() + _AFTER_ABORT_S)


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM/SIGINT starts `drain` (then exits), and whose second
    one exits at once."""

    def __init__(
        self, config: uvicorn.Config, state: DrainState, tm: TokenizerManager, timeout: float
    ) -> None:
        super().__init__(config)
        self.drain_state = state
        self.tm = tm
        self.drain_timeout = timeout
        self.drain_signal: int | None = None  # the signal that started the drain
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain_signal is not None or self.should_exit or self._loop is None:
            logger.warning("signal %d during shutdown: exiting now", sig)
            self.should_exit = True
            self.force_exit = True
            return
        self.drain_signal = sig
        logger.info(
            "signal %s: draining (--graceful-shutdown-timeout %g s)",
            signal.Signals(sig).name,
            self.drain_timeout,
        )
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await drain(self.drain_state, self.tm, self.drain_timeout)
        finally:
            self.should_exit = True

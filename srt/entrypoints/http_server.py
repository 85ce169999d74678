"""The HTTP server process: `launch_server` runs the app of `srt.entrypoints.http` under uvicorn.

Routes (see `srt.entrypoints.http` for the routers)
    POST /generate              native (SGLang shape); SSE when "stream": true
    POST /v1/completions        OpenAI completions (SSE streaming)
    POST /v1/chat/completions   OpenAI chat completions (SSE streaming)
    GET  /v1/models             the served model
    POST /v1/embeddings, /encode, /v1/rerank, /v1/score   embeddings and scoring (prefill only)
    GET  /health                200 while every process is alive, else 503 (never needs the API key)
    GET  /health_generate       a real one-token generation
    GET  /get_model_info, /get_server_info (server args + live scheduler state), /metrics
    POST /flush_cache, /abort_request

SIGTERM / SIGINT start a graceful drain (`srt.entrypoints.http.drain`): new requests get 503 with
Retry-After, /health 503, the requests in flight finish for up to --graceful-shutdown-timeout
seconds, the rest are aborted, and the server exits 0; a second signal exits at once.

If a child process dies, in-flight requests fail (503, or an SSE error event when already
streaming), /health turns 503 and the server exits with code 1: uvicorn shuts down gracefully
(``_GRACEFUL_SHUTDOWN_S``) and the process is forced out after ``_FORCED_EXIT_S``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from srt.entrypoints.launch import launch_subprocesses
from srt.server_args import ServerArgs
from srt.utils.errors import EngineDeadError

if TYPE_CHECKING:
    import uvicorn

    from srt.managers.tokenizer.tokenizer_manager import TokenizerManager

__all__ = ["launch_server"]

logger = logging.getLogger(__name__)

_GRACEFUL_SHUTDOWN_S = 5  # uvicorn's own, after the drain: closing connections, not requests
_FORCED_EXIT_S = 4.0


def launch_server(server_args: ServerArgs, scheduler_entry: Callable[..., None] | None = None) -> int:
    """Launch the processes and serve HTTP until SIGINT/SIGTERM or a child's death.

    Returns the process exit code: 0 after a signal, 1 when a child died or the port was taken.
    Raises `LaunchError` when a child fails at start-up."""
    previous = signal.signal(signal.SIGTERM, _raise_system_exit)  # clean up if killed during launch
    try:
        tm, _ = launch_subprocesses(
            server_args, scheduler_entry=scheduler_entry, owns_process=True, while_starting=_import_app
        )
    finally:
        signal.signal(signal.SIGTERM, previous)
    from srt.entrypoints.http.drain import DrainingServer

    config = _uvicorn_config(tm)
    server = DrainingServer(config, config.app.state.drain, tm, tm.server_args.graceful_shutdown_timeout)
    died = threading.Event()
    tm.add_death_callback(partial(_on_child_death, server, tm, died))
    # the server drains on SIGINT/SIGTERM (DrainingServer); should uvicorn re-raise a signal after
    # its shutdown, make that a no-op so the children are stopped below and the exit code is 0
    saved = {s: signal.signal(s, _ignore_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    exit_code = 0
    try:
        server.run()
        if died.is_set() or not server.started:
            exit_code = 1  # a child died, or uvicorn could not start (e.g. the port is taken; it logged why)
    finally:
        tm.launcher.shutdown()
        for s, handler in saved.items():
            signal.signal(s, handler)
    logger.info("server stopped (exit code %d)", exit_code)
    return exit_code


def _import_app() -> None:
    """The app's modules (FastAPI, the routers, uvicorn: about 1 s of a 2-core CPU), imported while
    the children start instead of before: the scheduler, the last to be ready, starts that much
    sooner."""
    import srt.entrypoints.http.app
    import srt.entrypoints.http.drain  # noqa: F401


def _uvicorn_config(tm: TokenizerManager) -> uvicorn.Config:
    import uvicorn

    from srt.entrypoints.http.app import create_app

    args = tm.server_args
    return uvicorn.Config(
        create_app(tm),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        loop="uvloop",
        access_log=args.log_requests,
        timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S,
        timeout_keep_alive=5,
        ssl_keyfile=args.ssl_keyfile,  # HTTPS when both are given (checked at resolve)
        ssl_certfile=args.ssl_certfile,
    )


def _on_child_death(
    server: uvicorn.Server, tm: TokenizerManager, died: threading.Event, err: EngineDeadError
) -> None:
    """Stop serving (exit code 1); force the exit if uvicorn has not stopped in time."""
    died.set()
    server.should_exit = True

    def force_exit() -> None:
        logger.error("the server did not stop in time after a child died; forcing exit")
        tm.launcher.shutdown()
        os._exit(1)

    timer = threading.Timer(_FORCED_EXIT_S, force_exit)
    timer.daemon = True
    timer.start()


def _ignore_signal(signum: int, frame: Any) -> None:
    logger.info("signal %d: stopping", signum)


def _raise_system_exit(signum: int, frame: Any) -> None:
    sys.exit(128 + signum)

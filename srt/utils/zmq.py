"""ZMQ sockets for srt's ipc:// PUSH/PULL pipes.

Every socket has ``LINGER 0`` (closing never blocks on undelivered messages of a dead peer) and
unbounded high-water marks (a burst of requests is queued, never dropped: PUSH blocks instead of
dropping, and the queue is bounded by the admission control of the tokenizer manager).
Messages are the msgspec structs of `srt.managers.io_struct`, encoded with ``io_struct.encode``.
"""

from __future__ import annotations

import zmq
import zmq.asyncio


def _configure(sock: zmq.Socket, bind: bool, endpoint: str) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)


def get_zmq_socket(ctx: zmq.Context, socket_type: int, endpoint: str, bind: bool) -> zmq.Socket:
    """A configured socket of ``socket_type`` (zmq.PUSH / zmq.PULL) bound or connected to ``endpoint``.

    Works for both ``zmq.Context`` (blocking) and ``zmq.asyncio.Context`` (awaitable send/recv).
    """
    sock = ctx.socket(socket_type)
    _configure(sock, bind, endpoint)
    return sock


def new_async_context() -> zmq.asyncio.Context:
    """A fresh asyncio ZMQ context (one per TokenizerManager; terminated on shutdown)."""
    return zmq.asyncio.Context(io_threads=1)

"""The tokenizer manager's sockets and receive loop.

    TokenizerIPC.send(msg) --PUSH--> scheduler_input_ipc_name   (TokenizedGenerateReqInput, AbortReq,
                                                                 FlushCacheReq, GetInternalStateReq,
                                                                 ProfileReq, UpdateWeightsFromDiskReq,
                                                                 Load/UnloadLoRAAdapterReq)
    detokenizer --PUSH--> [PULL tokenizer_ipc_name] TokenizerIPC._recv_loop
        BatchStrOut                 -> ``on_batch_str_out(msg)`` (the tokenizer manager's handler)
        FlushCacheReqOutput,        -> the oldest pending future of its type (`flush_cache`,
        ProfileReqOutput,              `profile`, `update_weights_from_disk`, `lora_adapter`; the
        UpdateWeightsFromDiskReqOutput, scheduler answers each type in order; both LoRA requests
        LoRAAdapterReqOutput           share a reply type: their caller sends one at a time)
        GetInternalStateReqOutput   -> the pending `get_internal_state` future (shared by callers)

The PULL socket is bound at construction (before the detokenizer sends anything); the receive
loop runs in the serving event loop from `start`. Sends are synchronous (a PUSH socket never
blocks the loop for long: the scheduler drains it).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from typing import Any

import zmq

from srt.managers.io_struct import (
    BatchStrOut,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    LoadLoRAAdapterReq,
    LoRAAdapterReqOutput,
    ProfileReq,
    ProfileReqOutput,
    SchedulerInput,
    UnloadLoRAAdapterReq,
    UpdateWeightsFromDiskReq,
    UpdateWeightsFromDiskReqOutput,
    encode,
    tokenizer_input_decoder,
)
from srt.server_args import PortArgs
from srt.utils.errors import EngineDeadError
from srt.utils.zmq import get_zmq_socket, new_async_context

logger = logging.getLogger(__name__)

_STATE_TIMEOUT_S = 5.0
_FLUSH_TIMEOUT_S = 30.0
_PROFILE_TIMEOUT_S = 60.0  # stopping writes the trace file
# an update first waits for the running requests to finish, then loads a checkpoint
_UPDATE_WEIGHTS_TIMEOUT_S = 1800.0
# the replies answered in order, per type, to the oldest waiting future
_ORDERED_REPLIES = (
    FlushCacheReqOutput,
    ProfileReqOutput,
    UpdateWeightsFromDiskReqOutput,
    LoRAAdapterReqOutput,
)
# loading an adapter reads its folder and copies its weights (beside the running requests)
_LORA_TIMEOUT_S = 300.0


class TokenizerIPC:
    """Sockets to the scheduler and from the detokenizer; replies to control requests."""

    def __init__(self, port_args: PortArgs, on_batch_str_out: Callable[[BatchStrOut], None]) -> None:
        self.on_batch_str_out = on_batch_str_out
        self._actx = new_async_context()
        self.recv_sock = get_zmq_socket(self._actx, zmq.PULL, port_args.tokenizer_ipc_name, bind=True)
        self._sctx = zmq.Context(io_threads=1)
        self.send_sock = get_zmq_socket(self._sctx, zmq.PUSH, port_args.scheduler_input_ipc_name, bind=False)
        self._reply_futures: dict[type, collections.deque[asyncio.Future]] = {
            t: collections.deque() for t in _ORDERED_REPLIES
        }
        self._state_future: asyncio.Future | None = None
        self._recv_task: asyncio.Task | None = None

    # ------------------------------------------------------------------ life cycle
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the receive loop in ``loop`` (the serving event loop)."""
        self._recv_task = loop.create_task(self._recv_loop(), name="srt-tokenizer-recv")

    async def close(self) -> None:
        """Stop the receive loop, then close the sockets."""
        if self._recv_task is not None:
            self._recv_task.cancel()
            try:
                await self._recv_task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
            self._recv_task = None
        self.close_sockets()

    def close_sockets(self) -> None:
        """Close both sockets and their contexts (the receive loop must not be running)."""
        self.recv_sock.close(linger=0)
        self.send_sock.close(linger=0)
        self._actx.term()
        self._sctx.term()

    def send(self, msg: SchedulerInput) -> None:
        self.send_sock.send(encode(msg))

    # ------------------------------------------------------------------ receive
    async def _recv_loop(self) -> None:
        while True:
            raw = await self.recv_sock.recv()
            try:
                self._dispatch(tokenizer_input_decoder.decode(raw))
            except Exception:  # noqa: BLE001 - one bad message must not stop the loop
                logger.exception("failed to handle a message from the detokenizer")

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, BatchStrOut):
            self.on_batch_str_out(msg)
        elif isinstance(msg, _ORDERED_REPLIES):
            futures = self._reply_futures[type(msg)]
            while futures:
                fut = futures.popleft()
                if not fut.done():
                    fut.set_result(msg)
                    break
        elif isinstance(msg, GetInternalStateReqOutput):
            if self._state_future is not None and not self._state_future.done():
                self._state_future.set_result(msg.state)

    # ------------------------------------------------------------------ control requests
    async def _request(self, msg: SchedulerInput, reply_type: type, timeout: float) -> Any:
        fut = asyncio.get_running_loop().create_future()
        self._reply_futures[reply_type].append(fut)
        self.send(msg)
        return await asyncio.wait_for(fut, timeout)

    async def flush_cache(self) -> FlushCacheReqOutput:
        """Ask the scheduler to flush its prefix cache; its reply (``success`` is False while
        requests run). Times out with ``asyncio.TimeoutError``."""
        return await self._request(FlushCacheReq(), FlushCacheReqOutput, _FLUSH_TIMEOUT_S)

    async def profile(self, req: ProfileReq) -> ProfileReqOutput:
        """Start or stop the scheduler's profiler; its reply."""
        return await self._request(req, ProfileReqOutput, _PROFILE_TIMEOUT_S)

    async def update_weights_from_disk(self, req: UpdateWeightsFromDiskReq) -> UpdateWeightsFromDiskReqOutput:
        """Ask the scheduler to reload its weights (once idle); its reply."""
        return await self._request(req, UpdateWeightsFromDiskReqOutput, _UPDATE_WEIGHTS_TIMEOUT_S)

    async def lora_adapter(self, req: LoadLoRAAdapterReq | UnloadLoRAAdapterReq) -> LoRAAdapterReqOutput:
        """Ask the scheduler to load or unload a LoRA adapter; its reply (send one at a time)."""
        return await self._request(req, LoRAAdapterReqOutput, _LORA_TIMEOUT_S)

    async def get_internal_state(self) -> dict[str, Any]:
        """The scheduler's live state (concurrent callers share one request)."""
        if self._state_future is None or self._state_future.done():
            self._state_future = asyncio.get_running_loop().create_future()
            self.send(GetInternalStateReq())
        return await asyncio.wait_for(asyncio.shield(self._state_future), _STATE_TIMEOUT_S)

    def fail_pending(self, error: EngineDeadError) -> None:
        """Fail every control request still waiting for a reply with ``error``."""
        for futures in self._reply_futures.values():
            for fut in futures:
                if not fut.done():
                    fut.set_exception(error)
            futures.clear()
        if self._state_future is not None and not self._state_future.done():
            self._state_future.set_exception(error)

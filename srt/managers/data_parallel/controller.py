"""The data-parallel controller process (``--dp-size N``): routing between the tokenizer manager
and N scheduler groups, and nothing else (it starts and owns no process).

    tokenizer manager, detokenizer --PUSH--> [PULL scheduler_input_ipc_name] controller
        TokenizedGenerateReqInput  -> one group, chosen by `DpRouter` (--load-balance-method)
        AbortReq(rid), StopStringHit -> the group that owns rid (dropped once it finished; an
                                      aborted rid is forgotten once its abort is sent)
        AbortReq("")               -> every group (every rid forgotten)
        FlushCacheReq, GetInternalStateReq, ProfileReq, UpdateWeightsFromDiskReq,
        LoadLoRAAdapterReq, UnloadLoRAAdapterReq -> every group (`REPLY_TYPE`'s requests)
    controller --PUSH--> group g's scheduler_input_ipc_name (the raw message, not re-encoded)
    groups --PUSH--> [PULL dp_controller_ipc_name] controller
        DpLoadReport    -> `DpRouter.on_report` (load, finished rids)
        DpControlReply  -> `ReplyMerger`; each complete merge --PUSH--> tokenizer_ipc_name
                           (a merged GetInternalStateReqOutput carries ``dp_controller``: the
                           router's per-group counts and loads)

The groups' token outputs go straight to the shared detokenizer. The process is supervised like
the scheduler: if it dies the server goes down; it dies (exit 1) on any unexpected error.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from srt.managers.data_parallel.policy import DpRouter
from srt.managers.data_parallel.replies import REPLY_TYPE, ReplyMerger
from srt.managers.io_struct import (
    AbortReq,
    DpControlReply,
    DpLoadReport,
    GetInternalStateReqOutput,
    StopStringHit,
    TokenizedGenerateReqInput,
    dp_controller_input_decoder,
    encode,
    scheduler_input_decoder,
)
from srt.utils.cpu_affinity import confine_aux_process
from srt.utils.process import exit_child_on_error
from srt.utils.zmq import get_zmq_socket

if TYPE_CHECKING:
    from srt.server_args import PortArgs, ServerArgs

logger = logging.getLogger("srt.dp_controller")


class DataParallelController:
    """Sockets, router and reply merger of the controller (see the module docstring)."""

    def __init__(
        self, server_args: ServerArgs, port_args: PortArgs, group_input_names: list[str], ctx: zmq.Context
    ) -> None:
        n = len(group_input_names)
        self.router = DpRouter(n, server_args.load_balance_method)
        self.merger = ReplyMerger(n)
        self.recv_input = get_zmq_socket(ctx, zmq.PULL, port_args.scheduler_input_ipc_name, bind=True)
        self.recv_groups = get_zmq_socket(ctx, zmq.PULL, port_args.dp_controller_ipc_name, bind=True)
        self.group_socks = [get_zmq_socket(ctx, zmq.PUSH, name, bind=False) for name in group_input_names]
        self.reply_sock = get_zmq_socket(ctx, zmq.PUSH, port_args.tokenizer_ipc_name, bind=False)

    # ------------------------------------------------------------------ inputs
    def handle_input(self, raw: bytes) -> None:
        """Forward one message from the tokenizer manager or the detokenizer."""
        msg = _decode_or_drop(scheduler_input_decoder, raw, "message")
        if msg is None:
            return
        if isinstance(msg, TokenizedGenerateReqInput):
            self._send(self.router.route(msg.rid, msg.input_ids), raw)
        elif isinstance(msg, (AbortReq, StopStringHit)):
            if isinstance(msg, AbortReq) and msg.rid == "":
                self._send_all(raw)
                self.router.release_all()
                return
            g = self.router.owner(msg.rid)
            if g is None:
                logger.debug("dropping %s for rid %r: no live request", type(msg).__name__, msg.rid)
                return
            self.router.forwarded(g)
            self._send(g, raw)
            if isinstance(msg, AbortReq):
                self.router.release(msg.rid)
        elif type(msg) in REPLY_TYPE:
            self.merger.expect(msg)
            self._send_all(raw)
        else:
            logger.warning("ignoring unknown message %r", type(msg).__name__)

    def _send(self, group: int, raw: bytes) -> None:
        self.group_socks[group].send(raw)

    def _send_all(self, raw: bytes) -> None:
        for g in range(len(self.group_socks)):
            self.router.forwarded(g)
            self.group_socks[g].send(raw)

    # ------------------------------------------------------------------ from the groups
    def handle_group_message(self, raw: bytes) -> None:
        """Apply a load report, or merge a control reply (sending each completed merge on)."""
        msg = _decode_or_drop(dp_controller_input_decoder, raw, "group message")
        if msg is None:
            return
        if isinstance(msg, DpLoadReport):
            self.router.on_report(
                msg.dp_rank,
                msg.num_received,
                msg.queued_tokens,
                msg.running_tokens,
                msg.num_queued_reqs,
                msg.num_running_reqs,
                msg.idle,
                msg.finished_rids,
            )
        elif isinstance(msg, DpControlReply):
            for merged in self.merger.add(msg.dp_rank, msg.reply):
                if isinstance(merged, GetInternalStateReqOutput):
                    merged.state["dp_controller"] = self.router.state()
                self.reply_sock.send(encode(merged))

    def state(self) -> dict[str, Any]:
        return self.router.state()

    # ------------------------------------------------------------------ loop
    def event_loop(self) -> None:
        """Serve forever: block in ``poll`` until either socket has messages, drain both."""
        poller = zmq.Poller()
        poller.register(self.recv_input, zmq.POLLIN)
        poller.register(self.recv_groups, zmq.POLLIN)
        pairs = ((self.recv_groups, self.handle_group_message), (self.recv_input, self.handle_input))
        while True:
            poller.poll()
            for sock, handle in pairs:
                while True:
                    try:
                        raw = sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    handle(raw)


def _decode_or_drop(decoder: msgspec.msgpack.Decoder, raw: bytes, what: str) -> Any | None:
    """``decoder.decode(raw)``, or None (logged, the message dropped) when it does not decode."""
    try:
        return decoder.decode(raw)
    except msgspec.DecodeError as e:
        logger.error("dropping an undecodable %s: %s", what, e)
        return None


def run_data_parallel_controller_process(
    server_args: ServerArgs, port_args: PortArgs, group_input_names: list[str], pipe_writer: Any
) -> None:
    """Process entry (``server_args`` resolved): step aside from the compute CPUs, bind the
    sockets, report ``{"status": "ready", "dp_size": N}``, then route forever. A failure before
    that is reported as ``{"status": "error", "message": traceback}``; any failure exits 1."""
    confine_aux_process(server_args.cpu_omp_threads_bind, server_args.aux_process_nice, "dp_controller")
    ready_sent = False
    try:
        ctx = zmq.Context(io_threads=1)
        controller = DataParallelController(server_args, port_args, group_input_names, ctx)
        pipe_writer.send({"status": "ready", "dp_size": len(group_input_names)})
        ready_sent = True
        controller.event_loop()
    except Exception:
        exit_child_on_error(pipe_writer, ready_sent, logger, "data-parallel controller")

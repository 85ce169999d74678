"""A tensor-parallel scheduler rank: identical schedulers on identical inputs.

Every rank runs the same `Scheduler` (its ModelRunner holds the rank's shard of the model) and
steps in lock step with the others; only rank 0 talks to the rest of srt::

    tokenizer manager / detokenizer --PUSH--> [PULL, rank 0 only] rank 0
    each iteration: rank 0 drains its socket -> broadcast_messages([its time.time(), *raw
                    messages]) -> every rank decodes and handles the same list in the same
                    order -> every rank steps (deadlines checked against rank 0's time)
    rank 0 [PUSH --> detokenizer]: outputs and control replies (ranks > 0 send nothing)

While idle rank 0 blocks in ``poll`` for at most `HEARTBEAT_S` and then broadcasts what it has
(an empty list is the heartbeat), so the other ranks wait in the broadcast and a dead peer fails
the collective within about a second even when no request arrives.

Exit: a failed collective (`is_group_failure`: a peer exited or hung for --dist-timeout) exits
rank 0 with code 1 (the launcher fails the requests in flight) and a rank > 0 with code 0 (rank
0 went away: the group is over; `srt.entrypoints.worker_node` then exits cleanly). Anything else
exits 1. Before readiness every failure is reported through the pipe, as in ``process.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import struct
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import zmq

from srt.distributed.init import init_tp_group, is_group_failure
from srt.managers.io_struct import encode
from srt.managers.scheduler.heartbeat import SchedulerHeartbeat
from srt.managers.scheduler.process import bind_compute_threads, decode_input, grammar_idle_tick
from srt.managers.scheduler.scheduler import Scheduler
from srt.managers.scheduler.step_timing import StepTrace, trace_path
from srt.utils.cpu_affinity import NOBIND, format_cpu_list
from srt.utils.process import exit_child_on_error
from srt.utils.tp_layout import rank_cpus, ranks_per_node
from srt.utils.watchdog import heartbeat_path
from srt.utils.zmq import get_zmq_socket

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from srt.server_args import PortArgs, ServerArgs

logger = logging.getLogger("srt.scheduler")

HEARTBEAT_S = 1.0


class MessageBroadcast(Protocol):
    """What the loop needs of the TP group (`srt.distributed.init.TPGroup`; tests pass fakes)."""

    rank: int

    def broadcast_messages(self, messages: list[bytes] | None) -> list[bytes]: ...


Receive = Callable[[float | None], list[bytes]]  # wait up to timeout (None: don't wait), drain
Clock = Callable[[], float]
Send = Callable[[Any], None]


def tp_iteration(
    scheduler: Any,
    group: MessageBroadcast,
    receive: Receive | None,
    send: Send | None,
    clock: Clock = time.time,
) -> None:
    """One lock-step iteration. Rank 0 (``receive`` and ``send`` given) waits up to `HEARTBEAT_S`
    for input when idle, drains it and broadcasts it with its ``clock()``; every rank takes that
    time as the scheduler's ``step_clock`` (deadlines expire alike on every rank), handles the
    broadcast messages, then steps while busy. Only rank 0 sends (replies, outputs)."""
    leader = group.rank == 0
    payload: list[bytes] | None = None
    idle = scheduler.is_idle()
    grammar_idle_tick(scheduler, idle)  # every rank builds its own backend (within a heartbeat)
    if leader:
        assert receive is not None and send is not None
        heartbeat = getattr(scheduler, "heartbeat", None)  # the hang watchdog's (rank 0 only)
        if idle and heartbeat is not None:
            heartbeat.on_idle(scheduler)
        raws = receive(HEARTBEAT_S if idle else None)
        payload = [struct.pack("<d", clock()), *raws]
    payload = group.broadcast_messages(payload)
    (scheduler.step_clock,) = struct.unpack("<d", payload[0])
    raws = payload[1:]
    for raw in raws:
        msg = decode_input(raw)
        if msg is None:
            continue
        for reply in scheduler.handle_message(msg):
            if leader:
                send(reply)
    if not scheduler.is_idle():
        outs = scheduler.step()
        replies = scheduler.take_replies()
        if leader:
            for item in [*outs, *replies]:
                send(item)


def zmq_receiver(sock: zmq.Socket) -> Receive:
    """Rank 0's ``receive``: poll ``sock`` up to ``timeout`` seconds, then drain it."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)

    def receive(timeout: float | None) -> list[bytes]:
        if timeout is not None:
            poller.poll(int(timeout * 1000))
        raws = []
        while True:
            try:
                raws.append(sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                return raws

    return receive


def rank_server_args(server_args: ServerArgs, tp_rank: int) -> ServerArgs:
    """``server_args`` as rank ``tp_rank`` runs it: its own share of the compute CPUs."""
    cpus = rank_cpus(server_args.cpu_omp_threads_bind, server_args.tp_size, server_args.nnodes, tp_rank)
    if cpus is None:
        return dataclasses.replace(server_args, cpu_omp_threads_bind=NOBIND)
    return dataclasses.replace(server_args, cpu_omp_threads_bind=format_cpu_list(cpus), num_threads=len(cpus))


def run_tp_scheduler_process(
    server_args: ServerArgs, port_args: PortArgs, pipe_writer: Connection, tp_rank: int, dist_init_addr: str
) -> None:
    """Entry of TP rank ``tp_rank`` (see the module docstring): pin its CPUs, join the group at
    ``dist_init_addr``, build ``Scheduler(tp_rank=...)``, (rank 0) bind the sockets, report ready
    through ``pipe_writer``, then iterate forever."""
    ready_sent = False
    try:
        args = rank_server_args(server_args, tp_rank)
        bind_compute_threads(args)
        local_rank = tp_rank % ranks_per_node(args.tp_size, args.nnodes)
        group = init_tp_group(
            dist_init_addr, tp_rank, args.tp_size, args.dist_timeout, args.device, local_rank
        )
        scheduler = Scheduler(args, tp_rank=tp_rank)
        receive: Receive | None = None
        send: Send | None = None
        if tp_rank == 0:
            if args.watchdog_timeout > 0:  # rank 0 steps in lock step with all: it speaks for them
                scheduler.heartbeat = SchedulerHeartbeat.open(heartbeat_path(port_args.ipc_dir))
            if args.step_trace_path:  # rank 0's steps are every rank's
                scheduler.step_trace = StepTrace(trace_path(args.step_trace_path, port_args.dp_rank))
            ctx = zmq.Context(io_threads=1)
            recv_sock = get_zmq_socket(ctx, zmq.PULL, port_args.scheduler_input_ipc_name, bind=True)
            send_sock = get_zmq_socket(ctx, zmq.PUSH, port_args.detokenizer_ipc_name, bind=False)
            receive = zmq_receiver(recv_sock)

            def send(item: Any) -> None:
                send_sock.send(encode(item))

        pipe_writer.send({"status": "ready", **msgspec.structs.asdict(scheduler.ready_message())})
        ready_sent = True
        if tp_rank > 0:  # rank 0 logs the batches; the others would repeat its lines
            logger.setLevel(max(logger.getEffectiveLevel(), logging.WARNING))
        while True:
            tp_iteration(scheduler, group, receive, send)
    except Exception as e:
        if ready_sent and is_group_failure(e):
            if tp_rank == 0:  # a peer rank died: the launcher fails the requests in flight
                logger.error("rank 0: the tensor-parallel group failed (%s); exiting", e)
                _exit_now(1)
            logger.warning("rank %d: the tensor-parallel group is gone (%s); exiting", tp_rank, e)
            _exit_now(0)
        exit_child_on_error(pipe_writer, ready_sent, logger, f"scheduler rank {tp_rank}")


def _exit_now(code: int) -> None:
    """Exit with ``code`` at once (``sys.exit`` would be turned into code 1 by ``run_child``)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

"""The scheduler as a process: its ZMQ event loop and the process entry point (this module
imports the scheduler; the scheduler never imports it).

    tokenizer manager / detokenizer --PUSH--> [PULL scheduler_input_ipc_name] Scheduler
    Scheduler [PUSH --> detokenizer_ipc_name] --> detokenizer
    Scheduler [PUSH --> dp_controller_ipc_name] --> controller   (``--dp-size`` groups only:
                                                   control replies, load reports; dp_link.py)

``run_scheduler_process`` first pins its compute threads (``bind_compute_threads``: one OpenMP
thread per CPU of ``--cpu-omp-threads-bind``, before the model loads so that loading runs on them
too), builds the ``Scheduler`` (which loads the model), reports readiness with its capacity figures
through the launcher's pipe, then runs ``event_loop`` forever on the same thread.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import torch
import zmq

from srt.kernels.cpu import OmpBinding, bind_omp_threads
from srt.managers.io_struct import SchedulerInput, encode, scheduler_input_decoder
from srt.managers.scheduler.dp_link import DpGroupLink
from srt.managers.scheduler.heartbeat import SchedulerHeartbeat
from srt.managers.scheduler.scheduler import Scheduler
from srt.managers.scheduler.step_timing import StepTrace, trace_path
from srt.utils.cpu_affinity import bound_cpus
from srt.utils.process import exit_child_on_error
from srt.utils.watchdog import heartbeat_path
from srt.utils.zmq import get_zmq_socket

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from srt.server_args import PortArgs, ServerArgs

logger = logging.getLogger("srt.scheduler")


def event_loop(
    scheduler: Scheduler, recv_socket: zmq.Socket, send_socket: zmq.Socket, dp: DpGroupLink | None = None
) -> None:
    """Serve forever: drain every pending input message (replies to control requests go out at
    once; a weight update's once the step that left the scheduler idle ran it), run one step
    while there is work, and block in ``poll`` (no spinning; with a timeout only until the grammar
    backend's build is due, `GrammarManager.idle_tick`) while the scheduler is idle. An
    undecodable message is logged and dropped; anything else that fails propagates (the process
    dies loudly). With ``dp`` (a data-parallel group) control replies go to the
    controller instead, and the group reports its load to it (`DpGroupLink`)."""
    send_reply = (lambda r: send_socket.send(encode(r))) if dp is None else dp.send_reply
    poller = zmq.Poller()
    poller.register(recv_socket, zmq.POLLIN)
    while True:
        idle = scheduler.is_idle()
        wait_s = grammar_idle_tick(scheduler, idle)
        if idle:
            if dp is not None:
                dp.on_idle(scheduler)
            if scheduler.heartbeat is not None:
                scheduler.heartbeat.on_idle(scheduler)
            poller.poll(None if wait_s is None else math.ceil(wait_s * 1000))
        while True:
            try:
                raw = recv_socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            if dp is not None:
                dp.on_message()
            msg = decode_input(raw)
            if msg is None:
                continue
            for reply in scheduler.handle_message(msg):
                send_reply(reply)
        if not scheduler.is_idle():
            outs = scheduler.step()
            for out in outs:
                send_socket.send(encode(out))
            for reply in scheduler.take_replies():
                send_reply(reply)
            if dp is not None:
                dp.after_step(scheduler, outs)


def grammar_idle_tick(scheduler: Scheduler, idle: bool) -> float | None:
    """`GrammarManager.idle_tick` for ``scheduler`` (None without grammars): the seconds an idle
    loop may block before its grammar backend is due to be built."""
    grammars = getattr(scheduler, "grammars", None)  # tests drive the loops with bare fakes
    if grammars is None or grammars.started:  # the usual case on a busy loop: no clock read
        return None
    return grammars.idle_tick(idle, time.monotonic())


def decode_input(raw: bytes) -> SchedulerInput | None:
    """One input message, or None (logged) when it cannot be decoded: it is dropped."""
    try:
        return scheduler_input_decoder.decode(raw)
    except msgspec.DecodeError as e:
        logger.error("dropping an undecodable message: %s", e)
        return None


def bind_compute_threads(server_args: ServerArgs) -> OmpBinding | None:
    """Pin the calling thread's compute threads as the resolved ``--cpu-omp-threads-bind`` says:
    ``torch.set_num_threads(len(cpus))``, then `bind_omp_threads` (native: OpenMP thread i on
    cpus[i]; fallback: the whole process confined to the set). Logs one line saying which; returns
    None for nobind or when binding failed. Never raises: a failure is a warning."""
    spec = server_args.cpu_omp_threads_bind
    try:
        cpus = bound_cpus(spec)
        if cpus is None:
            logger.info("compute threads: not pinned (--cpu-omp-threads-bind nobind)")
            return None
        torch.set_num_threads(len(cpus))
        binding = bind_omp_threads(cpus)
    except Exception as e:  # noqa: BLE001 - pinning is an optimisation, never fatal
        logger.warning("compute threads: pinning to CPU %s failed (%s); running unpinned", spec, e)
        return None
    if binding.failures:
        logger.warning(
            "compute threads: pinning failed for %s (%s)", "; ".join(binding.failures), binding.describe()
        )
    else:
        logger.info("compute threads: %s", binding.describe())
    return binding


def place_compute_threads(server_args: ServerArgs) -> Callable[[], None] | None:
    """Set up the thread that runs the model: without overlap scheduling this (main) thread, now
    (returns None); with it the forward worker thread, through the function returned (its
    ``thread_init``), and this thread runs torch single-threaded from here on: a second OpenMP
    pool would slow every forward (srt/utils/torch_threads.py)."""
    if server_args.disable_overlap_schedule:
        bind_compute_threads(server_args)
        return None
    num_threads = torch.get_num_threads()

    def on_worker() -> None:
        torch.set_num_threads(num_threads)
        bind_compute_threads(server_args)

    torch.set_num_threads(1)
    return on_worker


def run_scheduler_process(server_args: ServerArgs, port_args: PortArgs, pipe_writer: Connection) -> None:
    """Entry of the scheduler process (``server_args`` resolved).

    Sends ``{"status": "ready", **SchedulerReady fields}`` through ``pipe_writer`` once the model
    and pools exist and the sockets are bound (PULL at ``scheduler_input_ipc_name``, PUSH to
    ``detokenizer_ipc_name``), then serves. A failure before that is reported as
    ``{"status": "error", "message": traceback}``; any failure exits the process non-zero."""
    ready_sent = False
    try:
        scheduler = Scheduler(server_args, forward_thread_init=place_compute_threads(server_args))
        if server_args.watchdog_timeout > 0:  # one heartbeat file per data-parallel group
            path = heartbeat_path(port_args.ipc_dir, port_args.dp_rank or 0)
            scheduler.heartbeat = SchedulerHeartbeat.open(path)
        if server_args.step_trace_path:
            scheduler.step_trace = StepTrace(trace_path(server_args.step_trace_path, port_args.dp_rank))
        ctx = zmq.Context(io_threads=1)
        recv = get_zmq_socket(ctx, zmq.PULL, port_args.scheduler_input_ipc_name, bind=True)
        send = get_zmq_socket(ctx, zmq.PUSH, port_args.detokenizer_ipc_name, bind=False)
        dp = None
        if port_args.dp_rank is not None:
            dp = DpGroupLink(port_args.dp_rank, ctx, port_args.dp_controller_ipc_name)
        pipe_writer.send({"status": "ready", **msgspec.structs.asdict(scheduler.ready_message())})
        ready_sent = True
        event_loop(scheduler, recv, send, dp)
    except Exception:
        exit_child_on_error(pipe_writer, ready_sent, logger, "scheduler")

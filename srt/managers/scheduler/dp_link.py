"""A scheduler group's link to the data-parallel controller (``--dp-size > 1``).

    scheduler group [PUSH --> dp_controller_ipc_name] controller
        DpLoadReport    after a step, at most once per REPORT_INTERVAL_S, and before the group
                        blocks idle (if anything changed since the last report)
        DpControlReply  the group's reply to each control request, for the controller to merge

The event loop (``process.py``) calls `on_message` for every message taken from the input
socket (the report's ``num_received``: the controller forwards every message with a per-group
seq and knows which routed requests a report covers), `after_step` with the step's outputs (the
finished rids go into the next report) and `on_idle` before it blocks.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import zmq

from srt.managers.io_struct import BatchTokenIDOut, ControlReply, DpControlReply, DpLoadReport, encode
from srt.utils.zmq import get_zmq_socket

if TYPE_CHECKING:
    from srt.managers.scheduler.scheduler import Scheduler

# the longest a busy group's report lags behind its state (steps of the default model: ~12 ms)
REPORT_INTERVAL_S = 0.02


def _req_tokens(req) -> int:
    return len(req.origin_input_ids) + len(req.output_ids)


def measure_load(scheduler: Scheduler) -> tuple[int, int, int, int]:
    """``(num_queued_reqs, num_running_reqs, queued_tokens, running_tokens)`` of ``scheduler``:
    queued = the waiting queue, requests waiting for their grammar and those held behind a
    weight update; running = the running batch and the request mid-prompt. Tokens are prompt +
    output tokens so far."""
    queue = scheduler.waiting_queue  # its token count is kept as requests come and go
    pending = [r for r, _ in scheduler.grammars.pending] if scheduler.grammars is not None else []
    held = scheduler.weight_gate.held
    running = list(scheduler.running)
    if scheduler.chunked_req is not None:
        running.append(scheduler.chunked_req)
    queued_tokens = (
        queue.num_tokens + sum(_req_tokens(r) for r in pending) + sum(len(m.input_ids) for m in held)
    )
    running_tokens = sum(_req_tokens(r) for r in running)
    return len(queue) + len(pending) + len(held), len(running), queued_tokens, running_tokens


class DpGroupLink:
    """The PUSH socket to the controller and the report bookkeeping of one group."""

    def __init__(
        self, dp_rank: int, ctx: zmq.Context, endpoint: str, interval_s: float = REPORT_INTERVAL_S
    ) -> None:
        self.dp_rank = dp_rank
        self.sock = get_zmq_socket(ctx, zmq.PUSH, endpoint, bind=False)
        self.interval_s = interval_s
        self.num_received = 0
        self.finished_rids: list[str] = []
        self.dirty = True
        self.last_report = 0.0
        self.num_reports = 0

    def on_message(self) -> None:
        self.num_received += 1
        self.dirty = True

    def send_reply(self, reply: ControlReply) -> None:
        self.sock.send(encode(DpControlReply(dp_rank=self.dp_rank, reply=reply)))

    def after_step(self, scheduler: Scheduler, outs: list[BatchTokenIDOut]) -> None:
        for out in outs:
            self.finished_rids.extend(
                rid for rid, fr in zip(out.rids, out.finished_reasons) if fr is not None
            )
        self.dirty = True
        if time.monotonic() - self.last_report >= self.interval_s:
            self.report(scheduler, idle=False)

    def on_idle(self, scheduler: Scheduler) -> None:
        if self.dirty:
            self.report(scheduler, idle=True)

    def report(self, scheduler: Scheduler, idle: bool) -> None:
        nq, nr, qt, rt = measure_load(scheduler)
        msg = DpLoadReport(
            dp_rank=self.dp_rank,
            num_received=self.num_received,
            num_queued_reqs=nq,
            num_running_reqs=nr,
            queued_tokens=qt,
            running_tokens=rt,
            idle=idle,
            finished_rids=self.finished_rids,
        )
        self.sock.send(encode(msg))
        self.finished_rids = []
        self.dirty = False
        self.last_report = time.monotonic()
        self.num_reports += 1

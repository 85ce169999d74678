"""The scheduler's side of the hang watchdog (``--watchdog-timeout``; see srt/utils/watchdog.py).

``Scheduler.step`` calls `SchedulerHeartbeat.on_step` once its batch is formed (right before the
forward) and the event loop calls `on_idle` right before it blocks for messages. Each publishes
the step counter, whether work is pending, and a small state summary (`state_summary`) into the
shared heartbeat the main process's watcher reads, so that the watcher can report the state of a
scheduler whose thread is stuck. Cost: one small JSON encode and an 8 KiB mmap write per step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from srt.utils.watchdog import HeartbeatWriter

if TYPE_CHECKING:
    from srt.managers.scheduler.cache import CacheManager
    from srt.managers.scheduler.metrics import SchedulerMetrics
    from srt.managers.scheduler.req import Req
    from srt.managers.scheduler.schedule_batch import ScheduleBatch
    from srt.managers.scheduler.waiting_queue import WaitingQueue


class SchedulerView(Protocol):
    """What the heartbeat reads of the ``Scheduler`` (which imports this module)."""

    metrics: SchedulerMetrics
    cache: CacheManager
    max_total_num_tokens: int

    @property
    def waiting_queue(self) -> WaitingQueue: ...

    @property
    def running(self) -> list[Req]: ...

    @property
    def chunked_req(self) -> Req | None: ...


def state_summary(scheduler: SchedulerView, batch: ScheduleBatch | None) -> dict[str, Any]:
    """Queue and running sizes, pool usage, and the batch about to run (mode and shape)."""
    summary: dict[str, Any] = {
        "num_queued_reqs": len(scheduler.waiting_queue),
        "num_running_reqs": len(scheduler.running) + (scheduler.chunked_req is not None),
        "token_usage": round(scheduler.cache.token_usage(), 4),
        "available_size": scheduler.cache.allocator.available_size(),
        "evictable_size": scheduler.cache.evictable_size(),
        "max_total_num_tokens": scheduler.max_total_num_tokens,
        "free_req_rows": scheduler.cache.free_rows(),
    }
    if batch is None:
        summary["batch"] = None
    else:
        summary["batch"] = {
            "forward_mode": batch.forward_mode.name,
            "batch_size": len(batch.reqs),
            "num_extend_reqs": batch.num_extend_reqs,
            "extend_tokens": sum(batch.extend_lens[: batch.num_extend_reqs]) if batch.num_extend_reqs else 0,
            "num_tokens": len(batch.input_ids),
        }
    return summary


class SchedulerHeartbeat:
    """Publishes the scheduler's progress into the watchdog's heartbeat file."""

    def __init__(self, writer: HeartbeatWriter) -> None:
        self.writer = writer

    @classmethod
    def open(cls, path: str) -> SchedulerHeartbeat:
        return cls(HeartbeatWriter(path))

    def on_step(self, scheduler: SchedulerView, batch: ScheduleBatch | None) -> None:
        """A step started (its batch formed): progress, with work pending."""
        self.writer.publish(scheduler.metrics.num_steps, True, state_summary(scheduler, batch))

    def on_idle(self, scheduler: SchedulerView) -> None:
        """The loop is about to block for messages: no work pending."""
        self.writer.publish(scheduler.metrics.num_steps, False, state_summary(scheduler, None))

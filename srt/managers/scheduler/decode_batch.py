"""The decode batch of a step (``decode_batch``): the running requests, retracting some when KV
runs short. A function of the `Scheduler` (it reads several of its parts)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from srt.managers.scheduler.schedule_batch import KVAllocationError

if TYPE_CHECKING:
    from srt.managers.scheduler.cache import CacheManager
    from srt.managers.scheduler.decode import DecodeManager
    from srt.managers.scheduler.metrics import SchedulerMetrics
    from srt.managers.scheduler.prefill import PrefillManager
    from srt.managers.scheduler.requests import RequestTable
    from srt.managers.scheduler.schedule_batch import ScheduleBatch
    from srt.managers.scheduler.waiting_queue import WaitingQueue


class Scheduler(Protocol):
    """What forming the decode batch reads of the ``Scheduler`` (which imports this module)."""

    decode: DecodeManager
    requests: RequestTable
    metrics: SchedulerMetrics
    prefill: PrefillManager
    cache: CacheManager
    spec: Any

    @property
    def in_flight(self) -> Any: ...
    @property
    def waiting_queue(self) -> WaitingQueue: ...
    def complete_in_flight(self) -> None: ...


def decode_batch(s: Scheduler, mixed: bool) -> ScheduleBatch | None:
    """The decode batch of the running requests, retracting some if KV runs short.

    In a MIXED step (``mixed``) the prefill part is already allocated: if the decodes still
    cannot get slots they sit this step out (None). Otherwise the request mid-prompt is
    retracted too (it holds what the last decode needs) before giving up. With a batch in
    flight, a request whose token in flight is its last is left out, and a retraction
    first completes that batch."""
    decode = s.decode
    if not decode.has_room() and s.in_flight is not None:
        s.complete_in_flight()
    if not decode.has_room():
        victims = decode.retract_for_room()
        s.requests.requeue(victims)
        if victims:
            s.metrics.log_retract(
                len(victims), len(decode.running), len(s.waiting_queue), decode.new_token_ratio.value
            )
        if not decode.has_room():
            if mixed:
                return None
            chunked = s.prefill.take_chunked()
            if chunked is not None:
                decode.retract(chunked)
                s.requests.requeue([chunked])
                decode.new_token_ratio.on_retract()
            if not decode.has_room():
                raise KVAllocationError(
                    f"cannot decode {len(decode.running)} request(s): "
                    f"{s.cache.available()} KV slots obtainable"
                )
    if s.in_flight is None:
        return decode.prepare_batch(len(s.waiting_queue), spec=None if mixed else s.spec)
    reqs = [
        r for r in decode.running if r.kv_allocated_len == r.kv_committed_len or r.remaining_new_tokens > 1
    ]
    return decode.prepare_batch(len(s.waiting_queue), reqs) if reqs else None

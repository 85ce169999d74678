"""The deadlines part: per-request timeouts and ``--max-queue-time``, enforced by the scheduler.

Where the timers live (both sides, on purpose):

- **the scheduler (this part)** owns the clock of every request it holds. At the start of each
  step it pops the expired entries of a min-heap (O(1) per step when nothing expires, O(log n) per
  request tracked) and the scheduler finishes those requests between steps, wherever they are
  (waiting, waiting for a grammar, mid-chunk, running, retracted): their KV and request row are
  freed by the ordinary abort path at once, even when the main process is slow to react. A
  request is checked at step boundaries, so it overruns by at most one step (one forward).
- **the tokenizer manager** keeps a backstop timer (``TokenizerManager.run``): if the scheduler
  has not reported the finish shortly after the deadline (a stuck forward, a request still in a
  socket), it finishes the request itself with the same ``timeout`` reason and sends an abort.

Both clocks are ``time.time()`` (one host): ``TokenizedGenerateReqInput.deadline`` is absolute,
``arrival_time + timeout``, with ``arrival_time`` taken when the server received the request.

``--max-queue-time`` bounds the wait in the scheduler's queue from the scheduler's own arrival
(``Req.wait_start``) to the first admission; a request past it that never started is refused
with ``abort`` / 503 and a ``retry_after``. A request that started once (then was retracted) is
never refused for its wait; its deadline still applies.
"""

from __future__ import annotations

import heapq
import math
import time

from srt.managers.io_struct import FinishReason
from srt.managers.scheduler.req import Req, ReqStatus

_DEADLINE = 0
_QUEUE = 1
_MIN_COMPACT = 256  # entries of finished / started requests are dropped once the heap is this big


class DeadlineTracker:
    """Min-heap of ``(when, seq, kind, req)`` (``when`` in ``time.time()`` seconds)."""

    def __init__(self, max_queue_time: float | None) -> None:
        self.max_queue_time = max_queue_time
        self._heap: list[tuple[float, int, int, Req]] = []
        self._seq = 0
        self._compact_at = _MIN_COMPACT
        self.num_timeouts = 0
        self.num_queue_refusals = 0

    def __len__(self) -> int:
        return len(self._heap)

    def track(self, req: Req, now: float | None = None) -> None:
        """Watch a request that just arrived at the scheduler."""
        if req.deadline > 0:
            self._push(req.deadline, _DEADLINE, req)
        if self.max_queue_time is not None:
            self._push((time.time() if now is None else now) + self.max_queue_time, _QUEUE, req)

    def _push(self, when: float, kind: int, req: Req) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (when, self._seq, kind, req))
        if len(self._heap) >= self._compact_at:
            self._compact()

    def _compact(self) -> None:
        """Drop the entries that can no longer fire (amortized O(1) per push): a long timeout
        must not keep finished requests alive."""
        self._heap = [e for e in self._heap if _live(e)]
        heapq.heapify(self._heap)
        self._compact_at = max(_MIN_COMPACT, 2 * len(self._heap))

    def expired(self, now: float | None = None) -> list[tuple[Req, FinishReason]]:
        """The requests to finish now and why (each at most once; finished ones are dropped)."""
        heap = self._heap
        if not heap:
            return []
        now = time.time() if now is None else now
        out: list[tuple[Req, FinishReason]] = []
        seen: set[int] = set()
        while heap and heap[0][0] <= now:
            _, _, kind, req = heapq.heappop(heap)
            if req.state == ReqStatus.FINISHED or req.finished_reason is not None or id(req) in seen:
                continue
            if kind == _DEADLINE:
                self.num_timeouts += 1
                out.append((req, FinishReason.of_timeout(max(req.deadline - req.arrival_time, 0.0))))
            elif not req.admitted_once:
                self.num_queue_refusals += 1
                out.append((req, self._queue_refusal()))
            else:
                continue
            seen.add(id(req))
        return out

    def _queue_refusal(self) -> FinishReason:
        assert self.max_queue_time is not None
        return FinishReason.of_abort(
            f"the request waited more than --max-queue-time={self.max_queue_time:g} s in the queue "
            "without starting; the server is overloaded, retry later",
            503,
            retry_after=max(1, math.ceil(self.max_queue_time)),
        )


def _live(entry: tuple[float, int, int, Req]) -> bool:
    _, _, kind, req = entry
    if req.finished_reason is not None or req.state == ReqStatus.FINISHED:
        return False
    return kind == _DEADLINE or not req.admitted_once

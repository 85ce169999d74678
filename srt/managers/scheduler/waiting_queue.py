"""The waiting queue: the requests waiting for admission, indexed so that a step reads the head
of the policy's order without sorting the whole queue.

Admission reads at most the free request rows plus ``MAX_SKIPS_PER_STEP`` requests a step, but a
burst can leave tens of thousands waiting, and sorting all of them every step (what
``SchedulePolicy.order`` does) cost the scheduler 13 ms a step at 10,000 waiting and 127 ms at
60,000 under the default spf policy. So each request enters a heap under a key that stays fixed
while it waits (``SchedulePolicy.queue_key``: spf ranks ``tokens - aging x (now - enqueue_step)``,
the same order as ``tokens + aging x enqueue_step``), and ``in_order`` yields only as many as
admission reads, walking the heap without popping it. Under spf a request that has waited
``starvation_steps`` moves to a second heap, in arrival order, read before the first.

Removal is lazy: a removed request's heap entries are dropped when they surface, or when the heaps
are rebuilt once most of their entries are dead, so removing n requests costs O(n log n) in any
order (aborting a 200,000-prompt batch once held the scheduler for minutes).

``SchedulePolicy.order`` stays the reference: over the queue in arrival order and without prefix
lengths it gives the order ``in_order`` reads (tests/unit/test_waiting_queue.py). The prefix-matched
orders (spf and lpm up to ``max_matched_queue`` waiting) sort the queue as before."""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from srt.managers.scheduler.req import Req
    from srt.managers.scheduler.schedule_policy import SchedulePolicy

# an entry: (*key, token, req); the token is unique per add, so comparisons never reach the Req
_Entry = tuple


class WaitingQueue:
    """The waiting requests (see the module docstring). Iterating gives arrival order
    (``queue_seq``); ``in_order`` gives the policy's order."""

    def __init__(self, policy: SchedulePolicy) -> None:
        self.policy = policy
        self._live: dict[Req, tuple[int, bool]] = {}  # waiting request -> (its token, starved)
        self._heap: list[_Entry] = []  # (*queue_key, token, req), the requests not starved
        self._starved: list[_Entry] = []  # spf: (queue_seq, token, req)
        self._by_enqueue: list[_Entry] = []  # spf: (enqueue_step, token, req), not yet starved
        self._next_token = 0
        self.num_tokens = 0  # prompt + output tokens of the waiting requests

    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def __contains__(self, req: object) -> bool:
        return req in self._live

    def __iter__(self) -> Iterator[Req]:
        return iter(sorted(self._live, key=lambda r: r.queue_seq))

    # ------------------------------------------------------------------ membership
    def add(self, req: Req) -> None:
        """``req`` waits (its ``enqueue_step`` set by the caller)."""
        assert req not in self._live, req.rid
        token = self._next_token
        self._next_token += 1
        self._live[req] = (token, False)
        self.num_tokens += req.all_ids_len
        heapq.heappush(self._heap, (*self.policy.queue_key(req), token, req))
        if self.policy.starves_unmatched:
            heapq.heappush(self._by_enqueue, (req.enqueue_step, token, req))

    def remove(self, req: Req) -> bool:
        """``req`` no longer waits; False if it was not waiting."""
        if self._live.pop(req, None) is None:
            return False
        self.num_tokens -= req.all_ids_len
        if len(self._heap) + len(self._starved) > 2 * len(self._live) + 64:
            self._rebuild()
        return True

    def _rebuild(self) -> None:
        """The heaps without the entries of removed requests."""
        self._heap = self._kept(self._heap, False)
        self._starved = self._kept(self._starved, True)
        self._by_enqueue = self._kept(self._by_enqueue, False)

    def _kept(self, heap: list[_Entry], starved: bool) -> list[_Entry]:
        kept = [e for e in heap if self._is_live(e, starved)]
        heapq.heapify(kept)
        return kept

    def _is_live(self, entry: _Entry, starved: bool) -> bool:
        return self._live.get(entry[-1]) == (entry[-2], starved)

    # ------------------------------------------------------------------ order
    def in_order(self, now_step: int) -> Iterator[Req]:
        """The requests in the policy's order at ``now_step`` (the starved ones first), read
        lazily: k of them cost O(k log k) and change nothing, so the queue must not change while
        they are read (admission removes the admitted ones after its pass)."""
        if self.policy.starves_unmatched:
            self._age(now_step)
        for heap, starved in ((self._starved, True), (self._heap, False)):
            while heap and not self._is_live(heap[0], starved):  # entries of removed requests
                heapq.heappop(heap)
        return self._walk()

    def _age(self, now_step: int) -> None:
        """Move the requests that have waited ``starvation_steps`` to the starved heap."""
        limit = now_step - self.policy.starvation_steps
        by_enqueue = self._by_enqueue
        while by_enqueue and by_enqueue[0][0] <= limit:
            entry = heapq.heappop(by_enqueue)
            if self._is_live(entry, False):
                req, token = entry[-1], entry[-2]
                self._live[req] = (token, True)
                heapq.heappush(self._starved, (req.queue_seq, token, req))

    def _walk(self) -> Iterator[Req]:
        """Each heap in sorted order without popping it: a frontier of the entries whose parents
        were read (heap[i]'s children are heap[2i + 1] and heap[2i + 2])."""
        for heap, starved in ((self._starved, True), (self._heap, False)):
            frontier = [(heap[0], 0)] if heap else []
            while frontier:
                entry, i = heapq.heappop(frontier)
                if self._is_live(entry, starved):
                    yield entry[-1]
                for child in (2 * i + 1, 2 * i + 2):
                    if child < len(heap):
                        heapq.heappush(frontier, (heap[child], child))

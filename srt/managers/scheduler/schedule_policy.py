"""Scheduling policy: pure decisions from CPU state (no model, no tensors, no pools; requests
are seen through the ``WaitingReq`` protocol). Each piece is unit tested
without a model:

- ``SchedulePolicy.order``: waiting-queue order -- ``spf`` (shortest prefill first: fewest
  uncached prompt tokens, so the prompts that get a first token soonest go first), ``fcfs``
  (arrival), ``lpm`` (longest cached prefix first) and ``priority`` (higher ``priority`` first,
  then arrival). spf and lpm age: each step a request waits counts for it, and one that waited
  ``starvation_steps`` goes ahead of all the others, so none is starved.
- ``PrefillAdder``: admission of one prefill step under four budgets:

  ====================  =================================================================
  budget                meaning
  ====================  =================================================================
  prefill tokens        ``--max-prefill-tokens`` new tokens computed per step (the first
                        request of a step may exceed it when chunking is off)
  chunk                 ``--chunked-prefill-size``: a longer prompt is split; chunk ends
                        are page-aligned, outside ``whole_spans`` (bidirectional images);
                        at most one request is mid-prompt at a time
  KV tokens             free + evictable slots minus a reserve for the future decode
                        tokens of the running batch (``new_token_ratio`` x remaining
                        max_new_tokens); an admitted request costs its pages plus its
                        own reserve
  running requests      ``--max-running-requests``
  ====================  =================================================================

  A request that does not fit the KV budget is skipped so smaller ones behind it may go ahead,
  but only ``max_overtakes`` times; then it blocks the queue until it fits.
- ``InBatchPrefixFilter``: requests that share an uncached prefix with one admitted in the same
  step wait a step (then the prefix is cached) instead of computing it twice.

The decode side's pure decisions (the new-token ratio, retraction) are in ``decode_policy.py``.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from srt.utils.pages import page_ceil, page_floor, uncut_chunk


class WaitingReq(Protocol):
    """What queue ordering reads of a waiting request (``srt.managers.scheduler.req.Req`` is one)."""

    @property
    def priority(self) -> int: ...
    @property
    def queue_seq(self) -> int: ...
    @property
    def enqueue_step(self) -> int: ...
    @property
    def all_ids_len(self) -> int: ...


W = TypeVar("W", bound=WaitingReq)

SCHEDULE_POLICIES = ("spf", "fcfs", "lpm", "priority")

# spf / lpm: each scheduler step a request waits counts like this many prompt tokens (spf: fewer
# to compute; lpm: more cached)
AGING_TOKENS_PER_STEP = 16
# spf / lpm: a request that waited this many steps goes ahead of every non-starved one (fcfs
# among them)
STARVATION_STEPS = 64
# spf / lpm need a prefix match per waiting request per step: above this queue length lpm uses
# fcfs and spf the whole prompt lengths
MAX_MATCHED_QUEUE = 128
# a request that does not fit the KV budget may be overtaken this many times, then it blocks
MAX_OVERTAKES = 8


# ---------------------------------------------------------------------- queue order
class SchedulePolicy:
    """Waiting-queue order (see the module docstring)."""

    def __init__(
        self,
        policy: str,
        aging_tokens_per_step: int = AGING_TOKENS_PER_STEP,
        starvation_steps: int = STARVATION_STEPS,
        max_matched_queue: int = MAX_MATCHED_QUEUE,
    ) -> None:
        if policy not in SCHEDULE_POLICIES:
            raise ValueError(f"unknown schedule policy {policy!r}; choose one of {SCHEDULE_POLICIES}")
        self.policy = policy
        self.aging_tokens_per_step = aging_tokens_per_step
        self.starvation_steps = starvation_steps
        self.max_matched_queue = max_matched_queue

    def uses_prefix_lens(self, queue_len: int) -> bool:
        """Whether ``order`` wants the cached-prefix length of every waiting request."""
        return self.policy in ("spf", "lpm") and queue_len <= self.max_matched_queue

    @property
    def starves_unmatched(self) -> bool:
        """Whether the order without prefix lengths puts starved requests first (spf)."""
        return self.policy == "spf"

    def queue_key(self, req: WaitingReq) -> tuple[int, ...]:
        """``order`` without prefix lengths, among requests not starved, as a key fixed while a
        request waits (ascending; spf's ``tokens - aging x (now - enqueue_step)`` ranks as
        ``tokens + aging x enqueue_step``). ``waiting_queue.py`` keeps the queue in this order."""
        if self.policy == "priority":
            return (-req.priority, req.queue_seq)
        if self.policy == "spf":
            return (req.all_ids_len + self.aging_tokens_per_step * req.enqueue_step, req.queue_seq)
        return (req.queue_seq,)

    def order(self, queue: Sequence[W], now_step: int, prefix_lens: Sequence[int] | None = None) -> list[W]:
        """The queue in admission order (a new list; ``queue`` is not modified).

        ``prefix_lens[i]``: cached-prefix length of ``queue[i]`` (spf and lpm; without it spf
        ranks whole prompts and lpm falls back to fcfs). Ties always break by arrival
        (``queue_seq``)."""
        if self.policy == "priority":
            return sorted(queue, key=lambda r: (-r.priority, r.queue_seq))
        if self.policy == "fcfs" or (self.policy == "lpm" and prefix_lens is None):
            return sorted(queue, key=lambda r: r.queue_seq)
        waited = [now_step - r.enqueue_step for r in queue]
        seqs = [r.queue_seq for r in queue]
        if self.policy == "lpm" and prefix_lens is not None:
            return [queue[i] for i in self.lpm_order(prefix_lens, waited, seqs)]
        cached = prefix_lens if prefix_lens is not None else [0] * len(queue)
        work = [r.all_ids_len - c for r, c in zip(queue, cached, strict=True)]
        return [queue[i] for i in self.spf_order(work, waited, seqs)]

    def spf_order(self, work: Sequence[int], waited_steps: Sequence[int], seqs: Sequence[int]) -> list[int]:
        """Indices in spf order: starved requests (waited >= starvation_steps) first in arrival
        order; then by tokens to compute less the aging bonus, ascending."""
        return self._aged_order(work, waited_steps, seqs)

    def lpm_order(
        self, prefix_lens: Sequence[int], waited_steps: Sequence[int], seqs: Sequence[int]
    ) -> list[int]:
        """Indices in lpm order: starved requests (waited >= starvation_steps) first in arrival
        order; then by cached prefix + aging bonus, descending."""
        return self._aged_order([-n for n in prefix_lens], waited_steps, seqs)

    def _aged_order(self, cost: Sequence[int], waited_steps: Sequence[int], seqs: Sequence[int]) -> list[int]:
        """Starved requests first by arrival, then ``cost - aging x waited`` ascending, ties by
        arrival."""
        aging, starve = self.aging_tokens_per_step, self.starvation_steps

        def key(i: int) -> tuple[int, int, int]:
            w = waited_steps[i]
            if w >= starve:
                return (0, 0, seqs[i])
            return (1, cost[i] - aging * w, seqs[i])

        return sorted(range(len(cost)), key=key)


# ---------------------------------------------------------------------- in-batch sharing
IN_BATCH_PREFIX_BLOCK = 32  # granularity (tokens) of the in-batch prefix comparison
IN_BATCH_PREFIX_THRESHOLD = 32  # defer a request sharing at least this many uncached tokens


class InBatchPrefixFilter:
    """Finds requests of one admission step that share a not-yet-cached prefix with a request
    admitted earlier in the same step (or mid-prompt): computing both at once would compute
    the shared part twice, while one step later the second finds it in the prefix cache.

    Keys are compared in blocks of ``block`` tokens through chained hashes, so ``add`` and
    ``shared_len`` cost O(len(key)). A hash collision can only defer a request by a step."""

    def __init__(self, block: int = IN_BATCH_PREFIX_BLOCK) -> None:
        self.block = block
        self._seen: set[int] = set()

    def _hashes(self, key: Sequence[int]):
        h = 0
        b = self.block
        for end in range(b, len(key) + 1, b):
            h = hash((h, tuple(key[end - b : end])))
            yield end, h

    def add(self, key: Sequence[int]) -> None:
        self._seen.update(h for _, h in self._hashes(key))

    def shared_len(self, key: Sequence[int]) -> int:
        """Length (a multiple of ``block``) of the longest prefix of ``key`` that some added
        key starts with."""
        shared = 0
        for end, h in self._hashes(key):
            if h not in self._seen:
                break
            shared = end
        return shared


# ---------------------------------------------------------------------- admission
class AddResult(enum.Enum):
    ADMITTED = "admitted"  # the whole remaining input runs this step
    CHUNKED = "chunked"  # only a (page-aligned) chunk runs this step; admission stops
    SKIPPED = "skipped"  # does not fit the KV budget now; later requests may go ahead
    STOP = "stop"  # no further request can be admitted this step


@dataclass(slots=True)
class AddDecision:
    result: AddResult
    extend_len: int = 0  # tokens computed this step (ADMITTED / CHUNKED)

    @property
    def admitted(self) -> bool:
        return self.result in (AddResult.ADMITTED, AddResult.CHUNKED)


def decode_reserve(remaining_new_tokens: Sequence[int], new_token_ratio: float) -> int:
    """KV slots to keep for the future decode tokens of the running requests."""
    return sum(math.ceil(n * new_token_ratio) for n in remaining_new_tokens)


@dataclass(slots=True)
class PrefillAdder:
    """Admission of the requests of one prefill step, in queue order (one ``add`` per request).

    Args:
        page_size: KV page size (chunk ends and KV costs are page-rounded).
        rem_total_tokens: KV slots obtainable (free + evictable) minus the decode reserve of
            the running batch (``decode_reserve``).
        rem_input_tokens: the prefill token budget (``--max-prefill-tokens``), minus the decode
            tokens that share the forward in a MIXED step.
        rem_chunk_tokens: ``--chunked-prefill-size`` (minus MIXED decode tokens), None when off.
        max_new_reqs: how many more requests may run (``--max-running-requests`` and free
            request slots).
        new_token_ratio: the current ``NewTokenRatio`` value.
        max_overtakes: how often a request that does not fit may be overtaken before it blocks.
    """

    page_size: int
    rem_total_tokens: int
    rem_input_tokens: int
    rem_chunk_tokens: int | None
    max_new_reqs: int
    new_token_ratio: float
    max_overtakes: int = MAX_OVERTAKES
    num_admitted: int = 0
    num_new_tokens: int = 0
    stopped: bool = False
    _skipped: list[Hashable] = field(default_factory=list)
    _overtaken: list[Hashable] = field(default_factory=list)

    def kv_cost(self, prefix_len: int, input_len: int, max_new_left: int, retracted: bool) -> int:
        """Slots a request takes from the KV budget: the pages of its input beyond the prefix
        plus its estimated future decode tokens (all of them for a retracted request: it comes
        back only with margin)."""
        ratio = 1.0 if retracted else self.new_token_ratio
        est_new = math.ceil(max_new_left * ratio)
        return page_ceil(input_len + est_new, self.page_size) - page_ceil(prefix_len, self.page_size)

    def add(
        self,
        *,
        prefix_len: int,
        input_len: int,
        max_new_left: int,
        lock_cost: int = 0,
        retracted: bool = False,
        overtaken: int = 0,
        handle: Hashable = None,
        whole_spans: Sequence[tuple[int, int]] = (),
    ) -> AddDecision:
        """Decide for one request.

        Args:
            prefix_len: tokens of its input whose KV exists (cached prefix or earlier chunks).
            input_len: tokens whose KV must exist before its first new token is sampled.
            max_new_left: its remaining max_new_tokens.
            lock_cost: evictable slots that locking its cached prefix takes out of the budget.
            retracted: it was retracted before (re-admitted only with margin).
            overtaken: how often it was already overtaken.
            handle: identifies it in ``overtaken_handles()``.
            whole_spans: ``(start, end)`` positions a chunk may not cut (``uncut_chunk``).
        """
        if self.stopped:
            return AddDecision(AddResult.STOP)
        if (
            self.num_admitted >= self.max_new_reqs
            or self.rem_input_tokens <= 0
            or (self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0)
        ):
            return self._stop()
        extend = input_len - prefix_len
        assert extend >= 1, (prefix_len, input_len)
        cost = self.kv_cost(prefix_len, input_len, max_new_left, retracted) + lock_cost
        if cost > self.rem_total_tokens:
            return self.skip(overtaken, handle)

        if self.rem_chunk_tokens is not None:
            cap = min(self.rem_input_tokens, self.rem_chunk_tokens)
            if extend > cap:
                chunk = uncut_chunk(prefix_len, page_floor(cap, self.page_size), whole_spans, self.page_size)
                if chunk <= 0:
                    return self._stop()
                if chunk < extend:
                    self._commit(chunk, cost)
                    self.stopped = True
                    return AddDecision(AddResult.CHUNKED, chunk)
        elif extend > self.rem_input_tokens and self.num_admitted > 0:
            return self._stop()
        self._commit(extend, cost)
        return AddDecision(AddResult.ADMITTED, extend)

    def fits(self, *, prefix_len: int, input_len: int, max_new_left: int, retracted: bool = False) -> bool:
        """Whether a request with this prefix would fit the KV budget (no state change)."""
        return self.kv_cost(prefix_len, input_len, max_new_left, retracted) <= self.rem_total_tokens

    def skip(self, overtaken: int, handle: Hashable = None) -> AddDecision:
        """A request that does not fit the KV budget: SKIPPED (later ones may go ahead), or
        STOP once it was overtaken ``max_overtakes`` times (it blocks the queue)."""
        if self.stopped:
            return AddDecision(AddResult.STOP)
        if overtaken >= self.max_overtakes:
            return self._stop()
        self._skipped.append(handle)
        return AddDecision(AddResult.SKIPPED)

    def overtaken_handles(self) -> list[Hashable]:
        """Requests that were skipped and then overtaken by a later admission this step."""
        return list(self._overtaken)

    def _commit(self, extend: int, cost: int) -> None:
        self.rem_total_tokens -= cost
        self.rem_input_tokens -= extend
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= extend
        self.num_admitted += 1
        self.num_new_tokens += extend
        if self._skipped:
            self._overtaken.extend(self._skipped)
            self._skipped.clear()

    def _stop(self) -> AddDecision:
        self.stopped = True
        return AddDecision(AddResult.STOP)

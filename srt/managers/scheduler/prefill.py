"""The prefill part: the waiting queue, admission under the token budgets, chunking, and the
EXTEND batch of a step.

``PrefillManager`` owns ``waiting_queue`` (``waiting_queue.py``) and ``chunked_req``
(the one request in the middle of its prompt). ``schedule`` forms one step's prefill work:

    1. a ``PrefillAdder`` (schedule_policy.py) over the budgets of this step: KV slots obtainable
       minus the decode reserve of the running batch, ``--max-prefill-tokens``,
       ``--chunked-prefill-size`` (both less the decode tokens of a MIXED step), free request rows;
    2. the request mid-prompt first (its next chunk; it is never overtaken);
    3. the waiting queue in policy order (the head of it: admission stops after the free request
       rows plus ``MAX_SKIPS_PER_STEP`` passed over): each request is matched against the prefix cache,
       deferred a step when it shares an uncached prefix with one admitted this step
       (``InBatchPrefixFilter``), locked and offered to the adder; admitted ones leave the queue
       (at most one of them chunked), the others keep no match and no lock;
    4. ``ScheduleBatch.prepare_extend`` allocates the batch; one prefill log line.

The scheduler mixes the running decodes in (MIXED) with ``--enable-mixed-chunk``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from srt.managers.scheduler.req import Req, ReqStatus
from srt.managers.scheduler.schedule_batch import ScheduleBatch
from srt.managers.scheduler.schedule_policy import (
    IN_BATCH_PREFIX_THRESHOLD,
    AddDecision,
    AddResult,
    InBatchPrefixFilter,
    PrefillAdder,
    SchedulePolicy,
    decode_reserve,
)
from srt.managers.scheduler.waiting_queue import WaitingQueue
from srt.utils.pages import page_floor

if TYPE_CHECKING:
    from srt.managers.scheduler.cache import CacheManager
    from srt.managers.scheduler.lora_slots import LoRASlots
    from srt.managers.scheduler.metrics import SchedulerMetrics

# stop scanning the waiting queue after passing over this many requests (not fitting, or
# deferred to share a prefix admitted in the same step): bounds the work per step
MAX_SKIPS_PER_STEP = 64


@dataclass(frozen=True, slots=True)
class PrefillConfig:
    """The prefill budgets (resolved ``ServerArgs``; ``chunked_prefill_size`` None: no chunking).
    ``share_in_batch``: defer requests sharing an uncached prefix admitted in the same step (only
    useful with the radix cache)."""

    max_running_requests: int
    chunked_prefill_size: int | None
    max_prefill_tokens: int
    enable_mixed_chunk: bool
    share_in_batch: bool


@dataclass(slots=True)
class _Round:
    """One admission pass over the waiting queue."""

    adder: PrefillAdder
    can_run: list[Req]
    in_batch: InBatchPrefixFilter | None
    matched: list[Req] = field(default_factory=list)  # requests given a prefix match this pass
    admitted: set[int] = field(default_factory=set)  # id() of the admitted requests
    cached: int = 0  # cached prefix tokens the admitted requests reuse
    skips: int = 0

    def skip(self) -> bool:
        """Count a request passed over; True when the scan must stop."""
        self.skips += 1
        return self.skips >= MAX_SKIPS_PER_STEP


class PrefillManager:
    """The waiting queue and the prefill work of each step (see the module docstring)."""

    def __init__(
        self,
        cache: CacheManager,
        policy: SchedulePolicy,
        metrics: SchedulerMetrics,
        config: PrefillConfig,
    ) -> None:
        self.cache = cache
        self.policy = policy
        self.metrics = metrics
        self.config = config
        self.waiting_queue = WaitingQueue(policy)
        self.chunked_req: Req | None = None
        self.lora_slots: LoRASlots | None = None  # the adapter slots (None without --enable-lora)

    # ------------------------------------------------------------------ the queue
    def has_work(self) -> bool:
        return bool(self.waiting_queue) or self.chunked_req is not None

    def enqueue(self, req: Req, now_step: int) -> None:
        """A new request joins the queue (its wait for spf / lpm aging counts from ``now_step``)."""
        req.enqueue_step = now_step
        self.waiting_queue.add(req)

    def requeue(self, req: Req) -> None:
        """A retracted request waits again (its wait still counts from its first arrival)."""
        self.waiting_queue.add(req)

    def discard(self, req: Req) -> bool:
        """Remove a request finished between steps; False if it is neither queued nor mid-prompt
        (a WAITING request may not be queued yet: it waits for its grammar)."""
        if req.state == ReqStatus.WAITING:
            if not self.waiting_queue.remove(req):
                return False
        elif req is self.chunked_req:
            self.chunked_req = None
        else:
            return False
        return True

    def take_chunked(self) -> Req | None:
        """Hand over the request mid-prompt (to be retracted); None if there is none."""
        req, self.chunked_req = self.chunked_req, None
        return req

    # ------------------------------------------------------------------ one step
    def schedule(self, running: Sequence[Req], new_token_ratio: float, now_step: int) -> ScheduleBatch | None:
        """This step's EXTEND batch, or None when nothing can be prefilled.

        ``running``: the decoding requests (their reserve and slots count against the budgets);
        ``new_token_ratio``: the decode part's current estimate; ``now_step``: the step number."""
        if not self.has_work():
            return None
        has_chunked = self.chunked_req is not None
        free_req_slots = min(
            self.config.max_running_requests - len(running) - has_chunked, self.cache.free_rows()
        )
        if not has_chunked and free_req_slots <= 0:
            return None
        adder = self._new_adder(running, new_token_ratio, max(0, free_req_slots) + has_chunked)
        can_run: list[Req] = []
        if has_chunked and not self._continue_chunked(adder, can_run):
            return None
        num_continued = len(can_run)
        cached = 0
        if not adder.stopped and self.waiting_queue and free_req_slots > 0:
            cached = self._admit_from_queue(adder, can_run, now_step)
        if not can_run:
            return None
        batch = ScheduleBatch.prepare_extend(can_run, self.cache)
        self.metrics.log_prefill(
            len(can_run) - num_continued,
            adder.num_new_tokens,
            cached,
            self.cache.token_usage(),
            len(running),
            len(self.waiting_queue),
        )
        return batch

    def _new_adder(self, running: Sequence[Req], new_token_ratio: float, max_new_reqs: int) -> PrefillAdder:
        """The budgets of this step (module docstring, 1.)."""
        cfg = self.config
        P = self.cache.page_size
        mixed_tokens = len(running) if cfg.enable_mixed_chunk else 0
        reserve = decode_reserve([r.remaining_new_tokens for r in running], new_token_ratio)
        chunk = cfg.chunked_prefill_size
        return PrefillAdder(
            page_size=P,
            rem_total_tokens=self.cache.available() - reserve,
            rem_input_tokens=max(P, cfg.max_prefill_tokens - mixed_tokens),
            rem_chunk_tokens=None if chunk is None else max(P, chunk - mixed_tokens),
            max_new_reqs=max_new_reqs,
            new_token_ratio=new_token_ratio,
        )

    def _continue_chunked(self, adder: PrefillAdder, can_run: list[Req]) -> bool:
        """The next chunk of the request mid-prompt; False if it does not fit this step."""
        req = self.chunked_req
        assert req is not None
        d = adder.add(
            prefix_len=req.kv_committed_len,
            input_len=req.all_ids_len,
            max_new_left=req.remaining_new_tokens,
            overtaken=adder.max_overtakes,  # mid-prompt: wait rather than be overtaken
            whole_spans=_whole_spans(req),
        )
        if not d.admitted:
            return False
        _set_extend(req, d.extend_len)
        if d.result == AddResult.ADMITTED:
            self.chunked_req = None
        can_run.append(req)
        return True

    # ------------------------------------------------------------------ admission
    def _admit_from_queue(self, adder: PrefillAdder, can_run: list[Req], now_step: int) -> int:
        """Admit waiting requests in policy order (admitted ones leave the queue, lock their
        cached prefix and join ``can_run``); returns the cached tokens they reuse."""
        queue = self.waiting_queue
        rnd = _Round(adder, can_run, self._in_batch_filter(can_run))
        matched = self.policy.uses_prefix_lens(len(queue))
        if matched:  # a short queue: sorted whole, with the cached prefix of each request
            rnd.matched = list(queue)
            prefix_lens = [self.cache.match(r, r.prefix_match_key()) for r in rnd.matched]
            order: Iterable[Req] = self.policy.order(rnd.matched, now_step, prefix_lens)
        else:
            order = queue.in_order(now_step)
        first = len(can_run)  # the admitted requests join can_run after this
        for req in order:
            if not self._offer(req, rnd, matched=matched):
                break
        for req in can_run[first:]:  # after the pass: the queue must not change while it is read
            queue.remove(req)
        for handle in adder.overtaken_handles():  # the handles are the offered requests
            cast(Req, handle).overtaken += 1
        for req in rnd.matched:  # a waiting request holds no match (and no lock)
            if id(req) not in rnd.admitted:
                self.cache.drop_match(req)
        return rnd.cached

    def _in_batch_filter(self, can_run: list[Req]) -> InBatchPrefixFilter | None:
        if not self.config.share_in_batch:
            return None
        in_batch = InBatchPrefixFilter()
        for r in can_run:  # the request mid-prompt: its whole prompt gets cached
            in_batch.add(r.origin_input_ids + r.output_ids)
        return in_batch

    def _offer(self, req: Req, rnd: _Round, matched: bool) -> bool:
        """Offer one waiting request to the adder (``matched``: its prefix is matched
        already); False when the scan of the queue must stop."""
        adder = rnd.adder
        key = req.prefix_match_key()
        retracted = req.retract_count > 0
        if not matched:
            # cheap bound first: even with all of the key cached, does it fit?
            best = page_floor(len(key), self.cache.page_size)
            if not adder.fits(
                prefix_len=best,
                input_len=req.all_ids_len,
                max_new_left=req.remaining_new_tokens,
                retracted=retracted,
            ):
                stop = adder.skip(req.overtaken, req).result == AddResult.STOP
                return not rnd.skip() and not stop
            self.cache.match(req, key)
            rnd.matched.append(req)
        prefix_len = len(req.prefix_indices)
        if self.lora_slots is not None and not self.lora_slots.acquire(req):
            return False  # no adapter slot free: the requests behind it wait too (lora_slots.py)
        if (
            rnd.in_batch is not None
            and rnd.in_batch.shared_len(key) - prefix_len >= IN_BATCH_PREFIX_THRESHOLD
        ):
            # an earlier admission computes this prefix now: reuse it from the cache next step
            self._release_slot(req)
            return not rnd.skip()
        d = adder.add(
            prefix_len=prefix_len,
            input_len=req.all_ids_len,
            max_new_left=req.remaining_new_tokens,
            lock_cost=self.cache.lock(req),
            retracted=retracted,
            overtaken=req.overtaken,
            handle=req,
            whole_spans=_whole_spans(req),
        )
        if not d.admitted:
            self.cache.unlock(req)
            self._release_slot(req)
            return d.result != AddResult.STOP and not rnd.skip()
        self._admit(req, d, prefix_len, key, rnd)
        return True

    def _release_slot(self, req: Req) -> None:
        if self.lora_slots is not None:
            self.lora_slots.release(req)

    def _admit(self, req: Req, d: AddDecision, prefix_len: int, key: list[int], rnd: _Round) -> None:
        """Book an admitted request: its extend of this step, counters, the in-batch filter."""
        req.kv_committed_len = req.kv_allocated_len = prefix_len
        _set_extend(req, d.extend_len)
        self.metrics.num_admitted_input_tokens += req.all_ids_len
        self.metrics.num_admitted_cached_tokens += prefix_len
        if not req.admitted_once:
            req.admitted_once = True
            req.cached_tokens = prefix_len
            req.admit_time = time.perf_counter()
            req.queue_time = req.admit_time - req.wait_start
        rnd.cached += prefix_len
        rnd.admitted.add(id(req))
        if rnd.in_batch is not None:
            rnd.in_batch.add(key)
        rnd.can_run.append(req)
        if d.result == AddResult.CHUNKED:
            self.chunked_req = req


def _whole_spans(req: Req) -> list[tuple[int, int]]:
    """The positions of ``req``'s prompt a chunk may not cut (its bidirectional images)."""
    return req.images.whole_spans if req.images is not None else []


def _set_extend(req: Req, extend_len: int) -> None:
    """The request computes ``extend_len`` more tokens this step (from ``kv_committed_len``)."""
    start = req.kv_committed_len
    req.fill_ids = (req.origin_input_ids + req.output_ids)[: start + extend_len]
    req.extend_input_len = extend_len
    req.set_state(ReqStatus.PREFILLING)

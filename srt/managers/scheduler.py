"""The scheduler: an event loop that keeps the model busy with many requests at once.

It wires small parts together; the decisions live elsewhere:

    schedule_policy.py            queue order, admission budgets, chunk split, retraction choice
    req.py                        Req: one request's state machine and KV bookkeeping
    schedule_batch.py             ScheduleBatch, KV allocation of a batch -> ForwardBatch
    scheduler_output_processor.py forward results -> Req state, BatchTokenIDOut
    scheduler_metrics.py          counters and log lines
    scheduler_process.py          the ZMQ event loop and the process entry point
    srt/mem_cache/                RadixCache (or ChunkCache with --disable-radix-cache), allocator

One iteration (``step``)::

    new prefill work? (the request mid-prompt first, then the waiting queue in policy order,
                       admitted by PrefillAdder; each admitted request locks its cached prefix)
        yes -> EXTEND batch, or MIXED (+ every running decode) with --enable-mixed-chunk
        no  -> DECODE batch of the running requests (retracting some if KV runs short)
    -> ModelRunner.forward_batch_generation -> process results (append tokens, finish,
       hand KV to the prefix cache) -> merge finished prefills into the running batch
    -> one BatchTokenIDOut for every request that produced tokens or finished

In-process API (tests, benchmarks): ``handle_message(msg)`` for every ``SchedulerInput``,
``step()``, ``is_idle()``, ``run_until_idle()``, ``flush_cache()``, ``get_internal_state()``.
Process entry: ``run_scheduler_process(server_args, port_args, pipe_writer)``.
"""

from __future__ import annotations

import bisect
import logging
import random
import time
from typing import TYPE_CHECKING, Any

from srt.managers.io_struct import (
    AbortReq,
    BatchTokenIDOut,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    SchedulerReady,
    StopStringHit,
    TokenizedGenerateReqInput,
)
from srt.managers.req import Req, ReqState, finish_abort, finish_stop
from srt.managers.schedule_batch import KVAllocationError, KVContext, SamplingInfoCache, ScheduleBatch
from srt.managers.schedule_policy import (
    IN_BATCH_PREFIX_THRESHOLD,
    AddResult,
    InBatchPrefixFilter,
    NewTokenRatio,
    PrefillAdder,
    SchedulePolicy,
    check_request_fits,
    decode_reserve,
    decode_slots,
    resolve_max_new_tokens,
    retraction_order,
)
from srt.managers.scheduler_metrics import SchedulerMetrics
from srt.managers.scheduler_output_processor import build_batch_output, process_batch_result
from srt.managers.scheduler_process import run_scheduler_process

if TYPE_CHECKING:
    from srt.server_args import ServerArgs

__all__ = ["Scheduler", "run_scheduler_process"]

logger = logging.getLogger("srt.scheduler")

# retraction makes room for this many decode steps of the requests that stay
RETRACT_MARGIN_STEPS = 4
# a request retracted more often than this is aborted (the pool is too small for the load)
MAX_RETRACTIONS_PER_REQ = 8
# stop scanning the waiting queue after passing over this many requests (not fitting, or
# deferred to share a prefix admitted in the same step): bounds the work per step
MAX_SKIPS_PER_STEP = 64


class Scheduler:
    """See the module docstring. ``server_args`` must be resolved; ``model_runner`` defaults to
    a ``ModelRunner(server_args)`` (tests and benchmarks pass their own)."""

    def __init__(self, server_args: ServerArgs, model_runner: Any = None) -> None:
        self.server_args = server_args
        if model_runner is None:
            from srt.model_executor.model_runner import ModelRunner

            model_runner = ModelRunner(server_args)
        self.model_runner = model_runner
        cfg = model_runner.model_config
        self.vocab_size: int = cfg.vocab_size
        self.eos_token_ids: list[int] = list(cfg.eos_token_ids)
        self.context_len: int = cfg.context_len
        self.device = getattr(model_runner, "device", "cpu")
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.allocator = model_runner.token_to_kv_pool_allocator
        self.page_size: int = self.allocator.page_size
        self.max_total_num_tokens: int = model_runner.max_total_num_tokens
        self.max_running_requests: int = min(model_runner.max_running_requests, self.req_to_token_pool.size)
        self.max_req_input_len = min(self.context_len, self.max_total_num_tokens) - 1

        if server_args.disable_radix_cache:
            from srt.mem_cache.chunk_cache import ChunkCache

            self.tree_cache = ChunkCache(self.req_to_token_pool, self.allocator, self.page_size)
        else:
            from srt.mem_cache.radix_cache import RadixCache

            self.tree_cache = RadixCache(self.req_to_token_pool, self.allocator, self.page_size)
        self.kv = KVContext(self.req_to_token_pool, self.allocator, self.tree_cache, self.page_size)
        self.sampling_cache = SamplingInfoCache()

        self.policy = SchedulePolicy(server_args.schedule_policy)
        self.new_token_ratio = NewTokenRatio.from_conservativeness(server_args.schedule_conservativeness)
        cps = server_args.chunked_prefill_size
        self.chunked_prefill_size: int | None = cps if cps is not None and cps > 0 else None
        self.max_prefill_tokens = server_args.max_prefill_tokens
        self.enable_mixed_chunk = server_args.enable_mixed_chunk
        self.debug_checks = server_args.enable_debug_checks
        self.rng = random.Random(server_args.random_seed)
        self.metrics = SchedulerMetrics(decode_log_interval=server_args.decode_log_interval)

        self.waiting_queue: list[Req] = []
        self.running: list[Req] = []  # decoding requests, in admission order
        self.chunked_req: Req | None = None  # the request in the middle of its prompt
        self.reqs_by_rid: dict[str, Req] = {}  # every request not yet reported finished
        self.finished_outside: list[Req] = []  # finished between steps (abort, reject, stop string)
        self._next_queue_seq = 0
        self._was_idle = True
        self._running_finished = False  # some request of self.running finished this step
        self._finished_reqs: list[Req] = []  # released since the last output was built

    # ================================================================== messages
    def handle_message(self, msg: Any) -> list[Any]:
        """Apply one input message; returns the replies to send (flush / internal state)."""
        if isinstance(msg, TokenizedGenerateReqInput):
            self._add_request(msg)
        elif isinstance(msg, AbortReq):
            self.abort_request(msg.rid, msg.message, msg.status_code)
        elif isinstance(msg, StopStringHit):
            self._finish_between_steps(msg.rid, finish_stop(msg.matched))
        elif isinstance(msg, FlushCacheReq):
            return [self.flush_cache()]
        elif isinstance(msg, GetInternalStateReq):
            return [GetInternalStateReqOutput(state=self.get_internal_state())]
        else:
            logger.warning("ignoring unknown message %r", type(msg).__name__)
        return []

    def _add_request(self, msg: TokenizedGenerateReqInput) -> None:
        prompt_len = len(msg.input_ids)
        max_new = resolve_max_new_tokens(
            msg.sampling_params.max_new_tokens, prompt_len, self.context_len, self.max_total_num_tokens
        )
        seed = msg.sampling_params.seed
        req = Req.from_input(
            msg,
            max_new_tokens=max_new,
            seed=seed if seed is not None else self.rng.getrandbits(63),
            eos_token_ids=self.eos_token_ids,
            queue_seq=self._next_queue_seq,
        )
        self._next_queue_seq += 1
        if msg.rid in self.reqs_by_rid:
            # the rid names the live request's stream: answering under it would corrupt that stream
            logger.error(
                "dropping a request with the duplicate rid %r (a request with this rid is live)", msg.rid
            )
            self.metrics.num_rejected += 1
            return
        error = check_request_fits(
            prompt_len, max_new, self.context_len, self.max_total_num_tokens, self.page_size
        )
        if error is None and (min(msg.input_ids) < 0 or max(msg.input_ids) >= self.vocab_size):
            error = f"Input token ids must be in [0, {self.vocab_size}) for this model."
        self.reqs_by_rid[req.rid] = req
        if error is not None:
            req.finish(finish_abort(error, 400))
            self.metrics.num_rejected += 1
            self._release(req)
            self.finished_outside.append(req)
            return
        req.enqueue_step = self.metrics.num_steps
        self.waiting_queue.append(req)

    def abort_request(self, rid: str, message: str = "aborted", status_code: int | None = None) -> None:
        """Abort a request in any state ("" aborts every request); unknown rids are ignored."""
        if rid == "":
            for r in list(self.reqs_by_rid.values()):
                self._finish_between_steps(r.rid, finish_abort(message, status_code))
            return
        if self._finish_between_steps(rid, finish_abort(message, status_code)):
            self.metrics.num_aborted += 1

    def _finish_between_steps(self, rid: str, reason: dict[str, Any]) -> bool:
        """Finish a request outside a forward, releasing all it holds; False if unknown/done."""
        req = self.reqs_by_rid.get(rid)
        if req is None or req.state == ReqState.FINISHED:
            return False
        req.finish(reason)
        if req.state == ReqState.WAITING:
            self.waiting_queue.remove(req)
        elif req is self.chunked_req:
            self.chunked_req = None
        elif req.state == ReqState.DECODING:
            self.running.remove(req)
        self._release(req)
        self._running_finished = False
        self.finished_outside.append(req)
        return True

    def _release(self, req: Req) -> None:
        """Give back everything a finished request holds (its KV goes to the prefix cache)."""
        if req.req_pool_idx is not None:
            self.tree_cache.cache_finished_req(req)
        if req.state == ReqState.DECODING:
            self._running_finished = True
        req.mark_released()
        self.metrics.num_finished += 1
        self._finished_reqs.append(req)

    # ================================================================== one iteration
    def is_idle(self) -> bool:
        return not (self.waiting_queue or self.running or self.chunked_req or self.finished_outside)

    def step(self) -> list[BatchTokenIDOut]:
        """One scheduler iteration: form a batch, run it, process the results.

        Returns the step's output (one BatchTokenIDOut, or nothing)."""
        self.metrics.num_steps += 1
        batch = self._get_next_batch()
        touched: list[Req] = self.finished_outside  # aborted, rejected, retracted too often
        self.finished_outside = []
        if batch is not None:
            fb = batch.get_forward_batch(
                self.device, self.vocab_size, self.eos_token_ids, self.sampling_cache
            )
            logits_output, sample_output = self.model_runner.forward_batch_generation(fb)
            group = hasattr(self.allocator, "free_group_begin")
            if group:
                self.allocator.free_group_begin()
            try:
                new_decoding, generated = process_batch_result(
                    batch, logits_output, sample_output, self.tree_cache, self._release
                )
            finally:
                if group:
                    self.allocator.free_group_end()
            self.metrics.on_generated(generated)
            self._merge_running(new_decoding)
            touched = touched + batch.reqs
        out = build_batch_output(touched)
        for req in self._finished_reqs:  # reported now: the rid may be reused from here on
            if self.reqs_by_rid.get(req.rid) is req:
                del self.reqs_by_rid[req.rid]
        self._finished_reqs.clear()
        self._after_step()
        return [out] if out is not None else []

    def run_until_idle(self, max_steps: int = 1_000_000) -> list[BatchTokenIDOut]:
        """Step until idle (tests); raises RuntimeError after max_steps (a livelock)."""
        outs: list[BatchTokenIDOut] = []
        for _ in range(max_steps):
            if self.is_idle():
                return outs
            outs.extend(self.step())
        raise RuntimeError(f"scheduler not idle after {max_steps} steps: {self.get_internal_state()}")

    def _merge_running(self, new_decoding: list[Req]) -> None:
        if self._running_finished:
            self.running = [r for r in self.running if r.state != ReqState.FINISHED]
            self._running_finished = False
        self.running.extend(new_decoding)

    def _after_step(self) -> None:
        idle = self.is_idle()
        if idle and not self._was_idle:
            self.tree_cache.check_integrity(0)
        elif self.debug_checks:
            self.check_integrity()
        self._was_idle = idle

    def check_integrity(self) -> None:
        """The cache's slot accounting, counting the slots running requests own (between steps)."""
        holders = self.running + ([self.chunked_req] if self.chunked_req is not None else [])
        owned = sum(self.tree_cache.slots_owned_by_req(r) for r in holders)
        self.tree_cache.check_integrity(owned)
        rows = self.req_to_token_pool.size - self.req_to_token_pool.available_size()
        assert rows == len(holders), f"{rows} request rows in use, {len(holders)} requests hold one"

    # ================================================================== batch formation
    def _get_next_batch(self) -> ScheduleBatch | None:
        batch = self._get_new_prefill_batch()
        if batch is not None:
            if self.enable_mixed_chunk and self.running:
                decode = self._prepare_decode(mixed=True)
                if decode is not None:
                    batch.mix_with(decode)
                    self.metrics.num_mixed_steps += 1
            return batch
        if self.running:
            return self._prepare_decode(mixed=False)
        return None

    def token_usage(self) -> float:
        return 1.0 - self.kv.available() / self.max_total_num_tokens

    def _get_new_prefill_batch(self) -> ScheduleBatch | None:
        if not self.waiting_queue and self.chunked_req is None:
            return None
        running_bs = len(self.running)
        free_req_slots = min(
            self.max_running_requests - running_bs - (self.chunked_req is not None),
            self.req_to_token_pool.available_size(),
        )
        if self.chunked_req is None and free_req_slots <= 0:
            return None
        mixed_tokens = running_bs if self.enable_mixed_chunk else 0
        P = self.page_size
        reserve = decode_reserve([r.remaining_new_tokens for r in self.running], self.new_token_ratio.value)
        rem_chunk = (
            None if self.chunked_prefill_size is None else max(P, self.chunked_prefill_size - mixed_tokens)
        )
        adder = PrefillAdder(
            page_size=P,
            rem_total_tokens=self.kv.available() - reserve,
            rem_input_tokens=max(P, self.max_prefill_tokens - mixed_tokens),
            rem_chunk_tokens=rem_chunk,
            max_new_reqs=max(0, free_req_slots) + (self.chunked_req is not None),
            new_token_ratio=self.new_token_ratio.value,
        )
        can_run: list[Req] = []
        if self.chunked_req is not None:
            req = self.chunked_req
            d = adder.add(
                prefix_len=req.kv_committed_len,
                input_len=req.all_ids_len,
                max_new_left=req.remaining_new_tokens,
                overtaken=adder.max_overtakes,  # mid-prompt: wait rather than be overtaken
            )
            if not d.admitted:
                return None
            self._set_extend(req, d.extend_len)
            if d.result == AddResult.ADMITTED:
                self.chunked_req = None
            can_run.append(req)
        num_continued = len(can_run)
        cached = 0
        if not adder.stopped and self.waiting_queue and free_req_slots > 0:
            cached = self._admit_from_queue(adder, can_run)
        if not can_run:
            return None
        batch = ScheduleBatch.prepare_extend(can_run, self.kv)
        self.metrics.log_prefill(
            len(can_run) - num_continued,
            adder.num_new_tokens,
            cached,
            self.token_usage(),
            running_bs,
            len(self.waiting_queue),
        )
        return batch

    def _admit_from_queue(self, adder: PrefillAdder, can_run: list[Req]) -> int:
        """Admit waiting requests in policy order (admitted ones leave the queue, lock their
        cached prefix and join ``can_run``); returns the cached tokens they reuse."""
        queue = self.waiting_queue
        cache = self.tree_cache
        matched: list[Req] = []
        prefix_lens = None
        if self.policy.uses_prefix_lens(len(queue)):
            prefix_lens = []
            for req in queue:
                m = cache.match_prefix(req.prefix_match_key())
                req.prefix_indices, req.last_node = m.device_indices, m.last_node
                prefix_lens.append(len(m.device_indices))
            matched = list(queue)
        ordered = self.policy.order(queue, self.metrics.num_steps, prefix_lens)
        admitted: set[int] = set()
        cached = skips = 0
        P = self.page_size
        in_batch = None
        if not self.server_args.disable_radix_cache:
            in_batch = InBatchPrefixFilter()
            for r in can_run:  # the request mid-prompt: its whole prompt gets cached
                in_batch.add(r.origin_input_ids + r.output_ids)
        for req in ordered:
            input_len = req.all_ids_len
            retracted = req.retract_count > 0
            key = req.prefix_match_key()
            if prefix_lens is None:
                # cheap bound first: even with all of the key cached, does it fit?
                best = len(key) // P * P
                if not adder.fits(
                    prefix_len=best,
                    input_len=input_len,
                    max_new_left=req.remaining_new_tokens,
                    retracted=retracted,
                ):
                    d = adder.skip(req.overtaken, req)
                    skips += 1
                    if d.result == AddResult.STOP or skips >= MAX_SKIPS_PER_STEP:
                        break
                    continue
                m = cache.match_prefix(key)
                req.prefix_indices, req.last_node = m.device_indices, m.last_node
                matched.append(req)
            prefix_len = len(req.prefix_indices)
            if in_batch is not None and in_batch.shared_len(key) - prefix_len >= IN_BATCH_PREFIX_THRESHOLD:
                # an earlier admission computes this prefix now: reuse it from the cache next step
                skips += 1
                if skips >= MAX_SKIPS_PER_STEP:
                    break
                continue
            ev_before = cache.evictable_size()
            cache.inc_lock_ref(req.last_node)
            d = adder.add(
                prefix_len=prefix_len,
                input_len=input_len,
                max_new_left=req.remaining_new_tokens,
                lock_cost=ev_before - cache.evictable_size(),
                retracted=retracted,
                overtaken=req.overtaken,
                handle=req,
            )
            if not d.admitted:
                cache.dec_lock_ref(req.last_node)
                if d.result == AddResult.STOP:
                    break
                skips += 1
                if skips >= MAX_SKIPS_PER_STEP:
                    break
                continue
            req.kv_committed_len = req.kv_allocated_len = prefix_len
            self._set_extend(req, d.extend_len)
            self.metrics.num_admitted_input_tokens += input_len
            self.metrics.num_admitted_cached_tokens += prefix_len
            if not req.admitted_once:
                req.admitted_once = True
                req.cached_tokens = prefix_len
                req.queue_time = time.perf_counter() - req.wait_start
            cached += prefix_len
            admitted.add(id(req))
            if in_batch is not None:
                in_batch.add(key)
            can_run.append(req)
            if d.result == AddResult.CHUNKED:
                self.chunked_req = req
        for handle in adder.overtaken_handles():
            handle.overtaken += 1
        for req in matched:  # a waiting request holds no match (and no lock)
            if id(req) not in admitted:
                req.prefix_indices, req.last_node = req.prefix_indices[:0], None
        if admitted:
            self.waiting_queue = [r for r in queue if id(r) not in admitted]
        return cached

    def _set_extend(self, req: Req, extend_len: int) -> None:
        start = req.kv_committed_len
        req.fill_ids = (req.origin_input_ids + req.output_ids)[: start + extend_len]
        req.extend_input_len = extend_len
        req.set_state(ReqState.PREFILLING)

    # ================================================================== decode and retraction
    def _prepare_decode(self, mixed: bool) -> ScheduleBatch | None:
        """The decode batch of the running requests, retracting some if KV runs short.

        In a MIXED step (``mixed``) the prefill part is already allocated: if the decodes
        still cannot get slots they sit this step out (None)."""
        if not self._ensure_decode_memory(mixed):
            return None
        self.new_token_ratio.on_decode_step()
        batch = ScheduleBatch.prepare_decode(self.running, self.kv)
        self.metrics.on_decode_step(
            len(self.running),
            self.max_total_num_tokens - self.kv.available(),
            self.token_usage(),
            len(self.waiting_queue),
        )
        return batch

    def _ensure_decode_memory(self, mixed: bool) -> bool:
        """Make the KV slots of one decode step of ``self.running`` free, evicting cached
        prefixes and then retracting the requests that lose the least work (until the rest
        can decode RETRACT_MARGIN_STEPS steps). False if nothing is left to decode."""
        P = self.page_size
        if self.kv.ensure_free(ScheduleBatch.decode_slots_needed(self.running, P)):
            return True
        kept = list(self.running)
        victims: list[Req] = []
        margin_need = decode_slots([r.kv_committed_len for r in kept], P, RETRACT_MARGIN_STEPS)
        for v in retraction_order(self.running):
            if len(kept) <= 1 or margin_need <= self.kv.available():
                break
            kept.remove(v)
            margin_need -= decode_slots([v.kv_committed_len], P, RETRACT_MARGIN_STEPS)
            self._retract(v)
            victims.append(v)
        self.running = kept
        if victims:
            self.new_token_ratio.on_retract()
            logger.info(
                "Retract requests. #retracted: %d, #running-req: %d, #queue-req: %d, new_token_ratio: %.2f",
                len(victims),
                len(kept),
                len(self.waiting_queue),
                self.new_token_ratio.value,
            )
        if self.kv.ensure_free(ScheduleBatch.decode_slots_needed(self.running, P)):
            return bool(self.running)
        if mixed:
            return False
        if self.chunked_req is not None:  # the request mid-prompt holds what the last decode needs
            req, self.chunked_req = self.chunked_req, None
            self._retract(req)
            self.new_token_ratio.on_retract()
        if self.kv.ensure_free(ScheduleBatch.decode_slots_needed(self.running, P)):
            return bool(self.running)
        raise KVAllocationError(
            f"cannot decode {len(self.running)} request(s): {self.kv.available()} KV slots obtainable"
        )

    def _retract(self, req: Req) -> None:
        """Push a running (or mid-prompt) request back to the waiting queue; its KV goes to
        the prefix cache so re-admission can reuse it."""
        self.tree_cache.cache_finished_req(req)
        req.retract()
        req.fill_ids = []
        self.metrics.num_retractions += 1
        if req.retract_count > MAX_RETRACTIONS_PER_REQ:
            req.finish(
                finish_abort(
                    f"Request was retracted {req.retract_count} times because the KV cache "
                    f"({self.max_total_num_tokens} tokens) ran out; the load does not fit. Raise "
                    "--max-total-tokens / --mem-fraction-static, lower --max-running-requests, or raise "
                    "--schedule-conservativeness.",
                    503,
                )
            )
            self.metrics.num_retract_aborts += 1
            self._release(req)
            self.finished_outside.append(req)
            return
        # back in arrival order (the waiting queue is sorted by queue_seq)
        bisect.insort(self.waiting_queue, req, key=lambda r: r.queue_seq)

    # ================================================================== control
    def flush_cache(self) -> FlushCacheReqOutput:
        """Drop the prefix cache (only when idle); afterwards every KV slot and request row is free."""
        if not self.is_idle():
            return FlushCacheReqOutput(
                success=False,
                message=f"Cache not flushed: {len(self.running) + (self.chunked_req is not None)} running and "
                f"{len(self.waiting_queue)} waiting requests.",
            )
        self.tree_cache.reset()
        free, total = self.allocator.available_size(), self.allocator.size
        rows_free = self.req_to_token_pool.available_size()
        message = ""
        if free != total or rows_free != self.req_to_token_pool.size:
            message = (
                f"leak repaired: {total - free} KV slots and {self.req_to_token_pool.size - rows_free} "
                "request rows were not free after the flush"
            )
            logger.error("flush_cache: %s", message)
            self.allocator.clear()
            self.req_to_token_pool.clear()
        self.new_token_ratio.reset()
        return FlushCacheReqOutput(success=True, message=message)

    def get_internal_state(self) -> dict[str, Any]:
        """Queue and memory state plus every counter of ``SchedulerMetrics`` (plain values)."""
        return {
            "num_running_reqs": len(self.running) + (self.chunked_req is not None),
            "num_queued_reqs": len(self.waiting_queue),
            "token_usage": self.token_usage(),
            "max_total_num_tokens": self.max_total_num_tokens,
            "max_running_requests": self.max_running_requests,
            "available_size": self.allocator.available_size(),
            "evictable_size": self.tree_cache.evictable_size(),
            "protected_size": self.tree_cache.protected_size(),
            "new_token_ratio": self.new_token_ratio.value,
            "page_size": self.page_size,
            "context_len": self.context_len,
            "schedule_policy": self.policy.policy,
            "radix_cache": not self.server_args.disable_radix_cache,
            **self.metrics.snapshot(),
        }

    def ready_message(self) -> SchedulerReady:
        return SchedulerReady(
            max_total_num_tokens=self.max_total_num_tokens,
            max_running_requests=self.max_running_requests,
            max_req_input_len=self.max_req_input_len,
            context_len=self.context_len,
            page_size=self.page_size,
        )

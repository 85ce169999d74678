"""The ``Scheduler``: receives requests, runs one step at a time, sends the results.

It only wires the parts together; each part owns one job and its state:

    prefill.py     PrefillManager: waiting queue, request mid-prompt, admission budgets,
                   chunking, the EXTEND batch
    decode.py      DecodeManager: running batch, retraction and its hysteresis (NewTokenRatio)
    cache.py       CacheManager: request rows, KV allocator and prefix cache (match, lock,
                   insert, free, evict, flush, integrity)
    output.py      forward results -> Req state; the step's BatchTokenIDOut
    metrics.py     SchedulerMetrics: counters and log lines
    deadlines.py   DeadlineTracker: per-request deadlines and --max-queue-time, checked each step
    step_timing.py StepTimings: per-step scheduling / forward time histograms
    grammar.py     GrammarManager: grammars compiled off the loop, token masks, matchers
    profiler.py    SchedulerProfiler: torch.profiler around steps (/start_profile, /stop_profile)
    weight_update.py  WeightUpdateGate: a weight update waits for idle, new requests wait for it
    heartbeat.py   SchedulerHeartbeat: progress and a state summary for the hang watchdog
    process.py     the ZMQ event loop and the process entry point (imports this module)
    runner_protocol.py   SchedulerModelRunner: what the scheduler may call on the model runner

and the pure pieces in ``srt/managers/``: ``schedule_policy.py`` (queue order, budgets, chunk
split, retraction choice), ``request_fit.py`` (can a request ever fit?), ``req.py`` (Req and
its state machine), ``schedule_batch.py`` (ScheduleBatch -> ForwardBatch).

The scheduler itself owns the requests not yet reported finished (``reqs_by_rid``): arrival
(fit check, duplicate rids), finishes between steps (abort, stop string, rejection) and the
routing of retracted requests (back to the queue, or aborted when retracted too often).

One iteration (``step``)::

    prefill.schedule (request mid-prompt first, then the queue in policy order)
        batch -> EXTEND, or MIXED (+ decode.prepare_batch of every running request) with
                 --enable-mixed-chunk
        none  -> DECODE batch of the running requests (decode.retract_for_room if KV runs short)
    -> model_runner.forward_batch_generation -> output.process_batch_result (append tokens,
       finish, hand KV to the prefix cache) -> decode.merge (finished out, new decodes in)
    -> output.build_batch_output: one BatchTokenIDOut for every request that produced tokens
       or finished; the integrity check when the scheduler goes idle

In-process API (tests, benchmarks): ``handle_message(msg)`` for every ``SchedulerInput``,
``step()``, ``take_replies()`` (replies to control requests answered by a step: a deferred weight
update), ``is_idle()``, ``run_until_idle()``, ``flush_cache()``, ``get_internal_state()``,
``check_integrity()``, ``ready_message()``.
"""

from __future__ import annotations

import logging
import random
import time
from typing import TYPE_CHECKING, Any

from srt.managers.io_struct import (
    AbortReq,
    BatchTokenIDOut,
    ControlReply,
    FinishReason,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    ProfileReq,
    SchedulerInput,
    SchedulerReady,
    StopStringHit,
    TokenizedGenerateReqInput,
    UpdateWeightsFromDiskReq,
    UpdateWeightsFromDiskReqOutput,
)
from srt.managers.request_fit import check_request_fits, resolve_max_new_tokens
from srt.managers.scheduler.cache import CacheManager
from srt.managers.scheduler.deadlines import DeadlineTracker
from srt.managers.scheduler.decode import DecodeManager
from srt.managers.scheduler.grammar import GrammarManager
from srt.managers.scheduler.metrics import SchedulerMetrics
from srt.managers.scheduler.output import build_batch_output, process_batch_result
from srt.managers.scheduler.prefill import PrefillConfig, PrefillManager
from srt.managers.scheduler.profiler import SchedulerProfiler
from srt.managers.scheduler.req import Req, ReqStatus
from srt.managers.scheduler.schedule_batch import KVAllocationError, SamplingInfoCache, ScheduleBatch
from srt.managers.scheduler.schedule_policy import NewTokenRatio, SchedulePolicy
from srt.managers.scheduler.step_timing import StepTimings
from srt.managers.scheduler.weight_update import WeightUpdateGate
from srt.mem_cache.pool_size import process_rss_bytes
from srt.utils.fault import FaultHook
from srt.utils.hf_tokenizer import tokenizer_source

if TYPE_CHECKING:
    from srt.managers.scheduler.heartbeat import SchedulerHeartbeat
    from srt.managers.scheduler.runner_protocol import SchedulerModelRunner
    from srt.mem_cache.allocator import TokenToKVPoolAllocator
    from srt.mem_cache.base_prefix_cache import BasePrefixCache
    from srt.mem_cache.memory_pool import ReqToTokenPool
    from srt.server_args import ServerArgs

logger = logging.getLogger("srt.scheduler")

# with nothing to run but requests waiting for their grammars, a step waits this long for one
GRAMMAR_WAIT_SECONDS = 0.005


def _load_model_runner(server_args: ServerArgs, tp_rank: int) -> SchedulerModelRunner:
    from srt.model_executor.model_runner import ModelRunner

    return ModelRunner(server_args, tp_rank=tp_rank)


def _create_grammars(
    server_args: ServerArgs, vocab_size: int, eos_token_ids: list[int]
) -> GrammarManager | None:
    """The grammar part (None without a tokenizer or with ``--grammar-backend none``). Tensor-parallel
    ranks must admit a request at the same step, so with ``--tp-size`` > 1 grammar readiness never
    depends on timing."""
    if server_args.skip_tokenizer_init:
        return None
    grammars = GrammarManager.create(
        server_args.grammar_backend,
        tokenizer_source(server_args),
        vocab_size,
        eos_token_ids,
        server_args.trust_remote_code,
        server_args.reasoning_parser,
    )
    if grammars is not None:
        grammars.wait_all = server_args.tp_size > 1
    return grammars


class Scheduler:
    """See the module docstring. ``server_args`` must be resolved; ``model_runner`` defaults to
    a ``ModelRunner(server_args, tp_rank=tp_rank)`` (tests and benchmarks pass their own). With
    ``--tp-size`` > 1 every rank builds one and they must stay in lock step (tp_process.py)."""

    def __init__(
        self, server_args: ServerArgs, model_runner: SchedulerModelRunner | None = None, tp_rank: int = 0
    ) -> None:
        self.server_args = server_args
        self.tp_rank = tp_rank
        runner = model_runner if model_runner is not None else _load_model_runner(server_args, tp_rank)
        self.model_runner = runner
        cfg = runner.model_config
        self.vocab_size: int = cfg.vocab_size
        self.eos_token_ids: list[int] = list(cfg.eos_token_ids)
        self.context_len: int = cfg.context_len
        self.device = runner.device
        self.max_total_num_tokens: int = runner.max_total_num_tokens
        pool = runner.req_to_token_pool
        self.max_running_requests: int = min(runner.max_running_requests, pool.size)
        self.max_req_input_len = min(self.context_len, self.max_total_num_tokens) - 1

        self.cache = CacheManager.create(
            pool, runner.token_to_kv_pool_allocator, radix=not server_args.disable_radix_cache
        )
        self.page_size: int = self.cache.page_size
        self.metrics = SchedulerMetrics(decode_log_interval=server_args.decode_log_interval)
        ratio = NewTokenRatio.from_conservativeness(server_args.schedule_conservativeness)
        self.decode = DecodeManager(self.cache, ratio, self.metrics, self.max_total_num_tokens)
        cps = server_args.chunked_prefill_size
        prefill_config = PrefillConfig(
            max_running_requests=self.max_running_requests,
            chunked_prefill_size=cps if cps is not None and cps > 0 else None,
            max_prefill_tokens=server_args.max_prefill_tokens,
            enable_mixed_chunk=server_args.enable_mixed_chunk,
            share_in_batch=not server_args.disable_radix_cache,
        )
        self.policy = SchedulePolicy(server_args.schedule_policy)
        self.prefill = PrefillManager(self.cache, self.policy, self.metrics, prefill_config)
        self.sampling_cache = SamplingInfoCache()
        self.grammars = _create_grammars(server_args, self.vocab_size, self.eos_token_ids)
        self.enable_mixed_chunk = server_args.enable_mixed_chunk
        self.debug_checks = server_args.enable_debug_checks
        self.rng = random.Random(server_args.random_seed)
        self.profiler = SchedulerProfiler(self.device)
        self.weight_gate = WeightUpdateGate()
        self.deadlines = DeadlineTracker(server_args.max_queue_time)
        # time.time() of the deadlines when set: tensor-parallel ranks use rank 0's, broadcast
        # with the inputs, so that they expire the same requests at the same step
        self.step_clock: float | None = None
        self.step_timings = StepTimings()
        self._replies: list[ControlReply] = []  # answered by a step (take_replies)

        self.reqs_by_rid: dict[str, Req] = {}  # every request not yet reported finished
        self.finished_outside: list[Req] = []  # finished between steps (abort, reject, stop string)
        self._finished_reqs: list[Req] = []  # released since the last output was built
        self._next_queue_seq = 0
        self._was_idle = True
        # hang watchdog: progress published each step (set by process.py); test-only fault hook
        self.heartbeat: SchedulerHeartbeat | None = None
        self.fault = FaultHook.from_env()

    # the parts' state, read by tests and benchmarks
    @property
    def waiting_queue(self) -> list[Req]:
        return self.prefill.waiting_queue

    @property
    def chunked_req(self) -> Req | None:
        return self.prefill.chunked_req

    @property
    def running(self) -> list[Req]:
        return self.decode.running

    @property
    def req_to_token_pool(self) -> ReqToTokenPool:
        return self.cache.req_to_token_pool

    @property
    def allocator(self) -> TokenToKVPoolAllocator:
        return self.cache.allocator

    @property
    def tree_cache(self) -> BasePrefixCache:
        return self.cache.tree_cache

    # ================================================================== messages
    def handle_message(self, msg: SchedulerInput) -> list[ControlReply]:
        """Apply one input message; returns the replies to send now (control requests; a weight
        update that must wait for idle is answered later through ``take_replies``)."""
        if isinstance(msg, TokenizedGenerateReqInput):
            if not self.weight_gate.hold(msg):
                self._add_request(msg)
        elif isinstance(msg, AbortReq):
            self.weight_gate.drop(msg.rid)
            self.abort_request(msg.rid, msg.message, msg.status_code)
        elif isinstance(msg, StopStringHit):
            self._finish_between_steps(msg.rid, FinishReason.of_stop(msg.matched))
        elif isinstance(msg, FlushCacheReq):
            return [self.flush_cache()]
        elif isinstance(msg, GetInternalStateReq):
            return [GetInternalStateReqOutput(state=self.get_internal_state())]
        elif isinstance(msg, ProfileReq):
            return [self.profiler.handle(msg)]
        elif isinstance(msg, UpdateWeightsFromDiskReq):
            refused = self.weight_gate.submit(msg)
            if refused is not None:
                return [refused]
            if self.is_idle():
                return [self._update_weights()]
        else:
            logger.warning("ignoring unknown message %r", type(msg).__name__)
        return []

    def _add_request(self, msg: TokenizedGenerateReqInput) -> None:
        """Arrival: a Req for the waiting queue, or a rejection (never fits: abort 400;
        duplicate live rid: dropped)."""
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
        self.reqs_by_rid[req.rid] = req
        error = self._arrival_error(msg.input_ids, max_new)
        if error is not None:
            self._reject(req, error)
            return
        self.deadlines.track(req, self.step_clock)
        if req.grammar_spec is not None:
            if self.grammars is None:  # the tokenizer manager rejects these; input_ids-only clients
                self._reject(req, "constrained decoding is off (--grammar-backend none or no tokenizer)")
                return
            self.grammars.submit(req)
            return
        self.prefill.enqueue(req, self.metrics.num_steps)

    def _reject(self, req: Req, message: str) -> None:
        req.finish(FinishReason.of_abort(message, 400))
        self.metrics.num_rejected += 1
        self._release(req)
        self.finished_outside.append(req)

    def _admit_grammar_requests(self, timeout: float = 0.0) -> None:
        """Requests whose grammar is compiled join the waiting queue; failed ones are rejected."""
        if self.grammars is None or not self.grammars.pending:
            return
        ready, failed = self.grammars.poll(timeout)
        for req in ready:
            self.prefill.enqueue(req, self.metrics.num_steps)
        for req, message in failed:
            self._reject(req, message)

    def _arrival_error(self, input_ids: list[int], max_new_tokens: int) -> str | None:
        """Why a request can never run (request_fit.py, token ids outside the vocabulary)."""
        error = check_request_fits(
            len(input_ids), max_new_tokens, self.context_len, self.max_total_num_tokens, self.page_size
        )
        if error is None and (min(input_ids) < 0 or max(input_ids) >= self.vocab_size):
            error = f"Input token ids must be in [0, {self.vocab_size}) for this model."
        return error

    def abort_request(self, rid: str, message: str = "aborted", status_code: int | None = None) -> None:
        """Abort a request in any state ("" aborts every request); unknown rids are ignored."""
        if rid == "":
            for r in list(self.reqs_by_rid.values()):
                self._finish_between_steps(r.rid, FinishReason.of_abort(message, status_code))
            return
        if self._finish_between_steps(rid, FinishReason.of_abort(message, status_code)):
            self.metrics.num_aborted += 1

    def _finish_between_steps(self, rid: str, reason: FinishReason) -> bool:
        """Finish a request outside a forward, releasing all it holds; False if unknown/done."""
        req = self.reqs_by_rid.get(rid)
        if req is None or req.state == ReqStatus.FINISHED:
            return False
        req.finish(reason)
        if not self.prefill.discard(req) and not self.decode.discard(req) and self.grammars is not None:
            self.grammars.discard(req)
        self._release(req)
        self.finished_outside.append(req)
        return True

    def _release(self, req: Req) -> None:
        """A finished request gives back all it holds; it is reported with the next output."""
        self.cache.release(req)
        self.metrics.num_finished += 1
        self._finished_reqs.append(req)

    def _requeue(self, retracted: list[Req]) -> None:
        """Retracted requests wait again, or are aborted when retracted too often."""
        for req in retracted:
            reason = self.decode.retraction_abort(req)
            if reason is None:
                self.prefill.requeue(req)
                continue
            req.finish(reason)
            self.metrics.num_retract_aborts += 1
            self._release(req)
            self.finished_outside.append(req)

    # ================================================================== one iteration
    def is_idle(self) -> bool:
        return not (
            self.prefill.has_work()
            or self.decode.running
            or self.finished_outside
            or (self.grammars is not None and self.grammars.pending)
        )

    def step(self) -> list[BatchTokenIDOut]:
        """One scheduler iteration: form a batch, run it, process the results.

        Returns the step's output (one BatchTokenIDOut, or nothing)."""
        step_start = time.perf_counter()
        self.metrics.num_steps += 1
        self._expire_deadlines()
        # nothing else to do: wait (briefly, so that new messages are still read) for a grammar
        busy = self.prefill.has_work() or self.decode.running or self.finished_outside
        self._admit_grammar_requests(0.0 if busy else GRAMMAR_WAIT_SECONDS)
        batch = self._next_batch()
        if self.heartbeat is not None:
            self.heartbeat.on_step(self, batch)
        touched: list[Req] = self.finished_outside  # aborted, rejected, retracted too often
        self.finished_outside = []
        if batch is not None:
            self.fault.before_forward()  # test-only (SRT_TEST_FAULT): may stall this step's forward
            fb = batch.get_forward_batch(
                self.device, self.vocab_size, self.eos_token_ids, self.sampling_cache
            )
            # (a batch without constrained requests builds no row list: this runs every step)
            if self.grammars is not None and any(r.grammar is not None for r in batch.reqs):
                masks = self.grammars.fill_masks(batch.reqs, batch.sampling_rows(), self.vocab_size)
                if masks is not None:
                    fb.sampling_info = fb.sampling_info.with_grammar_masks(*masks)
            forward_start = time.perf_counter()
            logits_output, sample_output = self.model_runner.forward_batch_generation(fb)
            forward_seconds = time.perf_counter() - forward_start
            self.cache.begin_free_group()
            try:
                result = process_batch_result(batch, logits_output, sample_output, self.cache, self._release)
            finally:
                self.cache.end_free_group()
            self.metrics.on_generated(result.num_generated)
            self.decode.merge(result.new_decoding, result.decode_finished)
            touched = touched + batch.reqs
        out = build_batch_output(touched, self.server_args.stream_interval)
        for req in self._finished_reqs:  # reported now: the rid may be reused from here on
            if self.reqs_by_rid.get(req.rid) is req:
                del self.reqs_by_rid[req.rid]
        self._finished_reqs.clear()
        self._after_step()
        if batch is not None:
            self.step_timings.observe(time.perf_counter() - step_start, forward_seconds)
        return [out] if out is not None else []

    def _expire_deadlines(self) -> None:
        """Finish the requests whose deadline or --max-queue-time passed (deadlines.py)."""
        for req, reason in self.deadlines.expired(self.step_clock):
            if self.reqs_by_rid.get(req.rid) is req:
                self._finish_between_steps(req.rid, reason)

    def run_until_idle(self, max_steps: int = 1_000_000) -> list[BatchTokenIDOut]:
        """Step until idle (tests); raises RuntimeError after max_steps (a livelock)."""
        outs: list[BatchTokenIDOut] = []
        for _ in range(max_steps):
            if self.is_idle():
                return outs
            outs.extend(self.step())
        raise RuntimeError(f"scheduler not idle after {max_steps} steps: {self.get_internal_state()}")

    def take_replies(self) -> list[ControlReply]:
        """Replies produced by steps since the last call (a deferred weight update's)."""
        replies, self._replies = self._replies, []
        return replies

    def _after_step(self) -> None:
        self.profiler.on_step()
        if self.weight_gate.pending is not None and self.is_idle():
            self._replies.append(self._update_weights())
        idle = self.is_idle()
        if idle and not self._was_idle:
            self.cache.check_idle()
        elif self.debug_checks:
            self.check_integrity()
        self._was_idle = idle

    def check_integrity(self) -> None:
        """The cache's slot accounting, counting the slots running requests own (between steps)."""
        chunked = self.prefill.chunked_req
        self.cache.check_integrity(self.decode.running + ([chunked] if chunked is not None else []))

    def _next_batch(self) -> ScheduleBatch | None:
        running = self.decode.running
        batch = self.prefill.schedule(running, self.decode.new_token_ratio.value, self.metrics.num_steps)
        if batch is not None:
            if self.enable_mixed_chunk and running:
                decode = self._decode_batch(mixed=True)
                if decode is not None:
                    batch.mix_with(decode)
                    self.metrics.num_mixed_steps += 1
            return batch
        if running:
            return self._decode_batch(mixed=False)
        return None

    def _decode_batch(self, mixed: bool) -> ScheduleBatch | None:
        """The decode batch of the running requests, retracting some if KV runs short.

        In a MIXED step (``mixed``) the prefill part is already allocated: if the decodes still
        cannot get slots they sit this step out (None). Otherwise the request mid-prompt is
        retracted too (it holds what the last decode needs) before giving up."""
        decode = self.decode
        if not decode.has_room():
            victims = decode.retract_for_room()
            self._requeue(victims)
            if victims:
                self.metrics.log_retract(
                    len(victims), len(decode.running), len(self.waiting_queue), decode.new_token_ratio.value
                )
            if not decode.has_room():
                if mixed:
                    return None
                chunked = self.prefill.take_chunked()
                if chunked is not None:
                    decode.retract(chunked)
                    self._requeue([chunked])
                    decode.new_token_ratio.on_retract()
                if not decode.has_room():
                    raise KVAllocationError(
                        f"cannot decode {len(decode.running)} request(s): "
                        f"{self.cache.available()} KV slots obtainable"
                    )
        return decode.prepare_batch(len(self.waiting_queue))

    def token_usage(self) -> float:
        return self.cache.token_usage()

    # ================================================================== control
    def flush_cache(self) -> FlushCacheReqOutput:
        """Drop the prefix cache (only when idle); afterwards every KV slot and request row is free."""
        if not self.is_idle():
            return FlushCacheReqOutput(
                success=False,
                message=f"Cache not flushed: {len(self.running) + (self.chunked_req is not None)} running and "
                f"{len(self.waiting_queue)} waiting requests.",
            )
        message = self.cache.flush()
        self.decode.new_token_ratio.reset()
        return FlushCacheReqOutput(success=True, message=message)

    def _update_weights(self) -> UpdateWeightsFromDiskReqOutput:
        """Run the pending weight update (the scheduler is idle): reload through the model runner,
        flush the prefix cache (KV of the old weights), then admit the requests held meanwhile."""
        req, held = self.weight_gate.take()
        ok, message = self.model_runner.update_weights_from_disk(req.model_path, req.load_format)
        if ok:
            flushed = self.flush_cache()
            assert flushed.success, flushed.message
            self.check_integrity()
        logger.log(logging.INFO if ok else logging.WARNING, "weight update: %s", message)
        for msg in held:
            self._add_request(msg)
        return UpdateWeightsFromDiskReqOutput(success=ok, message=message)

    def get_internal_state(self) -> dict[str, Any]:
        """Queue and memory state plus every counter of ``SchedulerMetrics`` (plain values)."""
        return {
            "num_running_reqs": len(self.running) + (self.chunked_req is not None),
            # held behind a pending weight update count as queued
            "num_queued_reqs": len(self.waiting_queue) + len(self.weight_gate.held),
            "token_usage": self.token_usage(),
            "max_total_num_tokens": self.max_total_num_tokens,
            "max_running_requests": self.max_running_requests,
            "available_size": self.allocator.available_size(),
            "evictable_size": self.cache.evictable_size(),
            "protected_size": self.cache.protected_size(),
            # request rows free / in all (rows and locks back to idle: benchmarks/soak.py checks)
            "free_req_rows": self.cache.free_rows(),
            "req_rows": self.req_to_token_pool.size,
            "new_token_ratio": self.decode.new_token_ratio.value,
            "page_size": self.page_size,
            "context_len": self.context_len,
            "schedule_policy": self.policy.policy,
            "radix_cache": not self.server_args.disable_radix_cache,
            "quantization": self.server_args.quantization,
            # the loaded weights (quantized blocks as stored) and this process's resident memory
            "weight_bytes": getattr(self.model_runner, "weight_bytes", None),
            "profiling": self.profiler.active,
            "scheduler_rss_bytes": process_rss_bytes(),
            **self.metrics.snapshot(),
            "num_timeouts": self.deadlines.num_timeouts,
            "num_queue_time_refusals": self.deadlines.num_queue_refusals,
            "step_histograms": self.step_timings.snapshot(),
        }

    def ready_message(self) -> SchedulerReady:
        return SchedulerReady(
            max_total_num_tokens=self.max_total_num_tokens,
            max_running_requests=self.max_running_requests,
            max_req_input_len=self.max_req_input_len,
            context_len=self.context_len,
            page_size=self.page_size,
        )

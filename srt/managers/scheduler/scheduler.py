"""The ``Scheduler``: receives requests, runs one step at a time, sends the results.

It only wires the parts together (the parts are listed in the package's docstring).

Messages are dispatched by type through one table (``handle_message``).

One iteration (``step``)::

    prefill.schedule (request mid-prompt first, then the queue in policy order)
        batch -> EXTEND, or MIXED (+ decode.prepare_batch of every running request) with
                 --enable-mixed-chunk
        none  -> DECODE batch of the running requests (decode.retract_for_room if KV runs short)
    -> launch: model_runner.forward_batch_generation (worker.launch)
    -> complete: output.process_batch_result (append tokens, finish, hand KV to the prefix
       cache) -> decode.merge (finished out, new decodes in)
    -> output.build_batch_output: one BatchTokenIDOut for every request that produced tokens
       or finished; the integrity check when the scheduler goes idle

With overlap scheduling (overlap.py) the batch launched in a step completes in the next one,
after that step launched its own batch: the forward runs while the scheduler does the rest.

In-process API (tests, benchmarks): ``handle_message(msg)`` for every ``SchedulerInput``,
``step()``, ``take_replies()`` (replies to control requests answered by a step: a deferred weight
update, a LoRA adapter read beside the forwards), ``is_idle()``, ``run_until_idle()``, ``flush_cache()``, ``get_internal_state()``,
``check_integrity()``, ``ready_message()``.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from srt.managers.io_struct import (
    AbortReq,
    BatchTokenIDOut,
    ControlReply,
    FlushCacheReqOutput,
    SchedulerInput,
    SchedulerReady,
    StopStringHit,
    TokenizedGenerateReqInput,
)
from srt.managers.scheduler import control
from srt.managers.scheduler.cache import CacheManager
from srt.managers.scheduler.deadlines import DeadlineTracker
from srt.managers.scheduler.decode import DecodeManager
from srt.managers.scheduler.decode_batch import decode_batch
from srt.managers.scheduler.decode_policy import NewTokenRatio
from srt.managers.scheduler.metrics import SchedulerMetrics
from srt.managers.scheduler.output import build_batch_output, process_batch_result
from srt.managers.scheduler.overlap import InFlight, needs_sync
from srt.managers.scheduler.prefill import PrefillManager
from srt.managers.scheduler.profiler import SchedulerProfiler
from srt.managers.scheduler.req import Req
from srt.managers.scheduler.requests import ModelLimits, RequestTable
from srt.managers.scheduler.schedule_batch import SamplingInfoCache, ScheduleBatch
from srt.managers.scheduler.schedule_policy import SchedulePolicy
from srt.managers.scheduler.setup import (
    create_grammars,
    create_prefill_config,
    start_model_runner,
    wire_lora_slots,
)
from srt.managers.scheduler.speculative import SpeculativeDecoder
from srt.managers.scheduler.step_timing import StepTimings, StepTrace, step_work
from srt.managers.scheduler.weight_update import WeightUpdateGate
from srt.utils.fault import FaultHook

if TYPE_CHECKING:
    from srt.managers.scheduler.heartbeat import SchedulerHeartbeat
    from srt.managers.scheduler.runner_protocol import SchedulerModelRunner
    from srt.managers.scheduler.waiting_queue import WaitingQueue
    from srt.mem_cache.allocator import TokenToKVPoolAllocator
    from srt.mem_cache.base_prefix_cache import BasePrefixCache
    from srt.mem_cache.memory_pool import ReqToTokenPool
    from srt.server_args import ServerArgs

logger = logging.getLogger("srt.scheduler")

# with nothing to run but requests waiting for their grammars, a step waits this long for one
GRAMMAR_WAIT_SECONDS = 0.005
# the messages handled without completing the batch in flight first (overlap scheduling)
_NO_SYNC_MESSAGES = (TokenizedGenerateReqInput, AbortReq, StopStringHit)


class Scheduler:
    """See the module docstring. ``server_args`` must be resolved; ``model_runner`` defaults to
    a ``ModelRunner(server_args, tp_rank=tp_rank)`` (tests and benchmarks pass their own). With
    ``--tp-size`` > 1 every rank builds one and they must stay in lock step (tp_process.py).
    ``forward_thread_init``: run once on the forward worker thread with overlap scheduling (the
    compute-thread setup of the process; default: torch's thread count of the calling thread)."""

    step_trace: StepTrace | None = None  # --step-trace-path (set by process.py, tp_process.py)

    def __init__(
        self,
        server_args: ServerArgs,
        model_runner: SchedulerModelRunner | None = None,
        tp_rank: int = 0,
        forward_thread_init: Callable[[], None] | None = None,
    ) -> None:
        self.server_args = server_args
        self.tp_rank = tp_rank
        # the forwards (and the model load) run through the worker: on a thread of its own with
        # overlap scheduling (overlap.py)
        self.worker, runner = start_model_runner(server_args, model_runner, tp_rank, forward_thread_init)
        self.model_runner, self.overlap = runner, self.worker.threaded
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
        prefill_config = create_prefill_config(server_args, self.max_running_requests)
        self.policy = SchedulePolicy(server_args.schedule_policy)
        self.prefill = PrefillManager(self.cache, self.policy, self.metrics, prefill_config)
        self.sampling_cache = SamplingInfoCache()
        self.grammars = create_grammars(server_args, self.vocab_size, self.eos_token_ids)
        self.enable_mixed_chunk = server_args.enable_mixed_chunk
        self.spec = SpeculativeDecoder.from_server_args(server_args, pool.max_context_len, self.metrics)
        self.debug_checks = server_args.enable_debug_checks
        self.profiler = SchedulerProfiler(self.device)
        self.weight_gate = WeightUpdateGate()
        self.deadlines = DeadlineTracker(server_args.max_queue_time)
        limits = ModelLimits(
            self.context_len, self.max_total_num_tokens, self.page_size, self.vocab_size, self.eos_token_ids
        )
        parts = (self.cache, self.prefill, self.decode, self.grammars, self.deadlines, self.metrics)
        self.requests = RequestTable(limits, *parts, random.Random(server_args.random_seed))
        self.lora = wire_lora_slots(server_args, runner, self.cache, self.prefill, self.requests)
        # the deadlines' time.time() when set: TP ranks use rank 0's (broadcast with the inputs)
        self.step_clock: float | None = None
        self.step_timings = StepTimings()
        self._replies: list[ControlReply] = []  # answered by a step (take_replies)
        self._handlers = control.message_handlers(self)
        self._was_idle = True
        # hang watchdog: progress published each step (set by process.py); test-only fault hook
        self.heartbeat: SchedulerHeartbeat | None = None
        self.fault = FaultHook.from_env()
        # at most one batch in flight; outputs of a batch completed out of turn (before a
        # control message) go out with the next step
        self._in_flight: InFlight | None = None
        self._completed_outs: list[BatchTokenIDOut] = []

    # the parts' state, read by tests and benchmarks
    @property
    def waiting_queue(self) -> WaitingQueue:
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

    @property
    def in_flight(self) -> InFlight | None:
        """The batch launched and not completed yet (overlap scheduling)."""
        return self._in_flight

    @property
    def reqs_by_rid(self) -> dict[str, Req]:
        return self.requests.reqs_by_rid

    # ================================================================== messages
    def handle_message(self, msg: SchedulerInput) -> list[ControlReply]:
        """Apply one input message (control.py's table); returns the replies to send now (control
        requests; a weight update that must wait for idle is answered later through
        ``take_replies``). A control request first completes the batch in flight (overlap
        scheduling); a new request, an abort or a stop string does not: a request finished now
        gets no token from the batch in flight (its row there is discarded), as without overlap."""
        handler = self._handlers.get(type(msg))
        if handler is None:
            logger.warning("ignoring unknown message %r", type(msg).__name__)
            return []
        if type(msg) not in _NO_SYNC_MESSAGES:
            self.complete_in_flight()
        return handler(msg)

    def abort_request(self, rid: str, message: str = "aborted", status_code: int | None = None) -> None:
        """Abort a request in any state ("" aborts every request); unknown rids are ignored."""
        self.requests.abort(rid, message, status_code)

    # ================================================================== one iteration
    def is_idle(self) -> bool:
        loading = self.lora is not None and self.lora.loading  # its reply is sent by a step
        return not (
            self.holds_requests() or self.requests.finished_outside or self._completed_outs or loading
        )

    def holds_requests(self) -> bool:
        """A request is waiting, prefilling, decoding, compiling its grammar or in a batch in flight
        (what may hold KV slots); finished requests waiting to be reported do not count."""
        return bool(
            self.prefill.has_work()
            or self.decode.running
            or (self.grammars is not None and self.grammars.pending)
            or self._in_flight is not None
        )

    def step(self) -> list[BatchTokenIDOut]:
        """One scheduler iteration: form a batch, launch it, complete the batch launched before
        (overlap scheduling) or this one (module docstring).

        Returns the step's output (BatchTokenIDOut: at most one, plus any of a batch completed
        before a control message)."""
        step_start = time.perf_counter()
        self.metrics.num_steps += 1
        self.requests.expire_deadlines(self.step_clock)
        prev = self._in_flight
        if prev is not None and needs_sync(prev):
            self.complete_in_flight()
            prev = None
        # nothing else to do: wait (briefly, so that new messages are still read) for a grammar
        busy = self.prefill.has_work() or self.decode.running or self.requests.finished_outside
        self.requests.admit_grammar_requests(0.0 if busy else GRAMMAR_WAIT_SECONDS)
        batch = self._next_batch()
        if self._in_flight is None:  # completed while forming the batch (a retraction)
            prev = None
        if self.heartbeat is not None:
            self.heartbeat.on_step(self, batch)
        touched = self.requests.take_touched()  # aborted, rejected, retracted too often
        launched = self._launch(batch, step_start) if batch is not None else None
        if prev is not None:  # overlap: complete the batch before while this one runs
            self.metrics.num_overlapped_steps += launched is not None
            touched = touched + self._complete(prev)
        if launched is not None and not self.overlap:
            touched = touched + self._complete(launched)
            launched = None
        self._in_flight = launched
        out = build_batch_output(touched, self.server_args.stream_interval)
        self.requests.forget_reported()
        self._after_step()
        # outputs of batches completed out of turn come first (they hold earlier tokens)
        outs = self.take_outputs()
        if out is not None:
            outs.append(out)
        return outs

    def _launch(self, batch: ScheduleBatch, step_start: float) -> InFlight:
        """Build ``batch``'s ForwardBatch (grammar masks included) and start its forward
        (``step_start``: when the step launching it began, for the step timings)."""
        self.fault.before_forward()  # test-only (SRT_TEST_FAULT): may stall this step's forward
        fb = batch.get_forward_batch(self.device, self.vocab_size, self.eos_token_ids, self.sampling_cache)
        # (a batch without constrained requests builds no row list: this runs every step)
        if self.grammars is not None and any(r.grammar is not None for r in batch.reqs):
            masks = self.grammars.fill_masks(batch.reqs, batch.sampling_rows(), self.vocab_size)
            if masks is not None:
                fb.sampling_info = fb.sampling_info.with_grammar_masks(*masks)
        return self.worker.launch(batch, fb, step_start)

    def _complete(self, in_flight: InFlight) -> list[Req]:
        """Wait for ``in_flight``'s forward and apply its results; returns the requests whose
        rows were applied (to report). The step timings get one entry per batch: from the start
        of the step that launched it to its results applied, of which its forward."""
        res, batch, release = in_flight.wait(), in_flight.batch, self.requests.release
        work = step_work(batch.prefix_lens, batch.extend_lens) if self.step_trace is not None else None
        self.cache.begin_free_group()
        try:
            if batch.verify is not None and self.spec is not None:  # speculative (speculative.py)
                result = self.spec.process_result(batch, res.sample_output, self.cache, release)
            else:
                out, sample = res.logits_output, res.sample_output
                result = process_batch_result(batch, out, sample, self.cache, release, self.overlap)
        finally:
            self.cache.end_free_group()
        self.metrics.on_generated(result.num_generated)
        self.decode.merge(result.new_decoding, result.decode_finished)
        step_s = time.perf_counter() - in_flight.step_start
        self.step_timings.observe(step_s, res.forward_seconds)
        if work is not None:
            mode = batch.forward_mode.name.lower()
            self.step_trace.record(in_flight.step_start, step_s, res.forward_seconds, mode, work)
        return result.reqs

    def take_outputs(self) -> list[BatchTokenIDOut]:
        """The outputs of batches completed out of turn (``complete_in_flight``) that no step
        returned yet; the next step returns them otherwise."""
        outs, self._completed_outs = self._completed_outs, []
        return outs

    def complete_in_flight(self) -> None:
        """Complete the batch in flight now, if any (before a control message, a retraction, or
        a batch that needs its tokens on the host); its output goes out with the next step."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return
        out = build_batch_output(self._complete(in_flight), self.server_args.stream_interval)
        self.requests.forget_reported()
        if out is not None:
            self._completed_outs.append(out)

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
            self._replies.append(control.update_weights(self))
        if self.lora is not None:
            self._replies += self.lora.poll()
        idle = self.is_idle()
        if idle and not self._was_idle:
            self.cache.check_idle()
        elif self.debug_checks:
            self.check_integrity()
        self._was_idle = idle

    def check_integrity(self) -> None:
        """The cache's slot accounting, counting the slots running requests own (between steps)."""
        chunked = self.prefill.chunked_req
        holders = self.decode.running + ([chunked] if chunked is not None else [])
        if self._in_flight is not None:  # the extends in flight join the running batch later
            held = {id(r) for r in holders}
            holders += [
                r for r in self._in_flight.batch.reqs if id(r) not in held and r.req_pool_idx is not None
            ]
        self.cache.check_integrity(holders)

    def _next_batch(self) -> ScheduleBatch | None:
        running = self.decode.running
        batch = self.prefill.schedule(running, self.decode.new_token_ratio.value, self.metrics.num_steps)
        if batch is not None:
            if self.enable_mixed_chunk and running:
                decode = decode_batch(self, mixed=True)
                if decode is not None:
                    batch.mix_with(decode)
                    self.metrics.num_mixed_steps += 1
            return batch
        if running:
            return decode_batch(self, mixed=False)
        return None

    def token_usage(self) -> float:
        return self.cache.token_usage()

    # ================================================================== control (control.py)
    def flush_cache(self) -> FlushCacheReqOutput:
        self.complete_in_flight()
        return control.flush_cache(self)

    def get_internal_state(self) -> dict[str, Any]:
        return control.internal_state(self)

    def ready_message(self) -> SchedulerReady:
        return control.ready_message(self)

"""The scheduler's input messages: the table that says what applies each type
(``message_handlers``), and the control requests: flush the prefix cache, reload weights, report
its state and its capacity. Functions of the `Scheduler` (they read several of its parts); the
loop dispatches the messages through ``Scheduler.handle_message``."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from srt.managers.io_struct import (
    AbortReq,
    ControlReply,
    FinishReason,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    LoadLoRAAdapterReq,
    LoRAAdapterReqOutput,
    ProfileReq,
    SchedulerReady,
    StopStringHit,
    TokenizedGenerateReqInput,
    UnloadLoRAAdapterReq,
    UpdateWeightsFromDiskReq,
    UpdateWeightsFromDiskReqOutput,
)
from srt.mem_cache.pool_size import process_rss_bytes

if TYPE_CHECKING:
    from srt.managers.scheduler.cache import CacheManager
    from srt.managers.scheduler.deadlines import DeadlineTracker
    from srt.managers.scheduler.decode import DecodeManager
    from srt.managers.scheduler.lora_slots import LoRASlots
    from srt.managers.scheduler.metrics import SchedulerMetrics
    from srt.managers.scheduler.overlap import ForwardWorker
    from srt.managers.scheduler.profiler import SchedulerProfiler
    from srt.managers.scheduler.req import Req
    from srt.managers.scheduler.requests import RequestTable
    from srt.managers.scheduler.schedule_policy import SchedulePolicy
    from srt.managers.scheduler.step_timing import StepTimings
    from srt.managers.scheduler.waiting_queue import WaitingQueue
    from srt.managers.scheduler.weight_update import WeightUpdateGate
    from srt.server_args import ServerArgs

logger = logging.getLogger("srt.scheduler")


class Scheduler(Protocol):
    """What the control requests read and drive of the ``Scheduler`` (which imports this module)."""

    server_args: ServerArgs
    model_runner: Any
    cache: CacheManager
    decode: DecodeManager
    requests: RequestTable
    weight_gate: WeightUpdateGate
    lora: LoRASlots | None
    metrics: SchedulerMetrics
    deadlines: DeadlineTracker
    profiler: SchedulerProfiler
    policy: SchedulePolicy
    step_timings: StepTimings
    worker: ForwardWorker
    step_clock: float | None
    max_total_num_tokens: int
    max_running_requests: int
    max_req_input_len: int
    context_len: int
    page_size: int

    @property
    def running(self) -> list[Req]: ...
    @property
    def chunked_req(self) -> Req | None: ...
    @property
    def waiting_queue(self) -> WaitingQueue: ...
    @property
    def allocator(self) -> Any: ...
    @property
    def req_to_token_pool(self) -> Any: ...
    def is_idle(self) -> bool: ...
    def holds_requests(self) -> bool: ...
    def check_integrity(self) -> None: ...
    def token_usage(self) -> float: ...
    def flush_cache(self) -> FlushCacheReqOutput: ...
    def get_internal_state(self) -> dict[str, Any]: ...
    def abort_request(self, rid: str, message: str = "aborted", status_code: int | None = None) -> None: ...


def message_handlers(s: Scheduler) -> dict[type, Callable[[Any], list[ControlReply]]]:
    """Each input message type -> what applies it (returning the replies to send now)."""

    def generate(msg: TokenizedGenerateReqInput) -> list[ControlReply]:
        if not s.weight_gate.hold(msg):
            s.requests.add(msg, s.step_clock)
        return []

    def abort(msg: AbortReq) -> list[ControlReply]:
        s.weight_gate.drop(msg.rid)
        s.abort_request(msg.rid, msg.message, msg.status_code)
        return []

    def stop_string(msg: StopStringHit) -> list[ControlReply]:
        s.requests.finish_between_steps(msg.rid, FinishReason.of_stop(msg.matched))
        return []

    def weights(msg: UpdateWeightsFromDiskReq) -> list[ControlReply]:
        refused = s.weight_gate.submit(msg)
        if refused is not None:
            return [refused]
        return [update_weights(s)] if s.is_idle() else []

    def load_lora(msg: LoadLoRAAdapterReq) -> list[ControlReply]:
        if s.lora is None:
            return [LoRAAdapterReqOutput(success=False, message="LoRA adapters need --enable-lora")]
        return list(s.lora.load(msg, s.is_idle()))

    def unload_lora(msg: UnloadLoRAAdapterReq) -> list[ControlReply]:
        if s.lora is None:
            return [LoRAAdapterReqOutput(success=False, message="LoRA adapters need --enable-lora")]
        users = s.requests.users_of_adapter(msg.lora_name)
        users += sum(1 for m in s.weight_gate.held if m.lora_name == msg.lora_name)
        return [s.lora.unload(msg, users, s.cache.tree_cache)]

    return {
        TokenizedGenerateReqInput: generate,
        AbortReq: abort,
        StopStringHit: stop_string,
        FlushCacheReq: lambda msg: [s.flush_cache()],
        GetInternalStateReq: lambda msg: [GetInternalStateReqOutput(state=s.get_internal_state())],
        ProfileReq: lambda msg: [s.profiler.handle(msg)],
        UpdateWeightsFromDiskReq: weights,
        LoadLoRAAdapterReq: load_lora,
        UnloadLoRAAdapterReq: unload_lora,
    }


def flush_cache(s: Scheduler) -> FlushCacheReqOutput:
    """Drop the prefix cache (only when no request is waiting or running; finished ones not yet
    reported hold nothing); afterwards every KV slot and request row is free."""
    if s.holds_requests():
        return FlushCacheReqOutput(
            success=False,
            message=f"Cache not flushed: {len(s.running) + (s.chunked_req is not None)} running and "
            f"{len(s.waiting_queue)} waiting requests.",
        )
    message = s.cache.flush()
    s.decode.new_token_ratio.reset()
    return FlushCacheReqOutput(success=True, message=message)


def update_weights(s: Scheduler) -> UpdateWeightsFromDiskReqOutput:
    """Run the pending weight update (the scheduler is idle): reload through the model runner
    where the forwards run (the forward worker's thread with overlap scheduling), flush the
    prefix cache (KV of the old weights), then admit the requests held meanwhile."""
    req, held = s.weight_gate.take()
    ok, message = s.worker.call(s.model_runner.update_weights_from_disk, req.model_path, req.load_format)
    if ok:
        flushed = flush_cache(s)
        assert flushed.success, flushed.message
        s.check_integrity()
    logger.log(logging.INFO if ok else logging.WARNING, "weight update: %s", message)
    for msg in held:
        s.requests.add(msg, s.step_clock)
    return UpdateWeightsFromDiskReqOutput(success=ok, message=message)


def internal_state(s: Scheduler) -> dict[str, Any]:
    """Queue and memory state plus every counter of ``SchedulerMetrics`` (plain values)."""
    return {
        "num_running_reqs": len(s.running) + (s.chunked_req is not None),
        # held behind a pending weight update count as queued
        "num_queued_reqs": len(s.waiting_queue) + len(s.weight_gate.held),
        "token_usage": s.token_usage(),
        "max_total_num_tokens": s.max_total_num_tokens,
        "max_running_requests": s.max_running_requests,
        "available_size": s.allocator.available_size(),
        "evictable_size": s.cache.evictable_size(),
        "protected_size": s.cache.protected_size(),
        # request rows free / in all (rows and locks back to idle: benchmarks/soak.py checks)
        "free_req_rows": s.cache.free_rows(),
        "req_rows": s.req_to_token_pool.size,
        "new_token_ratio": s.decode.new_token_ratio.value,
        "page_size": s.page_size,
        "context_len": s.context_len,
        "schedule_policy": s.policy.policy,
        "radix_cache": not s.server_args.disable_radix_cache,
        "overlap_schedule": s.overlap,
        "quantization": s.server_args.quantization,
        # the loaded weights (quantized blocks as stored) and this process's resident memory
        "weight_bytes": getattr(s.model_runner, "weight_bytes", None),
        # of those, the quantized weights' float32 copies (--gguf-float32-rows), 0 without
        "float32_copy_bytes": getattr(s.model_runner, "float32_copy_bytes", None),
        "kv_pool_bytes": _kv_pool_bytes(s.model_runner),
        "vocab_size": s.vocab_size,
        "profiling": s.profiler.active,
        "scheduler_rss_bytes": process_rss_bytes(),
        **s.metrics.snapshot(),
        "num_timeouts": s.deadlines.num_timeouts,
        "num_queue_time_refusals": s.deadlines.num_queue_refusals,
        "step_histograms": s.step_timings.snapshot(),
        **(s.lora.state() if s.lora is not None else {}),
    }


def _kv_pool_bytes(runner) -> int | None:
    """Bytes of the runner's K and V buffers (None for a runner without a KV pool of its own)."""
    pool = getattr(runner, "token_to_kv_pool", None)
    return pool.mem_bytes() if pool is not None else None


def ready_message(s: Scheduler) -> SchedulerReady:
    """What the scheduler reports once loaded: its capacity figures."""
    return SchedulerReady(
        max_total_num_tokens=s.max_total_num_tokens,
        max_running_requests=s.max_running_requests,
        max_req_input_len=s.max_req_input_len,
        context_len=s.context_len,
        page_size=s.page_size,
    )

"""Overlap scheduling: the forward of one batch runs on a worker thread while the scheduler
processes the previous batch's results and prepares the next one (``--enable-overlap-schedule``).

At most one batch is in flight. One step of the scheduler with overlap::

    form batch N+1            (its decode rows may not know their input token yet)
    launch N+1                (queued behind N on the worker thread)
    complete N                (wait for its forward; append tokens, finish, release; output)

A decode row whose previous token is still being sampled (its request is a decode row of the
batch in flight) gets the input id ``-(req_pool_idx + 1)``: a reference into the **future
map**, one int64 per request row, that the worker fills with the sampled ids after each DECODE
forward and reads, before the next forward, in place of every negative input id
(``resolve_future_ids``). Forwards run strictly in order on one thread, so a reference is
always filled before it is read, and nothing on the host waits for it.

What the one-step lag changes, and how each case stays exact:

- **Positions and KV slots** come from ``kv_allocated_len`` (which counts the slot of the token in
  flight), not ``kv_committed_len``; the sampling noise position of a row counts its token in
  flight too, so seeded sampling draws what it draws without overlap.
- **Finishes** are known one step late. A request that reaches ``max_new_tokens`` with its token
  in flight is left out of the next batch (that finish is certain); one that stops on EOS or a
  stop token already has a row in the next batch: that row's token is discarded when the batch
  completes (the request is FINISHED by then, its KV, the extra slot included, released).
- **Anything that needs the in-flight token on the host** makes the step complete the batch in
  flight first (``needs_sync``): an EXTEND or MIXED batch in flight (prompt chunks, the prefix
  cache), a request with a grammar (its token mask) or per-step logit edits (penalties,
  min_new_tokens), and any retraction. Control requests (flush, weight update, internal
  state, profiling) also complete the batch in flight before they are handled.
- **Memory a running forward reads is never handed out.** The live rows of the batch in flight
  hold their request rows and KV slots. A row whose request finished meanwhile (a stop, a
  deadline, an abort, a stop string) gave its row and slots back to the free lists, so the next
  batch is only formed (allocating, evicting) once that batch completed: a released request in
  the batch in flight is another reason for ``needs_sync``. Its row's token is discarded: a
  request aborted or stopped between steps reports no token sampled after that, as without
  overlap.

Without overlap the same code runs with the worker inline: launch, then complete at once.

On CUDA the worker runs its forwards on a stream of its own (``ForwardWorker.attach``), which
first waits for the work the scheduler queued on the default stream (the next batch's inputs and
slot writes), so the scheduler's copies to the device never queue behind a running forward. The
sampled ids (and their logprobs) are copied to pinned host memory behind an event on that
stream; the worker thread waits for the event, so a completed batch holds host tensors and the
scheduler thread never synchronises with the device.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from srt.layers.forward_batch import ForwardMode
from srt.managers.scheduler.schedule_batch import ScheduleBatch, future_ref

T = TypeVar("T")

__all__ = ["ForwardWorker", "InFlight", "future_ref", "needs_sync", "resolve_future_ids", "same_thread_count"]

if TYPE_CHECKING:
    from srt.layers.forward_batch import ForwardBatch
    from srt.managers.scheduler.runner_protocol import LogitsResult, SampleResult, SchedulerModelRunner


def resolve_future_ids(input_ids: torch.Tensor, future_ids: torch.Tensor) -> torch.Tensor:
    """``input_ids`` with every future reference replaced by the id the future map holds
    (no host synchronisation: the selection is done on the device)."""
    rows = (-input_ids - 1).clamp_(min=0)
    return torch.where(input_ids < 0, future_ids[rows], input_ids)


@dataclass(slots=True)
class ForwardResult:
    logits_output: LogitsResult
    sample_output: SampleResult
    forward_seconds: float


@dataclass(slots=True)
class InFlight:
    """A launched batch: its scheduler-side batch and the forward's pending result."""

    batch: ScheduleBatch
    future: concurrent.futures.Future[ForwardResult]
    step_start: float  # perf_counter() when the step that launched it began

    def wait(self) -> ForwardResult:
        return self.future.result()


def same_thread_count(num_threads: int) -> Callable[[], None]:
    """A worker-thread setup giving the worker torch's thread count ``num_threads``."""
    return lambda: torch.set_num_threads(num_threads)


def needs_sync(in_flight: InFlight) -> bool:
    """Whether the next batch may only be formed once ``in_flight`` completed (module docstring)."""
    batch = in_flight.batch
    if batch.forward_mode != ForwardMode.DECODE:
        return True
    return not all(
        [r.static_sampling and r.grammar is None and r.finished_reason is None for r in batch.reqs]
    )


class ForwardWorker:
    """Runs the model runner's forwards in launch order and keeps the future map.

    ``threaded``: on one worker thread (overlap); otherwise inline in ``launch`` (the returned
    future is already done). ``thread_init`` runs once on the worker thread before its first
    task (the compute-thread setup: torch's thread count, CPU pinning). The runner is attached
    once it exists (``attach``); ``call`` runs a function where the forwards run, so that the
    model can be loaded there too: libgomp keeps one pool of compute threads per thread that
    starts a parallel region, and a second pool slows every parallel region of the process
    (srt/utils/torch_threads.py), so with overlap all of the model's work stays on the worker."""

    def __init__(self, threaded: bool, thread_init: Callable[[], None] | None = None) -> None:
        self.threaded = threaded
        self.runner: SchedulerModelRunner | None = None
        self.future_ids = torch.zeros(0, dtype=torch.int64)
        self.stream: Any = None  # the forwards' CUDA stream (threaded, on CUDA)
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        if threaded:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="srt-forward", initializer=thread_init
            )

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the worker thread (inline without one); waits for the result."""
        if self._executor is None:
            return fn(*args)
        return self._executor.submit(fn, *args).result()

    def attach(self, runner: SchedulerModelRunner) -> None:
        """The runner the forwards go to; the future map gets one entry per request row."""
        self.runner = runner
        pool = runner.req_to_token_pool
        device = pool.req_to_token.device
        self.future_ids = torch.zeros(pool.size, dtype=torch.int64, device=device)
        if self.threaded and device.type == "cuda":
            self.stream = torch.cuda.Stream(device)

    def launch(self, batch: ScheduleBatch, forward_batch: ForwardBatch, step_start: float) -> InFlight:
        """Start the forward of ``batch`` (its ``forward_batch`` built on the caller's thread)."""
        resolve = batch.has_future_refs
        publish = (
            batch.req_pool_indices_t if self.threaded and batch.forward_mode == ForwardMode.DECODE else None
        )
        if self._executor is None:
            future: concurrent.futures.Future[ForwardResult] = concurrent.futures.Future()
            future.set_result(self._run(forward_batch, resolve, publish))
        else:
            future = self._executor.submit(self._run, forward_batch, resolve, publish)
        return InFlight(batch, future, step_start)

    def _run(self, fb: ForwardBatch, resolve: bool, publish: torch.Tensor | None) -> ForwardResult:
        start = time.perf_counter()
        with self._on_stream():
            if resolve:
                fb.input_ids = resolve_future_ids(fb.input_ids, self.future_ids)
            assert self.runner is not None, "ForwardWorker.attach was not called"
            logits_output, sample_output = self.runner.forward_batch_generation(fb)
            if publish is not None:
                self.future_ids[publish.to(self.future_ids.device)] = sample_output.next_token_ids.to(
                    self.future_ids.device
                )
            if self.stream is not None:
                sample_output = self._sampled_to_host(sample_output)
        return ForwardResult(logits_output, sample_output, time.perf_counter() - start)

    def _on_stream(self) -> contextlib.AbstractContextManager:
        """The forwards' stream as this thread's current one, after the default stream's work."""
        if self.stream is None:
            return contextlib.nullcontext()
        self.stream.wait_stream(torch.cuda.default_stream(self.stream.device))
        return torch.cuda.stream(self.stream)

    def _sampled_to_host(self, out: SampleResult) -> SampleResult:
        """``out`` with its tensors copied to pinned host memory; returns once the stream reached
        the copies (everything the forward wrote is then done)."""
        if not dataclasses.is_dataclass(out):  # not the sampler's output: only wait for the stream
            self.stream.synchronize()
            return out
        ids = _pinned_copy(out.next_token_ids)
        lps = None if out.next_token_logprobs is None else _pinned_copy(out.next_token_logprobs)
        done = torch.cuda.Event()
        done.record(self.stream)
        done.synchronize()
        return dataclasses.replace(out, next_token_ids=ids, next_token_logprobs=lps)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)

"""The tokenizer manager's request-state registry: one `ReqState` per rid in flight.

A `ReqState` accumulates the ``BatchStrOut`` entries of one rid (text pieces, token ids,
logprobs, counts). Its `RequestGroup` (every rid of one user request: a batch of prompts times
``n``, plus the prefill-only warm-ups) shares one ``asyncio.Event``, set whenever any of its
states changes; the consumer clears it and then reads every state, so no update is lost and a
lagging consumer gets merged chunks (`srt.managers.tokenizer.req_output` builds the output dicts).

`ReqRegistry` owns the ``rid -> ReqState`` map of every request sent and not finished, the
*waiting* set (sent, no output yet) that ``--max-queued-requests`` admission counts, the recent
completion times that give a `QueueFullError` its Retry-After, the per-request metrics, and
fail-all when the engine dies. It never touches a socket: the tokenizer manager sends.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from dataclasses import dataclass, field

from srt.managers.io_struct import BatchStrOut, FinishReason, TokenizedGenerateReqInput
from srt.managers.tokenizer.metrics import TokenizerMetrics
from srt.utils.errors import QueueFullError

logger = logging.getLogger(__name__)

_RATE_WINDOW_S = 60.0  # completions older than this do not count towards the Retry-After rate


@dataclass(slots=True, eq=False)
class RequestGroup:
    """Every rid of one user request, sharing one wake-up event."""

    event: asyncio.Event = field(default_factory=asyncio.Event)
    states: list[ReqState] = field(default_factory=list)  # the outputs, in index order
    warmups: list[ReqState] = field(default_factory=list)  # prefill-only requests sent first (n > 1)
    stream: bool = False


@dataclass(slots=True, eq=False)
class ReqState:
    """What arrived so far for one rid (cumulative), plus the streaming cursors."""

    req: TokenizedGenerateReqInput
    index: int  # the output index within the user request (-1 for a warm-up)
    parent_rid: str  # the rid the user gave (== req.rid unless n > 1 or batch suffixes)
    group: RequestGroup
    is_warmup: bool = False
    created: float = field(default_factory=time.perf_counter)
    text_parts: list[str] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    abort_label: str | None = None  # metrics label when aborted locally
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    spec_verify_ct: int = 0  # speculative decoding: decode steps, and the tokens they produced
    spec_tokens: int = 0
    # logprobs of output positions logprobs_from ... (an incremental stream drops those it sent)
    out_logprobs: list[float] = field(default_factory=list)
    out_top: list[list[tuple[int, float]]] = field(default_factory=list)
    logprobs_from: int = 0
    in_logprobs: list[float | None] = field(default_factory=list)
    in_top: list[list[tuple[int, float]] | None] = field(default_factory=list)
    first_token_time: float = 0.0
    last_token_time: float = 0.0
    # phase timings reported by the scheduler (seconds; None until known, see req_output)
    queue_time: float | None = None
    prefill_time: float | None = None
    decode_time: float | None = None
    finish_time: float = 0.0  # perf_counter() when it finished here
    # streaming cursors: how much of text_parts / output_ids / the prompt logprobs was sent
    sent_parts: int = 0
    sent_ids: int = 0
    sent_input_logprobs: bool = False
    # a prefill-only request's pooled vector + label-token logprobs (io_struct.pooled_outputs)
    pooled: list[float] | None = None

    @property
    def rid(self) -> str:
        return self.req.rid

    @property
    def has_new_output(self) -> bool:
        return len(self.text_parts) > self.sent_parts or len(self.output_ids) > self.sent_ids

    def text(self) -> str:
        return "".join(self.text_parts)

    def drop_sent_logprobs(self) -> None:
        """Forget the logprobs an incremental stream has sent (nothing reads them again): a long
        stream with top logprobs keeps only those not sent yet, not ~300 B per entry so far."""
        sent = self.sent_ids - self.logprobs_from
        del self.out_logprobs[:sent]
        del self.out_top[:sent]
        self.logprobs_from = self.sent_ids
        if self.sent_input_logprobs:
            self.in_logprobs, self.in_top = [], []

    def absorb(self, out: BatchStrOut, i: int) -> list[int]:
        """Add entry ``i`` of ``out`` (this rid's increment); returns its new token ids."""
        if out.output_strs[i]:
            self.text_parts.append(out.output_strs[i])
        new_ids = out.output_ids[i]
        self.output_ids.extend(new_ids)
        self.prompt_tokens = out.prompt_tokens[i]
        self.completion_tokens = out.completion_tokens[i]
        self.cached_tokens = out.cached_tokens[i]
        if out.spec_accept_lens:
            self.spec_verify_ct += len(out.spec_accept_lens[i])
            self.spec_tokens += sum(out.spec_accept_lens[i])
        if out.output_token_logprobs:
            self.out_logprobs.extend(out.output_token_logprobs[i])
        if out.output_top_logprobs:
            self.out_top.extend(out.output_top_logprobs[i])
        if out.queue_times and out.queue_times[i] is not None:
            self.queue_time = out.queue_times[i]
        if out.prefill_times and out.prefill_times[i] is not None:
            self.prefill_time = out.prefill_times[i]
        if out.decode_times and out.decode_times[i] is not None:
            self.decode_time = out.decode_times[i]
        if out.pooled_outputs and out.pooled_outputs[i] is not None:
            self.pooled = out.pooled_outputs[i]
        if out.input_token_logprobs and out.input_token_logprobs[i]:
            self.in_logprobs = list(out.input_token_logprobs[i])
            if out.input_top_logprobs:
                self.in_top = list(out.input_top_logprobs[i])
        return new_ids


def abort_label(reason: FinishReason, local: str | None) -> str | None:
    """The ``reason`` label of the abort counter: ``client`` (disconnect, /abort_request),
    ``timeout``, ``queue_time`` (--max-queue-time: the one scheduler abort with status 503 and a
    ``retry_after``), ``shutdown`` (drain), ``error`` (anything else: rejected, retracted too
    often); ``local``: the label of an abort decided here. None when ``reason`` is not an abort."""
    if reason.type == "timeout":
        return "timeout"
    if not reason.is_abort:
        return None
    if local is not None:
        return local
    if reason.status_code == 503 and reason.retry_after is not None:
        return "queue_time"
    return "client" if reason.status_code == 499 else "error"


class ReqRegistry:
    """``rid -> ReqState`` of the requests in flight, waiting accounting and admission."""

    def __init__(self, metrics: TokenizerMetrics, max_queued: int | None, log_requests: bool) -> None:
        self.metrics = metrics
        self.max_queued = max_queued
        self.log_requests = log_requests
        self.rid_to_state: dict[str, ReqState] = {}
        self.waiting: set[str] = set()  # sent, no output yet
        self._completions: collections.deque[float] = collections.deque()  # monotonic times

    def in_use(self, rid: str) -> bool:
        return rid in self.rid_to_state

    def admit(self, num_new: int) -> None:
        """Raise `QueueFullError` (with a Retry-After from the recent completion rate) when
        ``num_new`` more requests would exceed ``--max-queued-requests`` waiting ones."""
        limit = self.max_queued
        if limit is None or len(self.waiting) + num_new <= limit:
            return
        over = len(self.waiting) + num_new - limit
        now = time.monotonic()
        while self._completions and now - self._completions[0] > _RATE_WINDOW_S:
            self._completions.popleft()
        if self._completions:
            span = max(now - self._completions[0], 1.0)
            rate = len(self._completions) / span  # requests completed per second, recently
            retry_after = min(max(math.ceil(over / rate), 1), 600)
        else:
            retry_after = 5
        raise QueueFullError(
            f"too many queued requests ({len(self.waiting)} waiting, limit --max-queued-requests={limit}); "
            f"retry after {retry_after} s",
            retry_after,
        )

    def add(self, st: ReqState) -> None:
        """Register ``st`` (about to be sent): it waits until its first output."""
        self.rid_to_state[st.rid] = st
        self.waiting.add(st.rid)

    def matching(self, rid: str) -> list[ReqState]:
        """The states of ``rid`` and of its ``n`` copies (``""``: every state)."""
        return [st for st in self.rid_to_state.values() if not rid or st.rid == rid or st.parent_rid == rid]

    def apply(self, out: BatchStrOut) -> None:
        """Absorb one detokenizer output into its states, finish those with a finish reason and
        wake their groups (rids no longer registered are ignored)."""
        now = time.perf_counter()
        for i, rid in enumerate(out.rids):
            st = self.rid_to_state.get(rid)
            if st is None:
                continue
            new_ids = st.absorb(out, i)
            if not st.is_warmup:
                self._observe_tokens(st, out, i, new_ids, now)
            self.waiting.discard(rid)
            reason = out.finished_reasons[i]
            if reason is not None:
                self.finish(st, reason)
            st.group.event.set()

    def _observe_tokens(self, st: ReqState, out: BatchStrOut, i: int, new_ids: list[int], now: float) -> None:
        if out.queue_times and out.queue_times[i] is not None:
            self.metrics.observe_queue_time(out.queue_times[i])
        if out.spec_accept_lens:
            self.metrics.observe_spec_accepts(out.spec_accept_lens[i])
        if not new_ids:
            return
        if st.first_token_time == 0.0:
            st.first_token_time = now
            self.metrics.observe_first_token(now - st.created)
            self.metrics.observe_tokens(0.0, len(new_ids) - 1)
        else:
            self.metrics.observe_tokens(now - st.last_token_time, len(new_ids))
        st.last_token_time = now

    def finish(self, st: ReqState, reason: FinishReason) -> None:
        """Mark ``st`` finished with ``reason`` and unregister it (the caller wakes its group)."""
        st.finished = True
        st.finish_reason = reason
        st.finish_time = time.perf_counter()
        self.rid_to_state.pop(st.rid, None)
        self.waiting.discard(st.rid)
        if st.is_warmup:
            return
        self._completions.append(time.monotonic())
        abort = abort_label(reason, st.abort_label)
        e2e = st.finish_time - st.created
        prompt_tokens = st.prompt_tokens or len(st.req.input_ids)
        self.metrics.observe_finished(e2e, prompt_tokens, st.completion_tokens, st.cached_tokens, abort)
        if self.log_requests:
            logger.info(
                "finished rid=%s prompt_tokens=%d completion_tokens=%d cached_tokens=%d finish_reason=%s "
                "e2e=%.3fs output=%r",
                st.rid,
                prompt_tokens,
                st.completion_tokens,
                st.cached_tokens,
                reason.to_dict(),
                e2e,
                st.text()[:200],
            )

    def fail_all(self) -> None:
        """Forget every state and wake its group (the engine is dead: consumers raise)."""
        states = list(self.rid_to_state.values())
        self.rid_to_state.clear()
        self.waiting.clear()
        for st in states:
            st.group.event.set()

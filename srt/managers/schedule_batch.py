"""Requests and batches on the scheduler side (CPU state), and their KV bookkeeping.

Data path of one scheduler step::

    TokenizedGenerateReqInput --> Req (CPU state of one request; lives until it finishes)
    waiting queue --PrefillAdder (schedule_policy.py)--> reqs to extend this step
    reqs --ScheduleBatch.prepare_extend / prepare_decode--> KV slots allocated, req_to_token rows written
    ScheduleBatch (CPU lists) --get_forward_batch()--> ForwardBatch (tensors) --> ModelRunner
    ModelRunner --> (LogitsProcessorOutput, SampleOutput) --> new token per Req (scheduler)

Request state machine (``ReqState``)::

    WAITING --admitted--> PREFILLING --last chunk done--> DECODING --finish--> FINISHED
       ^                    |   ^ (one more chunk per step)  |
       |                    +---+                            | KV short: retracted
       +------------------- RETRACTED <----------------------+
    (any state but FINISHED --abort / stop string--> FINISHED)

KV bookkeeping of a request (positions are token positions of ``origin_input_ids + output_ids``)::

    req_to_token[req_pool_idx, 0 : len(prefix_indices)]   slots shared with the prefix cache
                                                          (locked through ``last_node``)
    req_to_token[req_pool_idx, len(prefix_indices) : kv_committed_len]
                                                          slots owned by the request
    kv_committed_len                                      tokens whose KV is in the pool; for a
                                                          decoding request == len(all ids) - 1
                                                          (the newest token has no KV yet)
    fill_ids                                              the ids whose KV exists after the
                                                          current extend (prompt chunk so far,
                                                          or prompt + kept output after retraction)

The prefix cache (``srt/mem_cache/base_prefix_cache.py``) reads ``origin_input_ids``,
``output_ids``, ``fill_ids``, ``req_pool_idx``, ``prefix_indices``, ``last_node`` and
``kv_committed_len``; ``cache_unfinished_req`` rewrites ``prefix_indices``/``last_node``,
``cache_finished_req`` releases everything the request holds.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from srt.model_executor.forward_batch import ForwardBatch, ForwardMode
from srt.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from srt.managers.io_struct import TokenizedGenerateReqInput
    from srt.mem_cache.allocator import TokenToKVPoolAllocator
    from srt.mem_cache.base_prefix_cache import BasePrefixCache
    from srt.mem_cache.memory_pool import ReqToTokenPool

_EMPTY_SLOTS = torch.empty(0, dtype=torch.int64)


class ReqState(enum.Enum):
    WAITING = "waiting"  # in the waiting queue, holds no KV and no request slot
    PREFILLING = "prefilling"  # admitted; some (maybe not all) of fill_ids have KV
    DECODING = "decoding"  # in the running batch, one token per step
    RETRACTED = "retracted"  # pushed out of the running batch; released all KV (kept its output)
    FINISHED = "finished"  # done; holds nothing


_TRANSITIONS: dict[ReqState, frozenset[ReqState]] = {
    ReqState.WAITING: frozenset({ReqState.PREFILLING, ReqState.FINISHED}),
    ReqState.PREFILLING: frozenset(
        {ReqState.PREFILLING, ReqState.DECODING, ReqState.RETRACTED, ReqState.FINISHED}
    ),
    ReqState.DECODING: frozenset({ReqState.RETRACTED, ReqState.FINISHED}),
    ReqState.RETRACTED: frozenset({ReqState.WAITING, ReqState.FINISHED}),
    ReqState.FINISHED: frozenset(),
}


class InvalidTransitionError(RuntimeError):
    """A request was moved along an edge the state machine does not have (a scheduler bug)."""


def finish_length(length: int) -> dict[str, Any]:
    return {"type": "length", "length": length}


def finish_stop(matched: int | str) -> dict[str, Any]:
    return {"type": "stop", "matched": matched}


def finish_abort(message: str, status_code: int | None = None) -> dict[str, Any]:
    reason: dict[str, Any] = {"type": "abort", "message": message}
    if status_code is not None:
        reason["status_code"] = status_code
    return reason


class Req:
    """One generation request and its scheduler-side state (see the module docstring).

    ``max_new_tokens`` is resolved (never None). ``seed`` is always set (the request's own or
    one drawn at admission). ``stop_ids`` holds the token ids that finish the request once
    ``min_new_tokens`` are generated (``stop_token_ids`` plus the model's EOS unless
    ``ignore_eos``).
    """

    __slots__ = (
        "rid",
        "origin_input_ids",
        "sampling_params",
        "max_new_tokens",
        "min_new_tokens",
        "seed",
        "stop_ids",
        "stop_strs",
        "static_sampling",
        "out_static",
        "return_logprob",
        "logprob_start_len",
        "top_logprobs_num",
        "stream",
        "priority",
        "arrival_time",
        "queue_seq",
        "state",
        "output_ids",
        "finished_reason",
        "fill_ids",
        "kv_committed_len",
        "kv_allocated_len",
        "prefix_indices",
        "last_node",
        "req_pool_idx",
        "extend_input_len",
        "cached_tokens",
        "admitted_once",
        "wait_start",
        "queue_time",
        "retract_count",
        "overtaken",
        "enqueue_step",
        "num_sent",
        "pending_token_logprobs",
        "pending_top_logprobs",
        "input_token_logprobs",
        "input_top_logprobs",
        "input_logprobs_sent",
    )

    def __init__(
        self,
        rid: str,
        origin_input_ids: list[int],
        sampling_params: SamplingParams,
        *,
        max_new_tokens: int,
        seed: int,
        eos_token_ids: list[int] | tuple[int, ...] = (),
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        stream: bool = False,
        priority: int = 0,
        arrival_time: float = 0.0,
        queue_seq: int = 0,
    ) -> None:
        self.rid = rid
        self.origin_input_ids = list(origin_input_ids)
        self.sampling_params = sampling_params
        self.max_new_tokens = max_new_tokens
        self.min_new_tokens = sampling_params.min_new_tokens
        self.seed = seed
        stop = set(sampling_params.stop_token_ids or ())
        if not sampling_params.ignore_eos:
            stop.update(eos_token_ids)
        self.stop_ids: frozenset[int] = frozenset(stop)
        self.stop_strs: list[str] = sampling_params.stop_strs
        # no per-step logit edits (penalties, min_new_tokens mask): its sampling rows can be reused
        self.static_sampling = (
            sampling_params.repetition_penalty == 1.0
            and sampling_params.frequency_penalty == 0.0
            and sampling_params.presence_penalty == 0.0
            and sampling_params.min_new_tokens == 0
        )
        # the per-request fields of every BatchTokenIDOut that never change
        self.out_static = (
            rid,
            len(self.origin_input_ids),
            sampling_params.skip_special_tokens,
            sampling_params.spaces_between_special_tokens,
            sampling_params.no_stop_trim,
            self.stop_strs,
        )
        self.return_logprob = return_logprob
        self.logprob_start_len = logprob_start_len if return_logprob else -1
        self.top_logprobs_num = top_logprobs_num if return_logprob else 0
        self.stream = stream
        self.priority = priority
        self.arrival_time = arrival_time
        self.queue_seq = queue_seq  # arrival order: the fcfs key

        self.state = ReqState.WAITING
        self.output_ids: list[int] = []
        self.finished_reason: dict[str, Any] | None = None

        # KV bookkeeping (module docstring)
        self.fill_ids: list[int] = []
        self.kv_committed_len = 0
        self.kv_allocated_len = 0  # leading req_to_token entries holding slots (>= committed)
        self.prefix_indices: torch.Tensor = _EMPTY_SLOTS
        self.last_node: Any = None
        self.req_pool_idx: int | None = None
        self.extend_input_len = 0  # new tokens computed in the current step

        # accounting
        self.cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.admitted_once = False
        self.wait_start = time.perf_counter()  # when the scheduler received it
        self.queue_time: float | None = None  # seconds from arrival to the first admission
        self.retract_count = 0
        self.overtaken = 0  # times a later request was admitted while this one did not fit
        self.enqueue_step = 0  # scheduler step at which it (re)entered the waiting queue

        # output streaming
        self.num_sent = 0  # output_ids[:num_sent] were already sent
        self.pending_token_logprobs: list[float] = []
        self.pending_top_logprobs: list[list[tuple[int, float]]] = []
        self.input_token_logprobs: list[float | None] = []
        self.input_top_logprobs: list[list[tuple[int, float]] | None] = []
        self.input_logprobs_sent = False

    @classmethod
    def from_input(
        cls,
        msg: TokenizedGenerateReqInput,
        *,
        max_new_tokens: int,
        seed: int,
        eos_token_ids: list[int],
        queue_seq: int,
    ) -> Req:
        """A WAITING request from the tokenizer manager's message (a logprob start outside
        the prompt means no prompt logprobs)."""
        n = len(msg.input_ids)
        return cls(
            msg.rid,
            msg.input_ids,
            msg.sampling_params,
            max_new_tokens=max_new_tokens,
            seed=seed,
            eos_token_ids=eos_token_ids,
            return_logprob=msg.return_logprob,
            logprob_start_len=msg.logprob_start_len if 0 <= msg.logprob_start_len < n else -1,
            top_logprobs_num=msg.top_logprobs_num,
            stream=msg.stream,
            priority=msg.priority,
            arrival_time=msg.arrival_time or time.time(),
            queue_seq=queue_seq,
        )

    # ------------------------------------------------------------------ state machine
    def set_state(self, new: ReqState) -> None:
        if new not in _TRANSITIONS[self.state]:
            raise InvalidTransitionError(f"request {self.rid!r}: {self.state.value} -> {new.value}")
        self.state = new

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    def finish(self, reason: dict[str, Any]) -> None:
        """Record the finish reason (the first one wins); the state moves to FINISHED once the
        scheduler released the request's resources (``mark_released``)."""
        if self.finished_reason is None:
            self.finished_reason = reason

    def mark_released(self) -> None:
        """The request holds no KV and no request slot any more and is done."""
        self.clear_kv_state()
        self.set_state(ReqState.FINISHED)

    def clear_kv_state(self) -> None:
        self.prefix_indices = _EMPTY_SLOTS
        self.last_node = None
        self.req_pool_idx = None
        self.kv_committed_len = 0
        self.kv_allocated_len = 0
        self.extend_input_len = 0

    def retract(self) -> None:
        """Back to the waiting queue after its KV was handed to the cache: the kept output is
        recomputed as part of the prompt on re-admission."""
        self.set_state(ReqState.RETRACTED)
        self.clear_kv_state()
        self.retract_count += 1
        self.overtaken = 0
        self.set_state(ReqState.WAITING)

    # ------------------------------------------------------------------ lengths
    @property
    def all_ids_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def remaining_new_tokens(self) -> int:
        return max(0, self.max_new_tokens - len(self.output_ids))

    @property
    def wants_input_logprobs(self) -> bool:
        """Prompt logprobs requested and not yet delivered."""
        return self.logprob_start_len >= 0 and not self.input_logprobs_sent

    def prefix_match_key(self) -> list[int]:
        """Ids whose KV may come from the prefix cache on (re)admission.

        The last id is always recomputed (its logits give the next token); with prompt
        logprobs pending, nothing from ``logprob_start_len`` on may be skipped either (its
        logits are needed)."""
        ids = self.origin_input_ids + self.output_ids
        limit = len(ids) - 1
        if self.wants_input_logprobs:
            limit = min(limit, max(self.logprob_start_len - 1, 0))
        return ids[:limit]

    # ------------------------------------------------------------------ results
    def append_token(self, token_id: int) -> None:
        """Append a sampled token and set ``finished_reason`` when a stop condition holds."""
        self.output_ids.append(token_id)
        if len(self.output_ids) >= self.max_new_tokens or token_id in self.stop_ids:
            self.check_finished(token_id)

    def check_finished(self, token_id: int) -> None:
        """The finish rules after ``token_id`` was appended: ``max_new_tokens`` reached ->
        length; a stop token (``stop_token_ids``, EOS unless ``ignore_eos``) once
        ``min_new_tokens`` are generated -> stop. Length wins when both apply."""
        n = len(self.output_ids)
        if n >= self.max_new_tokens:
            self.finish(finish_length(n))
        elif n >= self.min_new_tokens and token_id in self.stop_ids:
            self.finish(finish_stop(token_id))

    def __repr__(self) -> str:
        return (
            f"Req(rid={self.rid!r}, state={self.state.value}, prompt={len(self.origin_input_ids)}, "
            f"out={len(self.output_ids)}, kv={self.kv_committed_len})"
        )


@dataclass(slots=True)
class KVContext:
    """The memory the batches of one scheduler allocate from (shared by every batch)."""

    req_to_token_pool: ReqToTokenPool
    allocator: TokenToKVPoolAllocator
    tree_cache: BasePrefixCache
    page_size: int

    def available(self) -> int:
        """Slots obtainable now: free + evictable."""
        return self.allocator.available_size() + self.tree_cache.evictable_size()

    def ensure_free(self, num_slots: int) -> bool:
        """Evict from the cache until ``num_slots`` slots are free; False if impossible."""
        free = self.allocator.available_size()
        if free < num_slots:
            self.tree_cache.evict(num_slots - free)
        return self.allocator.available_size() >= num_slots

    def pages_for(self, old_len: int, new_len: int) -> int:
        """Slots of the fresh pages a sequence needs to grow from old_len to new_len tokens."""
        p = self.page_size
        return (-(-new_len // p) - -(-old_len // p)) * p


class KVAllocationError(RuntimeError):
    """The allocator had fewer slots than the admission policy promised (a scheduler bug)."""


@dataclass(slots=True)
class ScheduleBatch:
    """The CPU-side batch of one step.

    ``reqs`` holds the extending requests first (``num_extend_reqs`` of them) and then the
    decoding ones (MIXED); all per-request lists are aligned with ``reqs``. ``input_ids`` and
    ``out_cache_loc`` are flat over the new tokens, sequence after sequence.
    """

    forward_mode: ForwardMode
    reqs: list[Req]
    num_extend_reqs: int = 0
    input_ids: list[int] = field(default_factory=list)
    req_pool_indices: list[int] = field(default_factory=list)
    prefix_lens: list[int] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    out_cache_loc: torch.Tensor = _EMPTY_SLOTS
    # DECODE: req_pool_indices / positions as tensors (built once in prepare_decode)
    req_pool_indices_t: torch.Tensor | None = None
    positions_t: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return len(self.reqs)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    # ------------------------------------------------------------------ building
    @classmethod
    def prepare_extend(cls, reqs: list[Req], kv: KVContext) -> ScheduleBatch:
        """Allocate request rows and KV slots for ``reqs``, whose ``fill_ids`` and
        ``extend_input_len`` the scheduler has set (``fill_ids[:kv_committed_len]`` already
        have KV: the cached prefix, or earlier chunks).

        Raises KVAllocationError if the pools cannot serve what admission promised."""
        pool = kv.req_to_token_pool
        new_rows = [r for r in reqs if r.req_pool_idx is None]
        if new_rows:
            rows = pool.alloc(len(new_rows))
            if rows is None:
                raise KVAllocationError(f"no free request slot for {len(new_rows)} new requests")
            for r, row in zip(new_rows, rows):
                r.req_pool_idx = row
                if r.prefix_indices.numel():
                    pool.write(row, 0, r.prefix_indices)
        prefix_lens = [r.kv_committed_len for r in reqs]
        seq_lens = [len(r.fill_ids) for r in reqs]
        need = sum(kv.pages_for(p, s) for p, s in zip(prefix_lens, seq_lens))
        if not kv.ensure_free(need):
            raise KVAllocationError(f"extend needs {need} KV slots, {kv.available()} obtainable")
        last_loc = _last_locs(pool.req_to_token, reqs, prefix_lens) if kv.page_size > 1 else prefix_lens
        out = kv.allocator.alloc_extend(prefix_lens, seq_lens, last_loc)
        if out is None:
            raise KVAllocationError(f"alloc_extend failed for {need} slots")
        input_ids: list[int] = []
        extend_lens: list[int] = []
        off = 0
        for r, p, s in zip(reqs, prefix_lens, seq_lens):
            n = s - p
            pool.write(r.req_pool_idx, p, out[off : off + n])
            r.kv_allocated_len = s
            off += n
            input_ids.extend(r.fill_ids[p:s])
            extend_lens.append(n)
        return cls(
            forward_mode=ForwardMode.EXTEND,
            reqs=list(reqs),
            num_extend_reqs=len(reqs),
            input_ids=input_ids,
            req_pool_indices=[r.req_pool_idx for r in reqs],
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            out_cache_loc=out,
        )

    @staticmethod
    def decode_slots_needed(reqs: list[Req], page_size: int) -> int:
        """KV slots one decode step of ``reqs`` takes from the free list."""
        if page_size == 1:
            return len(reqs)
        return page_size * sum(1 for r in reqs if r.kv_committed_len % page_size == 0)

    @classmethod
    def prepare_decode(cls, reqs: list[Req], kv: KVContext) -> ScheduleBatch:
        """Allocate one KV slot per decoding request (the scheduler made sure they exist,
        retracting if needed) and write it into req_to_token."""
        pool = kv.req_to_token_pool
        need = cls.decode_slots_needed(reqs, kv.page_size)
        if not kv.ensure_free(need):
            raise KVAllocationError(f"decode needs {need} KV slots, {kv.available()} obtainable")
        prefix_lens = [r.kv_committed_len for r in reqs]
        rows = [r.req_pool_idx for r in reqs]
        dev = pool.req_to_token.device
        rows_t = torch.tensor(rows, dtype=torch.int64, device=dev)
        pos_t = torch.tensor(prefix_lens, dtype=torch.int64, device=dev)
        seq_lens = pos_t + 1
        last_loc = pool.req_to_token[rows_t, pos_t - 1] if kv.page_size > 1 else pos_t
        out = kv.allocator.alloc_decode(seq_lens, last_loc)
        if out is None:
            raise KVAllocationError(f"alloc_decode failed for {need} slots")
        pool.req_to_token[rows_t, pos_t] = out.to(dev)
        for r in reqs:
            r.kv_allocated_len = r.kv_committed_len + 1
        return cls(
            forward_mode=ForwardMode.DECODE,
            reqs=list(reqs),
            num_extend_reqs=0,
            input_ids=[r.output_ids[-1] for r in reqs],
            req_pool_indices=rows,
            prefix_lens=prefix_lens,
            extend_lens=[1] * len(reqs),
            out_cache_loc=out,
            req_pool_indices_t=rows_t,
            positions_t=pos_t,
        )

    def mix_with(self, decode: ScheduleBatch) -> None:
        """Append a prepared decode batch to this extend batch: MIXED (extends first)."""
        assert self.forward_mode == ForwardMode.EXTEND and decode.forward_mode == ForwardMode.DECODE
        self.forward_mode = ForwardMode.MIXED
        self.reqs.extend(decode.reqs)
        self.input_ids.extend(decode.input_ids)
        self.req_pool_indices.extend(decode.req_pool_indices)
        self.prefix_lens.extend(decode.prefix_lens)
        self.extend_lens.extend(decode.extend_lens)
        self.out_cache_loc = torch.cat([self.out_cache_loc, decode.out_cache_loc])

    @property
    def return_logprob(self) -> bool:
        return any([r.return_logprob for r in self.reqs])

    # ------------------------------------------------------------------ to tensors
    def get_forward_batch(
        self,
        device: str | torch.device,
        vocab_size: int,
        eos_token_ids: list[int] | None,
        sampling_cache: SamplingInfoCache | None = None,
    ) -> ForwardBatch:
        """The ModelRunner's view of this batch (sampling info and logprob requests included)."""
        reqs = self.reqs
        kw: dict[str, Any] = {}
        if self.return_logprob:
            kw["return_logprob"] = True
            kw["top_logprobs_nums"] = [r.top_logprobs_num for r in reqs]
            # prompt logprobs: extends whose prompt logprobs are still pending (the logits
            # processor scores tokens max(start, prefix + 1) .. seq_len - 1, plus the first token
            # of the next chunk when the prompt goes on)
            starts: list[int] = []
            next_ids: list[int] = []
            for i, r in enumerate(reqs):
                seq_len = self.prefix_lens[i] + self.extend_lens[i]
                if i < self.num_extend_reqs and r.wants_input_logprobs:
                    starts.append(r.logprob_start_len)
                    more = seq_len < len(r.origin_input_ids)
                    next_ids.append(r.origin_input_ids[seq_len] if more else -1)
                else:
                    starts.append(seq_len)
                    next_ids.append(-1)
            kw["extend_logprob_start_lens_cpu"] = starts
            kw["extend_logprob_next_token_ids_cpu"] = next_ids
        if self.forward_mode == ForwardMode.DECODE and self.positions_t is not None:
            fb = self._decode_forward_batch(device, kw)
        else:
            if self.forward_mode == ForwardMode.MIXED:
                kw["num_extend_seqs"] = self.num_extend_reqs
            fb = ForwardBatch.build(
                self.forward_mode,
                self.input_ids,
                self.req_pool_indices,
                self.prefix_lens,
                self.extend_lens,
                self.out_cache_loc,
                device=device,
                **kw,
            )
        cache = sampling_cache if sampling_cache is not None else SamplingInfoCache()
        fb.sampling_info = cache.get(reqs, vocab_size, device, eos_token_ids)
        return fb

    def _decode_forward_batch(self, device: str | torch.device, kw: dict[str, Any]) -> ForwardBatch:
        """ForwardBatch.build's result for a DECODE batch, from the tensors prepare_decode made
        (every sequence: one token at position prefix_len, seq_len = prefix_len + 1)."""
        bs = len(self.reqs)
        pos = self.positions_t.to(device)
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=torch.tensor(self.input_ids, dtype=torch.int64, device=device),
            positions=pos,
            req_pool_indices=self.req_pool_indices_t.to(device),
            seq_lens=pos + 1,
            out_cache_loc=self.out_cache_loc.to(device=device, dtype=torch.int64),
            extend_seq_lens=torch.ones(bs, dtype=torch.int64, device=device),
            extend_prefix_lens=pos,
            extend_start_loc=torch.arange(bs, dtype=torch.int64, device=device),
            seq_lens_cpu=[p + 1 for p in self.prefix_lens],
            extend_seq_lens_cpu=self.extend_lens,
            extend_prefix_lens_cpu=self.prefix_lens,
            num_extend_seqs=0,
            **kw,
        )


class SamplingInfoCache:
    """Builds each step's ``SamplingBatchInfo``; reuses the previous one when the batch holds
    the same requests in the same order and none has per-step logit edits (penalties, a
    pending min_new_tokens mask) -- then only the noise positions are rebuilt."""

    def __init__(self) -> None:
        self._reqs: list[Req] | None = None
        self._info: Any = None

    def get(
        self, reqs: list[Req], vocab_size: int, device: str | torch.device, eos_token_ids: list[int] | None
    ):
        from srt.sampling.sampling_batch_info import SamplingBatchInfo

        if self._info is not None and reqs == self._reqs:
            positions = torch.tensor([len(r.output_ids) for r in reqs], dtype=torch.int64, device=device)
            return dataclasses.replace(self._info, positions=positions)
        info = SamplingBatchInfo.from_reqs(
            [r.sampling_params for r in reqs],
            [r.seed for r in reqs],
            [r.output_ids for r in reqs],
            [r.origin_input_ids for r in reqs],
            vocab_size,
            device,
            eos_token_ids,
        )
        reusable = all([r.static_sampling for r in reqs])
        self._reqs, self._info = (list(reqs), info) if reusable else (None, None)
        return info


def _last_locs(req_to_token: torch.Tensor, reqs: list[Req], prefix_lens: list[int]) -> list[int]:
    """Slot of token ``prefix_len - 1`` of each request (-1 when the prefix is empty)."""
    out = []
    for r, p in zip(reqs, prefix_lens):
        out.append(int(req_to_token[r.req_pool_idx, p - 1]) if p > 0 else -1)
    return out

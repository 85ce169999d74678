"""``ScheduleBatch``: the CPU-side batch of one scheduler step, its KV allocation and its
``ForwardBatch``.

Data path of one scheduler step::

    TokenizedGenerateReqInput --> Req (req.py; CPU state of one request, lives until it finishes)
    waiting queue --PrefillAdder (schedule_policy.py), in the prefill part--> reqs to extend this step
    reqs --ScheduleBatch.prepare_extend / prepare_decode--> KV slots allocated, req_to_token rows written
    ScheduleBatch (CPU lists) --get_forward_batch()--> ForwardBatch (tensors) --> ModelRunner
    ModelRunner --> (logits output, sample output) --> new token per Req (scheduler/output.py)

Batches allocate from a ``BatchMemory``: the scheduler's cache part
(``srt/managers/scheduler/cache.py``) is one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from srt.layers.forward_batch import ForwardBatch, ForwardMode
from srt.managers.scheduler import pooling
from srt.managers.scheduler.req import EMPTY_SLOTS, Req
from srt.multimodal.req_images import batch_image_inputs
from srt.utils.pages import page_ceil

if TYPE_CHECKING:
    from srt.mem_cache.allocator import TokenToKVPoolAllocator
    from srt.mem_cache.memory_pool import ReqToTokenPool
    from srt.sampling.sampling_batch_info import SamplingBatchInfo


class BatchMemory(Protocol):
    """What building a batch needs from the memory of the scheduler: the request rows, the KV
    allocator and a way to make slots free (evicting cached prefixes)."""

    @property
    def req_to_token_pool(self) -> ReqToTokenPool: ...

    @property
    def allocator(self) -> TokenToKVPoolAllocator: ...

    @property
    def page_size(self) -> int: ...

    def available(self) -> int:
        """Slots obtainable now: free + evictable."""
        ...

    def ensure_free(self, num_slots: int) -> bool:
        """Evict until ``num_slots`` slots are free; False if impossible."""
        ...


def future_ref(req_pool_idx: int) -> int:
    """The input id that stands for the token being sampled for request row ``req_pool_idx``
    by the batch in flight (overlap scheduling: srt/managers/scheduler/overlap.py)."""
    return -(req_pool_idx + 1)


class KVAllocationError(RuntimeError):
    """The allocator had fewer slots than the admission policy promised (a scheduler bug)."""


@dataclass(slots=True)
class VerifyRows:
    """The speculative layout of a DECODE batch (srt/managers/scheduler/speculative.py):
    ``reqs`` (distinct, in row order) and the ``drafts`` each verifies; request i owns
    ``1 + len(drafts[i])`` consecutive rows, row j sampled at output position
    ``len(output_ids) + j`` with ``drafts[i][:j]`` counted as output."""

    reqs: list[Req]
    drafts: list[list[int]]

    def sampling_info(
        self,
        vocab_size: int,
        device: str | torch.device,
        eos_token_ids: list[int] | None,
        cache: SamplingInfoCache,
    ) -> SamplingBatchInfo:
        if not any(self.drafts):  # one row per request: a plain decode step
            return cache.get(self.reqs, vocab_size, device, eos_token_ids)
        from srt.sampling.sampling_batch_info import SamplingBatchInfo

        params, seeds, outputs, prompts = [], [], [], []
        for r, d in zip(self.reqs, self.drafts):
            for j in range(1 + len(d)):
                params.append(r.sampling_params)
                seeds.append(r.seed)
                outputs.append(r.output_ids + d[:j] if j else r.output_ids)
                prompts.append(r.prompt_ids)
        return SamplingBatchInfo.from_reqs(params, seeds, outputs, prompts, vocab_size, device, eos_token_ids)


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
    out_cache_loc: torch.Tensor = EMPTY_SLOTS
    # DECODE: req_pool_indices / positions as tensors (built once in prepare_decode)
    req_pool_indices_t: torch.Tensor | None = None
    positions_t: torch.Tensor | None = None
    # overlap scheduling: per row, 1 where the request's previous token is still being sampled
    # by the batch in flight (its input id is a future reference, overlap.py); empty: none is
    pending_tokens: list[int] = field(default_factory=list)
    # speculative decoding: the requests and drafts behind the rows (None: one row per request)
    verify: VerifyRows | None = None

    @property
    def batch_size(self) -> int:
        return len(self.reqs)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def has_future_refs(self) -> bool:
        """Whether some input id refers to a token the batch in flight is sampling."""
        return bool(self.pending_tokens)

    # ------------------------------------------------------------------ building
    @classmethod
    def prepare_extend(cls, reqs: list[Req], kv: BatchMemory) -> ScheduleBatch:
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
        P = kv.page_size
        need = sum(page_ceil(s, P) - page_ceil(p, P) for p, s in zip(prefix_lens, seq_lens))
        if not kv.ensure_free(need):
            raise KVAllocationError(f"extend needs {need} KV slots, {kv.available()} obtainable")
        last_loc = last_locs(pool.req_to_token, reqs, prefix_lens) if kv.page_size > 1 else prefix_lens
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
            input_ids.extend(r.fill_ids[p:s] if r.images is None else r.images.model_ids(r.fill_ids[p:s]))
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
        return page_size * sum(1 for r in reqs if r.kv_allocated_len % page_size == 0)

    @classmethod
    def prepare_decode(cls, reqs: list[Req], kv: BatchMemory, batch_in_flight: bool = False) -> ScheduleBatch:
        """Allocate one KV slot per decoding request (the decode part made sure they exist,
        retracting if needed) and write it into req_to_token.

        ``batch_in_flight`` (overlap scheduling): a request whose previous token is still being
        sampled (its ``kv_allocated_len`` is one past ``kv_committed_len``) decodes at the
        position after that token, with a future reference as its input id (overlap.py)."""
        pool = kv.req_to_token_pool
        need = cls.decode_slots_needed(reqs, kv.page_size)
        if not kv.ensure_free(need):
            raise KVAllocationError(f"decode needs {need} KV slots, {kv.available()} obtainable")
        prefix_lens = [r.kv_allocated_len for r in reqs]
        rows = [r.req_pool_idx for r in reqs]
        dev = pool.req_to_token.device
        rows_t = torch.tensor(rows, dtype=torch.int64, device=dev)
        pos_t = torch.tensor(prefix_lens, dtype=torch.int64, device=dev)
        seq_lens = [p + 1 for p in prefix_lens]
        # last_loc stays on the pool's device; the allocator copies it to the host
        last_loc = pool.req_to_token[rows_t, pos_t - 1] if kv.page_size > 1 else prefix_lens
        out = kv.allocator.alloc_decode(seq_lens, last_loc)
        if out is None:
            raise KVAllocationError(f"alloc_decode failed for {need} slots")
        pool.req_to_token[rows_t, pos_t] = out.to(dev)
        pending = [p - r.kv_committed_len for r, p in zip(reqs, prefix_lens)] if batch_in_flight else []
        if any(pending):
            input_ids = [future_ref(r.req_pool_idx) if n else r.output_ids[-1] for r, n in zip(reqs, pending)]
        else:
            input_ids, pending = [r.output_ids[-1] for r in reqs], []
        for r in reqs:
            r.kv_allocated_len += 1
        return cls(
            forward_mode=ForwardMode.DECODE,
            reqs=list(reqs),
            num_extend_reqs=0,
            input_ids=input_ids,
            req_pool_indices=rows,
            prefix_lens=prefix_lens,
            extend_lens=[1] * len(reqs),
            out_cache_loc=out,
            req_pool_indices_t=rows_t,
            positions_t=pos_t,
            pending_tokens=pending,
        )

    def mix_with(self, decode: ScheduleBatch) -> None:
        """Append a prepared decode batch to this extend batch: MIXED (extends first)."""
        assert self.forward_mode == ForwardMode.EXTEND and decode.forward_mode == ForwardMode.DECODE
        self.forward_mode = ForwardMode.MIXED
        if decode.pending_tokens:
            self.pending_tokens = [0] * len(self.reqs) + decode.pending_tokens
        self.reqs.extend(decode.reqs)
        self.input_ids.extend(decode.input_ids)
        self.req_pool_indices.extend(decode.req_pool_indices)
        self.prefix_lens.extend(decode.prefix_lens)
        self.extend_lens.extend(decode.extend_lens)
        self.out_cache_loc = torch.cat([self.out_cache_loc, decode.out_cache_loc])

    def sampling_rows(self) -> list[int]:
        """The rows whose sampled token is kept: every decode row, and the extend rows that
        complete their prompt and may still generate."""
        rows = [
            i
            for i in range(self.num_extend_reqs)
            if self.prefix_lens[i] + self.extend_lens[i] >= self.reqs[i].all_ids_len
            and self.reqs[i].remaining_new_tokens > 0
        ]
        rows.extend(range(self.num_extend_reqs, len(self.reqs)))
        return rows

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
                    more = seq_len < len(r.prompt_ids)
                    next_ids.append(r.prompt_ids[seq_len] if more else -1)
                else:
                    starts.append(seq_len)
                    next_ids.append(-1)
            kw["extend_logprob_start_lens_cpu"] = starts
            kw["extend_logprob_next_token_ids_cpu"] = next_ids
        if self.num_extend_reqs:
            kw.update(pooling.forward_kwargs(reqs, self.num_extend_reqs))
        if any([r.lora_slot >= 0 for r in reqs]):
            kw["lora_slots"] = [r.lora_slot for r in reqs]
        if any([r.images is not None for r in reqs]):
            kw.update(batch_image_inputs(self, device))
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
        if self.verify is not None:
            fb.sampling_info = self.verify.sampling_info(vocab_size, device, eos_token_ids, cache)
        else:
            fb.sampling_info = cache.get(reqs, vocab_size, device, eos_token_ids, self.pending_tokens)
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
        self._info: SamplingBatchInfo | None = None

    def get(
        self,
        reqs: list[Req],
        vocab_size: int,
        device: str | torch.device,
        eos_token_ids: list[int] | None,
        pending_tokens: list[int] | None = None,
    ) -> SamplingBatchInfo:
        """``pending_tokens[i]``: tokens of request i still being sampled (overlap scheduling),
        counted in its noise position; empty or None: none."""
        from srt.sampling.sampling_batch_info import SamplingBatchInfo

        positions = [len(r.output_ids) for r in reqs]
        if pending_tokens:
            positions = [p + n for p, n in zip(positions, pending_tokens)]
        if self._info is not None and reqs == self._reqs:
            pos_t = torch.tensor(positions, dtype=torch.int64, device=device)
            return dataclasses.replace(self._info, positions=pos_t)
        info = SamplingBatchInfo.from_reqs(
            [r.sampling_params for r in reqs],
            [r.seed for r in reqs],
            [r.output_ids for r in reqs],
            [r.prompt_ids for r in reqs],
            vocab_size,
            device,
            eos_token_ids,
            step=positions,
        )
        reusable = all([r.static_sampling for r in reqs])
        self._reqs, self._info = (list(reqs), info) if reusable else (None, None)
        return info


def last_locs(req_to_token: torch.Tensor, reqs: list[Req], prefix_lens: list[int]) -> list[int]:
    """Slot of token ``prefix_len - 1`` of each request (-1 when the prefix is empty)."""
    held = [(r.req_pool_idx, p - 1) for r, p in zip(reqs, prefix_lens) if p > 0]
    if not held:
        return [-1] * len(prefix_lens)
    rows, cols = zip(*held)
    # one gather and one copy to the host (not one per request: each is a sync on a GPU)
    slots = iter(req_to_token[list(rows), list(cols)].tolist())
    return [next(slots) if p > 0 else -1 for p in prefix_lens]

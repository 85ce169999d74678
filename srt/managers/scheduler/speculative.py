"""The speculative part (``--speculative-algorithm NGRAM``): drafts, the verify batch, acceptance.

One decode step with speculation::

    plan      each running request drafts up to k tokens from its own history (ngram.py), within
              its budget (backoff below) and its remaining max_new_tokens; none when it has a
              grammar, when the running batch is larger than --speculative-max-batch-size, or
              when the drafts' KV slots are not free (drafts never evict the prefix cache)
    batch     a DECODE batch with one row per token to verify: request r (KV up to position
              P = kv_committed_len, last token t) contributes rows t, d1 .. dk at positions
              P .. P + k, all reading r's req_to_token row with seq_len position + 1. Every
              layer stores the K/V of all rows before attending, so row j sees exactly the
              drafts before it: the causal mask inside the draft, through the plain decode path
              (the native decode stack, CUDA graphs, any attention backend)
    sample    every row is sampled as an ordinary decode row at output position n + j, with
              the request's parameters and the drafts before it counted as output (penalties,
              min_new_tokens): token s_j
    accept    the longest prefix with s_j == d_{j+1}, then the first mismatching s_j (or s_k):
              1 .. k + 1 new tokens; the KV of the rejected rows is freed at once

Acceptance by equality is the speculative sampling rule for a deterministic draft: s_j ~ p_j,
so d_{j+1} is accepted with probability p_j(d_{j+1}) and a rejection leaves s_j distributed as
p_j without d_{j+1}, renormalised. Sampling noise is counter-based (seed, output position), so
a seeded request draws the very tokens it draws without speculation: outputs are the same with
speculation on and off, greedy or not, up to float differences between batch shapes.

Backoff: a request whose draft was rejected at once halves its budget; at 0 it skips drafting
for ``COOLDOWN_STEPS`` steps and then tries one token; a fully accepted draft raises the budget
by one, up to ``--speculative-num-draft-tokens``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from srt.layers.forward_batch import ForwardMode
from srt.managers.scheduler.grammar import GrammarManager
from srt.managers.scheduler.ngram import NgramConfig, NgramIndex, NgramStore
from srt.managers.scheduler.output import BatchResult, record_logprob, sampled_lists
from srt.managers.scheduler.schedule_batch import KVAllocationError, ScheduleBatch, VerifyRows, last_locs
from srt.utils.pages import page_ceil

if TYPE_CHECKING:
    from srt.managers.scheduler.cache import CacheManager
    from srt.managers.scheduler.metrics import SchedulerMetrics
    from srt.managers.scheduler.req import Req
    from srt.managers.scheduler.runner_protocol import SampleResult
    from srt.server_args import ServerArgs

# decode steps a request skips drafting after its budget fell to 0
COOLDOWN_STEPS = 8


@dataclass(slots=True)
class SpecReqState:
    """A request's drafting state: its history index, budget and counters."""

    index: NgramIndex
    budget: int
    cooldown: int = 0
    unsent_accepts: list[int] = field(default_factory=list)  # tokens per step, not yet reported

    def on_plain_step(self) -> None:
        self.unsent_accepts.append(1)

    def take_accepts(self) -> list[int]:
        out, self.unsent_accepts = self.unsent_accepts, []
        return out


class SpeculativeDecoder:
    """See the module docstring. ``max_positions``: the width of a req_to_token row."""

    def __init__(
        self, cfg: NgramConfig, max_batch_size: int, max_positions: int, metrics: SchedulerMetrics
    ) -> None:
        self.cfg = cfg
        self.max_batch_size = max_batch_size
        self.max_positions = max_positions
        self.metrics = metrics
        self.store = NgramStore(cfg.capacity, cfg.num_draft_tokens) if cfg.capacity > 0 else None

    @classmethod
    def from_server_args(
        cls, a: ServerArgs, max_positions: int, metrics: SchedulerMetrics
    ) -> SpeculativeDecoder | None:
        if a.speculative_algorithm is None:
            return None
        cfg = NgramConfig(
            a.speculative_num_draft_tokens,
            a.speculative_ngram_min_match_window_size,
            a.speculative_ngram_max_match_window_size,
            a.speculative_ngram_capacity,
        )
        return cls(cfg, a.speculative_max_batch_size, max_positions, metrics)

    # ------------------------------------------------------------------ drafting
    def state(self, req: Req) -> SpecReqState:
        if req.spec is None:
            req.spec = SpecReqState(NgramIndex(), self.cfg.num_draft_tokens)
        return req.spec

    def draft(self, req: Req) -> list[int]:
        """This step's draft of ``req`` (maybe empty); counts its cooldown."""
        st = self.state(req)
        if req.grammar is not None:
            return []
        if st.cooldown > 0:
            st.cooldown -= 1
            if st.cooldown == 0:
                st.budget = 1
            return []
        # room: the bonus token must fit max_new_tokens, every row a position of the row
        k = min(st.budget, req.remaining_new_tokens - 1, self.max_positions - req.kv_allocated_len - 1)
        if k <= 0:
            return []
        ids = st.index.sync(req.prompt_ids, req.output_ids)
        cfg = self.cfg
        d = st.index.draft(ids, k, cfg.min_match, cfg.max_match)
        if not d and self.store is not None:
            d = self.store.draft(ids, k)
        return d

    def plan(self, running: list[Req]) -> list[list[int]]:
        """Drafts of every running request (the caller keeps larger batches than
        ``max_batch_size`` on the plain decode path)."""
        return [self.draft(r) for r in running]

    # ------------------------------------------------------------------ the batch
    def prepare_batch(self, running: list[Req], cache: CacheManager) -> ScheduleBatch:
        """The verify batch of ``running`` (module docstring); without drafts (none found, or
        their slots not free) one row per request, as a plain decode step, which must fit."""
        drafts = self.plan(running)
        P = cache.page_size
        prefix = [r.kv_allocated_len for r in running]
        seq = [p + 1 + len(d) for p, d in zip(prefix, drafts)]
        need = sum(page_ceil(s, P) - page_ceil(p, P) for p, s in zip(prefix, seq))
        if need > cache.allocator.available_size() and any(drafts):
            drafts = [[] for _ in running]
            seq = [p + 1 for p in prefix]
            need = ScheduleBatch.decode_slots_needed(running, P)
            if not cache.ensure_free(need):
                raise KVAllocationError(f"decode needs {need} KV slots, {cache.available()} obtainable")
        pool = cache.req_to_token_pool
        last_loc = last_locs(pool.req_to_token, running, prefix) if P > 1 else prefix
        out = cache.allocator.alloc_extend(prefix, seq, last_loc)
        if out is None:
            raise KVAllocationError(f"verify needs {need} KV slots, {cache.allocator.available_size()} free")
        rows: list[Req] = []
        input_ids: list[int] = []
        positions: list[int] = []
        off = 0
        for r, p, s, d in zip(running, prefix, seq, drafts):
            n = s - p
            pool.write(r.req_pool_idx, p, out[off : off + n])
            off += n
            r.kv_allocated_len = s
            rows += [r] * n
            input_ids.append(r.output_ids[-1])
            input_ids += d
            positions += range(p, s)
        dev = pool.req_to_token.device
        pool_rows = [r.req_pool_idx for r in rows]
        return ScheduleBatch(
            forward_mode=ForwardMode.DECODE,
            reqs=rows,
            input_ids=input_ids,
            req_pool_indices=pool_rows,
            prefix_lens=positions,
            extend_lens=[1] * len(rows),
            out_cache_loc=out,
            req_pool_indices_t=torch.tensor(pool_rows, dtype=torch.int64, device=dev),
            positions_t=torch.tensor(positions, dtype=torch.int64, device=dev),
            verify=VerifyRows(list(running), drafts),
        )

    # ------------------------------------------------------------------ results
    def process_result(
        self,
        batch: ScheduleBatch,
        sample_output: SampleResult,
        cache: CacheManager,
        release: Callable[[Req], None],
    ) -> BatchResult:
        """Accept each request's tokens (module docstring), free the rejected rows' KV, finish
        and release requests."""
        next_ids, lps, tops = sampled_lists(sample_output)
        verify = batch.verify
        assert verify is not None
        finished = False
        appended = 0
        row = 0
        P = cache.page_size
        for req, draft in zip(verify.reqs, verify.drafts):
            n = 1 + len(draft)
            p = req.kv_committed_len
            m = 0  # tokens appended
            for j in range(n):
                t = next_ids[row + j]
                req.output_ids.append(t)
                m += 1
                if lps is not None and req.return_logprob:
                    record_logprob(req, lps[row + j], tops[row + j] if tops is not None else [])
                if len(req.output_ids) >= req.max_new_tokens or t in req.stop_ids:
                    req.check_finished(t)
                if req.grammar is not None and req.finished_reason is None:  # never drafts
                    GrammarManager.accept(req, t)
                if req.finished_reason is not None or j == n - 1 or t != draft[j]:
                    break
            row += n
            appended += m
            req.kv_committed_len = p + m
            keep = page_ceil(p + m, P)  # a partly used last page stays the request's
            if keep < p + n:
                cache.allocator.free(
                    cache.req_to_token_pool.req_to_token[req.req_pool_idx, keep : p + n].clone()
                )
            req.kv_allocated_len = p + m
            self._after_verify(req, len(draft), m)
            if req.finished_reason is not None:
                if self.store is not None:
                    self.store.add(req.output_ids)
                release(req)
                finished = True
        return BatchResult([], appended, finished, list(verify.reqs))

    def _after_verify(self, req: Req, drafted: int, produced: int) -> None:
        st = self.state(req)
        st.unsent_accepts.append(produced)
        self.metrics.on_verify(drafted, produced)
        if drafted == 0:
            return
        accepted = produced - 1
        if accepted >= drafted:
            st.budget = min(self.cfg.num_draft_tokens, st.budget + 1)
        elif accepted == 0:
            st.budget //= 2
            if st.budget == 0:
                st.cooldown = COOLDOWN_STEPS

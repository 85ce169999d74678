"""ChunkCache: the prefix cache used with --disable-radix-cache (no sharing).

Nothing is ever cached: ``match_prefix`` finds nothing, every KV slot a request holds is
owned by that request, and ``cache_finished_req`` frees all of them. It still implements
``cache_unfinished_req`` so that chunked prefill works the same way as with the radix cache:
after a chunk, ``req.prefix_indices`` holds the slots of every token computed so far (still
owned by the request, not cached).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from srt.mem_cache.base_prefix_cache import BasePrefixCache, MatchResult, PrefixCacheReq
from srt.utils.pages import page_ceil

if TYPE_CHECKING:
    from srt.mem_cache.allocator import TokenToKVPoolAllocator
    from srt.mem_cache.memory_pool import ReqToTokenPool


class ChunkCache(BasePrefixCache):
    """Prefix cache without sharing (same interface as RadixCache; locks are no-ops)."""

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        page_size: int,
    ):
        self.req_to_token_pool = req_to_token_pool
        self.allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self._empty = torch.empty(0, dtype=torch.int64, device=token_to_kv_pool_allocator.device)

    def match_prefix(self, key: list[int], namespace: str = "") -> MatchResult:
        """Always the empty prefix; last_node is None."""
        return MatchResult(self._empty, None)

    def insert(self, key: list[int], value: torch.Tensor, namespace: str = "") -> int:
        """There is no tree: the slots handed over are freed at once (as if inserted and
        evicted immediately). Returns 0."""
        if len(value):
            self.allocator.free(value.clone())
        return 0

    def cache_finished_req(self, req: PrefixCacheReq) -> None:
        """Free every slot of the req (``req_to_token[idx, :kv_allocated_len]``) and its row."""
        if req.req_pool_idx is None:
            raise AssertionError("cache_finished_req: req has no req_pool_idx")
        kv = self.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_allocated_len]
        if len(kv):
            self.allocator.free(kv.clone())
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.last_node = None

    def cache_unfinished_req(self, req: PrefixCacheReq) -> None:
        """``req.prefix_indices`` = slots of all of ``req.fill_ids`` (still owned by the req)."""
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        req.prefix_indices = row[: len(req.fill_ids)].clone()

    def slots_owned_by_req(self, req: PrefixCacheReq) -> int:
        """All of the req's pages are its own (nothing is in a tree)."""
        return page_ceil(req.kv_allocated_len, self.page_size)

    def inc_lock_ref(self, node) -> None:
        return None

    def dec_lock_ref(self, node) -> None:
        return None

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def reset(self) -> None:
        return None

    def check_integrity(self, owned_by_requests: int = 0) -> None:
        """free + owned_by_requests == total."""
        free, total = self.allocator.available_size(), self.allocator.size
        if free + owned_by_requests != total:
            raise AssertionError(f"free {free} + owned {owned_by_requests} != total {total}")

    def pretty_print(self, max_tokens: int = 8) -> str:
        return "ChunkCache (no tree)"

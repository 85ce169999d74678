"""The prefix-cache contract shared by RadixCache and ChunkCache (no sharing).

Ownership of KV slots. Every KV slot of the pool is, at any moment, in exactly one of:
  * free         -- in the allocator's free list;
  * cached       -- referenced by a tree node; *evictable* if no running request locks
                    the node (lock_ref == 0), *protected* (locked) otherwise;
  * owned by a request -- allocated for a running request and not (yet) in the tree
                    (the part of its sequence past its matched/inserted prefix).
Integrity: free + evictable + protected + owned == total. With no request running,
owned == 0, so free + evictable + protected == total (``check_integrity``).

Keys are token-id lists; values are the KV slot indices (int64 tensor) of those tokens.
With page_size P > 1 the tree stores whole pages only: every key length is a multiple
of P, and a node's value begins on a page boundary.

Fields of a request the cache reads and writes (``PrefixCacheReq``; srt/managers/scheduler/req.py's
``Req`` satisfies it, and the cache never imports the managers):
  req.origin_input_ids, req.output_ids  -- token ids
  req.fill_ids       -- the ids whose KV is computed after the current step
                        (prompt chunk so far, or prompt + output for retracted reqs)
  req.req_pool_idx   -- row of req_to_token_pool holding the req's KV slot indices:
                        req_to_token[req_pool_idx, t] = slot of token t
  req.prefix_indices -- int64 tensor: KV slots of the req's leading tokens that need no
                        recompute. Its first ``len(prefix_indices) // P * P`` slots belong to
                        the tree (locked through last_node); the remaining < P slots (only after
                        cache_unfinished_req of an unaligned fill) are still the req's own.
  req.last_node      -- the tree node that req locks (root if nothing matched; None for ChunkCache)
  req.kv_committed_len -- (set by the scheduler after every forward) number of leading tokens of
                        ``origin_input_ids + output_ids`` whose KV is written in the pool. After a
                        decode step that is ``len(origin_input_ids + output_ids) - 1``: the last
                        sampled token has no KV yet. Includes the matched prefix.
  req.kv_allocated_len -- (set by the scheduler whenever it allocates) number of leading entries of
                        the req's req_to_token row holding slots (>= kv_committed_len; equal
                        unless slots were allocated for a forward that never ran).

Lifecycle of a request (scheduler side):
  1. ``m = cache.match_prefix(ids[:-1])`` (ids = origin_input_ids + output_ids; keep >= 1 token
     to compute: logits need a forward); ``req.prefix_indices, req.last_node = m``;
     ``cache.inc_lock_ref(m.last_node)`` once admitted (before anything may evict).
  2. allocate a req_to_token row and the extend slots (``allocator.alloc_extend``), write the
     prefix and new slots into the row, run the forward, set kv_committed/allocated_len.
  3. after a non-final prefill chunk: ``cache.cache_unfinished_req(req)``.
  4. on finish, abort or retraction: ``cache.cache_finished_req(req)``; afterwards
     ``req.req_pool_idx`` and ``req.last_node`` are None (a retracted req must be matched again).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, NamedTuple, Protocol

import torch

from srt.utils.pages import page_ceil, page_floor


class MatchResult(NamedTuple):
    device_indices: torch.Tensor  # int64 KV slots of the longest cached prefix (page-aligned length)
    last_node: Any  # the cache's opaque handle to lock with inc_lock_ref while the prefix is in use


class PrefixCacheReq(Protocol):
    """The request fields of the prefix-cache contract (meanings in the module docstring)."""

    origin_input_ids: list[int]
    output_ids: list[int]
    fill_ids: list[int]
    req_pool_idx: int | None
    prefix_indices: torch.Tensor
    last_node: Any  # the handle of MatchResult.last_node (None once released)
    kv_committed_len: int
    kv_allocated_len: int
    lora_name: str  # the namespace of its KV: the LoRA adapter it runs ("" the base model)


class BasePrefixCache(ABC):
    page_size: int

    @abstractmethod
    def match_prefix(self, key: list[int], namespace: str = "") -> MatchResult:
        """Longest cached prefix of ``key`` (length a multiple of page_size) among the KV of
        ``namespace`` (the LoRA adapter that computed it; "" the base model).

        Refreshes the LRU time of the matched path. Does not lock: a caller that will
        use the slots must ``inc_lock_ref(last_node)`` before anything may evict."""

    @abstractmethod
    def insert(self, key: list[int], value: torch.Tensor, namespace: str = "") -> int:
        """Insert key -> value into ``namespace`` (len(key) == len(value), a multiple of page_size).

        Returns the length of the prefix of ``key`` that was already cached. For that part the
        tree keeps its own slots; the caller's slots ``value[:returned]`` that differ are
        duplicates the caller must free. Slots of the new suffix become owned by the tree."""

    @abstractmethod
    def cache_finished_req(self, req: PrefixCacheReq) -> None:
        """A request finished (or is aborted/retracted): hand its KV to the tree (insert of
        ``(origin_input_ids + output_ids)[:kv_committed_len]``, page-aligned), free duplicates,
        the unaligned tail and the slots past kv_committed_len up to kv_allocated_len, unlock
        ``req.last_node`` and free ``req.req_pool_idx``; then set req.req_pool_idx and
        req.last_node to None."""

    @abstractmethod
    def cache_unfinished_req(self, req: PrefixCacheReq) -> None:
        """A chunk of ``req.fill_ids`` was prefilled (KV of all of fill_ids is in the pool):
        insert it (page-aligned) so that other requests can share it at once, free the req's
        slots the tree already had (rewriting req_to_token with the tree's), move the req's
        lock to the new last node and set ``req.prefix_indices`` to the slots of all of
        fill_ids (tree part + the req's own unaligned tail), so
        ``len(req.prefix_indices) == len(req.fill_ids)``."""

    @abstractmethod
    def inc_lock_ref(self, node) -> None:
        """Protect node and all its ancestors from eviction."""

    @abstractmethod
    def dec_lock_ref(self, node) -> None:
        """Undo one inc_lock_ref."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots (if possible) from unlocked leaves in LRU order
        to the allocator; return the number freed. Cost per evicted page must not grow with
        the size of the tree."""

    @abstractmethod
    def evictable_size(self) -> int: ...

    @abstractmethod
    def protected_size(self) -> int: ...

    @abstractmethod
    def reset(self) -> None:
        """Drop the whole tree, returning every cached slot to the allocator. Only valid while
        no request holds a lock (RadixCache raises RuntimeError otherwise)."""

    @abstractmethod
    def check_integrity(self, owned_by_requests: int = 0) -> None:
        """Raise AssertionError unless free + evictable + protected + owned_by_requests == total
        and the tree's internal invariants hold."""

    def hit_stats(self) -> tuple[int, int]:
        """(matched tokens, looked-up tokens) since start, for the cache hit rate."""
        return (0, 0)

    def slots_owned_by_req(self, req: PrefixCacheReq) -> int:
        """Slots the running ``req`` holds outside the tree, in whole pages (sum this over the
        reqs holding a req_pool_idx for ``check_integrity(owned_by_requests=...)``)."""
        P = self.page_size
        return page_ceil(req.kv_allocated_len, P) - page_floor(len(req.prefix_indices), P)

    def total_size(self) -> int:
        """Slots held by the cache (evictable + protected)."""
        return self.evictable_size() + self.protected_size()

    def drop_namespace(self, namespace: str) -> int:
        """Forget the KV cached under ``namespace`` (no request may hold it); returns the slots freed."""
        return 0

    def pretty_print(self, max_tokens: int = 8) -> str:
        """Human-readable dump of the cache (debugging)."""
        return type(self).__name__

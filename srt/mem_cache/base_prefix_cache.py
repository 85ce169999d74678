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

Fields of ``Req`` the cache reads and writes (see srt/managers/schedule_batch.py):
  req.origin_input_ids, req.output_ids  -- token ids
  req.fill_ids       -- the ids whose KV is computed after the current step
                        (prompt chunk so far, or prompt + output for retracted reqs)
  req.req_pool_idx   -- row of req_to_token_pool holding the req's KV slot indices
  req.prefix_indices -- int64 tensor: KV slots of the prefix the req reuses from the tree
  req.last_node      -- the tree node that req locks (None for ChunkCache)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, NamedTuple

import torch


class MatchResult(NamedTuple):
    device_indices: torch.Tensor  # int64 KV slots of the longest cached prefix (page-aligned length)
    last_node: Any  # handle to lock with inc_lock_ref while the prefix is in use


class BasePrefixCache(ABC):
    @abstractmethod
    def match_prefix(self, key: list[int]) -> MatchResult:
        """Longest cached prefix of ``key`` (length a multiple of page_size).

        Refreshes the LRU time of the matched path. Does not lock: a caller that will
        use the slots must ``inc_lock_ref(last_node)`` before anything may evict."""

    @abstractmethod
    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Insert key -> value (len(key) == len(value), a multiple of page_size).

        Returns the length of the prefix of ``key`` that was already cached. For that part the
        tree keeps its own slots; the caller's slots ``value[:returned]`` that differ are
        duplicates the caller must free. Slots of the new suffix become owned by the tree."""

    @abstractmethod
    def cache_finished_req(self, req) -> None:
        """A request finished (or is aborted/retracted): hand its KV to the tree (insert of
        its tokens whose KV exists, page-aligned), free duplicates and the unaligned tail,
        unlock ``req.last_node`` and free ``req.req_pool_idx``."""

    @abstractmethod
    def cache_unfinished_req(self, req) -> None:
        """A chunk of ``req.fill_ids`` was prefilled: insert it (page-aligned) so that other
        requests can share it at once, then move the req's lock to the new last node and set
        ``req.prefix_indices`` to the tree's slots (writing them into req_to_token)."""

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
        """Drop the whole tree, returning every cached slot to the allocator."""

    @abstractmethod
    def check_integrity(self, owned_by_requests: int = 0) -> None:
        """Raise AssertionError unless free + evictable + protected + owned_by_requests == total
        and the tree's internal invariants hold."""

    def hit_stats(self) -> tuple[int, int]:
        """(matched tokens, looked-up tokens) since start, for the cache hit rate."""
        return (0, 0)

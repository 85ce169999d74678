"""The cache part: the scheduler's memory and every operation on it.

``CacheManager`` owns the request rows (``ReqToTokenPool``), the KV slots
(``TokenToKVPoolAllocator``) and the prefix cache (``RadixCache``, or ``ChunkCache`` with
``--disable-radix-cache``), and is the only part that calls them. It follows the prefix-cache
contract of srt/mem_cache/base_prefix_cache.py:

    match(req)            longest cached prefix of req.prefix_match_key() -> req.prefix_indices
    lock(req) / unlock    protect the matched prefix from eviction (admission) / undo
    cache_unfinished(req) a prefill chunk is done: make it shareable
    release(req)          a finished request: KV to the prefix cache, row freed, req FINISHED
    retract(req)          a retracted request: KV to the prefix cache, row freed, req WAITING
    ensure_free(n)        evict cached prefixes until n slots are free
    flush()               drop the prefix cache (idle only), repairing a leak if one is found

It is also the ``BatchMemory`` that ``ScheduleBatch.prepare_extend`` / ``prepare_decode``
allocate from.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from srt.managers.scheduler.lora_slots import LoRASlots
    from srt.managers.scheduler.req import Req
    from srt.mem_cache.allocator import TokenToKVPoolAllocator
    from srt.mem_cache.base_prefix_cache import BasePrefixCache
    from srt.mem_cache.memory_pool import ReqToTokenPool

logger = logging.getLogger("srt.scheduler")


@dataclass(slots=True)
class CacheManager:
    """The memory one scheduler allocates from (see the module docstring)."""

    req_to_token_pool: ReqToTokenPool
    allocator: TokenToKVPoolAllocator
    tree_cache: BasePrefixCache
    page_size: int
    # the LoRA adapter slots requests hold while admitted (None without --enable-lora)
    lora_slots: LoRASlots | None = None

    @classmethod
    def create(
        cls, req_to_token_pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator, radix: bool
    ) -> CacheManager:
        """A manager over these pools with a ``RadixCache`` (``radix``) or a ``ChunkCache``."""
        page_size = allocator.page_size
        if radix:
            from srt.mem_cache.radix_cache import RadixCache

            tree: BasePrefixCache = RadixCache(req_to_token_pool, allocator, page_size)
        else:
            from srt.mem_cache.chunk_cache import ChunkCache

            tree = ChunkCache(req_to_token_pool, allocator, page_size)
        return cls(req_to_token_pool, allocator, tree, page_size)

    # ------------------------------------------------------------------ capacity
    def available(self) -> int:
        """Slots obtainable now: free + evictable."""
        return self.allocator.available_size() + self.tree_cache.evictable_size()

    def token_usage(self) -> float:
        """Fraction of the KV slots not obtainable now (neither free nor evictable)."""
        return 1.0 - self.available() / self.allocator.size

    def free_rows(self) -> int:
        return self.req_to_token_pool.available_size()

    def ensure_free(self, num_slots: int) -> bool:
        """Evict from the cache until ``num_slots`` slots are free; False if impossible."""
        free = self.allocator.available_size()
        if free < num_slots:
            self.tree_cache.evict(num_slots - free)
        return self.allocator.available_size() >= num_slots

    # ------------------------------------------------------------------ prefix matching
    def match(self, req: Req, key: list[int]) -> int:
        """Match ``key`` (``req.prefix_match_key()``) against the cache; sets
        ``req.prefix_indices`` / ``req.last_node`` (not locked) and returns the prefix length."""
        m = self.tree_cache.match_prefix(key, req.lora_name)
        req.prefix_indices, req.last_node = m.device_indices, m.last_node
        return len(m.device_indices)

    def drop_match(self, req: Req) -> None:
        """Forget an unlocked match: a waiting request holds no match."""
        req.prefix_indices, req.last_node = req.prefix_indices[:0], None

    def lock(self, req: Req) -> int:
        """Lock the matched prefix; returns the evictable slots the lock took away."""
        before = self.tree_cache.evictable_size()
        self.tree_cache.inc_lock_ref(req.last_node)
        return before - self.tree_cache.evictable_size()

    def unlock(self, req: Req) -> None:
        self.tree_cache.dec_lock_ref(req.last_node)

    # ------------------------------------------------------------------ handing KV back
    def cache_unfinished(self, req: Req) -> None:
        """A prefill chunk (or the whole prompt) of ``req`` has KV: make it shareable."""
        self.tree_cache.cache_unfinished_req(req)

    def release(self, req: Req) -> None:
        """Give back everything a finished request holds (its KV goes to the prefix cache);
        the request becomes FINISHED."""
        if req.req_pool_idx is not None:
            self.tree_cache.cache_finished_req(req)
        if self.lora_slots is not None:
            self.lora_slots.release(req)
        req.mark_released()

    def retract(self, req: Req) -> None:
        """Take a running (or mid-prompt) request's KV back (into the prefix cache, so
        re-admission can reuse it); the request becomes WAITING with its output kept."""
        self.tree_cache.cache_finished_req(req)
        if self.lora_slots is not None:
            self.lora_slots.release(req)
        req.retract()
        req.fill_ids = []

    def begin_free_group(self) -> None:
        """Collect the allocator's frees (of one step's result processing) until
        ``end_free_group``, which frees them in one call."""
        self.allocator.free_group_begin()

    def end_free_group(self) -> None:
        self.allocator.free_group_end()

    # ------------------------------------------------------------------ control
    def flush(self) -> str:
        """Drop the prefix cache (no request may hold anything). Afterwards every KV slot and
        request row is free; returns "" or a message describing the leak that was repaired."""
        self.tree_cache.reset()
        pool, alloc = self.req_to_token_pool, self.allocator
        free, total = alloc.available_size(), alloc.size
        rows_free = pool.available_size()
        if free == total and rows_free == pool.size:
            return ""
        message = (
            f"leak repaired: {total - free} KV slots and {pool.size - rows_free} "
            "request rows were not free after the flush"
        )
        logger.error("flush_cache: %s", message)
        alloc.clear()
        pool.clear()
        return message

    def check_idle(self) -> None:
        """The cache's slot accounting with no request holding anything."""
        self.tree_cache.check_integrity(0)

    def check_integrity(self, holders: Sequence[Req]) -> None:
        """The cache's slot accounting, counting the slots ``holders`` (the requests holding a
        request row: running and mid-prompt) own; and one request row per holder."""
        owned = sum(self.tree_cache.slots_owned_by_req(r) for r in holders)
        self.tree_cache.check_integrity(owned)
        rows = self.req_to_token_pool.size - self.req_to_token_pool.available_size()
        assert rows == len(holders), f"{rows} request rows in use, {len(holders)} requests hold one"

    def evictable_size(self) -> int:
        return self.tree_cache.evictable_size()

    def protected_size(self) -> int:
        return self.tree_cache.protected_size()

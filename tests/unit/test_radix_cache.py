"""RadixCache: matching, page-aligned splits, locking, LRU eviction, request hand-over."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from srt.mem_cache.allocator import TokenToKVPoolAllocator
from srt.mem_cache.chunk_cache import ChunkCache
from srt.mem_cache.memory_pool import ReqToTokenPool
from srt.mem_cache.radix_cache import RadixCache


@dataclass
class FakeReq:
    """The Req fields the prefix-cache contract names (base_prefix_cache.py)."""

    origin_input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    fill_ids: list[int] = field(default_factory=list)
    req_pool_idx: int | None = None
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None
    kv_committed_len: int = 0
    kv_allocated_len: int = 0
    lora_name: str = ""


def make(P: int, pages: int = 64, reqs: int = 8, ctx: int = 256) -> tuple[RadixCache, TokenToKVPoolAllocator]:
    alloc = TokenToKVPoolAllocator(pages * P, P, debug=True)
    pool = ReqToTokenPool(reqs, ctx, "cpu")
    return RadixCache(pool, alloc, P), alloc


def insert_fresh(cache: RadixCache, key: list[int]) -> torch.Tensor:
    """Allocate slots for key, insert, free the duplicates as the contract says; return the
    tree's slots for key."""
    value = cache.allocator.alloc(len(key))
    n = cache.insert(key, value)
    cache.allocator.free(value[:n])
    return cache.match_prefix(key).device_indices


def admit(cache: RadixCache, ids: list[int], fill_len: int | None = None) -> FakeReq:
    """Scheduler-side admission: match, lock, allocate a row + extend slots, 'run' the forward."""
    req = FakeReq(origin_input_ids=list(ids))
    m = cache.match_prefix(ids[:-1])
    req.prefix_indices, req.last_node = m.device_indices, m.last_node
    cache.inc_lock_ref(req.last_node)
    req.req_pool_idx = cache.req_to_token_pool.alloc(1)[0]
    extend_to(cache, req, len(ids) if fill_len is None else fill_len, start=len(req.prefix_indices))
    return req


def extend_to(cache: RadixCache, req: FakeReq, n: int, start: int | None = None) -> None:
    row = cache.req_to_token_pool.req_to_token[req.req_pool_idx]
    p = req.kv_committed_len if start is None else start
    if start is not None:
        row[:p] = req.prefix_indices
    last = int(row[p - 1]) if p else -1
    out = cache.allocator.alloc_extend([p], [n], [last])
    assert out is not None
    row[p:n] = out
    req.fill_ids = (req.origin_input_ids + req.output_ids)[:n]
    req.kv_committed_len = req.kv_allocated_len = n


def owned(cache: RadixCache, *reqs: FakeReq) -> int:
    return sum(cache.slots_owned_by_req(r) for r in reqs if r.req_pool_idx is not None)


@pytest.mark.parametrize("P", [1, 4])
def test_match_after_insert(P: int):
    cache, alloc = make(P)
    key = list(range(1, 4 * P + 1))
    slots = insert_fresh(cache, key)
    assert len(slots) == len(key)
    m = cache.match_prefix(key + [999] * P)
    assert torch.equal(m.device_indices, slots)
    assert cache.match_prefix([12345] * P).device_indices.numel() == 0
    assert cache.match_prefix([12345] * P).last_node is cache.root
    # a key shorter than a page matches nothing
    if P > 1:
        assert cache.match_prefix(key[: P - 1]).device_indices.numel() == 0
    assert cache.evictable_size() == len(key) and cache.protected_size() == 0
    cache.check_integrity()


def test_split_only_on_page_boundaries():
    P = 4
    cache, alloc = make(P)
    a = list(range(100, 112))  # 3 pages
    slots = insert_fresh(cache, a)
    # match ends inside page 2 -> rounded down to 1 page, node split after 4 tokens
    m = cache.match_prefix(a[:6] + [7, 7, 7, 7])
    assert torch.equal(m.device_indices, slots[:4])
    (top,) = cache.root.children.values()
    assert top.key == a[:4] and len(top.children) == 1
    (low,) = top.children.values()
    assert low.key == a[4:] and m.last_node is top
    # a key differing inside page 3 shares 2 pages -> split at 8, a new sibling page
    b = a[:9] + [0, 0, 0]
    value = alloc.alloc(12)
    assert cache.insert(b, value) == 8
    alloc.free(value[:8])
    mid = top.children[tuple(a[4:8])]
    assert mid.key == a[4:8] and set(mid.children) == {tuple(a[8:12]), tuple(b[8:12])}
    for node in (top, mid, *mid.children.values()):
        assert len(node.key) % P == 0
    cache.check_integrity()


def test_insert_returns_cached_prefix_len_and_keeps_tree_slots():
    cache, alloc = make(1)
    first = insert_fresh(cache, [1, 2, 3, 4])
    value = alloc.alloc(6)
    assert cache.insert([1, 2, 3, 9, 9, 9], value) == 3
    alloc.free(value[:3])
    got = cache.match_prefix([1, 2, 3, 9, 9, 9]).device_indices
    assert torch.equal(got[:3], first[:3]) and torch.equal(got[3:], value[3:])
    assert torch.equal(cache.match_prefix((1, 2, 3, 9)).device_indices, got[:4])  # any int sequence
    value = alloc.alloc(4)
    assert cache.insert([1, 2, 3, 4], value) == 4  # fully present: nothing taken
    alloc.free(value)
    cache.check_integrity()


def test_lock_protects_from_eviction_and_counters():
    cache, alloc = make(1, pages=32)
    s1 = insert_fresh(cache, [1, 2, 3, 4])
    insert_fresh(cache, [1, 2, 7, 8])
    m = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(m.last_node)
    assert cache.protected_size() == 4 and cache.evictable_size() == 2  # [7, 8] only
    assert cache.evict(100) == 2
    assert torch.equal(cache.match_prefix([1, 2, 3, 4]).device_indices, s1)
    assert cache.match_prefix([1, 2, 7, 8]).device_indices.numel() == 2
    cache.check_integrity()
    cache.dec_lock_ref(m.last_node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 4
    with pytest.raises(AssertionError):
        cache.dec_lock_ref(m.last_node)
    # nodes are not merged back: leaf [3, 4] goes first (whole), then its parent [1, 2]
    assert cache.evict(1) == 2
    assert torch.equal(cache.match_prefix([1, 2, 3, 4]).device_indices, s1[:2])
    assert cache.evict(1) == 2
    assert alloc.available_size() == 32
    cache.check_integrity()


def test_lru_order_and_parent_becomes_candidate():
    cache, alloc = make(1, pages=64)
    insert_fresh(cache, [1, 1, 1, 1])  # t1
    insert_fresh(cache, [2, 2, 2, 2])  # t2
    insert_fresh(cache, [3, 3, 3, 3])  # t3
    cache.match_prefix([1, 1, 1, 1])  # [1..] is now the most recent
    assert cache.evict(4) == 4
    assert cache.match_prefix([2, 2, 2, 2]).device_indices.numel() == 0
    assert cache.match_prefix([1, 1, 1, 1]).device_indices.numel() == 4
    assert cache.match_prefix([3, 3, 3, 3]).device_indices.numel() == 4  # touched -> newest
    # shared prefix [5,5] with two children; evicting the children frees the parent last
    insert_fresh(cache, [5, 5, 6])
    insert_fresh(cache, [5, 5, 7])
    cache.match_prefix([1, 1, 1, 1])
    cache.match_prefix([3, 3, 3, 3])
    assert cache.evict(1) == 1 and cache.evict(1) == 1  # [6] then [7]
    assert cache.total_size() == 4 + 4 + 2
    assert cache.evict(2) == 2  # the parent [5, 5] is now the oldest leaf
    assert cache.match_prefix([5, 5]).device_indices.numel() == 0
    assert cache.total_size() == 8
    cache.check_integrity()


def test_evict_frees_exactly_the_cached_slots():
    P = 4
    cache, alloc = make(P, pages=16)
    s = insert_fresh(cache, list(range(8)))
    t = insert_fresh(cache, list(range(50, 62)))
    free_before = set(alloc.free_page_ids().tolist())
    assert cache.evict(1) == 8  # the older leaf, whole
    freed = set(alloc.free_page_ids().tolist()) - free_before
    assert freed == set((s // P).tolist())
    assert cache.evict(1000) == 12
    assert set(alloc.free_page_ids().tolist()) - free_before == set((s // P).tolist()) | set(
        (t // P).tolist()
    )
    assert cache.evict(5) == 0
    cache.check_integrity()


@pytest.mark.parametrize("P", [1, 4])
def test_finished_req_is_cached_and_shared(P: int):
    cache, alloc = make(P)
    prompt = list(range(10, 10 + 3 * P + 1))
    r1 = admit(cache, prompt)
    r1.output_ids = [7, 8, 9]  # decoded; the last sampled token has no KV yet
    extend_to(cache, r1, len(prompt) + 2)
    cache.check_integrity(owned(cache, r1))
    kv = cache.req_to_token_pool.req_to_token[r1.req_pool_idx, : r1.kv_committed_len].clone()
    cache.cache_finished_req(r1)
    assert r1.req_pool_idx is None and r1.last_node is None
    cached = (len(prompt) + 2) // P * P
    assert cache.total_size() == cached and cache.protected_size() == 0
    cache.check_integrity()
    # a new request with the same prompt + outputs reuses exactly those slots
    r2 = admit(cache, prompt + [7, 8, 9, 1])
    assert torch.equal(r2.prefix_indices, kv[:cached])
    assert cache.protected_size() == cached
    cache.check_integrity(owned(cache, r2))
    cache.cache_finished_req(r2)
    cache.check_integrity()


@pytest.mark.parametrize("P", [1, 4])
def test_concurrent_duplicates_are_freed(P: int):
    """Two reqs prefill the same prompt before either is cached: the second's slots are
    duplicates of the first's and go back to the allocator."""
    cache, alloc = make(P)
    prompt = list(range(3 * P + 2))
    r1, r2 = admit(cache, prompt), admit(cache, prompt)
    cache.check_integrity(owned(cache, r1, r2))
    cache.cache_finished_req(r1)
    cache.check_integrity(owned(cache, r2))
    size_after_r1 = cache.total_size()
    cache.cache_finished_req(r2)
    assert cache.total_size() == size_after_r1 == len(prompt) // P * P
    assert alloc.available_size() == alloc.size - size_after_r1
    cache.check_integrity()


@pytest.mark.parametrize("P", [1, 4])
def test_unfinished_req_chunks_are_shared_at_once(P: int):
    cache, alloc = make(P)
    prompt = list(range(5 * P + 3))
    r1 = admit(cache, prompt, fill_len=2 * P + 1)  # unaligned chunk when P > 1
    cache.cache_unfinished_req(r1)
    assert len(r1.prefix_indices) == 2 * P + 1
    row = cache.req_to_token_pool.req_to_token[r1.req_pool_idx]
    assert torch.equal(r1.prefix_indices, row[: 2 * P + 1])
    assert cache.protected_size() == (2 * P + 1) // P * P and cache.evictable_size() == 0
    cache.check_integrity(owned(cache, r1))
    # another request sees the chunk (page-aligned part) right away
    r2 = admit(cache, prompt[: 2 * P + 1] + [999] * P)
    assert torch.equal(r2.prefix_indices, r1.prefix_indices[: (2 * P + 1) // P * P])
    cache.check_integrity(owned(cache, r1, r2))
    # second chunk, then the rest; the lock moves down
    extend_to(cache, r1, 4 * P)
    cache.cache_unfinished_req(r1)
    assert cache.protected_size() == 4 * P
    extend_to(cache, r1, len(prompt))
    r1.output_ids = [5]
    cache.check_integrity(owned(cache, r1, r2))
    cache.cache_finished_req(r1)
    cache.cache_finished_req(r2)
    assert cache.protected_size() == 0
    cache.check_integrity()


def test_unfinished_req_duplicates_rewrite_the_row():
    cache, alloc = make(1)
    prompt = list(range(12))
    r1, r2 = admit(cache, prompt, fill_len=6), admit(cache, prompt, fill_len=6)
    cache.cache_unfinished_req(r1)
    mine = cache.req_to_token_pool.req_to_token[r2.req_pool_idx, :6].clone()
    cache.cache_unfinished_req(r2)  # its 6 slots are duplicates of r1's
    row2 = cache.req_to_token_pool.req_to_token[r2.req_pool_idx, :6]
    assert torch.equal(row2, r1.prefix_indices) and torch.equal(r2.prefix_indices, r1.prefix_indices)
    assert not set(mine.tolist()) & set(row2.tolist())
    assert set(mine.tolist()) <= set(alloc.free_page_ids().tolist())
    cache.check_integrity(owned(cache, r1, r2))
    for r in (r1, r2):
        extend_to(cache, r, 12)
        cache.cache_finished_req(r)
    cache.check_integrity()


def test_finish_frees_slots_allocated_past_committed():
    P = 4
    cache, alloc = make(P)
    r = admit(cache, list(range(9)))  # 9 tokens, pages: 3
    r.output_ids = [1]
    out = alloc.alloc_decode([10], [int(cache.req_to_token_pool.req_to_token[r.req_pool_idx, 8])])
    cache.req_to_token_pool.req_to_token[r.req_pool_idx, 9] = out
    r.kv_allocated_len = 10  # allocated for a forward that never ran
    cache.check_integrity(owned(cache, r))
    cache.cache_finished_req(r)
    assert cache.total_size() == 8 and alloc.available_size() == alloc.size - 8
    cache.check_integrity()


def test_reset_hit_stats_pretty_print_and_disable():
    cache, alloc = make(1)
    insert_fresh(cache, [1, 2, 3])
    before = cache.hit_stats()
    cache.match_prefix([1, 2, 9, 9])
    assert cache.hit_stats() == (before[0] + 2, before[1] + 4)
    text = cache.pretty_print()
    assert "[1, 2]" in text and "[3]" in text and "lock=0" in text
    m = cache.match_prefix([1, 2, 3])
    cache.inc_lock_ref(m.last_node)
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.dec_lock_ref(m.last_node)
    cache.reset()
    assert alloc.available_size() == alloc.size and cache.total_size() == 0
    assert cache.match_prefix([1, 2, 3]).device_indices.numel() == 0
    cache.check_integrity()

    off = ChunkCache(cache.req_to_token_pool, alloc, 1)  # the cache of --disable-radix-cache
    r = admit(off, [1, 2, 3, 4])
    assert r.prefix_indices.numel() == 0
    r.output_ids = [5]
    off.cache_finished_req(r)
    assert off.match_prefix([1, 2, 3, 4]).device_indices.numel() == 0
    assert alloc.available_size() == alloc.size and off.total_size() == 0
    off.check_integrity()


def test_check_integrity_detects_corruption():
    cache, alloc = make(1)
    insert_fresh(cache, [1, 2, 3])
    cache._evictable += 1
    with pytest.raises(AssertionError):
        cache.check_integrity()
    cache._evictable -= 1
    cache.check_integrity()
    (node,) = cache.root.children.values()
    alloc.free(node.value[:1])  # a cached slot leaks into the free list
    with pytest.raises(AssertionError):
        cache.check_integrity()
    with pytest.raises(AssertionError):
        cache.check_integrity(owned_by_requests=1)


def _build_leaves(num_leaves: int) -> RadixCache:
    """num_leaves leaves of 2 tokens under 16 shared 2-token prefixes (P = 1)."""
    cache, alloc = make(1, pages=3 * num_leaves + 64, reqs=1, ctx=4)
    for i in range(num_leaves):
        insert_fresh(cache, [i % 16, 10**6, i, i + 1])
    return cache


def test_evict_cost_per_page_does_not_grow_with_tree():
    costs = []
    for n in (1000, 10000):
        cache = _build_leaves(n)
        # churn: touch and lock/unlock some leaves so the heap holds stale entries
        for i in range(0, n, 7):
            m = cache.match_prefix([i % 16, 10**6, i, i + 1])
            cache.inc_lock_ref(m.last_node)
            cache.dec_lock_ref(m.last_node)
        pops0 = cache.evict_heap_pops
        freed = cache.evict(400)
        assert 400 <= freed <= 401
        costs.append((cache.evict_heap_pops - pops0) / freed)
        assert len(cache._heap) <= 3 * n + 1100  # stale entries stay bounded
        cache.check_integrity()
    small, large = costs
    assert large <= 2.0 and large <= small * 1.5 + 0.5, costs


def test_heap_stays_bounded_under_repeated_touches():
    cache = _build_leaves(50)
    for _ in range(20000):
        cache.match_prefix([3, 10**6, 3, 4])
    assert len(cache._heap) <= 2 * 50 + 1024 + 1
    cached = cache.total_size()
    assert cache.evict(10**9) == cached == 16 * 2 + 50 * 2
    assert cache.allocator.available_size() == cache.allocator.size
    cache.check_integrity()


# ---------------------------------------------------------------------------------------------
# Randomized: thousands of operations checked against a reference model after every one.
#
# Reference: ``ref`` maps every cached page-prefix (tuple of the first k*P token ids) to the
# first slot of its last page; ``ref_time`` is the logical time each prefix was last touched
# (match/insert touch every page of the path, as the tree does node by node); ``ref_lock``
# counts locks covering each prefix. Evictions are observed through the allocator (a cached
# page that became free was evicted) and must remove unlocked leaves, oldest first.
# ---------------------------------------------------------------------------------------------


class Harness:
    def __init__(self, P: int, seed: int):
        import random

        self.P = P
        self.rng = random.Random(seed)
        self.num_pages = 48
        self.cache, self.alloc = make(P, pages=self.num_pages, reqs=6, ctx=16 * P + 8)
        self.pool = self.cache.req_to_token_pool
        self.ref: dict[tuple[int, ...], int] = {}
        self.ref_time: dict[tuple[int, ...], int] = {}
        self.ref_lock: dict[tuple[int, ...], int] = {}
        self.clock = 0
        self.reqs: list[FakeReq] = []  # running (prefilling or decoding)
        self.prefilling: set[int] = set()  # id() of reqs still prefilling
        self.locks: list[tuple[Any, tuple[int, ...]]] = []  # raw locks: (node, prefix)
        self.corpus: list[list[int]] = [[]]
        self.vocab = 3

    # ---- reference helpers
    def ref_match(self, key: list[int]) -> int:
        P, k = self.P, 0
        while k + P <= len(key) and tuple(key[: k + P]) in self.ref:
            k += P
        return k

    def ref_slots(self, key: list[int], m: int) -> list[int]:
        P = self.P
        return [self.ref[tuple(key[: k + P])] + j for k in range(0, m, P) for j in range(P)]

    def touch(self, key: list[int], m: int) -> None:
        self.clock += 1
        for k in range(self.P, m + 1, self.P):
            self.ref_time[tuple(key[:k])] = self.clock

    def lock_path(self, key: list[int], m: int, delta: int) -> None:
        for k in range(self.P, m + 1, self.P):
            q = tuple(key[:k])
            self.ref_lock[q] = self.ref_lock.get(q, 0) + delta
            assert self.ref_lock[q] >= 0

    def ref_insert(self, key: list[int], slots: list[int]) -> int:
        """Mirror of an insert of key (page-aligned) with the caller's slots; returns the
        already-cached length the tree must report."""
        m = self.ref_match(key)
        for k in range(m, len(key), self.P):
            self.ref[tuple(key[: k + self.P])] = slots[k]
        self.touch(key, len(key))
        return m

    def tree_locked_len(self, req: FakeReq) -> int:
        return len(req.prefix_indices) // self.P * self.P

    # ---- checks
    def free_pages(self) -> set[int]:
        return set(self.alloc.free_page_ids().tolist())

    def req_pages(self) -> set[int]:
        out: set[int] = set()
        for r in self.reqs:
            row = self.pool.req_to_token[r.req_pool_idx, self.tree_locked_len(r) : r.kv_allocated_len]
            pages = set((row // self.P).tolist())
            assert not pages & out, "two requests own the same page"
            out |= pages
        return out

    def check(self) -> None:
        P, cache = self.P, self.cache
        # the tree spells exactly the reference: prefix -> slot of each page
        tree: dict[tuple[int, ...], int] = {}
        stack = [(c, []) for c in cache.root.children.values()]
        while stack:
            node, pre = stack.pop()
            full, value = pre + node.key, node.value.tolist()
            for k in range(len(pre), len(full), P):
                tree[tuple(full[: k + P])] = value[k - len(pre)]
            stack.extend((c, full) for c in node.children.values())
        assert tree == self.ref
        locked = sum(1 for q in self.ref if self.ref_lock.get(q, 0) > 0)
        assert cache.protected_size() == locked * P
        assert cache.evictable_size() == (len(self.ref) - locked) * P
        # every page is in exactly one place: free, the tree, or one request
        free, mine = self.free_pages(), self.req_pages()
        cached = {s // P for s in self.ref.values()}
        assert not (free & cached) and not (free & mine) and not (cached & mine)
        assert len(free) + len(cached) + len(mine) == self.num_pages
        cache.check_integrity(owned(cache, *self.reqs))
        # each running request's row: tree part equals the tree's slots for its tokens
        for r in self.reqs:
            n = self.tree_locked_len(r)
            row = self.pool.req_to_token[r.req_pool_idx, :n].tolist()
            ids = r.origin_input_ids + r.output_ids
            assert row == self.ref_slots(ids, n) == r.prefix_indices[:n].tolist()

    # ---- allocation with eviction
    def with_evict(self, fn, need: int):
        before_free = self.free_pages()
        before_used = self.req_pages()
        out = fn()
        if out is None:
            self.evict(need)
            before_free = self.free_pages()
            out = fn()
        if out is not None:  # only pages that were free are handed out
            assert set((out // self.P).tolist()) - before_used <= before_free
        return out

    def evict(self, n: int) -> None:
        P = self.P
        free0 = self.free_pages()
        leaves = self.ref_leaves()
        freed = self.cache.evict(n)
        gone = {q for q, s in self.ref.items() if s // P in self.free_pages() - free0}
        assert freed == len(gone) * P
        assert freed >= n or self.cache.evictable_size() == 0
        for q in gone:
            assert self.ref_lock.get(q, 0) == 0, "evicted a locked page"
            del self.ref[q]
        for q in self.ref:  # what is left is still prefix-closed
            assert len(q) == P or q[:-P] in self.ref
        if gone:  # LRU: nothing evicted is newer than an evictable leaf that survived
            newest_gone = max(self.ref_time[q] for q in gone)
            survivors = [self.ref_time[q] for q in self.ref_leaves() if self.ref_lock.get(q, 0) == 0]
            assert all(newest_gone <= t for t in survivors)
            assert {q for q in gone if q in leaves} or not gone
        for q in gone:
            self.ref_time.pop(q, None)
            self.ref_lock.pop(q, None)

    def ref_leaves(self) -> set[tuple[int, ...]]:
        inner = {q[: -self.P] for q in self.ref if len(q) > self.P}
        return set(self.ref) - inner

    # ---- random inputs
    def random_ids(self, lo: int = 1) -> list[int]:
        base = self.rng.choice(self.corpus)
        cut = self.rng.randint(0, len(base))
        ids = base[:cut] + [
            self.rng.randrange(self.vocab) for _ in range(self.rng.randint(lo, 3 * self.P + 2))
        ]
        ids = ids[: 8 * self.P + 3]
        self.corpus.append(ids)
        if len(self.corpus) > 40:
            self.corpus.pop(1)
        return ids

    # ---- operations
    def op_match(self, lock: bool) -> None:
        key = self.random_ids(lo=0)
        m = self.cache.match_prefix(key)
        exp = self.ref_match(key)
        assert m.device_indices.tolist() == self.ref_slots(key, exp)
        self.touch(key, exp)
        if lock:
            self.cache.inc_lock_ref(m.last_node)
            self.locks.append((m.last_node, tuple(key[:exp])))
            self.lock_path(key, exp, +1)

    def op_unlock(self) -> None:
        if self.locks:
            node, q = self.locks.pop(self.rng.randrange(len(self.locks)))
            self.cache.dec_lock_ref(node)
            self.lock_path(list(q), len(q), -1)

    def op_insert(self) -> None:
        key = self.random_ids()
        key = key[: len(key) // self.P * self.P]
        value = self.with_evict(lambda: self.alloc.alloc(len(key)), len(key))
        if value is None:
            return
        exp = self.ref_insert(key, value.tolist())
        assert self.cache.insert(key, value) == exp
        self.alloc.free(value[:exp])  # duplicates, per the contract

    def op_admit(self) -> None:
        if self.pool.available_size() == 0:
            return
        ids = self.random_ids()
        req = FakeReq(origin_input_ids=ids)
        m = self.cache.match_prefix(ids[:-1])
        exp = self.ref_match(ids[:-1])
        assert m.device_indices.tolist() == self.ref_slots(ids, exp)
        self.touch(ids, exp)
        req.prefix_indices, req.last_node = m.device_indices, m.last_node
        self.cache.inc_lock_ref(m.last_node)
        self.lock_path(ids, exp, +1)
        req.req_pool_idx = self.pool.alloc(1)[0]
        self.pool.req_to_token[req.req_pool_idx, :exp] = m.device_indices
        req.kv_committed_len = req.kv_allocated_len = exp
        req.fill_ids = ids[:exp]
        self.reqs.append(req)
        self.prefilling.add(id(req))
        self.op_prefill(req)

    def op_prefill(self, req: FakeReq) -> None:
        P, ids = self.P, req.origin_input_ids
        p = req.kv_committed_len
        chunk = self.rng.choice([P, 2 * P, self.rng.randint(1, 2 * P + 1)])
        n = min(len(ids), p + chunk)
        row = self.pool.req_to_token[req.req_pool_idx]
        last = int(row[p - 1]) if p else -1
        need = (-(-n // P) - (-(-p // P))) * P
        out = self.with_evict(lambda: self.alloc.alloc_extend([p], [n], [last]), need)
        if out is None:  # cannot run: abort the request
            self.finish(req)
            return
        row[p:n] = out
        req.kv_committed_len = req.kv_allocated_len = n
        req.fill_ids = ids[:n]
        if n == len(ids):  # prefill done: first token sampled
            self.prefilling.discard(id(req))
            req.output_ids.append(self.rng.randrange(self.vocab))
            return
        old = self.tree_locked_len(req)
        aligned = n // P * P
        exp = self.ref_insert(ids[:aligned], row[:aligned].tolist())
        self.cache.cache_unfinished_req(req)
        assert len(req.prefix_indices) == n
        assert req.prefix_indices[:aligned].tolist() == self.ref_slots(ids, aligned)
        assert exp >= old
        self.lock_path(ids, old, -1)
        self.lock_path(ids, aligned, +1)

    def op_decode(self, req: FakeReq) -> None:
        c = req.kv_committed_len
        row = self.pool.req_to_token[req.req_pool_idx]
        out = self.with_evict(lambda: self.alloc.alloc_decode([c + 1], [int(row[c - 1])]), self.P)
        if out is None:  # retract
            self.finish(req)
            return
        row[c] = out
        req.kv_allocated_len = c + 1
        if self.rng.random() < 0.1:  # the forward never ran (abort right after allocation)
            self.finish(req)
            return
        req.kv_committed_len = c + 1
        req.output_ids.append(self.rng.randrange(self.vocab))
        if len(req.origin_input_ids) + len(req.output_ids) >= self.pool.max_context_len:
            self.finish(req)

    def finish(self, req: FakeReq) -> None:
        P = self.P
        ids = req.origin_input_ids + req.output_ids
        aligned = req.kv_committed_len // P * P
        row = self.pool.req_to_token[req.req_pool_idx]
        self.ref_insert(ids[:aligned], row[:aligned].tolist())
        self.lock_path(ids, self.tree_locked_len(req), -1)
        rows_free = self.pool.available_size()
        self.cache.cache_finished_req(req)
        assert self.pool.available_size() == rows_free + 1 and req.req_pool_idx is None
        self.reqs.remove(req)
        self.prefilling.discard(id(req))

    def step(self) -> None:
        r = self.rng.random()
        if r < 0.18:
            self.op_admit()
        elif r < 0.45 and self.reqs:
            req = self.rng.choice(self.reqs)
            if id(req) in self.prefilling:
                self.op_prefill(req)
            else:
                self.op_decode(req)
        elif r < 0.55 and self.reqs:
            self.finish(self.rng.choice(self.reqs))
        elif r < 0.65:
            self.op_match(lock=False)
        elif r < 0.75:
            self.op_insert()
        elif r < 0.82:
            self.op_match(lock=True)
        elif r < 0.9:
            self.op_unlock()
        else:
            self.evict(self.rng.randint(1, 6 * self.P))
        self.check()

    def drain(self) -> None:
        while self.reqs:
            self.finish(self.reqs[0])
            self.check()
        while self.locks:
            self.op_unlock()
        self.check()
        self.cache.reset()
        assert self.alloc.available_size() == self.alloc.size
        self.ref.clear()
        self.check()


@pytest.mark.parametrize("P", [1, 4, 16])
@pytest.mark.parametrize("seed", [0, 1])
def test_randomized_against_reference(P: int, seed: int):
    h = Harness(P, seed=1000 * P + seed)
    for _ in range(1200):
        h.step()
    h.drain()

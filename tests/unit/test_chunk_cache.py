"""ChunkCache (--disable-radix-cache): no sharing, every slot owned by its request."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from srt.mem_cache.allocator import TokenToKVPoolAllocator
from srt.mem_cache.chunk_cache import ChunkCache
from srt.mem_cache.memory_pool import ReqToTokenPool


@dataclass
class FakeReq:
    origin_input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    fill_ids: list[int] = field(default_factory=list)
    req_pool_idx: int | None = None
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None
    kv_committed_len: int = 0
    kv_allocated_len: int = 0
    lora_name: str = ""


def make(P: int, pages: int = 32, disable_radix: bool = False):
    alloc = TokenToKVPoolAllocator(pages * P, P, debug=True)
    pool = ReqToTokenPool(8, 64 * P, "cpu")
    cache = ChunkCache(pool, alloc, P)  # --disable-radix-cache and the plain ChunkCache are one path
    return cache, alloc, pool


def extend(cache, alloc, pool, req: FakeReq, n: int) -> None:
    row = pool.req_to_token[req.req_pool_idx]
    p = req.kv_allocated_len
    out = alloc.alloc_extend([p], [n], [int(row[p - 1]) if p else -1])
    assert out is not None
    row[p:n] = out
    req.fill_ids = req.origin_input_ids[:n]
    req.kv_committed_len = req.kv_allocated_len = n


def owned(cache, reqs) -> int:
    return sum(cache.slots_owned_by_req(r) for r in reqs)


@pytest.mark.parametrize("disable_radix", [False, True])
@pytest.mark.parametrize("P", [1, 4])
def test_chunked_prefill_then_finish_frees_everything(P: int, disable_radix: bool):
    cache, alloc, pool = make(P, disable_radix=disable_radix)
    ids = list(range(5 * P + 1))
    m = cache.match_prefix(ids)
    assert m.device_indices.numel() == 0 and m.last_node is None
    req = FakeReq(ids, prefix_indices=m.device_indices, last_node=m.last_node)
    cache.inc_lock_ref(req.last_node)
    req.req_pool_idx = pool.alloc(1)[0]
    extend(cache, alloc, pool, req, 2 * P + 1)
    cache.cache_unfinished_req(req)
    assert torch.equal(req.prefix_indices, pool.req_to_token[req.req_pool_idx, : 2 * P + 1])
    assert cache.evictable_size() == cache.protected_size() == cache.total_size() == 0
    cache.check_integrity(owned(cache, [req]))
    # nothing is shared: a second request with the same prompt matches nothing
    assert cache.match_prefix(ids).device_indices.numel() == 0
    extend(cache, alloc, pool, req, len(ids))
    req.output_ids = [1]
    # one slot allocated for a forward that never ran
    out = alloc.alloc_decode([len(ids) + 1], [int(pool.req_to_token[req.req_pool_idx, len(ids) - 1])])
    pool.req_to_token[req.req_pool_idx, len(ids)] = out
    req.kv_allocated_len += 1
    cache.check_integrity(owned(cache, [req]))
    rows = pool.available_size()
    cache.cache_finished_req(req)
    assert req.req_pool_idx is None and pool.available_size() == rows + 1
    assert alloc.available_size() == alloc.size
    assert cache.evict(100) == 0
    cache.check_integrity()


def test_insert_takes_and_drops_slots_and_integrity_detects_leaks():
    cache, alloc, pool = make(4)
    v = alloc.alloc(8)
    assert cache.insert(list(range(8)), v) == 0
    assert alloc.available_size() == alloc.size  # no tree: the slots went straight back
    cache.reset()
    leaked = alloc.alloc(4)
    with pytest.raises(AssertionError):
        cache.check_integrity()
    cache.check_integrity(owned_by_requests=4)
    alloc.free(leaked)
    assert cache.hit_stats() == (0, 0) and "ChunkCache" in cache.pretty_print()


@pytest.mark.parametrize("P", [1, 4, 16])
def test_random_requests_never_share_or_leak(P: int):
    rng = random.Random(P)
    cache, alloc, pool = make(P, pages=40)
    running: list[FakeReq] = []
    for _ in range(800):
        r = rng.random()
        if r < 0.3 and pool.available_size():
            req = FakeReq([rng.randrange(5) for _ in range(rng.randint(1, 6 * P))])
            req.req_pool_idx = pool.alloc(1)[0]
            running.append(req)
        elif r < 0.8 and running:
            req = rng.choice(running)
            n = min(req.kv_allocated_len + rng.randint(1, 2 * P), 64 * P)
            need = (-(-n // P) - (-(-req.kv_allocated_len // P))) * P
            if need > alloc.available_size():
                cache.cache_finished_req(req)
                running.remove(req)
            else:
                req.origin_input_ids += [0] * max(0, n - len(req.origin_input_ids))
                extend(cache, alloc, pool, req, n)
                cache.cache_unfinished_req(req)
                assert len(req.prefix_indices) == n
        elif running:
            req = running.pop(rng.randrange(len(running)))
            cache.cache_finished_req(req)
        pages = [
            set((pool.req_to_token[q.req_pool_idx, : q.kv_allocated_len] // P).tolist()) for q in running
        ]
        assert sum(map(len, pages)) == len(set().union(*pages))  # no page owned twice
        assert not set().union(*pages) & set(alloc.free_page_ids().tolist())
        cache.check_integrity(owned(cache, running))
    for req in running:
        cache.cache_finished_req(req)
    assert alloc.available_size() == alloc.size and pool.available_size() == pool.size

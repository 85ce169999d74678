"""RadixCache namespaces (one tree per LoRA adapter, "" the base model): no match across them,
requests cache into their adapter's, eviction / locks / check_integrity over several, ``drop_namespace``
(slots back to the allocator, refused while locked) and ``reset`` of them all; a randomized run against
a per-namespace reference. Helpers and FakeReq from test_radix_cache.py."""

from __future__ import annotations

import random

import pytest
import torch

from srt.mem_cache.radix_cache import RadixCache
from tests.unit.test_radix_cache import FakeReq, extend_to, make, owned

NAMESPACES = ("", "a", "b")


def insert_in(cache: RadixCache, key: list[int], ns: str) -> torch.Tensor:
    """Allocate, insert into ``ns``, free the duplicates; return the tree's slots for key in ns."""
    value = cache.allocator.alloc(len(key))
    assert value is not None
    n = cache.insert(key, value, ns)
    cache.allocator.free(value[:n])
    return cache.match_prefix(key, ns).device_indices


def admit_in(cache: RadixCache, ids: list[int], ns: str) -> FakeReq:
    req = FakeReq(origin_input_ids=list(ids), lora_name=ns)
    m = cache.match_prefix(ids[:-1], ns)
    req.prefix_indices, req.last_node = m.device_indices, m.last_node
    cache.inc_lock_ref(req.last_node)
    req.req_pool_idx = cache.req_to_token_pool.alloc(1)[0]
    extend_to(cache, req, len(ids), start=len(req.prefix_indices))
    return req


@pytest.mark.parametrize("P", [1, 4])
def test_same_key_in_two_namespaces_never_matches_across(P: int):
    cache, alloc = make(P)
    key = list(range(1, 3 * P + 1))
    base = insert_in(cache, key, "")
    a = insert_in(cache, key, "a")
    assert len(base) == len(a) == len(key)
    assert not set(base.tolist()) & set(a.tolist())  # two copies of the KV, one per adapter
    assert torch.equal(cache.match_prefix(key + [7] * P).device_indices, base)
    assert torch.equal(cache.match_prefix(key + [7] * P, "a").device_indices, a)
    m = cache.match_prefix(key, "b")
    assert m.device_indices.numel() == 0 and m.last_node is not cache.root and not m.last_node.children
    # a prefix only one namespace has
    only_b = insert_in(cache, [50] * (2 * P), "b")
    assert cache.match_prefix([50] * (2 * P), "").device_indices.numel() == 0
    assert cache.match_prefix([50] * (2 * P), "a").device_indices.numel() == 0
    assert torch.equal(cache.match_prefix([50] * (2 * P), "b").device_indices, only_b)
    # inserting the key again into "a" finds a's copy, not the base's
    value = alloc.alloc(len(key))
    assert cache.insert(key, value, "a") == len(key)
    alloc.free(value)
    assert cache.evictable_size() == 2 * len(key) + 2 * P
    cache.check_integrity()
    assert "namespace 'a'" in cache.pretty_print() and "namespace 'b'" in cache.pretty_print()


@pytest.mark.parametrize("P", [1, 4])
def test_requests_cache_into_their_adapters_namespace(P: int):
    cache, alloc = make(P)
    ids = list(range(10, 10 + 4 * P + 1))
    ra = admit_in(cache, ids, "a")
    cache.cache_unfinished_req(ra)  # chunk shared at once, in "a" only
    aligned = len(ids) // P * P
    assert cache.match_prefix(ids, "a").device_indices.numel() == aligned
    assert cache.match_prefix(ids, "").device_indices.numel() == 0
    rb = admit_in(cache, ids, "")  # the base model computes its own
    assert len(rb.prefix_indices) == 0
    ra.output_ids = [3]
    ra.kv_committed_len = ra.kv_allocated_len = len(ids)
    ra_slots = cache.req_to_token_pool.req_to_token[ra.req_pool_idx, : 4 * P].clone()
    cache.cache_finished_req(ra)
    cache.check_integrity(owned(cache, rb))
    rb2 = admit_in(cache, ids, "a")  # a later request of a finds a's KV: the slots ra computed
    assert torch.equal(rb2.prefix_indices, ra_slots)
    assert not set(rb.prefix_indices.tolist()) & set(ra_slots.tolist())
    for r in (rb, rb2):
        cache.cache_finished_req(r)
    cache.check_integrity()
    assert cache.protected_size() == 0
    cache.reset()
    assert alloc.available_size() == alloc.size


def test_eviction_is_lru_across_namespaces_and_spares_locked_ones():
    P = 2
    cache, alloc = make(P, pages=12)
    old_a = insert_in(cache, [1, 1, 2, 2], "a")  # oldest
    base = insert_in(cache, [1, 1, 3, 3], "")
    locked_b = insert_in(cache, [1, 1, 4, 4], "b")
    new_a = insert_in(cache, [5, 5], "a")  # newest
    m = cache.match_prefix([1, 1, 4, 4], "b")
    cache.inc_lock_ref(m.last_node)
    cache.check_integrity()
    assert cache.protected_size() == 4 and cache.evictable_size() == 10
    free0 = alloc.available_size()
    assert cache.evict(4) == 4  # a's old path, whole
    assert alloc.available_size() == free0 + 4
    assert cache.match_prefix([1, 1, 2, 2], "a").device_indices.numel() == 0
    assert torch.equal(cache.match_prefix([5, 5], "a").device_indices, new_a)
    assert torch.equal(cache.match_prefix([1, 1, 3, 3]).device_indices, base)
    cache.check_integrity()
    cache.evict(100)  # everything evictable
    assert cache.evictable_size() == 0 and cache.protected_size() == 4
    assert torch.equal(cache.match_prefix([1, 1, 4, 4], "b").device_indices, locked_b)
    assert old_a.numel() == 4
    cache.check_integrity()
    cache.dec_lock_ref(m.last_node)
    assert cache.evict(4) == 4 and alloc.available_size() == alloc.size
    cache.check_integrity()


@pytest.mark.parametrize("P", [1, 4])
def test_drop_namespace_frees_its_slots_and_refuses_while_locked(P: int):
    cache, alloc = make(P)
    base = insert_in(cache, list(range(1, 2 * P + 1)), "")
    for key in ([1] * (3 * P), [1] * P + [2] * P, [9] * P):
        insert_in(cache, key, "a")
    insert_in(cache, [1] * (2 * P), "b")
    a_slots = 5 * P  # [1]*P shared, then 2P + P below it, and [9]*P
    used = alloc.size - alloc.available_size()
    m = cache.match_prefix([1] * (3 * P), "a")
    cache.inc_lock_ref(m.last_node)
    with pytest.raises(RuntimeError, match="'a'"):
        cache.drop_namespace("a")
    cache.check_integrity()  # refused: nothing changed
    assert cache.match_prefix([1] * (3 * P), "a").device_indices.numel() == 3 * P
    cache.dec_lock_ref(m.last_node)
    assert cache.drop_namespace("a") == a_slots
    assert alloc.size - alloc.available_size() == used - a_slots
    assert cache.evictable_size() == 2 * P + 2 * P
    cache.check_integrity()
    # a later adapter of the same name finds nothing of the old one's KV
    assert cache.match_prefix([1] * (3 * P), "a").device_indices.numel() == 0
    assert cache.drop_namespace("a") == 0 and cache.drop_namespace("zz") == 0
    assert cache.drop_namespace("") == 0  # the base model's tree is never dropped
    assert torch.equal(cache.match_prefix(list(range(1, 2 * P + 1))).device_indices, base)
    # stale heap entries of the dropped nodes: evicting frees each slot once (debug allocator)
    assert cache.evict(alloc.size) == 4 * P
    assert alloc.available_size() == alloc.size
    cache.check_integrity()
    assert cache.drop_namespace("b") == 0


def test_reset_clears_every_namespace():
    P = 2
    cache, alloc = make(P)
    for ns in NAMESPACES:
        insert_in(cache, [3] * (2 * P), ns)
    req = admit_in(cache, [3] * (2 * P) + [4], "b")
    with pytest.raises(RuntimeError):
        cache.reset()  # a request holds b's prefix
    req.kv_committed_len = req.kv_allocated_len = len(req.origin_input_ids)
    cache.cache_finished_req(req)
    cache.reset()
    assert alloc.available_size() == alloc.size
    assert cache.evictable_size() == cache.protected_size() == 0
    for ns in NAMESPACES:
        assert cache.match_prefix([3] * (2 * P), ns).device_indices.numel() == 0
    cache.check_integrity()


@pytest.mark.parametrize("P", [1, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_randomized_namespaces_against_reference(P: int, seed: int):
    """insert / match / lock / unlock / evict / drop over three namespaces, checked after each step
    against a reference per namespace (page prefix -> first slot of its page)."""
    rng = random.Random(100 * P + seed)
    pages = 40
    cache, alloc = make(P, pages=pages)
    ref: dict[str, dict[tuple[int, ...], int]] = {ns: {} for ns in NAMESPACES}
    locks: list[tuple[str, object, tuple[int, ...]]] = []

    def ref_match(ns: str, key: list[int]) -> list[int]:
        out, k = [], 0
        while k + P <= len(key) and tuple(key[: k + P]) in ref[ns]:
            out += [ref[ns][tuple(key[: k + P])] + j for j in range(P)]
            k += P
        return out

    def locked(ns: str, q: tuple[int, ...]) -> bool:
        return any(lns == ns and lq[: len(q)] == q for lns, _, lq in locks)

    def random_key() -> list[int]:
        return [rng.randrange(3) for _ in range(rng.randint(0, 4) * P + rng.randrange(P))]

    for _ in range(600):
        ns = rng.choice(NAMESPACES)
        op = rng.random()
        if op < 0.35:
            key = random_key()
            key = key[: len(key) // P * P]
            value = alloc.alloc(len(key)) if key else torch.empty(0, dtype=torch.int64)
            if value is None:
                continue
            got = cache.insert(key, value, ns)
            exp = len(ref_match(ns, key))
            assert got == exp
            for k in range(exp, len(key), P):
                ref[ns][tuple(key[: k + P])] = int(value[k])
            alloc.free(value[:exp])
        elif op < 0.6:
            key = random_key()
            m = cache.match_prefix(key, ns)
            assert m.device_indices.tolist() == ref_match(ns, key)
            if rng.random() < 0.3:
                cache.inc_lock_ref(m.last_node)
                locks.append((ns, m.last_node, tuple(key[: len(m.device_indices)])))
        elif op < 0.75 and locks:
            _, node, _ = locks.pop(rng.randrange(len(locks)))
            cache.dec_lock_ref(node)
        elif op < 0.9:
            free0 = set(alloc.free_page_ids().tolist())
            freed = cache.evict(rng.randint(1, 6) * P)
            gone = set(alloc.free_page_ids().tolist()) - free0
            removed = 0
            for n in NAMESPACES:
                for q in [q for q, s in ref[n].items() if s // P in gone]:
                    assert not locked(n, q), "evicted a locked page"
                    del ref[n][q]
                    removed += P
            assert freed == removed
        elif ns:
            if any(lns == ns and lq for lns, _, lq in locks):  # a lock on the root holds nothing
                with pytest.raises(RuntimeError):
                    cache.drop_namespace(ns)
            else:
                before = alloc.available_size()
                assert cache.drop_namespace(ns) == len(ref[ns]) * P
                assert alloc.available_size() == before + len(ref[ns]) * P
                ref[ns].clear()
        cached = sum(len(r) for r in ref.values()) * P
        assert alloc.available_size() + cached == alloc.size
        assert cache.evictable_size() + cache.protected_size() == cached
        cache.check_integrity()
    for _, node, _ in locks:
        cache.dec_lock_ref(node)
    cache.reset()
    assert alloc.available_size() == alloc.size

"""TokenToKVPoolAllocator: slot ranges, page layout, exhaustion, double-free guard."""

from __future__ import annotations

import random

import pytest
import torch

from srt.mem_cache.allocator import DoubleFreeError, InvalidFreeError, TokenToKVPoolAllocator


def pages_of(slots: torch.Tensor, P: int) -> set[int]:
    return set((slots // P).tolist())


@pytest.mark.parametrize("P", [1, 4, 16])
def test_alloc_free_roundtrip(P: int):
    a = TokenToKVPoolAllocator(32 * P, P, debug=True)
    assert a.available_size() == 32 * P
    x = a.alloc(8 * P)
    assert x.dtype == torch.int64 and x.shape == (8 * P,)
    assert len(set(x.tolist())) == 8 * P
    assert int(x.min()) >= P and int(x.max()) < 33 * P  # page 0 is the padding page
    # whole pages, slots of a page consecutive
    assert torch.equal(x.view(-1, P) - x.view(-1, P)[:, :1], torch.arange(P).expand(8, P))
    assert a.available_size() == 24 * P
    y = a.alloc(24 * P)
    assert not set(x.tolist()) & set(y.tolist())
    assert a.available_size() == 0
    assert a.alloc(P) is None
    a.free(x)
    assert a.available_size() == 8 * P
    z = a.alloc(8 * P)
    assert set(z.tolist()) == set(x.tolist())  # the freed pages are the only free ones
    a.clear()
    assert a.available_size() == 32 * P
    assert sorted(a.free_page_ids().tolist()) == list(range(1, 33))


def test_constructor_and_alloc_validation():
    with pytest.raises(ValueError):
        TokenToKVPoolAllocator(10, 4)  # not a multiple of the page size
    with pytest.raises(ValueError):
        TokenToKVPoolAllocator(0, 1)
    a = TokenToKVPoolAllocator(16, 4)
    with pytest.raises(ValueError):
        a.alloc(3)
    assert a.alloc(0).numel() == 0
    with pytest.raises(ValueError):
        a.alloc_extend([3], [2], [-1])  # seq_len < prefix_len


@pytest.mark.parametrize("P", [1, 4])
def test_exhaustion_returns_none_and_allocates_nothing(P: int):
    a = TokenToKVPoolAllocator(8 * P, P, debug=True)
    held = a.alloc(6 * P)
    before = a.available_size()
    assert a.alloc(3 * P) is None
    # 2 sequences need 1 + 2 fresh pages; only 2 free
    assert a.alloc_extend([0, 0], [P, 2 * P], [-1, -1]) is None
    assert a.available_size() == before
    b = a.alloc(2 * P)
    assert b is not None and a.available_size() == 0
    # a decode that needs a fresh page fails; one continuing in its page does not need one
    assert a.alloc_decode([P + 1], [int(held[P - 1])]) is None
    assert a.available_size() == 0
    if P > 1:
        out = a.alloc_decode([2], [int(held[0])])
        assert out.tolist() == [int(held[0]) + 1]
    a.free(held)
    a.free(b)
    assert a.available_size() == 8 * P


def test_double_free_and_padding_guard():
    a = TokenToKVPoolAllocator(16, 4, debug=True)
    x = a.alloc(8)
    a.free(x[:4])
    with pytest.raises(DoubleFreeError) as e:
        a.free(x[:4])
    assert str(int(x[0])) in str(e.value)  # the message names the slots
    with pytest.raises(DoubleFreeError):
        a.free(x[1:2])  # a different slot of an already free page
    with pytest.raises(InvalidFreeError):
        a.free(torch.tensor([0, 1], dtype=torch.int64))  # padding page
    with pytest.raises(InvalidFreeError):
        a.free(torch.tensor([20], dtype=torch.int64))  # past the pool
    a.free(x[4:])
    assert a.available_size() == 16

    # without debug: padding/out-of-range frees and over-freeing are still rejected
    for P in (1, 4):
        c = TokenToKVPoolAllocator(4 * P, P)
        with pytest.raises(InvalidFreeError):
            c.free(torch.tensor([P - 1], dtype=torch.int64))
        with pytest.raises(InvalidFreeError):
            c.free(torch.tensor([5 * P], dtype=torch.int64))
        with pytest.raises(DoubleFreeError):
            c.free(torch.tensor([P], dtype=torch.int64))  # nothing allocated yet
        assert c.available_size() == 4 * P

    b = TokenToKVPoolAllocator(8, 1, debug=True)
    y = b.alloc(2)
    with pytest.raises(DoubleFreeError):
        b.free(torch.cat([y, y[:1]]))  # same slot twice in one call


def test_free_group_defers_and_batches():
    a = TokenToKVPoolAllocator(16, 2, debug=True)
    x, y = a.alloc(4), a.alloc(4)
    a.free_group_begin()
    a.free(x)
    a.free(y)
    assert a.available_size() == 8  # deferred
    a.free_group_end()
    assert a.available_size() == 16
    z = a.alloc(2)
    a.free_group_begin()
    a.free(z)
    a.free(z[1:])  # same page freed twice in the group
    with pytest.raises(DoubleFreeError):
        a.free_group_end()
    with pytest.raises(RuntimeError):
        a.free_group_end()


def test_alloc_extend_debug_checks_last_loc():
    a = TokenToKVPoolAllocator(32, 4, debug=True)
    x = a.alloc(4)
    with pytest.raises(ValueError):
        a.alloc_extend([2], [6], [int(x[2])])  # slot of token 1 is x[1], not x[2]
    with pytest.raises(ValueError):
        a.alloc_extend([0], [3], [int(x[0])])  # no prefix -> last_loc must be -1
    out = a.alloc_extend([2], [6], [int(x[1])])
    assert out[:2].tolist() == x[2:4].tolist()


def test_alloc_extend_partial_last_page_example():
    P = 4
    a = TokenToKVPoolAllocator(64, P)
    first = a.alloc_extend([0, 0], [6, 3], [-1, -1])
    s0, s1 = first[:6], first[6:]
    # seq 0: tokens 0..3 on one page, 4..5 at the start of a second page
    assert s0[:4].tolist() == list(range(int(s0[0]), int(s0[0]) + 4)) and int(s0[0]) % P == 0
    assert int(s0[4]) % P == 0 and int(s0[5]) == int(s0[4]) + 1
    assert int(s1[0]) % P == 0 and s1.tolist() == list(range(int(s1[0]), int(s1[0]) + 3))
    assert a.available_size() == 64 - 3 * P
    # extend seq 0 by 7 (6 -> 13): 2 slots finish its page, then 1 full page and 1 more slot
    more = a.alloc_extend([6, 3], [13, 4], [int(s0[5]), int(s1[2])])
    m0, m1 = more[:7], more[7:]
    assert m0[:2].tolist() == [int(s0[5]) + 1, int(s0[5]) + 2]
    assert int(m0[2]) % P == 0 and int(m0[6]) % P == 0
    assert m1.tolist() == [int(s1[2]) + 1]  # seq 1 fills its page, no new page
    assert a.available_size() == 64 - 5 * P


@pytest.mark.parametrize("P", [1, 4, 16])
def test_random_sequences_keep_page_layout(P: int):
    """Random batched extends/decodes/frees against a reference of each sequence's slots."""
    rng = random.Random(1234 + P)
    num_pages = 96
    a = TokenToKVPoolAllocator(num_pages * P, P, debug=True)
    seqs: dict[int, list[int]] = {}  # seq id -> slot of each token
    next_id = 0

    def used_pages() -> set[int]:
        return {s // P for slots in seqs.values() for s in slots}

    for _ in range(600):
        op = rng.random()
        before_free = set(a.free_page_ids().tolist())
        used_before = used_pages()
        if op < 0.35:  # batched extend of new and existing sequences
            ids = rng.sample(sorted(seqs), k=min(len(seqs), rng.randint(0, 3)))
            new = [next_id + i for i in range(rng.randint(0, 3))]
            prefix = [len(seqs[i]) for i in ids] + [0] * len(new)
            ext = [rng.randint(0, 3 * P + 1) for _ in prefix]
            last = [seqs[i][-1] if seqs[i] else -1 for i in ids] + [-1] * len(new)
            out = a.alloc_extend(prefix, [p + e for p, e in zip(prefix, ext)], last)
            if out is None:
                need = sum(-(-(p + e) // P) - (-(-p // P)) for p, e in zip(prefix, ext))
                assert need > len(before_free)
                assert set(a.free_page_ids().tolist()) == before_free
                continue
            next_id += len(new)
            for i in new:
                seqs[i] = []
            assert out.numel() == sum(ext)
            off = 0
            for i, e in zip(ids + new, ext):
                seqs[i].extend(out[off : off + e].tolist())
                off += e
        elif op < 0.75 and seqs:  # batched decode
            ids = rng.sample(sorted(seqs), k=rng.randint(1, len(seqs)))
            lens = [len(seqs[i]) + 1 for i in ids]
            last = [seqs[i][-1] if seqs[i] else -1 for i in ids]
            out = a.alloc_decode(lens, last)
            if out is None:
                assert sum((n - 1) % P == 0 for n in lens) > len(before_free)
                assert set(a.free_page_ids().tolist()) == before_free
                continue
            for i, s in zip(ids, out.tolist()):
                seqs[i].append(s)
        elif seqs:  # free whole sequences
            for i in rng.sample(sorted(seqs), k=rng.randint(1, min(3, len(seqs)))):
                if seqs[i]:
                    a.free(torch.tensor(seqs[i], dtype=torch.int64))
                del seqs[i]
        # fresh pages came from the free list only (no page handed out twice)
        after_free = set(a.free_page_ids().tolist())
        assert used_pages() - used_before <= before_free
        # layout: token t of a sequence at page[t // P] * P + t % P; pages of different
        # sequences disjoint; used + free == all pages
        owner: dict[int, int] = {}
        for i, slots in seqs.items():
            for t, s in enumerate(slots):
                assert P <= s < (num_pages + 1) * P
                assert s % P == t % P
                assert s // P == slots[t - t % P] // P
                assert owner.setdefault(s // P, i) == i
        pages_used = {(i, t // P) for i, slots in seqs.items() for t in range(len(slots))}
        assert len(owner) == len(pages_used)
        assert not set(owner) & after_free
        assert len(owner) + len(after_free) == num_pages == len(owner) + a.available_size() // P

"""Req state machine and finish rules; ScheduleBatch KV allocation and its ForwardBatch."""

from __future__ import annotations

import pytest
import torch

from srt.layers.forward_batch import ForwardMode
from srt.managers.io_struct import FinishReason
from srt.managers.scheduler.cache import CacheManager
from srt.managers.scheduler.req import InvalidTransitionError, Req, ReqStatus
from srt.managers.scheduler.schedule_batch import ScheduleBatch
from srt.mem_cache.allocator import TokenToKVPoolAllocator
from srt.mem_cache.memory_pool import ReqToTokenPool
from srt.mem_cache.radix_cache import RadixCache
from srt.sampling.sampling_params import SamplingParams

EOS = 2


def make_req(rid: str, ids: list[int], max_new: int = 10, **params) -> Req:
    kw = {
        k: params.pop(k) for k in ("return_logprob", "logprob_start_len", "top_logprobs_num") if k in params
    }
    return Req(rid, ids, SamplingParams(**params), max_new_tokens=max_new, seed=1, eos_token_ids=[EOS], **kw)


# ---------------------------------------------------------------------- state machine
def test_state_machine_happy_path_and_retraction():
    r = make_req("a", [5, 6, 7])
    assert r.state == ReqStatus.WAITING
    r.set_state(ReqStatus.PREFILLING)
    r.set_state(ReqStatus.PREFILLING)  # next chunk
    r.set_state(ReqStatus.DECODING)
    r.output_ids = [9, 9]
    r.kv_committed_len = 4
    r.retract()
    assert r.state == ReqStatus.WAITING and r.retract_count == 1
    assert r.output_ids == [9, 9], "a retracted request keeps its output"
    assert r.kv_committed_len == 0 and r.req_pool_idx is None and r.last_node is None
    r.set_state(ReqStatus.PREFILLING)
    r.finish(FinishReason.of_abort("x"))
    r.mark_released()
    assert r.state == ReqStatus.FINISHED and r.finished


@pytest.mark.parametrize(
    "path",
    [
        [ReqStatus.DECODING],
        [ReqStatus.RETRACTED],
        [ReqStatus.PREFILLING, ReqStatus.WAITING],
        [ReqStatus.FINISHED, ReqStatus.WAITING],
        [ReqStatus.PREFILLING, ReqStatus.DECODING, ReqStatus.PREFILLING],
    ],
)
def test_invalid_transitions_raise(path):
    r = make_req("a", [1, 2])
    with pytest.raises(InvalidTransitionError):
        for s in path:
            r.set_state(s)


# ---------------------------------------------------------------------- finish rules
def reason(req: Req) -> dict | None:
    """The request's finish reason in its wire dict shape (None while it runs)."""
    return None if req.finished_reason is None else req.finished_reason.to_dict()


def feed(req: Req, tokens: list[int]) -> int:
    """Append tokens until the request finishes; return how many were taken."""
    for i, t in enumerate(tokens):
        req.append_token(t)
        if req.finished:
            return i + 1
    return len(tokens)


def test_finish_by_length():
    r = make_req("a", [1], max_new=3)
    assert feed(r, [10, 11, 12, 13]) == 3
    assert reason(r) == {"type": "length", "length": 3}


def test_finish_by_eos_unless_ignore_eos():
    r = make_req("a", [1])
    assert feed(r, [10, EOS, 11]) == 2
    assert reason(r) == {"type": "stop", "matched": EOS}
    r = make_req("b", [1], max_new=4, ignore_eos=True)
    assert feed(r, [10, EOS, 11, 12, 13]) == 4
    assert reason(r)["type"] == "length"


def test_stop_token_ids_apply_even_with_ignore_eos():
    r = make_req("a", [1], stop_token_ids=[42], ignore_eos=True)
    assert feed(r, [10, EOS, 42, 11]) == 3
    assert reason(r) == {"type": "stop", "matched": 42}


def test_min_new_tokens_defers_stop_tokens():
    r = make_req("a", [1], max_new=10, min_new_tokens=3, stop_token_ids=[42])
    assert feed(r, [EOS, 42, 11, EOS, 12]) == 4
    assert reason(r) == {"type": "stop", "matched": EOS}


def test_length_wins_over_a_stop_token_on_the_last_position():
    r = make_req("a", [1], max_new=2)
    assert feed(r, [10, EOS]) == 2
    assert reason(r) == {"type": "length", "length": 2}


def test_first_finish_reason_wins():
    r = make_req("a", [1])
    r.finish(FinishReason.of_abort("m"))
    r.append_token(EOS)
    assert reason(r)["type"] == "abort"


# ---------------------------------------------------------------------- prefix keys
def test_prefix_match_key_keeps_the_last_token_and_pending_logprob_positions():
    r = make_req("a", list(range(100)))
    assert r.prefix_match_key() == list(range(99))
    r.output_ids = [500, 501]
    assert r.prefix_match_key() == list(range(100)) + [500]
    lp = make_req("b", list(range(100)), return_logprob=True, logprob_start_len=40)
    assert lp.prefix_match_key() == list(range(39)), "logits of position 39 score token 40"
    lp.input_logprobs_sent = True
    assert len(lp.prefix_match_key()) == 99
    first = make_req("c", list(range(10)), return_logprob=True, logprob_start_len=0)
    assert first.prefix_match_key() == []


# ---------------------------------------------------------------------- batches
def make_kv(P: int = 1, size: int = 256) -> CacheManager:
    pool = ReqToTokenPool(8, 512, "cpu")
    alloc = TokenToKVPoolAllocator(size, P, "cpu", debug=True)
    return CacheManager(pool, alloc, RadixCache(pool, alloc, P), P)


def admit(req: Req, kv: CacheManager, extend: int | None = None) -> None:
    """What the scheduler does on admission: match, lock, set fill_ids."""
    m = kv.tree_cache.match_prefix(req.prefix_match_key())
    req.prefix_indices, req.last_node = m.device_indices, m.last_node
    kv.tree_cache.inc_lock_ref(m.last_node)
    req.kv_committed_len = req.kv_allocated_len = len(m.device_indices)
    full = req.origin_input_ids + req.output_ids
    n = len(full) if extend is None else req.kv_committed_len + extend
    req.fill_ids = full[:n]
    req.extend_input_len = n - req.kv_committed_len
    req.set_state(ReqStatus.PREFILLING)


@pytest.mark.parametrize("P", [1, 4])
def test_prepare_extend_then_decode_writes_req_to_token(P):
    kv = make_kv(P)
    a = make_req("a", list(range(10, 30)))
    admit(a, kv)
    b = make_req("b", list(range(100, 107)))
    admit(b, kv)
    batch = ScheduleBatch.prepare_extend([a, b], kv)
    assert batch.forward_mode == ForwardMode.EXTEND
    assert batch.input_ids == a.fill_ids + b.fill_ids
    assert batch.prefix_lens == [0, 0] and batch.extend_lens == [20, 7]
    r2t = kv.req_to_token_pool.req_to_token
    assert torch.equal(r2t[a.req_pool_idx, :20], batch.out_cache_loc[:20])
    assert torch.equal(r2t[b.req_pool_idx, :7], batch.out_cache_loc[20:])
    assert a.kv_allocated_len == 20 and b.kv_allocated_len == 7
    slots = batch.out_cache_loc.tolist()
    assert len(set(slots)) == len(slots)
    # tokens of a sequence sit on consecutive slots within each page
    for row, n in ((a.req_pool_idx, 20), (b.req_pool_idx, 7)):
        s = r2t[row, :n].tolist()
        assert all(s[t] % P == t % P for t in range(n))

    fb = batch.get_forward_batch("cpu", vocab_size=1000, eos_token_ids=[EOS])
    assert fb.forward_mode == ForwardMode.EXTEND and fb.num_extend_seqs == 2
    assert fb.positions.tolist() == list(range(20)) + list(range(7))
    assert fb.extend_start_loc.tolist() == [0, 20] and fb.seq_lens.tolist() == [20, 7]
    assert fb.sampling_info.batch_size == 2 and not fb.return_logprob

    for r in (a, b):  # what processing the result does
        r.kv_committed_len = len(r.fill_ids)
        r.output_ids.append(999)
        kv.tree_cache.cache_unfinished_req(r)
        r.set_state(ReqStatus.DECODING)
    dec = ScheduleBatch.prepare_decode([a, b], kv)
    assert dec.forward_mode == ForwardMode.DECODE
    assert dec.input_ids == [999, 999] and dec.prefix_lens == [20, 7] and dec.extend_lens == [1, 1]
    assert r2t[a.req_pool_idx, 20] == dec.out_cache_loc[0] and r2t[b.req_pool_idx, 7] == dec.out_cache_loc[1]
    if P > 1:  # b's 8th token continues its partly filled page
        assert int(dec.out_cache_loc[1]) == int(r2t[b.req_pool_idx, 6]) + 1
    assert a.kv_allocated_len == 21 and b.kv_allocated_len == 8
    fb = dec.get_forward_batch("cpu", 1000, [EOS])
    assert fb.positions.tolist() == [20, 7] and fb.seq_lens.tolist() == [21, 8] and fb.num_extend_seqs == 0


def test_extend_on_a_cached_prefix_reuses_its_slots():
    kv = make_kv(1)
    first = make_req("a", list(range(50)))
    admit(first, kv)
    b1 = ScheduleBatch.prepare_extend([first], kv)
    first.kv_committed_len = 50
    kv.tree_cache.cache_unfinished_req(first)
    second = make_req("b", list(range(40)) + [777, 778])
    admit(second, kv)
    assert second.kv_committed_len == 40
    b2 = ScheduleBatch.prepare_extend([second], kv)
    assert b2.prefix_lens == [40] and b2.extend_lens == [2] and b2.input_ids == [777, 778]
    r2t = kv.req_to_token_pool.req_to_token
    assert torch.equal(r2t[second.req_pool_idx, :40], b1.out_cache_loc[:40])
    fb = b2.get_forward_batch("cpu", 1000, [EOS])
    assert fb.positions.tolist() == [40, 41] and fb.extend_prefix_lens.tolist() == [40]


def test_mixed_batch_puts_extends_first():
    kv = make_kv(1)
    d = make_req("d", [1, 2, 3])
    admit(d, kv)
    ScheduleBatch.prepare_extend([d], kv)
    d.kv_committed_len = 3
    d.output_ids.append(50)
    kv.tree_cache.cache_unfinished_req(d)
    d.set_state(ReqStatus.DECODING)
    e = make_req("e", [9, 8, 7, 6])
    admit(e, kv)
    batch = ScheduleBatch.prepare_extend([e], kv)
    batch.mix_with(ScheduleBatch.prepare_decode([d], kv))
    assert batch.forward_mode == ForwardMode.MIXED and batch.num_extend_reqs == 1
    assert batch.reqs == [e, d] and batch.input_ids == [9, 8, 7, 6, 50]
    fb = batch.get_forward_batch("cpu", 1000, [EOS])
    assert fb.num_extend_seqs == 1 and fb.extend_seq_lens.tolist() == [4, 1]
    assert fb.positions.tolist() == [0, 1, 2, 3, 3] and fb.out_cache_loc.numel() == 5


def test_prompt_logprob_fields_follow_the_chunks():
    kv = make_kv(1)
    r = make_req("a", list(range(10, 40)), return_logprob=True, logprob_start_len=5, top_logprobs_num=2)
    admit(r, kv, extend=16)
    fb = ScheduleBatch.prepare_extend([r], kv).get_forward_batch("cpu", 1000, [EOS])
    assert fb.return_logprob and fb.top_logprobs_nums == [2]
    assert fb.extend_logprob_start_lens_cpu == [5]
    assert fb.extend_logprob_next_token_ids_cpu == [r.origin_input_ids[16]], "the next chunk's first token"
    r.kv_committed_len = 16
    kv.tree_cache.cache_unfinished_req(r)
    full = r.origin_input_ids + r.output_ids
    r.fill_ids = full
    fb = ScheduleBatch.prepare_extend([r], kv).get_forward_batch("cpu", 1000, [EOS])
    assert fb.extend_logprob_next_token_ids_cpu == [-1], "the last chunk has no next prompt token"


def test_decode_slots_needed_counts_fresh_pages():
    reqs = []
    for n in (4, 5, 8, 9):
        r = make_req(str(n), [1] * n)
        r.kv_committed_len = r.kv_allocated_len = n
        reqs.append(r)
    assert ScheduleBatch.decode_slots_needed(reqs, 1) == 4
    assert ScheduleBatch.decode_slots_needed(reqs, 4) == 8  # lengths 4 and 8 start a new page
    # overlap scheduling: a token in flight already holds its slot; the next one goes after it
    for r, n in zip(reqs, (3, 5, 7, 8)):
        r.kv_committed_len, r.kv_allocated_len = n, n + 1
    assert ScheduleBatch.decode_slots_needed(reqs, 4) == 8  # allocated 4 and 8 start a new page


def test_ensure_free_evicts_from_the_cache():
    kv = make_kv(1, size=64)
    r = make_req("a", list(range(60)))
    admit(r, kv)
    ScheduleBatch.prepare_extend([r], kv)
    r.kv_committed_len = 60
    kv.tree_cache.cache_finished_req(r)  # 60 slots cached, evictable
    assert kv.allocator.available_size() == 4 and kv.available() == 64
    assert kv.ensure_free(30)
    assert kv.allocator.available_size() >= 30
    assert not kv.ensure_free(65)

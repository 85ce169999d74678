"""The scheduler's parts one at a time, without a model, a runner or a process: the cache part
(match / lock / release / flush), the prefill part (admission, chunking, queue), the decode part
(retraction) and the output part (results -> Req state -> BatchTokenIDOut)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from srt.managers.io_struct import FinishReason
from srt.managers.scheduler.cache import CacheManager
from srt.managers.scheduler.decode import DecodeManager
from srt.managers.scheduler.decode_policy import NewTokenRatio, retraction_order
from srt.managers.scheduler.metrics import SchedulerMetrics
from srt.managers.scheduler.output import build_batch_output, process_batch_result
from srt.managers.scheduler.prefill import PrefillConfig, PrefillManager
from srt.managers.scheduler.req import Req, ReqStatus
from srt.managers.scheduler.schedule_policy import SchedulePolicy
from srt.mem_cache.allocator import TokenToKVPoolAllocator
from srt.mem_cache.memory_pool import ReqToTokenPool
from srt.sampling.sampling_params import SamplingParams


@dataclass
class Sampled:
    next_token_ids: torch.Tensor
    next_token_logprobs: torch.Tensor | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class NoLogits:
    input_token_logprobs: list[list[float | None]] | None = None
    input_top_logprobs: list[list[list[tuple[int, float]] | None]] | None = None


def make_parts(total: int = 512, chunk: int | None = None, radix: bool = True, policy: str = "fcfs"):
    cache = CacheManager.create(
        ReqToTokenPool(16, 1024, "cpu"), TokenToKVPoolAllocator(total, 1, "cpu", debug=True), radix
    )
    metrics = SchedulerMetrics()
    config = PrefillConfig(
        max_running_requests=8,
        chunked_prefill_size=chunk,
        max_prefill_tokens=4096,
        enable_mixed_chunk=False,
        share_in_batch=radix,
    )
    prefill = PrefillManager(cache, SchedulePolicy(policy), metrics, config)
    decode = DecodeManager(cache, NewTokenRatio(), metrics, total)
    return cache, prefill, decode, metrics


def make_req(i: int, prompt: list[int], max_new: int = 50) -> Req:
    return Req(f"r{i}", prompt, SamplingParams(), max_new_tokens=max_new, seed=i, queue_seq=i)


def run(batch, cache, decode, token: int = 7) -> None:
    """A forward that samples ``token`` for every row, processed like the scheduler does."""
    sampled = Sampled(torch.full((batch.batch_size,), token, dtype=torch.int64))
    result = process_batch_result(batch, NoLogits(), sampled, cache, cache.release)
    decode.merge(result.new_decoding, result.decode_finished)


def test_cache_part_match_lock_release_and_flush():
    cache, *_ = make_parts()
    a = make_req(0, list(range(100, 140)))
    assert cache.match(a, a.prefix_match_key()) == 0
    assert cache.lock(a) == 0
    cache.unlock(a)
    cache.drop_match(a)
    assert a.last_node is None and a.prefix_indices.numel() == 0
    assert cache.available() == 512 and cache.token_usage() == 0.0
    assert cache.flush() == ""


def test_prefill_part_admits_in_order_and_chunks_one_request():
    cache, prefill, decode, metrics = make_parts(chunk=64)
    reqs = [make_req(i, [3 + i] * n) for i, n in enumerate((30, 100, 20))]
    for r in reqs:
        prefill.enqueue(r, now_step=0)
    batch = prefill.schedule(decode.running, decode.new_token_ratio.value, now_step=1)
    # 30 tokens of r0, then a page-aligned 34-token chunk of r1 fills the 64-token chunk budget
    assert batch is not None and batch.reqs == reqs[:2] and batch.extend_lens == [30, 34]
    assert prefill.chunked_req is reqs[1] and list(prefill.waiting_queue) == [reqs[2]]
    run(batch, cache, decode)
    assert decode.running == [reqs[0]] and reqs[1].state == ReqStatus.PREFILLING
    assert prefill.take_chunked() is reqs[1] and prefill.chunked_req is None
    assert metrics.num_prefill_steps == 1


def test_prefill_part_spf_takes_the_fewest_tokens_to_compute_first():
    """spf: in a burst, the prompts with the fewest tokens still to compute are prefilled first (a
    cached prefix counts off), ties in arrival order; the long prompt that came first is chunked
    last, not starved."""
    cache, prefill, decode, _ = make_parts(chunk=128, policy="spf")
    warm = make_req(9, list(range(200, 264)))
    prefill.enqueue(warm, now_step=0)
    run(prefill.schedule([], 0.7, 1), cache, decode)  # caches 64 of its tokens
    long, mid, hot, short = (
        make_req(0, [3] * 100),
        make_req(1, [4] * 40),
        make_req(2, list(range(200, 264)) + [5] * 10),  # 74 tokens, 64 of them cached
        make_req(3, [6] * 20),
    )
    for r in (long, mid, hot, short):
        prefill.enqueue(r, now_step=1)
    batch = prefill.schedule(decode.running, 0.7, now_step=2)
    assert batch is not None and batch.reqs[:3] == [hot, short, mid]
    assert batch.extend_lens[:3] == [10, 20, 40]
    run(batch, cache, decode)
    while prefill.waiting_queue or prefill.chunked_req is not None:
        batch = prefill.schedule(decode.running, 0.7, now_step=3)
        run(batch, cache, decode)
    assert long.state != ReqStatus.WAITING and long in decode.running


def test_decode_part_retracts_the_cheapest_and_keeps_one():
    cache, prefill, decode, metrics = make_parts(total=256)
    reqs = [make_req(i, [10 + i] * 60, max_new=200) for i in range(4)]
    for r in reqs:
        prefill.enqueue(r, now_step=0)
    run(prefill.schedule([], 0.0, 1), cache, decode)
    assert decode.running == reqs
    while decode.has_room():  # decode until the pool runs short
        run(decode.prepare_batch(num_waiting=0), cache, decode)
    order = retraction_order(decode.running)
    ratio = decode.new_token_ratio.value
    victims = decode.retract_for_room()
    assert victims and victims == order[: len(victims)] and decode.running
    assert all(v.state == ReqStatus.WAITING and v.output_ids and v.req_pool_idx is None for v in victims)
    assert decode.has_room() and decode.new_token_ratio.value > ratio
    assert metrics.num_retractions == len(victims)
    cache.check_integrity(decode.running)


def test_output_part_reports_tokens_once_and_the_finish_reason():
    cache, prefill, decode, _ = make_parts()
    r = make_req(0, [5] * 12, max_new=2)
    prefill.enqueue(r, now_step=0)
    run(prefill.schedule([], 0.7, 1), cache, decode)
    first = build_batch_output([r])
    assert first.output_ids == [[7]] and first.finished_reasons == [None]
    assert build_batch_output([r]) is None, "nothing new to send"
    run(decode.prepare_batch(num_waiting=0), cache, decode)
    last = build_batch_output([r])
    assert last.output_ids == [[7]] and last.finished_reasons == [FinishReason.of_length(2)]
    assert r.state == ReqStatus.FINISHED and decode.running == []
    cache.check_idle()

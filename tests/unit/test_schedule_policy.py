"""Scheduling policy: pure decisions, tested without a model (many randomized states)."""

from __future__ import annotations

import math
import random

import pytest

from srt.managers.request_fit import check_request_fits
from srt.managers.scheduler.decode_policy import (
    NewTokenRatio,
    decode_slots,
    plan_retraction,
    retraction_order,
)
from srt.managers.scheduler.req import Req
from srt.managers.scheduler.schedule_policy import (
    AddResult,
    InBatchPrefixFilter,
    PrefillAdder,
    SchedulePolicy,
    decode_reserve,
)
from srt.sampling.sampling_params import SamplingParams, resolve_max_new_tokens
from srt.utils.pages import page_ceil


def make_req(i: int, prompt_len: int = 10, out_len: int = 0, max_new: int = 100, **kw) -> Req:
    req = Req(
        f"r{i}", list(range(prompt_len)), SamplingParams(), max_new_tokens=max_new, seed=i, queue_seq=i, **kw
    )
    req.output_ids = [7] * out_len
    return req


# ---------------------------------------------------------------------- arrival checks
def test_never_fits_rejections_name_numbers_and_flags():
    assert check_request_fits(100, 50, context_len=2048, max_total_tokens=4096) is None
    msg = check_request_fits(3000, 10, context_len=2048, max_total_tokens=100_000)
    assert "3000" in msg and "2048" in msg and "--context-length" in msg
    msg = check_request_fits(2000, 100, context_len=2048, max_total_tokens=100_000)
    assert "2000" in msg and "100" in msg and "2100" in msg and "--context-length" in msg
    msg = check_request_fits(500, 600, context_len=4096, max_total_tokens=1000)
    assert "1100" in msg and "1000" in msg and "--max-total-tokens" in msg
    assert "empty" in check_request_fits(0, 10, context_len=4096, max_total_tokens=1000)


def test_never_fits_counts_whole_pages():
    # 1000 tokens need 63 pages of 16 = 1008 slots
    assert check_request_fits(900, 100, context_len=4096, max_total_tokens=1008, page_size=16) is None
    assert check_request_fits(900, 100, context_len=4096, max_total_tokens=992, page_size=16) is not None


def test_resolve_max_new_tokens():
    assert resolve_max_new_tokens(17, 100, 2048, 4096) == 17
    assert resolve_max_new_tokens(None, 100, 2048, 4096) == 1948
    assert resolve_max_new_tokens(None, 100, 8192, 1000) == 900  # the pool is the tighter cap
    assert resolve_max_new_tokens(None, 5000, 2048, 4096) == 0
    # whatever comes out of None always passes the fit check
    for _ in range(1000):
        r = random.Random(_)
        ctx, pool, prompt = r.randint(16, 5000), r.randint(16, 5000), r.randint(1, 5000)
        m = resolve_max_new_tokens(None, prompt, ctx, pool)
        if prompt < min(ctx, pool):
            assert check_request_fits(prompt, m, ctx, pool) is None


# ---------------------------------------------------------------------- admission budgets
def _random_adder(rng: random.Random, chunked: bool) -> PrefillAdder:
    P = rng.choice([1, 1, 4, 16])
    chunk = page_ceil(rng.randint(1, 512), P) if chunked else None
    return PrefillAdder(
        page_size=P,
        rem_total_tokens=rng.randint(-100, 5000),
        rem_input_tokens=rng.randint(P, 1024),
        rem_chunk_tokens=chunk,
        max_new_reqs=rng.randint(0, 8),
        new_token_ratio=rng.uniform(0.1, 1.0),
        max_overtakes=rng.randint(0, 4),
    )


@pytest.mark.parametrize("chunked", [False, True])
def test_adder_respects_every_budget_randomized(chunked):
    rng = random.Random(1234 + chunked)
    for _ in range(3000):
        a = _random_adder(rng, chunked)
        P = a.page_size
        total0, input0, chunk0, reqs0 = (
            a.rem_total_tokens,
            a.rem_input_tokens,
            a.rem_chunk_tokens,
            a.max_new_reqs,
        )
        admitted: list[tuple[int, int]] = []  # (extend, cost)
        stopped = False
        for j in range(rng.randint(1, 12)):
            prefix = page_ceil(rng.randint(0, 300), P) if rng.random() < 0.5 else 0
            input_len = prefix + rng.randint(1, 700)
            max_new = rng.randint(0, 300)
            lock = rng.randint(0, 50) if prefix else 0
            retracted = rng.random() < 0.2
            overtaken = rng.randint(0, 5)
            before = a.rem_total_tokens
            cost = a.kv_cost(prefix, input_len, max_new, retracted) + lock
            d = a.add(
                prefix_len=prefix,
                input_len=input_len,
                max_new_left=max_new,
                lock_cost=lock,
                retracted=retracted,
                overtaken=overtaken,
                handle=j,
            )
            if stopped:
                assert d.result == AddResult.STOP, "a stopped adder admitted more"
                continue
            if d.result == AddResult.STOP:
                stopped = True
                continue
            if d.result == AddResult.SKIPPED:
                assert cost > before, "skipped a request that fit"
                assert overtaken < a.max_overtakes, "a request at its overtake limit must block, not skip"
                continue
            assert cost <= before, "admitted a request beyond the KV budget"
            extend = input_len - prefix
            if d.result == AddResult.CHUNKED:
                assert chunked and 0 < d.extend_len < extend and d.extend_len % P == 0
                assert a.stopped, "admission goes on after a chunked request"
            else:
                assert d.extend_len == extend
            admitted.append((d.extend_len, cost))
        assert len(admitted) <= reqs0
        assert sum(c for _, c in admitted) <= max(total0, 0)
        new_tokens = sum(e for e, _ in admitted)
        if chunked:
            assert new_tokens <= min(input0, chunk0)
        elif len(admitted) > 1:
            # only the first request of a step may exceed the prefill budget
            assert new_tokens - admitted[-1][0] <= input0
        assert a.num_new_tokens == new_tokens


def test_small_requests_go_ahead_of_a_blocked_large_one():
    a = PrefillAdder(
        page_size=1,
        rem_total_tokens=1000,
        rem_input_tokens=4096,
        rem_chunk_tokens=None,
        max_new_reqs=10,
        new_token_ratio=0.5,
    )
    big = a.add(prefix_len=0, input_len=2000, max_new_left=100, handle="big")
    small1 = a.add(prefix_len=0, input_len=100, max_new_left=100, handle="s1")
    small2 = a.add(prefix_len=0, input_len=100, max_new_left=100, handle="s2")
    assert big.result == AddResult.SKIPPED
    assert small1.result == small2.result == AddResult.ADMITTED
    assert a.overtaken_handles() == ["big"]


def test_blocked_request_stops_the_queue_after_max_overtakes():
    a = PrefillAdder(
        page_size=1,
        rem_total_tokens=1000,
        rem_input_tokens=4096,
        rem_chunk_tokens=None,
        max_new_reqs=10,
        new_token_ratio=0.5,
        max_overtakes=3,
    )
    assert (
        a.add(prefix_len=0, input_len=2000, max_new_left=1, overtaken=3, handle="big").result
        == AddResult.STOP
    )
    assert a.add(prefix_len=0, input_len=10, max_new_left=1, handle="small").result == AddResult.STOP
    assert a.overtaken_handles() == []


def test_skipped_but_not_overtaken_is_not_counted():
    a = PrefillAdder(
        page_size=1,
        rem_total_tokens=100,
        rem_input_tokens=4096,
        rem_chunk_tokens=None,
        max_new_reqs=10,
        new_token_ratio=0.5,
    )
    a.add(prefix_len=0, input_len=2000, max_new_left=1, handle="a")
    a.add(prefix_len=0, input_len=3000, max_new_left=1, handle="b")
    assert a.overtaken_handles() == []


@pytest.mark.parametrize("max_overtakes", [0, 2, 8])
def test_overtaking_is_bounded_under_a_stream_of_small_requests(max_overtakes):
    """Simulation: a pool of 1000 slots, a 900-slot request at the head of the queue and two new
    60-slot requests arriving every step, each living 5 steps (so 600 slots stay busy). Without
    the bound the big request waits forever; with it, it runs within max_overtakes + lifetime + 1
    steps."""
    pool, lifetime = 1000, 5

    def simulate(bound: int, steps: int = 200) -> int | None:
        # steady state: 10 small requests in flight (600 slots), two finishing every step
        running: list[list[int]] = [[60, 1 + k // 2] for k in range(2 * lifetime)]  # [slots, steps left]
        queue: list[tuple[str, int, int]] = [("big", 900, 0)]  # (name, slots, overtaken)
        for step in range(steps):
            queue += [(f"s{step}a", 60, 0), (f"s{step}b", 60, 0)]
            a = PrefillAdder(
                page_size=1,
                rem_total_tokens=pool - sum(s for s, _ in running),
                rem_input_tokens=1 << 20,
                rem_chunk_tokens=None,
                max_new_reqs=100,
                new_token_ratio=1.0,
                max_overtakes=bound,
            )
            keep = []
            for name, slots, over in queue:
                d = a.add(prefix_len=0, input_len=slots, max_new_left=0, overtaken=over, handle=name)
                if d.admitted:
                    if name == "big":
                        return step
                    running.append([slots, lifetime])
                else:
                    keep.append((name, slots, over))
            over_names = set(a.overtaken_handles())
            queue = [(n, s, o + (n in over_names)) for n, s, o in keep]
            running = [[s, t - 1] for s, t in running if t > 1]
        return None

    assert simulate(bound=10**9) is None, "the scenario must starve an unbounded big request"
    admitted_at = simulate(bound=max_overtakes)
    assert admitted_at is not None and admitted_at <= max_overtakes + lifetime + 1


# ---------------------------------------------------------------------- chunking
def test_chunk_split_is_page_aligned_and_covers_the_prompt_randomized():
    rng = random.Random(7)
    for _ in range(2000):
        P = rng.choice([1, 2, 8, 16])
        chunk_size = page_ceil(rng.randint(1, 300), P)
        max_prefill = rng.randint(P, 2000)
        prefix = page_ceil(rng.randint(0, 200), P) if rng.random() < 0.5 else 0
        total = prefix + rng.randint(1, 1500)
        done, pieces = prefix, []
        while done < total:
            a = PrefillAdder(
                page_size=P,
                rem_total_tokens=1 << 30,
                rem_input_tokens=max_prefill,
                rem_chunk_tokens=chunk_size,
                max_new_reqs=1,
                new_token_ratio=0.5,
            )
            d = a.add(prefix_len=done, input_len=total, max_new_left=10)
            assert d.admitted
            pieces.append(d.extend_len)
            done += d.extend_len
            if d.result == AddResult.CHUNKED:
                assert done % P == 0, "a chunk must end on a page boundary"
            else:
                assert done == total
        assert done == total
        assert all(0 < x <= min(chunk_size, max_prefill) for x in pieces)
        # full page-aligned chunks while more than the budget is left, then the rest at once
        cap = min(chunk_size, max_prefill)
        full = max(0, math.ceil((total - prefix - cap) / (cap // P * P)))
        assert len(pieces) == full + 1
        assert all(x == cap // P * P for x in pieces[:-1])


def test_chunk_budget_below_one_page_stops():
    a = PrefillAdder(
        page_size=16,
        rem_total_tokens=10_000,
        rem_input_tokens=10,
        rem_chunk_tokens=64,
        max_new_reqs=4,
        new_token_ratio=0.5,
    )
    assert a.add(prefix_len=0, input_len=100, max_new_left=10).result == AddResult.STOP


def test_without_chunking_the_first_request_may_exceed_the_prefill_budget():
    a = PrefillAdder(
        page_size=1,
        rem_total_tokens=100_000,
        rem_input_tokens=100,
        rem_chunk_tokens=None,
        max_new_reqs=4,
        new_token_ratio=0.5,
    )
    assert a.add(prefix_len=0, input_len=500, max_new_left=10).result == AddResult.ADMITTED
    assert a.add(prefix_len=0, input_len=5, max_new_left=10).result == AddResult.STOP
    b = PrefillAdder(
        page_size=1,
        rem_total_tokens=100_000,
        rem_input_tokens=100,
        rem_chunk_tokens=None,
        max_new_reqs=4,
        new_token_ratio=0.5,
    )
    assert b.add(prefix_len=0, input_len=50, max_new_left=10).result == AddResult.ADMITTED
    assert b.add(prefix_len=0, input_len=500, max_new_left=10).result == AddResult.STOP


def test_kv_cost_uses_the_ratio_and_whole_pages():
    a = PrefillAdder(
        page_size=16,
        rem_total_tokens=0,
        rem_input_tokens=1,
        rem_chunk_tokens=None,
        max_new_reqs=1,
        new_token_ratio=0.5,
    )
    # 100 input tokens past a 32-token prefix + ceil(0.5 * 30) = 15 decode tokens -> 115 -> 128 - 32
    assert a.kv_cost(32, 100, 30, retracted=False) == 96
    # a retracted request reserves all of its remaining tokens: 130 -> 144 - 32
    assert a.kv_cost(32, 100, 30, retracted=True) == 112


def test_decode_reserve():
    assert decode_reserve([], 0.7) == 0
    assert decode_reserve([10, 10], 0.5) == 10
    assert decode_reserve([10, 10], 1.0) == 20
    assert decode_reserve([3], 0.5) == 2  # rounded up per request


# ---------------------------------------------------------------------- queue order
def test_fcfs_and_priority_order():
    reqs = [make_req(i, priority=p) for i, p in enumerate([0, 5, 1, 5])]
    shuffled = [reqs[2], reqs[0], reqs[3], reqs[1]]
    assert SchedulePolicy("fcfs").order(shuffled, 0) == reqs
    assert SchedulePolicy("priority").order(shuffled, 0) == [reqs[1], reqs[3], reqs[2], reqs[0]]
    with pytest.raises(ValueError, match="lpm"):
        SchedulePolicy("random")


def test_lpm_prefers_long_prefixes_then_arrival():
    pol = SchedulePolicy("lpm", aging_tokens_per_step=0, starvation_steps=10**9)
    reqs = [make_req(i) for i in range(4)]
    assert pol.order(reqs, 0, [0, 300, 100, 300]) == [reqs[1], reqs[3], reqs[2], reqs[0]]
    # without prefix lengths (queue too long for matching) lpm falls back to arrival order
    assert pol.order(list(reversed(reqs)), 0, None) == reqs
    assert pol.uses_prefix_lens(10) and not pol.uses_prefix_lens(10**6)
    assert not SchedulePolicy("fcfs").uses_prefix_lens(1)


@pytest.mark.parametrize("policy", ["lpm", "spf"])
def test_aging_and_starvation_order_randomized(policy):
    """lpm ranks cached prefix + aging descending, spf tokens to compute - aging ascending; both
    put starved requests first, in arrival order, and break ties by arrival."""
    rng = random.Random(3)
    for _ in range(1000):
        aging, starve = rng.randint(0, 50), rng.randint(1, 100)
        pol = SchedulePolicy(policy, aging_tokens_per_step=aging, starvation_steps=starve)
        n = rng.randint(1, 20)
        tokens = [rng.choice([0, rng.randint(0, 2000)]) for _ in range(n)]
        waited = [rng.randint(0, 150) for _ in range(n)]
        seqs = rng.sample(range(1000), n)
        order = (pol.lpm_order if policy == "lpm" else pol.spf_order)(tokens, waited, seqs)
        assert sorted(order) == list(range(n))
        starved = [i for i in order if waited[i] >= starve]
        assert order[: len(starved)] == sorted(starved, key=lambda i: seqs[i]), (
            "starved first, in arrival order"
        )
        sign = -1 if policy == "lpm" else 1
        scores = [(sign * tokens[i] - aging * waited[i], seqs[i]) for i in order[len(starved) :]]
        assert scores == sorted(scores)


def test_lpm_cold_request_is_not_starved_by_hot_ones():
    """A cache-cold request among a steady stream of cache-hot ones that keep arriving: it reaches
    the head of the lpm order within the starvation bound (with aging, usually sooner)."""
    pol = SchedulePolicy("lpm", aging_tokens_per_step=16, starvation_steps=64)
    cold = make_req(0)
    cold.enqueue_step = 0
    queue = [cold]
    seq = 1
    for step in range(1000):
        hot = make_req(seq)
        hot.enqueue_step = step
        seq += 1
        queue.append(hot)
        prefix = [0 if r is cold else 1000 for r in queue]
        head = pol.order(queue, step, prefix)[0]
        if head is cold:
            assert step <= 64
            break
        queue.remove(head)  # the hot one at the head is admitted
    else:
        pytest.fail("the cold request never reached the head of the queue")


def test_spf_ranks_tokens_left_to_compute_then_arrival():
    pol = SchedulePolicy("spf", aging_tokens_per_step=0, starvation_steps=10**9)
    reqs = [make_req(i, prompt_len=n) for i, n in enumerate([300, 40, 300, 500])]
    # without prefix lengths (queue too long for matching): whole prompts, ties by arrival
    assert pol.order(list(reversed(reqs)), 0, None) == [reqs[1], reqs[0], reqs[2], reqs[3]]
    # a cached prefix counts off: 500 - 480 = 20 tokens left beats 40
    assert pol.order(reqs, 0, [0, 0, 0, 480]) == [reqs[3], reqs[1], reqs[0], reqs[2]]
    # a retracted request recomputes its outputs too
    reqs[1].output_ids = [7] * 400
    assert pol.order(reqs, 0, None) == [reqs[0], reqs[2], reqs[1], reqs[3]]
    assert pol.uses_prefix_lens(10) and not pol.uses_prefix_lens(10**6)


def test_spf_long_prompt_is_not_starved_by_short_ones():
    """A long prompt among a steady stream of short ones that keep arriving reaches the head of
    the spf order within the starvation bound."""
    pol = SchedulePolicy("spf")
    long = make_req(0, prompt_len=8000)
    long.enqueue_step = 0
    queue, seq = [long], 1
    for step in range(1000):
        short = make_req(seq, prompt_len=20)
        short.enqueue_step = step
        seq += 1
        queue.append(short)
        head = pol.order(queue, step, [0] * len(queue))[0]
        if head is long:
            assert step <= pol.starvation_steps
            break
        queue.remove(head)
    else:
        pytest.fail("the long prompt never reached the head of the queue")


# ---------------------------------------------------------------------- new-token ratio
def test_new_token_ratio_decays_to_min_and_rises_on_retraction():
    r = NewTokenRatio(init=0.7, min=0.1, decay=0.01)
    assert r.value == 0.7
    for _ in range(1000):
        r.on_decode_step()
        assert r.value >= 0.1
    assert r.value == pytest.approx(0.1)
    r.on_retract()
    assert r.value > 0.7
    for _ in range(20):
        r.on_retract()
    assert r.value == 1.0
    r.reset()
    assert r.value == 0.7
    with pytest.raises(ValueError):
        NewTokenRatio(init=0.05, min=0.1)


def test_conservativeness_scales_the_new_token_ratio():
    base = NewTokenRatio.from_conservativeness(1.0)
    assert base.value == pytest.approx(0.7) and base.min == pytest.approx(0.098)
    assert NewTokenRatio.from_conservativeness(2.0).value == 1.0
    low = NewTokenRatio.from_conservativeness(0.5)
    assert low.value == pytest.approx(0.35) and low.min < base.min
    for r in (base, low):  # reaches its minimum after the decay steps
        for _ in range(600):
            r.on_decode_step()
        assert r.value == pytest.approx(r.min)


# ---------------------------------------------------------------------- retraction
def test_retraction_order_loses_the_least_work_first():
    a = make_req(0, prompt_len=50, out_len=10)
    b = make_req(1, prompt_len=500, out_len=2)
    c = make_req(2, prompt_len=20, out_len=2)
    d = make_req(3, prompt_len=20, out_len=2)  # same as c but arrived later: retracted first
    assert retraction_order([a, b, c, d]) == [d, c, b, a]


def test_plan_retraction_randomized():
    rng = random.Random(11)
    for _ in range(2000):
        P = rng.choice([1, 4, 16])
        reqs = []
        for i in range(rng.randint(1, 12)):
            r = make_req(i, prompt_len=rng.randint(1, 300), out_len=rng.randint(1, 100))
            r.kv_committed_len = r.all_ids_len - 1
            reqs.append(r)
        available = rng.randint(0, 400)
        margin = rng.randint(1, 4)
        victims = plan_retraction(reqs, available, P, margin)
        order = retraction_order(reqs)
        assert victims == order[: len(victims)], "victims must be the cheapest requests"
        kept = order[len(victims) :]
        assert kept, "at least one request is kept"

        def freed(vs, P=P):
            return sum(page_ceil(v.kv_committed_len, P) for v in vs)

        need = decode_slots([r.kv_committed_len for r in kept], P, margin)
        assert need <= available + freed(victims) or len(kept) == 1
        if victims:  # one victim fewer would not have been enough
            prev_kept = order[len(victims) - 1 :]
            prev_need = decode_slots([r.kv_committed_len for r in prev_kept], P, margin)
            assert prev_need > available + freed(victims[:-1])


def test_decode_slots_counts_fresh_pages():
    assert decode_slots([5, 7], 1) == 2
    assert decode_slots([16, 17, 31], 16) == 16  # only the full page at 16 needs a new one
    assert decode_slots([15], 16, steps=2) == 16
    assert decode_slots([0], 16, steps=1) == 16


# ---------------------------------------------------------------------- in-batch sharing
def test_in_batch_prefix_filter_block_granularity():
    f = InBatchPrefixFilter(block=4)
    assert f.shared_len(list(range(20))) == 0
    f.add(list(range(10)))  # blocks [0,4) and [4,8) are recorded
    assert f.shared_len(list(range(20))) == 8
    assert f.shared_len(list(range(7))) == 4
    assert f.shared_len([0, 1, 2, 99] + list(range(4, 20))) == 0
    assert f.shared_len(list(range(4)) + [5, 4, 6, 7]) == 4


def test_in_batch_prefix_filter_matches_a_brute_force_model():
    rng = random.Random(5)
    for _ in range(300):
        f = InBatchPrefixFilter(block=rng.choice([1, 2, 8]))
        added: list[list[int]] = []
        for _ in range(rng.randint(1, 6)):
            base = rng.choice(added) if added and rng.random() < 0.6 else []
            key = base[: rng.randint(0, len(base))] + [rng.randrange(4) for _ in range(rng.randint(0, 40))]
            expect = 0
            for other in added:
                common = 0
                while common < min(len(key), len(other)) and key[common] == other[common]:
                    common += 1
                expect = max(expect, common // f.block * f.block)
            assert f.shared_len(key) == expect
            f.add(key)
            added.append(key)

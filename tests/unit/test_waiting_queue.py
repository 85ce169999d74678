"""The indexed waiting queue (srt/managers/scheduler/waiting_queue.py) against its reference,
``SchedulePolicy.order`` over the whole queue: under random arrivals, retractions, aborts and
admissions, every read of its head gives the reference's order, and what it holds (members,
arrival order, token count) stays exact."""

from __future__ import annotations

import random

import pytest

from srt.managers.scheduler.req import Req
from srt.managers.scheduler.schedule_policy import SCHEDULE_POLICIES, SchedulePolicy
from srt.managers.scheduler.waiting_queue import WaitingQueue
from srt.sampling.sampling_params import SamplingParams


def make_req(seq: int, prompt_len: int, priority: int = 0) -> Req:
    return Req(
        f"r{seq}",
        [1] * prompt_len,
        SamplingParams(),
        max_new_tokens=100,
        seed=seq,
        queue_seq=seq,
        priority=priority,
    )


def check_contents(q: WaitingQueue, expected: set[Req]) -> None:
    assert len(q) == len(expected) and bool(q) == bool(expected)
    assert list(q) == sorted(expected, key=lambda r: r.queue_seq)
    assert all(r in q for r in expected)
    assert q.num_tokens == sum(r.all_ids_len for r in expected)


@pytest.mark.parametrize("policy", SCHEDULE_POLICIES)
@pytest.mark.parametrize("seed", range(6))
def test_head_reads_the_reference_order_under_random_traffic(policy, seed):
    rng = random.Random(seed)
    pol = SchedulePolicy(
        policy, aging_tokens_per_step=rng.choice([0, 1, 16]), starvation_steps=rng.choice([1, 8, 64])
    )
    q = WaitingQueue(pol)
    waiting: set[Req] = set()
    admitted: list[Req] = []  # may come back retracted
    now, seq = 0, 0
    for _ in range(400):
        now += rng.choice([0, 1, 1, 3])
        for _ in range(rng.choice([0, 1, 5, 40])):  # arrivals (bursts of equal enqueue_step)
            req = make_req(seq, rng.choice([rng.randint(1, 40), rng.randint(1, 3000)]), rng.randint(0, 3))
            seq += 1
            req.enqueue_step = now
            q.add(req)
            waiting.add(req)
        if admitted and rng.random() < 0.3:  # a retraction: back with its outputs, its old step
            req = admitted.pop(rng.randrange(len(admitted)))
            req.output_ids.extend([7] * rng.randint(1, 500))
            q.add(req)
            waiting.add(req)
        for req in rng.sample(
            sorted(waiting, key=lambda r: r.queue_seq), min(len(waiting), rng.choice([0, 0, 2, 30]))
        ):
            assert q.remove(req)  # aborts, in any order
            waiting.discard(req)
        assert not q.remove(make_req(10**6, 5))
        want = pol.order(sorted(waiting, key=lambda r: r.queue_seq), now)
        k = rng.choice([0, 1, 3, 10, 100])
        got = []
        for req in q.in_order(now):
            if len(got) == k:
                break
            got.append(req)
        assert got == want[: len(got)] and len(got) == min(k, len(want))
        for req in got:
            if rng.random() < 0.5:  # admitted
                assert q.remove(req)
                waiting.discard(req)
                admitted.append(req)
        check_contents(q, waiting)


def test_removing_every_request_in_any_order_leaves_it_empty_and_reusable():
    for order in ("oldest first", "newest first", "shuffled"):
        q = WaitingQueue(SchedulePolicy("spf"))
        reqs = [make_req(i, 1 + i % 50) for i in range(5000)]
        for r in reqs:
            q.add(r)
        victims = reqs[::-1] if order == "newest first" else list(reqs)
        if order == "shuffled":
            random.Random(0).shuffle(victims)
        for r in victims:
            assert q.remove(r)
        check_contents(q, set())
        assert list(q.in_order(10**6)) == []
        q.add(reqs[7])
        assert list(q.in_order(0)) == [reqs[7]] == list(q.in_order(0))

"""Per-request deadlines, --max-queue-time and the phase timings on the real scheduler, allocator
and prefix cache (KV-checking fake model, tests/helpers/scheduler_fakes.py).

The deadline clock (``time.time`` in srt.managers.scheduler.deadlines) is replaced by a fake one
so that each request is in the intended state when its deadline passes. After every scenario the
cache's integrity holds and, after a flush, every KV slot and request row is free again."""

from __future__ import annotations

import json
import time
from concurrent import futures

import pytest

from srt.managers.io_struct import AbortReq, TokenizedGenerateReqInput
from srt.managers.scheduler import deadlines
from srt.managers.scheduler.deadlines import DeadlineTracker
from srt.managers.scheduler.req import ReqStatus
from srt.managers.scheduler.step_timing import StepTrace, trace_path
from srt.sampling.sampling_params import SamplingParams
from tests.helpers.scheduler_fakes import reference_generate
from tests.integration.test_scheduler_abort import (
    Collector,
    finish_and_check_free,
    make_scheduler,
    prompt,
    step,
)

T0 = 1_000.0


class FakeClock:
    def __init__(self) -> None:
        self.now = T0

    def time(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(deadlines, "time", c)
    return c


def gen(
    rid: str, ids: list[int], max_new: int = 8, timeout: float | None = None
) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(
        rid=rid,
        input_ids=ids,
        sampling_params=SamplingParams(max_new_tokens=max_new, temperature=0),
        arrival_time=T0,
        deadline=T0 + timeout if timeout is not None else 0.0,
    )


def timed_out(c: Collector, rid: str, timeout: float) -> bool:
    return c.finish[rid] == {
        "type": "timeout",
        "message": f"request timed out after {timeout:g} s",
        "status_code": 408,
    }


def test_deadline_while_waiting_behind_a_full_batch(clock):
    s = make_scheduler(max_running_requests=1)
    c = Collector()
    s.handle_message(gen("run", prompt(1, 20), max_new=30))
    s.handle_message(gen("wait", prompt(2, 20), timeout=2.5))
    step(s, c, 3)
    assert s.reqs_by_rid["wait"].state == ReqStatus.WAITING
    clock.now = T0 + 2.4
    step(s, c)
    assert "wait" not in c.finish
    clock.now = T0 + 2.5
    step(s, c)
    assert timed_out(c, "wait", 2.5) and c.tokens["wait"] == []
    assert s.get_internal_state()["num_timeouts"] == 1
    finish_and_check_free(s, c)
    assert c.tokens["run"] == reference_generate(prompt(1, 20), 30)


@pytest.mark.parametrize("radix", [True, False])
def test_deadline_mid_chunk(clock, radix):
    s = make_scheduler(radix=radix, chunk=32)
    c = Collector()
    s.handle_message(gen("long", prompt(3, 150), timeout=1))
    step(s, c, 2)
    req = s.reqs_by_rid["long"]
    assert req is s.chunked_req and req.state == ReqStatus.PREFILLING
    clock.now = T0 + 5
    step(s, c)
    assert timed_out(c, "long", 1) and s.chunked_req is None
    finish_and_check_free(s, c)


def test_deadline_while_running(clock):
    s = make_scheduler()
    c = Collector()
    s.handle_message(gen("a", prompt(4, 30), max_new=50, timeout=3))
    s.handle_message(gen("b", prompt(5, 30), max_new=20))
    step(s, c, 6)
    assert s.reqs_by_rid["a"].state == ReqStatus.DECODING
    sent = list(c.tokens["a"])
    clock.now = T0 + 3
    step(s, c)
    assert timed_out(c, "a", 3) and c.tokens["a"] == sent
    assert sent == reference_generate(prompt(4, 30), 50)[: len(sent)]
    finish_and_check_free(s, c)
    assert c.tokens["b"] == reference_generate(prompt(5, 30), 20)


def test_deadline_while_retracted(clock):
    s = make_scheduler(total=512, chunk=64, schedule_conservativeness=0.3)
    c = Collector()
    for i in range(8):  # deadlines 100, 200, ... s apart: the clock picks who times out
        s.handle_message(gen(f"r{i}", prompt(10 + i, 40), max_new=120, timeout=100.0 * (i + 1)))
    retracted = None
    for _ in range(2000):
        step(s, c)
        retracted = next((r for r in s.waiting_queue if r.retract_count > 0 and r.output_ids), None)
        if retracted is not None:
            break
    assert retracted is not None, "the pool is small enough that a request must be retracted"
    rid = retracted.rid
    kept = list(c.tokens[rid])
    clock.now = retracted.deadline
    step(s, c)
    assert timed_out(c, rid, retracted.deadline - T0) and c.tokens[rid] == kept
    finish_and_check_free(s, c)
    for i in range(8):  # the others either timed out too (earlier deadlines) or are exact
        r = f"r{i}"
        if c.finish[r]["type"] != "timeout":
            assert c.tokens[r] == reference_generate(prompt(10 + i, 40), 120)


def test_max_queue_time_refuses_a_request_that_never_started(clock):
    s = make_scheduler(max_running_requests=1, max_queue_time=5)
    c = Collector()
    s.handle_message(gen("run", prompt(1, 20), max_new=40))
    s.handle_message(gen("wait", prompt(2, 20)))
    step(s, c, 2)
    clock.now = T0 + 5
    step(s, c)
    assert c.finish["wait"] == {
        "type": "abort",
        "message": "the request waited more than --max-queue-time=5 s in the queue without starting; "
        "the server is overloaded, retry later",
        "status_code": 503,
        "retry_after": 5,
    }
    assert "run" not in c.finish, "a request that started is never refused"
    assert s.get_internal_state()["num_queue_time_refusals"] == 1
    finish_and_check_free(s, c)
    assert c.tokens["run"] == reference_generate(prompt(1, 20), 40)


def test_finished_requests_do_not_pile_up_in_the_deadline_heap(clock):
    s = make_scheduler(max_queue_time=60)
    c = Collector()
    for i in range(600):
        s.handle_message(gen(f"q{i}", prompt(i, 8), max_new=1, timeout=3600))
        step(s, c)
    finish_and_check_free(s, c)
    assert len(s.deadlines) < 2 * deadlines._MIN_COMPACT
    assert all(c.finish[f"q{i}"]["type"] == "length" for i in range(600))


def test_tracker_reports_each_request_once():
    t = DeadlineTracker(max_queue_time=1.0)
    s = make_scheduler()
    s.handle_message(gen("a", prompt(1, 8), timeout=1.0))
    req = s.reqs_by_rid["a"]
    t.track(req, now=T0)
    (only,) = t.expired(now=T0 + 10)  # both its deadline and its queue bound passed
    assert only[0] is req and only[1].type == "timeout"
    assert t.expired(now=T0 + 20) == []


def test_phase_timings_ride_on_the_first_and_the_last_output():
    s = make_scheduler(chunk=32)
    s.handle_message(gen("a", prompt(6, 100), max_new=5))
    outs = s.run_until_idle()
    per_rid = [(o.queue_times, o.prefill_times, o.decode_times, o.finished_reasons) for o in outs]
    firsts = [p for p in per_rid if p[0]]
    lasts = [p for p in per_rid if p[2]]
    assert len(firsts) == 1 and len(lasts) == 1
    (queue,), (prefill,) = firsts[0][0], firsts[0][1]
    assert queue is not None and queue >= 0 and prefill is not None and prefill > 0
    (decode,) = lasts[0][2]
    assert decode is not None and decode >= 0 and lasts[0][3][0] is not None
    hist = s.get_internal_state()["step_histograms"]
    forward_steps = hist["forward_seconds"]["count"]
    assert forward_steps == s.metrics.num_prefill_steps + s.metrics.num_decode_steps > 0
    assert hist["scheduling_seconds"]["cumulative"][-1] == forward_steps
    assert 0 < hist["overhead_ratio"]["count"] <= forward_steps


def test_deadline_while_waiting_for_a_grammar(clock):
    s = make_scheduler()
    if s.grammars is None:
        pytest.skip("no grammar backend")
    c = Collector()
    msg = gen("g", prompt(8, 10), timeout=1)
    msg.sampling_params.regex = "[a-z]+"
    s.handle_message(msg)
    assert s.grammars.pending and s.reqs_by_rid["g"].state == ReqStatus.WAITING
    clock.now = T0 + 1
    step(s, c)
    assert timed_out(c, "g", 1) and not s.grammars.pending
    # an explicit abort takes the same path (it used to crash: the request is not queued yet)
    msg = gen("g2", prompt(9, 10))
    msg.sampling_params.regex = "[a-z]+"
    s.handle_message(msg)
    s.handle_message(AbortReq(rid="g2", message="bye"))
    step(s, c)
    assert c.finish["g2"]["type"] == "abort" and not s.grammars.pending
    finish_and_check_free(s, c)
    # let the background compile (and the backend build) end here, not in a later test's CPU budget
    futures.wait(list(s.grammars._cache.values()), timeout=300)


def test_step_trace_records_each_forward_and_its_work(tmp_path):
    """--step-trace-path: a chunked prompt's extends (prefix and new tokens per chunk), then its
    decode steps (one row, the KV growing by one), one JSON line per forward."""
    s = make_scheduler(chunk=32)
    s.step_trace = StepTrace(str(tmp_path / "steps.jsonl"))
    s.handle_message(gen("a", prompt(6, 100), max_new=5))
    s.run_until_idle()
    s.step_trace.close()
    lines = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [x["mode"] for x in lines] == ["extend"] * 4 + ["decode"] * 4
    extends = lines[:4]
    assert [x["tokens"] for x in extends] == [32, 32, 32, 4]
    assert [x["kv"] for x in extends] == [32, 64, 96, 100]
    # causal pairs of a chunk after p tokens: p * n + n (n + 1) / 2, summing to 100 * 101 / 2
    assert sum(x["pairs"] for x in extends) == 100 * 101 // 2
    assert [x["kv"] for x in lines[4:]] == [101, 102, 103, 104]
    assert all(x["rows"] == 1 and x["tokens"] == 1 and x["pairs"] == x["kv"] for x in lines[4:])
    assert all(0 <= x["forward_s"] <= x["step_s"] for x in lines)
    assert [x["t"] for x in lines] == sorted(x["t"] for x in lines)
    assert lines[-1]["t"] == pytest.approx(time.time(), abs=60)  # epoch seconds


def test_trace_paths_of_data_parallel_groups():
    assert trace_path("/x/steps.jsonl", None) == "/x/steps.jsonl"
    assert trace_path("/x/steps.jsonl", 1) == "/x/steps.jsonl.dp1"

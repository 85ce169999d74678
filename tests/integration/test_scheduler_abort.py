"""Aborts (and other early finishes) in every request state, on the real scheduler, allocator and
prefix cache with a KV-checking fake model (tests/helpers/scheduler_fakes.py).

After every scenario: the cache's integrity holds, and after a flush every KV slot and request
row is free again."""

from __future__ import annotations

import random
import tempfile
import threading
import time

import pytest
import zmq

from srt.managers.io_struct import (
    AbortReq,
    BatchTokenIDOut,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    StopStringHit,
    TokenizedGenerateReqInput,
    encode,
)
from srt.managers.scheduler import Scheduler
from srt.managers.scheduler.process import event_loop
from srt.managers.scheduler.req import ReqStatus
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs
from tests.helpers.scheduler_fakes import KVEchoRunner, reference_generate


def make_scheduler(total: int = 2048, page: int = 1, radix: bool = True, **kw) -> Scheduler:
    max_running = kw.pop("max_running_requests", 32)
    args = ServerArgs(
        device="cpu",
        chunked_prefill_size=kw.pop("chunk", 32),
        page_size=page,
        disable_radix_cache=not radix,
        enable_debug_checks=True,
        max_running_requests=max_running,
        **kw,
    ).resolve()
    runner = KVEchoRunner(max_total_tokens=total, page_size=page, max_running_requests=max_running)
    return Scheduler(args, runner)


def gen(rid: str, prompt: list[int], max_new: int = 8, **params) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(
        rid=rid,
        input_ids=prompt,
        sampling_params=SamplingParams(max_new_tokens=max_new, temperature=0, **params),
    )


def prompt(seed: int, n: int) -> list[int]:
    return [3 + (seed * 7919 + i * 104729) % 997 for i in range(n)]


class Collector:
    """Per-rid token stream; checks that nothing arrives after a request's finish reason."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, dict] = {}

    def add(self, outs: list[BatchTokenIDOut]) -> None:
        for o in outs:
            assert len(o.rids) == len(set(o.rids)), "a request appears twice in one output"
            for rid, ids, fr, n in zip(o.rids, o.output_ids, o.finished_reasons, o.completion_tokens):
                assert rid not in self.finish, f"output for {rid} after its finish reason"
                self.tokens.setdefault(rid, []).extend(ids)
                assert n == len(self.tokens[rid]), "completion_tokens must count every token sent"
                if fr is not None:
                    self.finish[rid] = fr.to_dict()


def step(s: Scheduler, c: Collector, n: int = 1) -> None:
    """``n`` steps; then the batch launched last is completed (a no-op without overlap
    scheduling), so that the state checked next is the state between two steps."""
    for _ in range(n):
        c.add(s.step())
    s.complete_in_flight()
    c.add(s.take_outputs())


def finish_and_check_free(s: Scheduler, c: Collector) -> None:
    c.add(s.run_until_idle(max_steps=10_000))
    s.tree_cache.check_integrity(0)
    flushed = s.flush_cache()
    assert flushed.success and flushed.message == "", flushed
    assert s.allocator.available_size() == s.allocator.size
    assert s.req_to_token_pool.available_size() == s.req_to_token_pool.size
    assert not s.reqs_by_rid


@pytest.mark.parametrize("radix", [True, False])
def test_abort_waiting(radix):
    s = make_scheduler(radix=radix, max_running_requests=1)
    c = Collector()
    s.handle_message(gen("run", prompt(1, 20)))
    s.handle_message(gen("wait", prompt(2, 20)))
    step(s, c, 2)
    assert s.reqs_by_rid["wait"].state == ReqStatus.WAITING
    s.handle_message(AbortReq(rid="wait", message="client went away", status_code=499))
    step(s, c)
    assert c.finish["wait"] == {"type": "abort", "message": "client went away", "status_code": 499}
    assert c.tokens["wait"] == []
    finish_and_check_free(s, c)
    assert c.tokens["run"] == reference_generate(prompt(1, 20), 8)


def test_aborts_of_queued_requests_in_any_order_between_admissions_and_retractions():
    """Aborted waiting requests leave the queue lazily (in one pass when it is next read): the
    queue stays the arrival order of exactly those not aborted, through admissions, more arrivals
    and retractions, and every one not aborted is served exactly."""
    rng = random.Random(7)
    s = make_scheduler(total=512, chunk=64, schedule_conservativeness=0.3, max_running_requests=8)
    c = Collector()
    live: dict[str, tuple[list[int], int]] = {}
    for wave in range(4):
        for i in range(40):
            rid, ids, max_new = f"w{wave}-{i}", prompt(wave * 100 + i, 20 + i % 30), 30 + (7 * i) % 90
            s.handle_message(gen(rid, ids, max_new=max_new))
            live[rid] = (ids, max_new)
        waiting = [r.rid for r in s.waiting_queue]
        for rid in rng.sample(waiting, len(waiting) // 2)[::-1]:
            s.handle_message(AbortReq(rid=rid))
            del live[rid]
        assert [r.rid for r in s.waiting_queue] == [rid for rid in waiting if rid in live]
        step(s, c, 40)
        seqs = [r.queue_seq for r in s.waiting_queue]
        assert seqs == sorted(seqs) and len({r.rid for r in s.waiting_queue}) == len(seqs)
    finish_and_check_free(s, c)
    assert s.metrics.num_retractions > 0, "the pool is small enough that requests are retracted"
    aborted = {rid for rid, fr in c.finish.items() if fr["type"] == "abort"}
    assert aborted.isdisjoint(live) and len(aborted) + len(live) == 160
    for rid, (ids, max_new) in live.items():
        assert c.tokens[rid] == reference_generate(ids, max_new), rid


@pytest.mark.parametrize("radix", [True, False])
@pytest.mark.parametrize("page", [1, 16])
def test_abort_between_chunks(radix, page):
    s = make_scheduler(radix=radix, page=page, chunk=32)
    c = Collector()
    s.handle_message(gen("long", prompt(3, 150)))
    step(s, c, 2)
    req = s.reqs_by_rid["long"]
    assert req is s.chunked_req and req.state == ReqStatus.PREFILLING and req.kv_committed_len == 64
    s.handle_message(AbortReq(rid="long"))
    assert s.chunked_req is None and s.req_to_token_pool.available_size() == s.req_to_token_pool.size
    s.tree_cache.check_integrity(0)
    step(s, c)
    assert c.finish["long"]["type"] == "abort" and c.tokens["long"] == []
    if radix:  # the prefilled chunks stay shareable
        assert s.tree_cache.evictable_size() == 64
    # the same prompt again: exact, reusing the aborted request's chunks when radix is on
    s.handle_message(gen("again", prompt(3, 150)))
    finish_and_check_free(s, c)
    assert c.tokens["again"] == reference_generate(prompt(3, 150), 8)


@pytest.mark.parametrize("radix", [True, False])
def test_abort_running(radix):
    s = make_scheduler(radix=radix)
    c = Collector()
    s.handle_message(gen("a", prompt(4, 30), max_new=50))
    s.handle_message(gen("b", prompt(5, 30), max_new=20))
    step(s, c, 6)
    assert s.reqs_by_rid["a"].state == ReqStatus.DECODING
    sent = list(c.tokens["a"])
    assert 0 < len(sent) < 50
    s.handle_message(AbortReq(rid="a", message="stop now"))
    step(s, c)
    assert c.finish["a"]["type"] == "abort" and c.finish["a"]["message"] == "stop now"
    assert c.tokens["a"] == sent, "no token after the abort"
    assert sent == reference_generate(prompt(4, 30), 50)[: len(sent)]
    finish_and_check_free(s, c)
    assert c.tokens["b"] == reference_generate(prompt(5, 30), 20)


def test_abort_retracted():
    s = make_scheduler(total=512, chunk=64, schedule_conservativeness=0.3)
    c = Collector()
    for i in range(8):
        s.handle_message(gen(f"r{i}", prompt(10 + i, 40), max_new=120))
    retracted = None
    for _ in range(2000):
        step(s, c)
        retracted = next(
            (r for r in s.waiting_queue if r.retract_count > 0 and r.output_ids and not r.finished), None
        )
        if retracted is not None:
            break
    assert retracted is not None, "the pool is small enough that a request must be retracted"
    assert s.metrics.num_retractions > 0
    rid = retracted.rid
    kept = list(c.tokens[rid])
    s.handle_message(AbortReq(rid=rid))
    finish_and_check_free(s, c)
    assert c.finish[rid]["type"] == "abort" and c.tokens[rid] == kept
    for i in range(8):
        if f"r{i}" != rid:
            assert c.tokens[f"r{i}"] == reference_generate(prompt(10 + i, 40), 120)


def test_abort_unknown_finished_and_all():
    s = make_scheduler()
    c = Collector()
    s.handle_message(AbortReq(rid="nope"))
    assert s.is_idle() and s.step() == []
    s.handle_message(gen("done", prompt(6, 10), max_new=2))
    finish_and_check_free(s, c)
    s.handle_message(AbortReq(rid="done"))  # already finished: ignored
    assert s.is_idle()
    for i in range(5):
        s.handle_message(gen(f"x{i}", prompt(20 + i, 40 + 30 * i), max_new=30))
    step(s, c, 3)
    s.handle_message(AbortReq(rid="", message="shutdown", status_code=503))
    assert not s.waiting_queue and s.running == [] and s.chunked_req is None
    step(s, c)
    assert all(
        c.finish[f"x{i}"] == {"type": "abort", "message": "shutdown", "status_code": 503} for i in range(5)
    )
    finish_and_check_free(s, c)


def test_stop_string_hit_finishes_a_running_request():
    s = make_scheduler()
    c = Collector()
    s.handle_message(gen("a", prompt(7, 20), max_new=40, stop=["xyz"]))
    step(s, c, 5)
    sent = list(c.tokens["a"])
    s.handle_message(StopStringHit(rid="a", matched="xyz"))
    step(s, c)
    assert c.finish["a"] == {"type": "stop", "matched": "xyz"} and c.tokens["a"] == sent
    finish_and_check_free(s, c)


def test_never_fitting_and_duplicate_requests_are_rejected():
    s = make_scheduler(total=1024)
    c = Collector()
    s.handle_message(gen("huge", prompt(8, 900), max_new=200))
    s.handle_message(gen("ok", prompt(9, 10), max_new=3))
    s.handle_message(gen("ok", prompt(99, 10), max_new=3))  # duplicate rid: dropped
    step(s, c)
    huge = c.finish["huge"]
    assert huge["type"] == "abort" and huge["status_code"] == 400
    assert "1100" in huge["message"] and "1024" in huge["message"] and "--max-total-tokens" in huge["message"]
    s.handle_message(gen("bad_id", [5, 1000, 7], max_new=3))  # the fake vocabulary is 1000
    finish_and_check_free(s, c)
    assert c.tokens["ok"] == reference_generate(prompt(9, 10), 3)
    assert c.finish["bad_id"]["status_code"] == 400 and "[0, 1000)" in c.finish["bad_id"]["message"]
    assert s.metrics.num_rejected == 3


def test_flush_refused_while_busy_and_internal_state():
    s = make_scheduler()
    c = Collector()
    s.handle_message(gen("a", prompt(11, 30), max_new=5))
    (reply,) = s.handle_message(FlushCacheReq())
    assert isinstance(reply, FlushCacheReqOutput) and not reply.success and "waiting" in reply.message
    (state,) = s.handle_message(GetInternalStateReq())
    assert isinstance(state, GetInternalStateReqOutput)
    assert state.state["num_queued_reqs"] == 1 and state.state["max_total_num_tokens"] == 2048
    finish_and_check_free(s, c)
    st = s.get_internal_state()
    assert st["num_finished"] == 1 and st["num_generated_tokens"] == 5 and st["available_size"] == 2048


def test_flush_right_after_an_abort_before_the_next_step():
    """An aborted request gives back its KV at once; a flush that arrives before the step that
    reports the abort is not refused (it once answered "0 running and 0 waiting" with a 400)."""
    s = make_scheduler()
    c = Collector()
    s.handle_message(gen("a", prompt(13, 30), max_new=50))
    for _ in range(4):
        c.add(s.step())
    assert s.get_internal_state()["num_running_reqs"] == 1
    s.handle_message(AbortReq(rid="a"))
    assert not s.is_idle()  # the abort is reported with the next step
    (reply,) = s.handle_message(FlushCacheReq())
    assert isinstance(reply, FlushCacheReqOutput) and reply.success, reply
    assert s.allocator.available_size() == s.allocator.size
    c.add(s.run_until_idle(max_steps=10))
    assert c.finish["a"]["type"] == "abort"
    finish_and_check_free(s, c)


def test_event_loop_serves_over_zmq_and_blocks_when_idle():
    s = make_scheduler()
    d = tempfile.mkdtemp(prefix="srt-test-")
    in_addr, out_addr = f"ipc://{d}/in", f"ipc://{d}/out"
    ctx = zmq.Context()
    recv = ctx.socket(zmq.PULL)
    recv.bind(in_addr)
    send = ctx.socket(zmq.PUSH)
    send.connect(out_addr)
    sink = ctx.socket(zmq.PULL)
    sink.bind(out_addr)
    push = ctx.socket(zmq.PUSH)
    push.connect(in_addr)
    thread = threading.Thread(target=event_loop, args=(s, recv, send), daemon=True)
    try:
        thread.start()
        from srt.managers.io_struct import detokenizer_input_decoder

        push.send(encode(gen("z", prompt(12, 25), max_new=6)))
        tokens: list[int] = []
        sink.setsockopt(zmq.RCVTIMEO, 20_000)
        while True:
            out = detokenizer_input_decoder.decode(sink.recv())
            assert isinstance(out, BatchTokenIDOut)
            tokens += out.output_ids[0]
            if out.finished_reasons[0] is not None:
                break
        assert tokens == reference_generate(prompt(12, 25), 6)
        push.send(b"not msgpack")  # dropped with an error log, the loop survives
        push.send(encode(GetInternalStateReq()))
        state = detokenizer_input_decoder.decode(sink.recv())
        assert isinstance(state, GetInternalStateReqOutput) and state.state["num_finished"] == 1
        # idle: the loop blocks in poll instead of spinning
        time.sleep(0.2)
        t0 = time.thread_time()  # this thread's CPU
        c0 = time.process_time()
        time.sleep(1.0)
        busy = (time.process_time() - c0) - (time.thread_time() - t0)
        assert busy < 0.2, f"the idle event loop used {busy:.2f} s of CPU in 1 s"
    finally:
        for sock in (push, sink):
            sock.close(linger=0)
        # the loop thread is a daemon blocked in poll on its own sockets; it ends with the process.
        # If it is not running, nothing would ever close them and the context's finalizer would
        # block the test run in zmq_ctx_term: close everything here instead.
        if not thread.is_alive():
            ctx.destroy(linger=0)


def test_an_idle_event_loop_builds_the_grammar_backend(monkeypatch):
    """With no request at all, the loop wakes once its idle stretch reaches the grammar warm-up
    time and starts the backend's build (not at start-up: a busy server pays for it only when a
    grammar asks)."""
    from srt.managers.scheduler import grammar

    monkeypatch.setattr(grammar, "WARM_UP_AFTER_IDLE_S", 0.3)
    s = make_scheduler()
    built = threading.Event()
    s.grammars = grammar.GrammarManager(lambda: built.set() or object())
    d = tempfile.mkdtemp(prefix="srt-test-")
    ctx = zmq.Context()
    recv = ctx.socket(zmq.PULL)
    recv.bind(f"ipc://{d}/in")
    send = ctx.socket(zmq.PUSH)
    send.connect(f"ipc://{d}/out")
    thread = threading.Thread(target=event_loop, args=(s, recv, send), daemon=True)
    thread.start()
    assert not s.grammars.started
    assert built.wait(timeout=10), "the idle loop never built the grammar backend"
    assert thread.is_alive()  # blocked in poll again


def test_zero_and_unbounded_max_new_tokens():
    """max_new_tokens=0 finishes after the prefill with no token; None runs up to the context
    length (here 2048 - prompt) unless a stop token comes first."""
    s = make_scheduler(total=4096)
    c = Collector()
    s.handle_message(gen("zero", prompt(13, 30), max_new=0))
    s.handle_message(
        TokenizedGenerateReqInput(
            rid="none",
            input_ids=prompt(14, 2000),
            sampling_params=SamplingParams(max_new_tokens=None, temperature=0, ignore_eos=True),
        )
    )
    finish_and_check_free(s, c)
    assert c.tokens["zero"] == [] and c.finish["zero"] == {"type": "length", "length": 0}
    assert c.finish["none"] == {"type": "length", "length": 48}
    assert c.tokens["none"] == reference_generate(prompt(14, 2000), 48)

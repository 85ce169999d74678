"""Overlap scheduling (srt/managers/scheduler/overlap.py): the future map, the flags, that the
forward really runs while the scheduler goes on, and that outputs do not change.

Exactness under continuous batching with overlap on (fake and real model, retraction, mixed
chunks, EOS stops) is in tests/integration/test_scheduler_exactness.py; the scheduler suites
rerun with overlap on by default in tests/integration/test_overlap_suites.py."""

from __future__ import annotations

import threading
import types

import pytest
import torch

from srt.configs.server_args_resolve import _resolve_overlap
from srt.managers.io_struct import AbortReq, TokenizedGenerateReqInput
from srt.managers.scheduler import Scheduler
from srt.managers.scheduler.overlap import future_ref, resolve_future_ids
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs
from srt.utils.errors import ConfigError
from tests.helpers.overlap import forced as overlap_forced
from tests.helpers.scheduler_fakes import EOS, KVEchoRunner, reference_generate


def test_future_refs_are_replaced_by_the_ids_the_map_holds():
    future = torch.tensor([100, 101, 102, 103])
    ids = torch.tensor([7, future_ref(2), 9, future_ref(0), future_ref(3)])
    assert resolve_future_ids(ids, future).tolist() == [7, 102, 9, 100, 103]
    plain = torch.tensor([0, 5, 6])
    assert resolve_future_ids(plain, future).tolist() == [0, 5, 6]


def _args(**kw) -> types.SimpleNamespace:
    base = dict(device="cpu", tp_size=1, enable_overlap_schedule=False, disable_overlap_schedule=False)
    return types.SimpleNamespace(**{**base, **kw})


@pytest.mark.skipif(overlap_forced(), reason="this run forces overlap scheduling on by default")
@pytest.mark.parametrize(
    ("kw", "on"),
    [
        (dict(), False),  # CPU: off by default (measured: docs/benchmarks.md)
        (dict(device="cuda"), False),  # not measured on a GPU yet
        (dict(device="cuda", enable_overlap_schedule=True), True),
        (dict(device="cuda", disable_overlap_schedule=True), False),
        (dict(enable_overlap_schedule=True), True),
    ],
)
def test_overlap_flag_resolution(kw, on):
    a = _args(**kw)
    _resolve_overlap(a)
    assert a.disable_overlap_schedule is (not on)


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        (dict(enable_overlap_schedule=True, disable_overlap_schedule=True), "contradict"),
        (dict(enable_overlap_schedule=True, tp_size=2), "--tp-size"),
    ],
)
def test_overlap_flag_errors(kw, words):
    with pytest.raises(ConfigError, match=words):
        _resolve_overlap(_args(**kw))
    with pytest.raises(ConfigError, match=words):
        ServerArgs(device="cpu", **kw).resolve()


class GatedRunner(KVEchoRunner):
    """KVEchoRunner whose forwards wait for ``gate`` and record the thread they ran on."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.gate = threading.Event()
        self.threads: set[int] = set()

    def forward_batch_generation(self, fb):
        assert self.gate.wait(10), "the test never opened the gate"
        self.threads.add(threading.get_ident())
        return super().forward_batch_generation(fb)


def _req(rid: str, prompt: list[int], max_new: int, **params) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(
        rid=rid,
        input_ids=prompt,
        sampling_params=SamplingParams(max_new_tokens=max_new, temperature=0.0, **params),
    )


def _scheduler(runner: KVEchoRunner, overlap: bool, **kw) -> Scheduler:
    flag = {"enable_overlap_schedule": True} if overlap else {}
    args = ServerArgs(device="cpu", enable_debug_checks=True, **flag, **kw).resolve()
    return Scheduler(args, runner)


def _collect(outs, tokens: dict[str, list[int]], finished: dict[str, str]) -> None:
    for out in outs:
        for rid, ids, fr in zip(out.rids, out.output_ids, out.finished_reasons):
            assert rid not in finished, f"output for {rid} after its finish"
            tokens.setdefault(rid, []).extend(ids)
            if fr is not None:
                finished[rid] = fr.type


def test_the_step_returns_while_its_forward_runs_on_the_worker_thread():
    runner = GatedRunner(max_total_tokens=1024, max_running_requests=4)
    sched = _scheduler(runner, overlap=True)
    sched.handle_message(_req("a", list(range(10, 30)), 6))
    assert sched.step() == []  # launched the prefill, nothing completed yet: returns at once
    assert not sched.is_idle()
    runner.gate.set()
    tokens: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    while not sched.is_idle():
        _collect(sched.step(), tokens, finished)
    assert tokens["a"] == reference_generate(list(range(10, 30)), 6) and finished == {"a": "length"}
    assert runner.threads and threading.get_ident() not in runner.threads
    sched.worker.shutdown()


def test_a_decode_batch_is_launched_before_the_previous_one_completes():
    """With overlap the decode step N+1 reads token N from the future map: the forward of N+1
    is queued while N is still blocked, and the outputs are exact."""
    runner = GatedRunner(max_total_tokens=1024, max_running_requests=4)
    runner.gate.set()
    sched = _scheduler(runner, overlap=True)
    sched.handle_message(_req("a", list(range(40, 50)), 12))
    sched.step()  # prefill launched
    sched.step()  # prefill completed (needs its tokens on the host), first decode launched
    sched._in_flight.wait()  # decode 1 ran
    runner.gate.clear()  # the next decode launched will block in its forward
    sched.step()  # completes decode 1 (not blocked: it ran already) after launching decode 2
    launched = sched._in_flight
    assert launched is not None and launched.batch.has_future_refs  # decode 2 reads decode 1's token
    assert not launched.future.done()
    runner.gate.set()
    tokens: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    while not sched.is_idle():
        _collect(sched.step(), tokens, finished)
    expected = reference_generate(list(range(40, 50)), 12)
    assert tokens["a"] == expected[len(expected) - len(tokens["a"]) :]


@pytest.mark.parametrize("page_size", [1, 16])
def test_eos_stops_aborts_and_length_finishes_match_without_overlap(page_size):
    """Requests stopping on EOS (their next row is discarded), finishing by length (left out of the
    next batch) and aborted while their row is in flight: same tokens, and every KV slot and
    request row back afterwards."""
    prompts = {f"r{i}": [(i * 37 + j * 11) % 500 + 3 for j in range(5 + 7 * i)] for i in range(10)}
    results = []
    for overlap in (False, True):
        runner = KVEchoRunner(
            max_total_tokens=2048, page_size=page_size, max_running_requests=16, eos_every=4
        )
        sched = _scheduler(runner, overlap, page_size=page_size, max_running_requests=16)
        for rid, p in prompts.items():
            sched.handle_message(_req(rid, p, 20))
        tokens: dict[str, list[int]] = {}
        finished: dict[str, str] = {}
        for step in range(10_000):
            if sched.is_idle():
                break
            if step == 6:
                sched.handle_message(AbortReq(rid="r9"))
            _collect(sched.step(), tokens, finished)
        results.append((tokens, finished))
        sched.flush_cache()
        assert sched.cache.available() == runner.max_total_num_tokens
        assert runner.req_to_token_pool.available_size() == runner.req_to_token_pool.size
    (t_off, f_off), (t_on, f_on) = results
    assert f_on == f_off and f_on["r9"] == "abort"
    assert sum(1 for v in f_off.values() if v == "stop") >= 2, "the workload must stop on EOS"
    for rid in prompts:
        if rid != "r9":
            assert t_on[rid] == t_off[rid] == reference_generate(prompts[rid], 20, eos_every=4), rid
            assert (t_on[rid][-1] == EOS) == (f_on[rid] == "stop")


class PositionRecorder(KVEchoRunner):
    """Records (sequence length, sampling noise position) of every DECODE row."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.rows: list[tuple[int, int]] = []

    def forward_batch_generation(self, fb):
        if fb.forward_mode.name == "DECODE":
            self.rows += zip(fb.seq_lens_cpu, fb.sampling_info.positions.tolist())
        return super().forward_batch_generation(fb)


@pytest.mark.parametrize("overlap", [False, True])
def test_sampling_positions_count_the_token_in_flight(overlap):
    """Seeded sampling draws its noise at the request's output position: a decode row sampling
    output k (its input is output k-1, in flight or not) must carry position k."""
    L = 12
    runner = PositionRecorder(max_total_tokens=1024, max_running_requests=8)
    sched = _scheduler(runner, overlap)
    for i in range(5):
        sched.handle_message(_req(f"p{i}", [(i * 13 + j) % 400 + 3 for j in range(L)], 9 + i, seed=i))
    sched.run_until_idle()
    assert len(runner.rows) > 20
    assert all(pos == seq_len - L for seq_len, pos in runner.rows), runner.rows
    if overlap:
        assert sched.metrics.num_overlapped_steps > 0

"""The scheduler's weight updates and profiler, in process on the model-free KVEchoRunner: an update
waits for the admitted requests, holds new ones and serves them afterwards (no KV slot leaked, no
request lost); the profiler starts, stops, refuses bad states and stops by itself after num_steps."""

from __future__ import annotations

import gzip
import json
import os

from srt.managers.io_struct import (
    AbortReq,
    ProfileReq,
    ProfileReqOutput,
    UpdateWeightsFromDiskReq,
    UpdateWeightsFromDiskReqOutput,
)
from tests.helpers.scheduler_fakes import reference_generate
from tests.integration.test_scheduler_abort import (
    Collector,
    finish_and_check_free,
    gen,
    make_scheduler,
    prompt,
)


def _run_until_reply(s, c: Collector, max_steps: int = 10_000) -> list:
    for _ in range(max_steps):
        c.add(s.step())
        replies = s.take_replies()
        if replies:
            return replies
    raise AssertionError("no reply")


def test_update_when_idle_is_answered_at_once():
    s = make_scheduler()
    (reply,) = s.handle_message(UpdateWeightsFromDiskReq(model_path="/ckpt/b"))
    assert isinstance(reply, UpdateWeightsFromDiskReqOutput) and reply.success
    assert s.model_runner.weight_updates == ["/ckpt/b"]
    assert s.is_idle() and s.weight_gate.pending is None


def test_update_waits_for_running_requests_and_holds_new_ones():
    s = make_scheduler(max_running_requests=2)
    c = Collector()
    for i in range(3):  # two run, one queued: all admitted before the update
        s.handle_message(gen(f"old{i}", prompt(i, 20), max_new=6))
    c.add(s.step())
    assert s.handle_message(UpdateWeightsFromDiskReq(model_path="/ckpt/b")) == []
    s.handle_message(gen("new", prompt(7, 20), max_new=6))
    s.handle_message(gen("new-aborted", prompt(8, 20), max_new=6))
    s.handle_message(AbortReq(rid="new-aborted"))
    assert [m.rid for m in s.weight_gate.held] == ["new"]
    assert s.get_internal_state()["num_queued_reqs"] == len(s.waiting_queue) + 1  # + "new", held
    (reply,) = _run_until_reply(s, c)
    assert reply.success and s.model_runner.weight_updates == ["/ckpt/b"]
    # every admitted request finished on the old weights before the update; "new" after it
    assert all(f"old{i}" in c.finish for i in range(3)) and "new" not in c.finish
    assert s.tree_cache.evictable_size() == 0  # flushed: the cache held the old weights' KV
    finish_and_check_free(s, c)
    for i in range(3):
        assert c.tokens[f"old{i}"] == reference_generate(prompt(i, 20), 6)
    assert c.tokens["new"] == reference_generate(prompt(7, 20), 6)
    assert "new-aborted" not in c.tokens


def test_failed_update_keeps_serving_and_releases_held_requests():
    s = make_scheduler()
    c = Collector()
    s.handle_message(gen("a", prompt(1, 30), max_new=5))
    assert s.handle_message(UpdateWeightsFromDiskReq(model_path="/missing/ckpt")) == []
    (refused,) = s.handle_message(UpdateWeightsFromDiskReq(model_path="/ckpt/c"))
    assert not refused.success and "already in progress" in refused.message
    s.handle_message(gen("b", prompt(2, 30), max_new=5))
    (reply,) = _run_until_reply(s, c)
    assert not reply.success and "does not exist" in reply.message
    finish_and_check_free(s, c)
    assert c.tokens["b"] == reference_generate(prompt(2, 30), 5)


def test_profiler_start_stop_and_states(tmp_path):
    s = make_scheduler()
    (bad,) = s.handle_message(ProfileReq(action="stop"))
    assert isinstance(bad, ProfileReqOutput) and not bad.success and "not running" in bad.message
    (gpu,) = s.handle_message(ProfileReq(action="start", activities=["GPU"]))
    assert not gpu.success and "CUDA" in gpu.message
    (steps,) = s.handle_message(ProfileReq(action="start", num_steps=0))
    assert not steps.success
    (started,) = s.handle_message(ProfileReq(action="start", output_dir=str(tmp_path)))
    assert started.success and started.trace_path.startswith(str(tmp_path))
    assert s.get_internal_state()["profiling"] is True
    (twice,) = s.handle_message(ProfileReq(action="start", output_dir=str(tmp_path)))
    assert not twice.success and "already running" in twice.message
    c = Collector()
    s.handle_message(gen("a", prompt(1, 10), max_new=3))
    finish_and_check_free(s, c)
    (stopped,) = s.handle_message(ProfileReq(action="stop"))
    assert stopped.success and stopped.trace_path == started.trace_path
    with gzip.open(stopped.trace_path) as f:
        assert "traceEvents" in json.load(f)
    assert s.get_internal_state()["profiling"] is False


def test_profiler_stops_by_itself_after_num_steps(tmp_path, monkeypatch):
    monkeypatch.setenv("SRT_TORCH_PROFILER_DIR", str(tmp_path / "env-dir"))
    s = make_scheduler()
    (started,) = s.handle_message(ProfileReq(action="start", num_steps=2))
    assert started.success and started.trace_path.startswith(str(tmp_path / "env-dir"))
    c = Collector()
    s.handle_message(gen("a", prompt(1, 10), max_new=8))
    c.add(s.step())
    assert s.profiler.active
    c.add(s.step())
    assert not s.profiler.active and os.path.isfile(started.trace_path)
    (late,) = s.handle_message(ProfileReq(action="stop"))
    assert not late.success
    finish_and_check_free(s, c)

"""The hang watchdog (``--watchdog-timeout``) on real processes, the forward stalled on purpose
with the test-only ``SRT_TEST_FAULT`` hook (srt/utils/fault.py): the server dumps the stacks of
every process and the scheduler's state, fails in-flight requests with 503 and exits non-zero
with no process left; an Engine raises EngineDeadError. Plus the scheduler's heartbeat on the
KV-checking fake model (no process)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import psutil
import pytest
import requests

from srt.managers.io_struct import TokenizedGenerateReqInput
from srt.managers.scheduler import Scheduler
from srt.managers.scheduler.heartbeat import SchedulerHeartbeat
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs
from srt.utils.errors import EngineDeadError
from srt.utils.watchdog import HeartbeatReader, create_heartbeat_file
from tests.helpers.scheduler_fakes import KVEchoRunner
from tests.helpers.server import ServerProcess, wait_gone

WATCHDOG_S = 3.0
# detection (one poll interval), the stack dumps (0.5 s per child), the stop of the children and
# uvicorn's shutdown: "within watchdog-timeout + 5 s" of the stall, with room for a loaded machine
EXIT_SLACK_S = 5.0 + 10.0


def test_the_scheduler_publishes_each_step_and_going_idle(tmp_path):
    path = str(tmp_path / "hb")
    create_heartbeat_file(path)
    args = ServerArgs(device="cpu", enable_debug_checks=True, max_running_requests=8).resolve()
    s = Scheduler(args, KVEchoRunner(max_total_tokens=2048, page_size=1, max_running_requests=8))
    s.heartbeat = SchedulerHeartbeat.open(path)
    reader = HeartbeatReader(path)
    params = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    s.handle_message(TokenizedGenerateReqInput(rid="a", input_ids=list(range(3, 40)), sampling_params=params))
    s.step()
    beat = reader.read()
    assert beat.has_work and beat.step == s.metrics.num_steps == 1
    assert beat.summary["batch"] == {
        "forward_mode": "EXTEND",
        "batch_size": 1,
        "num_extend_reqs": 1,
        "extend_tokens": 37,
        "num_tokens": 37,
    }
    s.step()
    beat = reader.read()
    assert beat.step == 2 and beat.summary["batch"]["forward_mode"] == "DECODE"
    assert beat.summary["num_running_reqs"] == 1 and beat.summary["num_queued_reqs"] == 0
    s.run_until_idle()
    s.heartbeat.on_idle(s)  # what the event loop does before it blocks
    beat = reader.read()
    assert not beat.has_work and beat.summary["batch"] is None and beat.summary["num_running_reqs"] == 0


def _post(url: str, body: dict, out: list) -> None:
    try:
        r = requests.post(url, json=body, timeout=120, stream=body.get("stream", False))
        out.append((r.status_code, r.text))
    except requests.RequestException as e:
        out.append((None, repr(e)))


def test_a_stalled_forward_holding_the_gil_dumps_every_stack_fails_requests_and_exits():
    server = ServerProcess(
        ["--max-total-tokens", "16384", "--log-level", "warning", "--watchdog-timeout", str(WATCHDOG_S)],
        env={"SRT_TEST_FAULT": "stall_forward_gil_after:4"},
    )
    server.start()
    try:
        tree = server.process_tree()
        assert len(tree) >= 3  # main, scheduler, detokenizer (and helpers of theirs)
        # on demand: SIGUSR1 prints the main process's stacks and it goes on serving
        os.kill(server.proc.pid, signal.SIGUSR1)
        # an idle scheduler (no work) never trips, however long it stays idle
        time.sleep(WATCHDOG_S + 1.5)
        assert server.proc.poll() is None
        assert requests.get(server.url("/health"), timeout=30).status_code == 200
        assert "in launch_server" in server.log_text()
        plain: list = []
        streamed: list = []
        long = {"max_new_tokens": 200, "ignore_eos": True}
        threads = [
            threading.Thread(
                target=_post, args=(server.url("/generate"), {"text": "Hi", "sampling_params": long}, plain)
            ),
            threading.Thread(
                target=_post,
                args=(
                    server.url("/v1/completions"),
                    {"prompt": "Hi", "max_tokens": 200, "stream": True},
                    streamed,
                ),
            ),
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while "stalling forward" not in server.log_text():
            assert time.monotonic() < deadline and server.proc.poll() is None, server.log_tail()
            time.sleep(0.05)
        stalled_at = time.monotonic()
        code = server.wait_exit(WATCHDOG_S + EXIT_SLACK_S)
        exited_after = time.monotonic() - stalled_at
        for t in threads:
            t.join(timeout=30)
        log = server.log_text()
        assert code is not None and code != 0, log[-4000:]
        assert exited_after < WATCHDOG_S + EXIT_SLACK_S
        assert wait_gone(tree, 10) == []
    finally:
        server.stop()
    # in-flight requests failed with 5xx in OpenAI's error shape (the stream: an error event)
    assert plain and plain[0][0] == 503, plain
    assert json.loads(plain[0][1])["error"]["code"] == "engine_dead"
    assert streamed and streamed[0][0] == 200 and '"engine_dead"' in streamed[0][1], streamed
    # the state summary, then the stacks of the main process, the stuck scheduler, the detokenizer
    line = next(x for x in log.splitlines() if "scheduler state: " in x)
    state = json.loads(line.split("scheduler state: ", 1)[1])
    assert state["seconds_since_progress"] >= WATCHDOG_S and state["num_running_reqs"] >= 1
    assert (
        state["batch"]["forward_mode"] in ("DECODE", "EXTEND", "MIXED") and state["batch"]["batch_size"] >= 1
    )
    main, rest = log.split("Python stacks of the main process", 1)[1].split(
        "Python stacks of the scheduler", 1
    )
    sched, detok = rest.split("Python stacks of the detokenizer", 1)
    assert "srt/utils/watchdog.py" in main and "launch_server" in main
    assert "stall_forward_holding_gil" in sched and "in step" in sched and "in event_loop" in sched
    assert "run_detokenizer_process" in detok


def test_an_engine_raises_engine_dead_for_in_flight_and_later_calls(monkeypatch):
    from srt import Engine

    monkeypatch.setenv("SRT_TEST_FAULT", "stall_forward_after:2")  # inherited by the spawned children
    llm = Engine(max_total_tokens=16384, log_level="warning", watchdog_timeout=WATCHDOG_S)
    try:
        children = [psutil.Process(p) for p in llm.child_pids.values() if p is not None]
        monkeypatch.delenv("SRT_TEST_FAULT")
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="no progress"):
            llm.generate("Hello", {"max_new_tokens": 50, "ignore_eos": True})
        assert time.monotonic() - t0 < WATCHDOG_S + EXIT_SLACK_S
        with pytest.raises(EngineDeadError):
            llm.generate("Hello again", {"max_new_tokens": 2})
        assert wait_gone(children, 15) == []
    finally:
        llm.shutdown()
        os.environ.pop("SRT_TEST_FAULT", None)

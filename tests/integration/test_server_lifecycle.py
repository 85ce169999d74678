"""Process life cycle of the real server: client disconnects, explicit aborts, idle CPU, a dying
scheduler, SIGTERM (see test_launch.py for start-up failures and parent death)."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import pytest
import requests

from tests.helpers.server import DEFAULT_TEST_ARGS, ServerProcess, wait_gone

LONG = {"max_new_tokens": 4000, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    # a short drain: test_sigterm_stops_everything signals it with a long request in flight
    with ServerProcess([*DEFAULT_TEST_ARGS, "--graceful-shutdown-timeout", "1"]) as s:
        yield s


def state(server) -> dict:
    return requests.get(server.url("/get_server_info"), timeout=30).json()["internal_states"][0]


def wait_until_running(server, n: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while state(server)["num_running_reqs"] < n:
        assert time.monotonic() < deadline, "request never started running"
        time.sleep(0.05)


def assert_freed_promptly(server, before: dict, closed_at: float, timeout_s: float = 5.0) -> None:
    """After a disconnect at ``closed_at`` (monotonic; ``before``: the state just before it):
    running drops to 0 within 2 s, a tenth at most of the 4,000 tokens asked for. The bound is
    loose and in wall-clock time: the HTTP process notices the disconnect, and answers the polls
    that observe the freeing, while the compute threads hold both cores (under the test suite's
    load, 10 decode steps once passed between two polls 10 ms apart). That an abort arriving
    between two steps lands before the next one is test_scheduler_abort's."""
    last = state(server)
    while last["num_running_reqs"] > 0:
        assert time.monotonic() - closed_at < timeout_s, f"request still running: {last}"
        last = state(server)
    elapsed = time.monotonic() - closed_at
    steps = last["num_steps"] - before["num_steps"]
    assert elapsed < 2.0 and steps < 400, (before["num_steps"], last["num_steps"], elapsed)


def test_streaming_client_disconnect_frees_the_request(server):
    r = requests.post(
        server.url("/v1/completions"),
        stream=True,
        timeout=60,
        json={
            "prompt": "Tell me a long story.",
            "max_tokens": 4000,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        },
    )
    lines = r.iter_lines()
    got = 0
    while got < 3:
        if next(lines).startswith(b"data: "):
            got += 1
    before = state(server)
    assert before["num_running_reqs"] == 1
    closed_at = time.monotonic()
    r.close()  # the client goes away mid-stream
    assert_freed_promptly(server, before, closed_at)
    metrics = requests.get(server.url("/metrics"), timeout=30).text
    assert 'reason="client"' in metrics
    # once idle, flushing the cache frees every KV slot
    assert requests.post(server.url("/flush_cache"), timeout=30).status_code == 200
    s = state(server)
    assert s["available_size"] == s["max_total_num_tokens"] and s["evictable_size"] == 0


def test_non_streaming_client_disconnect_frees_the_request(server):
    body = json.dumps({"text": "Count to a million:", "sampling_params": LONG}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    wait_until_running(server, 1)
    before, closed_at = state(server), time.monotonic()
    sock.close()
    assert_freed_promptly(server, before, closed_at)


def test_explicit_abort_request(server):
    result: dict = {}

    def run() -> None:
        result["out"] = requests.post(
            server.url("/generate"),
            timeout=120,
            json={"text": "Count to a million:", "sampling_params": LONG, "rid": "to-abort"},
        ).json()

    t = threading.Thread(target=run)
    t.start()
    wait_until_running(server, 1)
    r = requests.post(server.url("/abort_request"), json={"rid": "to-abort"}, timeout=30)
    assert r.status_code == 200 and r.json() == {"aborted": 1}
    t.join(timeout=30)
    assert result["out"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert state(server)["num_running_reqs"] == 0


def test_idle_cpu_below_5_percent(server):
    procs = server.process_tree()  # main (tokenizer manager + HTTP), scheduler, detokenizer (+ mp's tracker)
    assert set(_child_pids(server).values()) <= {p.pid for p in procs}
    # a grammar first: its backend is built now (else a few seconds into the idle stretch, once)
    body = {
        "text": "Digits:",
        "sampling_params": {"regex": "[0-9]{3}", "max_new_tokens": 4, "temperature": 0},
    }
    assert requests.post(server.url("/generate"), json=body, timeout=120).status_code == 200
    time.sleep(1.0)  # let the last request's bookkeeping settle

    def cpu() -> float:
        total = 0.0
        for p in procs:
            t = p.cpu_times()
            total += t.user + t.system
        return total

    c0, t0 = cpu(), time.monotonic()
    time.sleep(5.0)
    used = (cpu() - c0) / (time.monotonic() - t0)
    assert used < 0.05, f"idle server used {used:.1%} of a core"


def test_only_the_scheduler_loads_torch(server):
    """On a CPU host the HTTP process and the detokenizer never load torch (srt/utils/torch_free.py
    and ServerArgs' torch-free resolution), after serving chat, a JSON schema and logprobs: about
    200 MiB of resident memory each."""
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 8,
        "logprobs": True,
        "top_logprobs": 2,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "a", "schema": {"type": "object"}},
        },
    }
    r = requests.post(server.url("/v1/chat/completions"), json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert json.loads(r.json()["choices"][0]["message"]["content"]) is not None

    def maps_torch(pid: int) -> bool:
        with open(f"/proc/{pid}/maps") as f:
            return "libtorch_cpu" in f.read()

    children = _child_pids(server)
    assert not maps_torch(server.proc.pid)
    assert not maps_torch(children["detokenizer"])
    schedulers = [pid for name, pid in children.items() if name.startswith("scheduler")]
    assert schedulers and all(maps_torch(pid) for pid in schedulers), children


def _child_pids(server) -> dict[str, int]:
    return requests.get(server.url("/get_server_info"), timeout=30).json()["process_pids"]


def test_scheduler_death_fails_requests_and_stops_the_server():
    with ServerProcess() as srv:
        tree = srv.process_tree()
        pids = _child_pids(srv)
        statuses: list[int] = []
        stream_events: list[bytes] = []

        def non_streaming() -> None:
            r = requests.post(srv.url("/generate"), json={"text": "Hi", "sampling_params": LONG}, timeout=60)
            statuses.append(r.status_code)

        def streaming() -> None:
            try:
                r = requests.post(
                    srv.url("/v1/completions"),
                    stream=True,
                    timeout=60,
                    json={"prompt": "Hi", "max_tokens": 4000, "stream": True, "ignore_eos": True},
                )
                stream_events.extend(line for line in r.iter_lines() if line.startswith(b"data: "))
            except requests.RequestException:
                stream_events.append(b"connection error")

        threads = [threading.Thread(target=non_streaming) for _ in range(2)] + [
            threading.Thread(target=streaming)
        ]
        for t in threads:
            t.start()
        wait_until_running(srv, 3)
        time.sleep(0.3)
        os.kill(pids["scheduler"], signal.SIGKILL)
        t0 = time.monotonic()
        code = srv.wait_exit(10)
        elapsed = time.monotonic() - t0
        for t in threads:
            t.join(timeout=10)
        assert code is not None and elapsed < 5.0, f"server still up {elapsed:.1f} s after the scheduler died"
        assert code != 0
        assert statuses and all(s >= 500 for s in statuses), statuses
        assert stream_events and (
            b"error" in stream_events[-2] or stream_events[-1] == b"connection error"
        ), stream_events[-3:]
        assert wait_gone(tree, 2.0) == []
        assert "scheduler process died" in srv.log_text()


def test_sigterm_stops_everything(server):
    """Runs last in this module: it stops the module's server (the fixture's teardown is then a no-op);
    the request in flight is aborted when the 1 s drain ends."""
    tree = server.process_tree()
    assert set(_child_pids(server).values()) <= {p.pid for p in tree}
    r = requests.post(
        server.url("/v1/completions"),
        stream=True,
        timeout=60,
        json={"prompt": "Hi", "max_tokens": 4000, "stream": True, "ignore_eos": True},
    )
    next(r.iter_lines())  # a request is in flight
    code = server.stop(signal.SIGTERM, timeout_s=15)
    assert code == 0
    assert wait_gone(tree, 5.0) == []
    r.close()

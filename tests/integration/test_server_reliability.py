"""Reliability on the real server: per-request deadlines (body field and X-Request-Timeout header,
streaming and not, both route families), --max-queue-time, phase timings, the scheduler-step
metrics, and the graceful drain on SIGTERM (requests in flight complete; after a short
--graceful-shutdown-timeout they are aborted with the shutdown reason; exit code 0 both ways).

Two servers: ``server`` (the last test drains it) and ``tight`` (one running request at a time,
--max-queue-time 1, a 1 s drain)."""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest
import requests

from tests.helpers.server import DEFAULT_TEST_ARGS, ServerProcess, wait_gone

LONG = {"max_new_tokens": 4000, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    with ServerProcess([*DEFAULT_TEST_ARGS, "--graceful-shutdown-timeout", "120"]) as s:
        yield s


@pytest.fixture(scope="module")
def tight():
    args = ["--max-running-requests", "1", "--max-queue-time", "1", "--graceful-shutdown-timeout", "1"]
    with ServerProcess([*DEFAULT_TEST_ARGS, *args]) as s:
        yield s


def state(srv) -> dict:
    return requests.get(srv.url("/get_server_info"), timeout=30).json()["internal_states"][0]


def wait_idle(srv, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        st = state(srv)
        if st["num_running_reqs"] == 0 and st["num_queued_reqs"] == 0:
            return st
        assert time.monotonic() < deadline, f"requests left: {st}"
        time.sleep(0.05)


def sse_payloads(resp: requests.Response) -> list:
    """Every ``data:`` payload of an SSE response, ``[DONE]`` as the string."""
    out = []
    for line in resp.iter_lines():
        if line.startswith(b"data: "):
            body = line[len(b"data: ") :]
            out.append("[DONE]" if body == b"[DONE]" else json.loads(body))
    return out


# ---------------------------------------------------------------------------- deadlines
def test_non_streaming_timeout_is_408_and_frees_the_request(server):
    t0 = time.monotonic()
    r = requests.post(
        server.url("/generate"), json={"text": "Hi", "sampling_params": LONG, "timeout": 0.5}, timeout=60
    )
    elapsed = time.monotonic() - t0
    assert r.status_code == 408, r.text
    err = r.json()["error"]
    assert err["message"] == "request timed out after 0.5 s" and err["code"] == "request_timeout"
    assert elapsed < 10, elapsed
    st = wait_idle(server)
    assert st["available_size"] + st["evictable_size"] == st["max_total_num_tokens"]


def test_header_timeout_on_chat_and_bad_values(server):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4000, "ignore_eos": True}
    r = requests.post(
        server.url("/v1/chat/completions"), json=body, headers={"X-Request-Timeout": "0.5"}, timeout=60
    )
    assert r.status_code == 408 and r.json()["error"]["type"] == "timeout_error", r.text
    r = requests.post(
        server.url("/v1/chat/completions"), json=body, headers={"X-Request-Timeout": "soon"}, timeout=60
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Timeout"
    r = requests.post(server.url("/generate"), json={"text": "Hi", "timeout": -1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "timeout"
    # the body's field wins over the header
    r = requests.post(
        server.url("/generate"),
        json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}, "timeout": 60},
        headers={"X-Request-Timeout": "0.001"},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["meta_info"]["finish_reason"]["type"] == "length"
    wait_idle(server)


def test_streaming_timeout_ends_with_a_timeout_finish(server):
    body = {"prompt": "Hi", "max_tokens": 4000, "ignore_eos": True, "stream": True, "timeout": 0.5}
    with requests.post(server.url("/v1/completions"), json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200
        events = sse_payloads(r)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "timeout"
    body = {"text": "Hi", "sampling_params": LONG, "stream": True, "timeout": 0.5}
    with requests.post(server.url("/generate"), json=body, stream=True, timeout=60) as r:
        events = sse_payloads(r)
    assert events[-1] == "[DONE]"
    reason = events[-2]["meta_info"]["finish_reason"]
    assert reason == {"type": "timeout", "message": "request timed out after 0.5 s", "status_code": 408}
    wait_idle(server)


# ---------------------------------------------------------------------------- timings, metrics
def test_phase_timings_are_consistent_and_cached_tokens_count(server):
    text = "The quick brown fox jumps over the lazy dog. " * 8
    body = {"text": text, "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}
    metas = [
        requests.post(server.url("/generate"), json=body, timeout=60).json()["meta_info"] for _ in range(2)
    ]
    for m in metas:
        for k in ("queue_time", "prefill_time", "decode_time", "ttft", "e2e_latency"):
            assert isinstance(m[k], float) and m[k] >= 0, (k, m)
        assert m["ttft"] <= m["e2e_latency"]
        phases = m["queue_time"] + m["prefill_time"] + m["decode_time"]
        assert phases <= m["e2e_latency"] + 1e-3, m
        assert m["e2e_latency"] - phases < 0.5 + 0.25 * m["e2e_latency"], m  # tokenize, ipc, detokenize
        assert m["prefill_time"] <= m["ttft"]
    assert metas[0]["cached_tokens"] == 0 or metas[1]["cached_tokens"] >= metas[0]["cached_tokens"]
    assert metas[1]["cached_tokens"] > 0
    # the OpenAI routes give them when asked, per choice
    r = requests.post(
        server.url("/v1/completions"),
        json={"prompt": text, "max_tokens": 4, "n": 2, "return_timings": True},
        timeout=60,
    ).json()
    assert sorted(m["index"] for m in r["metrics"]) == [0, 1]
    assert all(m["cached_tokens"] > 0 and m["ttft"] <= m["e2e_latency"] for m in r["metrics"])
    body = {"prompt": text, "max_tokens": 4, "stream": True, "return_timings": True}
    with requests.post(server.url("/v1/completions"), json=body, stream=True, timeout=60) as resp:
        events = [e for e in sse_payloads(resp) if e != "[DONE]"]
    with_metrics = [e for e in events if "metrics" in e]
    assert len(with_metrics) == 1 and with_metrics[0]["choices"][0]["finish_reason"] == "length"
    assert (
        "metrics"
        not in requests.post(
            server.url("/v1/completions"), json={"prompt": "Hi", "max_tokens": 2}, timeout=60
        ).json()
    )


def _metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_step_metrics_and_abort_reasons(server):
    text = requests.get(server.url("/metrics"), timeout=30).text
    steps = _metric(text, "srt:step_forward_seconds_count")
    assert steps is not None and steps > 10
    assert _metric(text, "srt:step_scheduling_seconds_count") == steps
    assert (
        0
        < _metric(text, "srt:step_scheduling_seconds_sum")
        < _metric(text, "srt:step_forward_seconds_sum") * 10
    )
    frac = _metric(text, "srt:scheduler_overhead_fraction")
    assert frac is not None and 0 < frac < 1
    inf = next(
        ln for ln in text.splitlines() if ln.startswith('srt:step_scheduler_overhead_ratio_bucket{le="+Inf"')
    )
    assert float(inf.rsplit(" ", 1)[1]) == steps
    timeouts = [
        ln
        for ln in text.splitlines()
        if ln.startswith("srt:num_aborted_requests_total{") and 'reason="timeout"' in ln
    ]
    assert timeouts and float(timeouts[0].rsplit(" ", 1)[1]) >= 4, timeouts  # the deadline tests above
    assert _metric(text, "srt:e2e_request_latency_seconds_count") >= 5
    assert _metric(text, "srt:queue_time_seconds_count") >= 5


# ---------------------------------------------------------------------------- --max-queue-time
def test_max_queue_time_refuses_with_503_and_retry_after(tight):
    results: list = []

    def long_stream() -> None:
        body = {"text": "Hi", "sampling_params": LONG, "stream": True}
        with requests.post(tight.url("/generate"), json=body, stream=True, timeout=120) as r:
            results.append(sse_payloads(r))

    t = threading.Thread(target=long_stream)
    t.start()
    deadline = time.monotonic() + 60
    while state(tight)["num_running_reqs"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    r = requests.post(
        tight.url("/generate"), json={"text": "Hello", "sampling_params": {"max_new_tokens": 4}}, timeout=60
    )
    assert r.status_code == 503 and r.headers["Retry-After"] == "1", r.text
    assert "--max-queue-time" in r.json()["error"]["message"]
    body = {"prompt": "Hello", "max_tokens": 4, "stream": True}
    with requests.post(tight.url("/v1/completions"), json=body, stream=True, timeout=60) as resp:
        events = sse_payloads(resp)
    assert events[-1] == "[DONE]" and "--max-queue-time" in events[-2]["error"]["message"]
    metrics = requests.get(tight.url("/metrics"), timeout=30).text
    assert 'reason="queue_time"' in metrics
    # ---- the drain times out: the long stream is aborted with the shutdown reason, exit 0
    tree = tight.process_tree()
    tight.proc.send_signal(signal.SIGTERM)
    code = tight.wait_exit(30)
    t.join(timeout=30)
    assert code == 0, tight.log_tail()
    events = results[0]
    assert events[-1] == "[DONE]"
    reason = events[-2]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 503 and "shut down" in reason["message"]
    assert wait_gone(tree, 10.0) == []


# ---------------------------------------------------------------------------- drain (runs last)
def test_sigterm_drains_requests_in_flight(server):
    tree = server.process_tree()
    results: dict[int, list] = {}
    started = threading.Barrier(3)

    def stream(i: int) -> None:
        body = {"prompt": "Count:", "max_tokens": 150, "ignore_eos": True, "stream": True}
        with requests.post(server.url("/v1/completions"), json=body, stream=True, timeout=180) as r:
            lines = r.iter_lines()
            first = next(ln for ln in lines if ln.startswith(b"data: "))
            started.wait(timeout=60)
            rest = [ln for ln in lines if ln.startswith(b"data: ")]
            results[i] = [json.loads(x[6:]) if x != b"data: [DONE]" else "[DONE]" for x in [first, *rest]]

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    started.wait(timeout=60)
    server.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    while requests.get(server.url("/health"), timeout=10).status_code != 503:
        assert time.monotonic() < deadline, "/health never turned 503"
        time.sleep(0.02)
    r = requests.post(server.url("/generate"), json={"text": "Hi"}, timeout=30)
    assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
    assert r.json()["error"]["code"] == "shutting_down"
    code = server.wait_exit(150)
    for t in threads:
        t.join(timeout=30)
    assert code == 0, server.log_tail()
    for i in range(2):
        events = results[i]
        assert events[-1] == "[DONE]"
        finishes = [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]]
        assert finishes == ["length"], events[-3:]
    assert wait_gone(tree, 10.0) == []

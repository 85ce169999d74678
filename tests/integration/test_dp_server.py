"""``--dp-size 2`` end to end on the default model: two scheduler groups behind the controller.

The suite's shared dp=1 server (tests/integration/conftest.py) gives the reference greedy outputs
of a short burst; one dp=2 server (shared by the tests below, killed by the last one) must give
the same outputs with the requests spread over both groups (read from the controller's state and
/metrics), route an abort to the group that runs the request, leave every pool full after idle,
and go down when a group dies."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.helpers.server import DEFAULT_TEST_ARGS, ServerProcess

PROMPTS = [f"Question {i}: what is {i} plus {i + 3}? Answer:" for i in range(16)]
SHORT = {"max_new_tokens": 12, "temperature": 0}
LONG = {"max_new_tokens": 4000, "temperature": 0, "ignore_eos": True}


def burst(server: ServerProcess, concurrency: int = 8) -> list[list[int]]:
    """The 16 prompts at ``concurrency``, like a small bench_serving run; output ids per prompt."""

    def one(prompt: str) -> list[int]:
        r = requests.post(
            server.url("/generate"), json={"text": prompt, "sampling_params": SHORT}, timeout=300
        )
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, PROMPTS))


def info(server: ServerProcess) -> dict:
    return requests.get(server.url("/get_server_info"), timeout=30).json()


def wait_for(pred, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def pools_full(server: ServerProcess) -> bool:
    states = info(server)["internal_states"]
    return len(states) == 2 and all(
        s["num_running_reqs"] == 0 and s["available_size"] + s["evictable_size"] == s["max_total_num_tokens"]
        for s in states
    )


@pytest.fixture(scope="module")
def reference(default_server) -> list[list[int]]:
    return burst(default_server)


@pytest.fixture(scope="module")
def server(reference):  # after the reference burst: the dp=1 server idles while this one runs
    with ServerProcess([*DEFAULT_TEST_ARGS, "--dp-size", "2"]) as s:
        yield s


def test_burst_matches_dp1_and_spreads_over_both_groups(server, reference):
    before = info(server)["dp_controller"]["num_routed_reqs"]
    assert burst(server) == reference
    routed = [a - b for a, b in zip(info(server)["dp_controller"]["num_routed_reqs"], before)]
    assert sum(routed) == 16 and min(routed) >= 4, routed
    metrics = requests.get(server.url("/metrics"), timeout=30).text
    series = dict(re.findall(r'srt:dp_routed_reqs_total\{dp_rank="(\d)"[^}]*\} ([0-9.]+)', metrics))
    assert sorted(series) == ["0", "1"] and sum(float(v) for v in series.values()) >= 16
    assert re.search(r'srt:dp_load_tokens\{dp_rank="1"', metrics)
    wait_for(lambda: pools_full(server), "both pools full after the burst")
    # each group has its own pool, sized from its share of the memory (CPU: no fraction given)
    assert info(server)["mem_fraction_static"] is None


def test_abort_lands_in_the_owning_group_and_pools_are_full_after_a_flush(server):
    aborted_before = [s["num_aborted"] for s in info(server)["internal_states"]]
    result: dict = {}

    def run() -> None:
        r = requests.post(
            server.url("/generate"),
            json={"text": "Tell me a story.", "rid": "dp-abort", "sampling_params": LONG},
        )
        result["body"] = r.json()

    t = threading.Thread(target=run)
    t.start()
    states = wait_for(
        lambda: (s := info(server)["internal_states"]) and sum(x["num_running_reqs"] for x in s) == 1 and s,
        "the long request to run",
    )
    owner = next(i for i, s in enumerate(states) if s["num_running_reqs"] == 1)
    assert info(server)["dp_controller"]["num_live_reqs"][owner] == 1
    r = requests.post(server.url("/abort_request"), json={"rid": "dp-abort"}, timeout=30)
    assert r.json()["aborted"] == 1
    t.join(timeout=60)
    assert result["body"]["meta_info"]["finish_reason"]["type"] == "abort"
    wait_for(lambda: pools_full(server), "both pools full after the abort")
    after = [s["num_aborted"] for s in info(server)["internal_states"]]
    assert after[owner] == aborted_before[owner] + 1
    assert after[1 - owner] == aborted_before[1 - owner]
    wait_for(
        lambda: info(server)["dp_controller"]["num_live_reqs"] == [0, 0], "the controller to forget rids"
    )
    flushed = requests.post(server.url("/flush_cache"), timeout=60)
    assert flushed.status_code == 200, flushed.text
    for s in info(server)["internal_states"]:
        assert s["evictable_size"] == 0 and s["available_size"] == s["max_total_num_tokens"]


def test_group_death_fails_requests_and_stops_the_server(server):
    pids = info(server)["process_pids"]
    assert {"scheduler_dp0", "scheduler_dp1", "dp_controller"} <= set(pids)
    statuses: list[int] = []

    def run() -> None:
        r = requests.post(server.url("/generate"), json={"text": "Hi", "sampling_params": LONG}, timeout=60)
        statuses.append(r.status_code)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    wait_for(lambda: sum(s["num_running_reqs"] for s in info(server)["internal_states"]) == 2, "2 running")
    os.kill(pids["scheduler_dp1"], signal.SIGKILL)
    t0 = time.monotonic()
    code = server.wait_exit(15)
    for t in threads:
        t.join(timeout=15)
    assert code is not None and code != 0, f"server still up {time.monotonic() - t0:.1f} s after a group died"
    assert statuses and all(s >= 500 for s in statuses), statuses

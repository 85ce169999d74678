"""Tensor-parallel processes with real launches (default model, CPU, gloo; 2 ranks).

* Engine(tp_size=2) (one node: the two ranks split the CPUs): greedy outputs on the correctness
  prompts equal transformers' (so equal to --tp-size 1's; near-tie rule of hf_reference.py).
* Engine(tp_size=2) with a tiny random-weight Qwen2 of ONE KV head (replicated over the ranks):
  greedy outputs equal transformers' on the same weights.
* Two launches ``--nnodes 2 --node-rank 0/1 --dist-init-addr 127.0.0.1:PORT`` on this host:
  - they serve the same outputs, a request deadline expires alike on both ranks (408, the group
    goes on serving); SIGTERM to node 0 -> node 1 notices and exits with code 0;
  - killing node 1 (SIGKILL) while a request is in flight: the request gets a 5xx, node 0 exits
    non-zero within 10 s; afterwards no process of either launch is left.
* A rendezvous that never completes (node 1 never started) fails node 0 after --dist-timeout
  naming the missing rank.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import requests

from srt import Engine
from tests.helpers.hf_reference import (
    assert_tokens_match,
    default_model_references,
    default_prompt_set,
    make_prompts,
)
from tests.helpers.ref_cache import hf_folder_references
from tests.helpers.server import DEFAULT_TEST_ARGS, ServerProcess, free_port, wait_gone
from tests.helpers.tiny_models import save_tiny_model

MAX_NEW_TOKENS = 48
GREEDY = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def workload():
    # the first 20 of the exactness prompts test_runner_exactness.py uses: their references come
    # from the disk cache when that module ran first
    prompts = default_prompt_set(24, seed=0, min_len=5, max_len=400)[0][:20]
    return prompts, default_model_references(prompts, MAX_NEW_TOKENS)


def check_outputs(outputs: list[list[int]], refs) -> None:
    near_ties = sum(
        assert_tokens_match(out, ref.token_ids, ref.top_logprobs) for out, ref in zip(outputs, refs)
    )
    assert near_ties <= max(1, len(outputs) // 24)


def test_engine_tp2_matches_transformers(workload):
    prompts, refs = workload
    llm = Engine(tp_size=2, max_total_tokens=16384, log_level="warning")
    try:
        pids = llm.tokenizer_manager.launcher.child_pids
        assert {"scheduler", "scheduler-tp1"} <= set(pids)
        # half the prompts here, the other half through the two-node launch below (CI time)
        outs = llm.generate(input_ids=prompts[:12], sampling_params=GREEDY)
        check_outputs([o["output_ids"] for o in outs], refs[:12])
    finally:
        llm.shutdown()


def test_engine_tp2_tiny_qwen2_with_replicated_kv_head(tmp_path):
    path = save_tiny_model("qwen2", tmp_path / "qwen2-kv1", seed=5, num_key_value_heads=1)
    prompts = make_prompts([3, 17, 60, 150], seed=7, vocab_size=320)
    refs = hf_folder_references(path, prompts, 24)
    llm = Engine(
        model_path=path, tp_size=2, skip_tokenizer_init=True, max_total_tokens=4096, log_level="warning"
    )
    try:
        outs = llm.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 24})
    finally:
        llm.shutdown()
    check_outputs([o["output_ids"] for o in outs], refs)


def two_nodes(extra: list[str] | None = None) -> tuple[ServerProcess, ServerProcess]:
    addr = f"127.0.0.1:{free_port()}"
    common = [*DEFAULT_TEST_ARGS, "--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr, *(extra or [])]
    # both "nodes" share this host: each takes one CPU (a node binds all CPUs it sees by default,
    # and two ranks spinning on the same cores would slow each other down many times over)
    nodes = [
        [*common, "--node-rank", str(r), "--cpu-omp-threads-bind", str(r % os.cpu_count())] for r in (0, 1)
    ]
    return ServerProcess(nodes[0]), ServerProcess(nodes[1])


def generate_ids(server: ServerProcess, prompts: list[list[int]]) -> list[list[int]]:
    r = requests.post(
        server.url("/generate"), json={"input_ids": prompts, "sampling_params": GREEDY}, timeout=600
    )
    assert r.status_code == 200, r.text
    return [o["output_ids"] for o in r.json()]


def start_pair(node0: ServerProcess, node1: ServerProcess) -> None:
    node1.launch()
    node0.start()  # waits for /health; the rendezvous needs node 1's rank
    assert node1.proc.poll() is None, node1.log_tail()


def test_two_nodes_serve_and_node1_exits_cleanly_after_node0(workload):
    prompts, refs = workload
    node0, node1 = two_nodes()
    try:
        start_pair(node0, node1)
        check_outputs(generate_ids(node0, prompts[12:18]), refs[12:18])
        assert node1.children() and "Uvicorn" not in node1.log_text()  # its rank runs, no HTTP server
        # a deadline expires on both ranks at the same step (rank 0's clock is broadcast): 408,
        # and the group keeps serving
        body = {
            "input_ids": prompts[1],
            "timeout": 1.0,
            "sampling_params": {**GREEDY, "max_new_tokens": 4000},
        }
        assert requests.post(node0.url("/generate"), json=body, timeout=120).status_code == 408
        check_outputs(generate_ids(node0, prompts[18:20]), refs[18:20])
        tree = node0.process_tree() + node1.process_tree()
        assert node0.stop(signal.SIGTERM) == 0
        assert node1.wait_exit(15) == 0, node1.log_tail()
        assert wait_gone(tree, 10) == []
    finally:
        node0.stop()
        node1.stop()


def test_killing_node1_fails_requests_and_node0_exits(workload):
    prompts, _ = workload
    node0, node1 = two_nodes()
    try:
        start_pair(node0, node1)
        tree = node0.process_tree() + node1.process_tree()
        result: dict = {}

        def long_request() -> None:
            body = {"input_ids": prompts[0], "sampling_params": {**GREEDY, "max_new_tokens": 4000}}
            try:
                result["status"] = requests.post(node0.url("/generate"), json=body, timeout=120).status_code
            except requests.RequestException as e:  # the connection dropped: no 5xx seen
                result["error"] = repr(e)

        t = threading.Thread(target=long_request)
        t.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until the request runs (on both ranks, in lock step)
            info = requests.get(node0.url("/get_server_info"), timeout=10).json()
            if info["internal_states"][0].get("num_running_reqs", 0) >= 1:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the request never started running")
        t0 = time.monotonic()
        node1.proc.kill()
        code = node0.wait_exit(10)
        elapsed = time.monotonic() - t0
        t.join(30)
        assert code not in (None, 0), f"node 0 exit code {code} after {elapsed:.1f} s:\n{node0.log_tail()}"
        assert 500 <= result.get("status", 0) < 600, result
        assert wait_gone(tree, 10) == []
    finally:
        node0.stop()
        node1.stop()


def test_rendezvous_timeout_names_the_missing_rank():
    node0, _ = two_nodes(["--dist-timeout", "3"])
    try:
        node0.launch()
        code = node0.wait_exit(120)
        assert code == 1, node0.log_tail()
        log = node0.log_text()
        assert "rendezvous" in log and "rank(s) 1 of 2 never joined" in log, node0.log_tail()
    finally:
        node0.stop()

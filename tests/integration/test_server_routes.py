"""SGLang's scripting routes on the real server (default model, one server for the module, debug
checks on so the scheduler checks its KV accounting every step): /tokenize, /detokenize,
/get_load, /version, /start_profile + /stop_profile, /update_weights_from_disk."""

from __future__ import annotations

import gzip
import importlib.metadata
import json
import os
import threading
import time

import pytest
import requests

from srt.utils.model_path import resolve_model_path
from tests.helpers.server import DEFAULT_TEST_ARGS, ServerProcess

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server():
    with ServerProcess([*DEFAULT_TEST_ARGS, "--enable-debug-checks"]) as s:
        yield s


def post(server, path: str, body=None, timeout: float = 120):
    return requests.post(server.url(path), json=body if body is not None else {}, timeout=timeout)


def greedy(server, text: str = PROMPT, max_new_tokens: int = 16) -> list[int]:
    r = post(
        server,
        "/generate",
        {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}},
    )
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def assert_error(r: requests.Response, status: int, needle: str = "") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and needle in err["message"], err
    return err


# ---------------------------------------------------------------------- tokenize / detokenize
def test_tokenize_and_detokenize_round_trip(server):
    r = post(server, "/tokenize", {"prompt": PROMPT})
    assert r.status_code == 200, r.text
    body = r.json()
    context_len = requests.get(server.url("/get_model_info"), timeout=10).json()["context_len"]
    assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] == context_len
    assert all(isinstance(t, int) for t in body["tokens"])
    # the same ids /generate counts as the prompt
    gen = post(server, "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 1}}).json()
    assert gen["meta_info"]["prompt_tokens"] == body["count"]
    r = post(server, "/detokenize", {"tokens": body["tokens"]})
    assert r.status_code == 200 and r.json() == {"text": PROMPT}


def test_tokenize_a_list_and_special_tokens(server):
    body = post(
        server, "/tokenize", {"prompt": ["a b", "hello there", ""], "add_special_tokens": False}
    ).json()
    assert len(body["tokens"]) == 3 and body["count"] == [len(t) for t in body["tokens"]]
    assert body["tokens"][2] == [] and body["count"][2] == 0
    im_start = post(server, "/tokenize", {"prompt": "<|im_start|>", "add_special_tokens": False}).json()
    ids = im_start["tokens"]
    assert len(ids) == 1  # a special token of SmolLM2's chat template
    assert post(server, "/detokenize", {"tokens": ids}).json()["text"] == ""
    kept = post(server, "/detokenize", {"tokens": ids, "skip_special_tokens": False}).json()
    assert kept["text"] == "<|im_start|>"


@pytest.mark.parametrize(
    "path, body, needle",
    [
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/detokenize", {"tokens": [1, 10**9]}, "outside the vocabulary"),
        ("/detokenize", {"tokens": [-1]}, "outside the vocabulary"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/detokenize", {"tokens": [1.5]}, "tokens"),
    ],
)
def test_tokenize_errors_are_400(server, path, body, needle):
    assert_error(post(server, path, body), 400, needle)


# ---------------------------------------------------------------------- get_load / version
def test_version(server):
    r = requests.get(server.url("/version"), timeout=10)
    assert r.status_code == 200 and r.json() == {"version": importlib.metadata.version("srt-engine")}


def test_get_load_idle_and_busy(server):
    idle = requests.get(server.url("/get_load"), timeout=10).json()
    assert idle == [{"num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0, "dp_rank": 0}]
    result: list = []
    t = threading.Thread(target=lambda: result.append(greedy(server, "Count: 1 2 3 4 5", 200)))
    t.start()
    busy = None
    deadline = time.monotonic() + 60
    while t.is_alive() and time.monotonic() < deadline:
        load = requests.get(server.url("/get_load"), timeout=10).json()[0]
        if load["num_reqs"] == 1 and load["num_waiting_reqs"] == 0:  # admitted, not just queued
            busy = load
            break
        time.sleep(0.02)
    t.join(120)
    assert busy is not None and busy["num_tokens"] > 0 and busy["num_waiting_reqs"] == 0 and result


# ---------------------------------------------------------------------- profiler
def test_profile_start_stop(server, tmp_path):
    r = post(server, "/start_profile", {"output_dir": str(tmp_path), "activities": ["CPU"]})
    assert r.status_code == 200, r.text
    path = r.json()["trace_path"]
    assert path.startswith(str(tmp_path)) and path.endswith(".trace.json.gz") and path in r.json()["message"]
    assert_error(post(server, "/start_profile", {"output_dir": str(tmp_path)}), 400, "already running")
    greedy(server, max_new_tokens=4)
    r = post(server, "/stop_profile")
    assert r.status_code == 200 and r.json()["trace_path"] == path, r.text
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    assert any("aten::" in str(e.get("name")) for e in events)
    assert_error(post(server, "/stop_profile"), 400, "not running")


def test_profile_num_steps_stops_by_itself(server, tmp_path):
    r = post(server, "/start_profile", {"output_dir": str(tmp_path), "num_steps": 3})
    assert r.status_code == 200, r.text
    path = r.json()["trace_path"]
    greedy(server, max_new_tokens=8)  # more than 3 steps
    deadline = time.monotonic() + 30
    while not os.path.isfile(path) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert os.path.isfile(path)
    assert_error(post(server, "/stop_profile"), 400, "not running")


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"num_steps": 0}, "num_steps"),
        ({"activities": ["GPU"]}, "CUDA"),
        ({"activities": ["DISK"]}, "DISK"),
        ({"num_steps": "3"}, "num_steps"),
    ],
)
def test_profile_bad_arguments_are_400(server, body, needle):
    assert_error(post(server, "/start_profile", body), 400, needle)


# ---------------------------------------------------------------------- weight updates
def test_update_weights_same_gguf_keeps_greedy_outputs(server):
    before = greedy(server)
    info = requests.get(server.url("/get_server_info"), timeout=10).json()["internal_states"][0]
    r = post(server, "/update_weights_from_disk", {"model_path": resolve_model_path(None)})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    after = requests.get(server.url("/get_server_info"), timeout=10).json()["internal_states"][0]
    assert after["weight_bytes"] == info["weight_bytes"] and after["num_running_reqs"] == 0
    assert after["available_size"] == after["max_total_num_tokens"]  # the cache was flushed
    assert greedy(server) == before


def test_update_weights_missing_path_is_400_and_keeps_serving(server, tmp_path):
    before = greedy(server)
    r = post(server, "/update_weights_from_disk", {"model_path": str(tmp_path / "nope.gguf")})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["success"] is False and "does not exist" in body["message"]
    assert body["error"]["message"] == body["message"] and body["error"]["param"] == "model_path"
    assert greedy(server) == before
    assert_error(post(server, "/update_weights_from_disk", {}), 400, "model_path")


def test_update_weights_while_requests_run_loses_none(server):
    solo = {text: greedy(server, text, 48) for text in ("One, two, three,", "Paris is", "def f(x):")}
    results: dict[str, list[int]] = {}
    done_at: dict[str, float] = {}

    def run(text: str) -> None:
        results[text] = greedy(server, text, 48)
        done_at[text] = time.monotonic()

    first = threading.Thread(target=run, args=("One, two, three,",))
    first.start()
    time.sleep(0.3)  # running when the update arrives
    update: list[requests.Response] = []

    def run_update() -> None:
        update.append(post(server, "/update_weights_from_disk", {"model_path": resolve_model_path(None)}))
        done_at["update"] = time.monotonic()

    upd = threading.Thread(target=run_update)
    upd.start()
    time.sleep(0.1)
    later = [threading.Thread(target=run, args=(t,)) for t in ("Paris is", "def f(x):")]
    for t in later:
        t.start()
    for t in [first, upd, *later]:
        t.join(300)
    assert update and update[0].status_code == 200 and update[0].json()["success"], update
    assert results == solo
    # the requests that arrived during the update ran after it (the running one finished first: its
    # response and the update's come back from the same scheduler step, in either order)
    assert done_at["update"] <= min(done_at["Paris is"], done_at["def f(x):"])
    load = requests.get(server.url("/get_load"), timeout=10).json()[0]
    assert load["num_reqs"] == 0

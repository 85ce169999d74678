"""srt as a worker of SGLang's router (``sglang-router``): two srt servers (the default model,
loopback ports) behind routers of every policy.

Checked: the router registers the workers under the served model name (so a client that takes the
name from the router's /v1/models is served); the openai client's chat and completions, streamed
or not, through the router equal one server's greedy outputs; the native routes the router calls
answer in its shapes under every policy; round_robin spreads requests over both workers and
cache_aware keeps requests that share a long prefix on one (each server's own counters show it);
a worker added at run time through the router's API gets traffic; a worker killed mid-run cuts
its in-flight streams (the survivor's go on), new requests go to the survivor and nothing hangs (last test: it
kills a worker of the shared fleet).
"""

from __future__ import annotations

import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.helpers.router import RouterProcess, router_unavailable
from tests.helpers.server import DEFAULT_TEST_ARGS, ServerProcess

pytestmark = pytest.mark.skipif(router_unavailable() is not None, reason=str(router_unavailable()))

openai = pytest.importorskip("openai")

MODEL = "SmolLM2-135M-Instruct"
POLICIES = ["cache_aware", "round_robin", "random", "power_of_two"]
CHAT = [{"role": "user", "content": "Name a colour."}]
GREEDY = {"max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def workers():
    a, b = ServerProcess(DEFAULT_TEST_ARGS), ServerProcess(DEFAULT_TEST_ARGS)
    try:
        a.launch(), b.launch()  # start both at once
        a.wait_ready(), b.wait_ready()
        yield a, b
    finally:
        a.stop(), b.stop()


@pytest.fixture(scope="module")
def routers(workers):
    """Policy -> a router in front of both workers (started on first use)."""
    started: dict[str, RouterProcess] = {}

    def get(policy: str) -> RouterProcess:
        if policy not in started:
            started[policy] = RouterProcess([w.base_url for w in workers], policy=policy).start()
        return started[policy]

    yield get
    for r in started.values():
        r.stop()


def counter(server: ServerProcess, name: str) -> float:
    text = requests.get(server.url("/metrics"), timeout=30).text
    return sum(float(m) for m in re.findall(rf"^srt:{name}_total{{[^}}]*}} (\S+)$", text, re.M))


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="none", timeout=120, max_retries=0)


def outputs(base_url: str, model: str) -> list[str]:
    """Chat and completions, plain and streamed, greedy."""
    c = client(base_url)
    chat = c.chat.completions.create(model=model, messages=CHAT, **GREEDY).choices[0].message.content
    comp = c.completions.create(model=model, prompt="The sky is", **GREEDY).choices[0].text
    chat_s = "".join(
        ch.choices[0].delta.content or ""
        for ch in c.chat.completions.create(model=model, messages=CHAT, stream=True, **GREEDY)
        if ch.choices
    )
    comp_s = "".join(
        ch.choices[0].text
        for ch in c.completions.create(model=model, prompt="The sky is", stream=True, **GREEDY)
        if ch.choices
    )
    return [chat, comp, chat_s, comp_s]


def test_router_lists_the_served_name_and_clients_taking_it_are_served(routers):
    router = routers("round_robin")
    assert {w["model_id"] for w in router.workers()} == {MODEL}
    models = client(router.base_url).models.list().data
    assert [m.id for m in models] == [MODEL]
    c = client(router.base_url)
    assert c.chat.completions.create(model=models[0].id, messages=CHAT, max_tokens=2).choices


def test_openai_client_through_router_equals_one_server(workers, routers):
    reference = outputs(workers[0].base_url, MODEL)
    assert reference[0] == reference[2] and reference[1] == reference[3]
    assert outputs(routers("round_robin").base_url, MODEL) == reference


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_serves_what_the_router_calls(workers, routers, policy):
    router = routers(policy)
    body = {"text": "The sky is", "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    direct = requests.post(workers[0].url("/generate"), json=body, timeout=120).json()
    r = requests.post(router.url("/generate"), json=body, timeout=120)
    assert r.status_code == 200 and r.json()["text"] == direct["text"], r.text
    with requests.post(router.url("/generate"), json={**body, "stream": True}, stream=True, timeout=120) as s:
        events = [ln for ln in s.iter_lines() if ln.startswith(b"data:")]
    assert events[-1] == b"data: [DONE]" and b'"text"' in events[-2]
    for path in ("/health", "/health_generate", "/get_model_info", "/get_server_info", "/v1/models"):
        assert requests.get(router.url(path), timeout=60).status_code == 200, path
    flushed = requests.post(router.url("/flush_cache"), timeout=60)
    assert flushed.status_code == 200, flushed.text
    chat = {"model": MODEL, "messages": CHAT, **GREEDY}
    r = requests.post(router.url("/v1/chat/completions"), json=chat, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text


def test_round_robin_spreads_requests_over_both_workers(workers, routers):
    router = routers("round_robin")
    before = [counter(w, "num_requests") for w in workers]
    body = {"text": "Count:", "sampling_params": {"max_new_tokens": 2}}
    for _ in range(6):
        assert requests.post(router.url("/generate"), json=body, timeout=120).status_code == 200
    served = [counter(w, "num_requests") - b for w, b in zip(workers, before)]
    assert sum(served) == 6 and min(served) >= 2, served


def test_cache_aware_keeps_a_shared_prefix_on_one_worker(workers, routers):
    router = routers("cache_aware")
    for w in workers:
        assert requests.post(w.url("/flush_cache"), timeout=60).status_code == 200
    prefix = "You are a careful assistant. " * 12 + "Here is the shared context of every question. "
    before = [(counter(w, "num_requests"), counter(w, "cached_tokens")) for w in workers]
    for i in range(5):
        body = {
            "text": prefix + f"Question {i}: what is {i} plus {i}?",
            "sampling_params": {"max_new_tokens": 2},
        }
        assert requests.post(router.url("/generate"), json=body, timeout=120).status_code == 200
    after = [(counter(w, "num_requests"), counter(w, "cached_tokens")) for w in workers]
    served = [a[0] - b[0] for a, b in zip(after, before)]
    cached = [a[1] - b[1] for a, b in zip(after, before)]
    assert sorted(served) == [0, 5], served
    hot = served.index(5)
    assert cached[hot] >= 4 * 50, cached  # the four later requests reused the prefix's KV


def test_worker_added_at_run_time_receives_traffic(workers):
    a, b = workers
    with RouterProcess([a.base_url], policy="round_robin") as router:
        router.add_worker(b.base_url)
        assert {w["url"] for w in router.workers()} == {a.base_url, b.base_url}
        before = counter(b, "num_requests")
        body = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}
        for _ in range(4):
            assert requests.post(router.url("/generate"), json=body, timeout=120).status_code == 200
        assert counter(b, "num_requests") - before >= 1


def _stream(url: str, result: list, started: threading.Event) -> None:
    """A long streamed generation; appends ("done" (ended with [DONE]) | "cut", detail)."""
    body = {"text": "Tell a long story.", "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    try:
        with requests.post(url, json={**body, "stream": True}, stream=True, timeout=(10, 60)) as r:
            last = b""
            for line in r.iter_lines():
                started.set()
                last = line or last
            done = r.status_code == 200 and last == b"data: [DONE]"
            result.append(("done" if done else "cut", last[-200:]))
    except requests.RequestException as e:
        result.append(("cut", repr(e)))


def test_killed_worker_fails_in_flight_cleanly_and_survivor_serves(workers, routers):
    """Runs last: kills worker b."""
    a, b = workers
    router = routers("round_robin")
    results: list = []
    threads = []
    for _ in range(4):  # round robin: two on each worker
        started = threading.Event()
        t = threading.Thread(target=_stream, args=(router.url("/generate"), results, started))
        t.start()
        threads.append(t)
        assert started.wait(60)
    killed_at = time.monotonic()
    b.stop(signal.SIGKILL)
    time.sleep(1)
    # the survivor's streams are still running: end them (they close with [DONE])
    assert requests.post(a.url("/abort_request"), json={"abort_all": True}, timeout=30).status_code == 200
    for t in threads:
        t.join(timeout=90)
    assert not any(t.is_alive() for t in threads), "a request on the killed worker hangs"
    kinds = [kind for kind, _ in results]
    assert kinds.count("cut") >= 1 and kinds.count("done") >= 1, results
    body = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}
    before = counter(a, "num_requests")

    def one(_: int) -> int:
        return requests.post(router.url("/generate"), json=body, timeout=60).status_code

    with ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(one, range(6)))
    assert codes == [200] * 6, codes
    assert counter(a, "num_requests") - before == 6
    assert time.monotonic() - killed_at < 120

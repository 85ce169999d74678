"""Multi-LoRA through the real server (``python -m srt.launch_server``) on the default model (GGUF
Q4_1 base): PEFT adapters written by ``peft`` over transformers' load of the same GGUF, served
alone, mixed in one concurrent burst and loaded / unloaded at run time; greedy tokens equal
transformers + peft for each adapter alone (near-ties explained); KV of one adapter never serves
another; every error is a 4xx naming its cause; the pool is idle afterwards.

Two adapters at start-up (``a``: rank 8 on q/v; ``b``: rank 4 on all seven projections) and one
loaded at run time (``c``: rank 16 on q/v/o), in 2 adapter slots, so the burst also evicts slots.
"""

from __future__ import annotations

import concurrent.futures
import copy
import functools
import time

import pytest
import requests

from tests.helpers import lora_adapters
from tests.helpers.hf_reference import (
    DEFAULT_MODEL_KEY,
    assert_tokens_match,
    default_model_identity,
    hf_greedy_references,
    load_default_hf_model,
    make_prompts,
)
from tests.helpers.lora_adapters import ALL_TARGETS, peft_reference_model, rewrite_adapter, save_peft_adapter
from tests.helpers.ref_cache import folder_key
from tests.helpers.server import DEFAULT_TEST_ARGS, ServerProcess

# transformers' load of the default GGUF (seconds), once; each user gets a copy (peft edits it)
_base = functools.cache(load_default_hf_model)


def load_base():
    return copy.deepcopy(_base())


MAX_NEW = 10
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
ADAPTERS = {  # name -> (targets, rank, seed)
    "a": (["q_proj", "v_proj"], 8, 1),
    "b": (ALL_TARGETS, 4, 2),
    "c": (["q_proj", "v_proj", "o_proj"], 16, 3),
}


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora")
    return {
        name: save_peft_adapter(load_base, root / name, targets, rank, seed, b_scale=1.5)
        for name, (targets, rank, seed) in ADAPTERS.items()
    }


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts([7, 23, 41, 60], seed=11)


@pytest.fixture(scope="module")
def references(adapter_dirs, prompts) -> dict[str | None, list]:
    """Greedy tokens of transformers + peft, each prompt alone, per adapter (None: the base),
    cached on disk by the adapter's bytes (tests/helpers/ref_cache.py)."""
    base_key = [DEFAULT_MODEL_KEY, *map(str, default_model_identity())]
    out = {}
    for name in (None, "a", "b", "c"):
        path = adapter_dirs[name] if name else None
        key = folder_key(path, *base_key, code=[lora_adapters]) if path else DEFAULT_MODEL_KEY
        out[name] = hf_greedy_references(
            key, prompts, MAX_NEW, lambda p=path: peft_reference_model(load_base, p)
        )
    return out


@pytest.fixture(scope="module")
def server(adapter_dirs):
    args = [
        *DEFAULT_TEST_ARGS,
        "--lora-paths",
        f"a={adapter_dirs['a']}",
        f"b={adapter_dirs['b']}",
        "--max-loras-per-batch",
        "2",
        "--max-lora-rank",
        "16",
    ]
    with ServerProcess(args) as s:
        yield s


def _generate(server, prompt: list[int], lora: str | None, **extra) -> dict:
    body = {"input_ids": prompt, "sampling_params": GREEDY, "lora_path": lora, **extra}
    r = requests.post(server.url("/generate"), json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _check(outs: dict[tuple[str | None, int], list[int]], references) -> None:
    near_ties = 0
    for (name, i), ids in outs.items():
        ref = references[name][i]
        near_ties += assert_tokens_match(ids, ref.token_ids, ref.top_logprobs)
    assert near_ties <= max(1, len(outs) // 8)


def test_each_adapter_alone_matches_peft(server, prompts, references):
    outs = {
        (n, i): _generate(server, p, n)["output_ids"] for n in (None, "a", "b") for i, p in enumerate(prompts)
    }
    _check(outs, references)
    # the adapters change the model: their tokens are not the base's
    for name in ("a", "b"):
        assert any(outs[(name, i)] != outs[(None, i)] for i in range(len(prompts)))


def test_mixed_concurrent_burst_matches_each_alone(server, prompts, references):
    jobs = [(n, i) for _ in range(2) for n in (None, "a", "b", "a") for i in range(len(prompts))]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = {pool.submit(_generate, server, prompts[i], n): (n, i) for n, i in jobs}
        outs = {}
        for f, key in futures.items():
            ids = f.result()["output_ids"]
            assert outs.setdefault(key, ids) == ids, f"{key}: two runs of the same request differ"
    _check(outs, references)


def test_openai_model_names_select_the_adapter(server, prompts):
    text = "The capital of France is"
    native = requests.post(
        server.url("/generate"), json={"text": text, "sampling_params": GREEDY, "lora_path": "b"}, timeout=60
    ).json()["text"]
    served = requests.get(server.url("/v1/models"), timeout=10).json()["data"]
    base = served[0]["id"]
    assert {m["id"]: m.get("parent") for m in served[1:]} == {"a": base, "b": base}
    for body in ({"model": "b"}, {"model": f"{base}:b"}, {"model": base, "lora_path": "b"}):
        r = requests.post(
            server.url("/v1/completions"),
            json={"prompt": text, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True, **body},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == native
        assert r.json()["model"] == body["model"]
    # OpenAI's own client: the adapter as the model, and through extra_body
    import openai

    client = openai.OpenAI(base_url=server.url("/v1"), api_key="none")
    extra = {"ignore_eos": True}
    out = client.completions.create(
        model="b", prompt=text, max_tokens=MAX_NEW, temperature=0, extra_body=extra
    )
    assert out.choices[0].text == native
    out = client.completions.create(
        model=base, prompt=text, max_tokens=MAX_NEW, temperature=0, extra_body={**extra, "lora_path": "b"}
    )
    assert out.choices[0].text == native
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt=text, max_tokens=2)


def test_prefix_cache_is_keyed_by_adapter(server):
    prompt = make_prompts([80], seed=99)[0]
    first_a = _generate(server, prompt, "a")
    assert first_a["meta_info"]["cached_tokens"] == 0
    base = _generate(server, prompt, None)  # the same tokens under the base: nothing of a's KV
    assert base["meta_info"]["cached_tokens"] == 0
    under_b = _generate(server, prompt, "b")
    assert under_b["meta_info"]["cached_tokens"] == 0
    again_a = _generate(server, prompt, "a")  # a's own KV is shared
    assert again_a["meta_info"]["cached_tokens"] >= 64
    assert again_a["output_ids"] == first_a["output_ids"]
    assert base["output_ids"] != first_a["output_ids"] or under_b["output_ids"] != first_a["output_ids"]


@pytest.mark.parametrize(
    "body, status, needle",
    [
        ({"text": "hi", "lora_path": "nope"}, 400, "nope"),
        ({"text": ["hi", "ho"], "lora_path": ["a"]}, 400, "lora_path"),
    ],
)
def test_bad_adapter_names_are_4xx(server, body, status, needle):
    r = requests.post(server.url("/generate"), json=body, timeout=30)
    assert r.status_code == status and needle in r.json()["error"]["message"], r.text


def test_unknown_openai_model_is_404(server):
    r = requests.post(server.url("/v1/completions"), json={"model": "nope", "prompt": "hi"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "'a', 'b'" in r.json()["error"]["message"]  # the adapters it could have named


def test_bad_adapters_are_refused_at_load(server, adapter_dirs, tmp_path):
    too_big = save_peft_adapter(load_base, tmp_path / "r32", ["q_proj"], 32, seed=5)
    lacks = rewrite_adapter(
        adapter_dirs["a"], tmp_path / "lacks", rename=lambda k: k.replace("q_proj", "c_attn")
    )
    dora = rewrite_adapter(adapter_dirs["a"], tmp_path / "dora", config_edits={"use_dora": True})
    cases = [
        (too_big, "--max-lora-rank"),
        (lacks, "c_attn"),
        (dora, "use_dora"),
        (str(tmp_path / "missing"), "not a directory"),
    ]
    for i, (path, needle) in enumerate(cases):
        r = requests.post(
            server.url("/load_lora_adapter"), json={"lora_name": f"bad{i}", "lora_path": path}, timeout=60
        )
        assert r.status_code == 400 and needle in r.json()["message"], r.text
    r = requests.post(
        server.url("/load_lora_adapter"), json={"lora_name": "a", "lora_path": adapter_dirs["a"]}
    )
    assert r.status_code == 400 and "already" in r.json()["error"]["message"]
    assert set(
        requests.get(server.url("/v1/models"), timeout=10).json()["data"][i]["id"] for i in (1, 2)
    ) == {"a", "b"}


def test_load_serve_unload_at_run_time(server, adapter_dirs, prompts, references):
    # a long request of "a" runs while "c" loads and is served
    long_body = {
        "input_ids": prompts[0],
        "sampling_params": {**GREEDY, "max_new_tokens": 400},
        "lora_path": "a",
    }
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = pool.submit(requests.post, server.url("/generate"), json=long_body, timeout=300)
        time.sleep(0.5)
        t0 = time.perf_counter()
        r = requests.post(
            server.url("/load_lora_adapter"), json={"lora_name": "c", "lora_path": adapter_dirs["c"]}
        )
        load_s = time.perf_counter() - t0
        assert r.status_code == 200 and r.json()["loaded_adapters"].keys() == {"a", "b", "c"}, r.text
        assert load_s < 1.0, f"loading a rank-16 adapter took {load_s:.2f} s"
        # unloading an adapter a request still runs is refused with the count
        busy = requests.post(server.url("/unload_lora_adapter"), json={"lora_name": "a"}, timeout=60)
        assert busy.status_code == 400 and "used by 1 request" in busy.json()["message"], busy.text
        outs = {("c", i): _generate(server, p, "c")["output_ids"] for i, p in enumerate(prompts)}
        assert running.result().status_code == 200
    _check(outs, references)
    r = requests.post(server.url("/unload_lora_adapter"), json={"lora_name": "c"}, timeout=60)
    assert r.status_code == 200 and "c" not in r.json()["loaded_adapters"]
    gone = requests.post(server.url("/generate"), json={"text": "hi", "lora_path": "c"}, timeout=30)
    assert gone.status_code == 400
    # reloaded under the same name: served again, equal to before (no KV of the old one reused)
    r = requests.post(
        server.url("/load_lora_adapter"), json={"lora_name": "c", "lora_path": adapter_dirs["c"]}
    )
    assert r.status_code == 200
    assert _generate(server, prompts[1], "c")["output_ids"] == outs[("c", 1)]


def test_pool_idle_after_everything(server):
    deadline = time.time() + 30
    while True:
        state = requests.get(server.url("/get_server_info"), timeout=10).json()["internal_states"][0]
        if state["num_running_reqs"] == 0 or time.time() > deadline:
            break
        time.sleep(0.2)
    assert state["num_running_reqs"] == 0 and state["num_queued_reqs"] == 0
    assert state["free_req_rows"] == state["req_rows"]
    assert state["lora_refs"] == {}
    assert state["available_size"] + state["evictable_size"] == state["max_total_num_tokens"]


def test_bad_start_up_adapter_fails_the_launch(tmp_path):
    server = ServerProcess([*DEFAULT_TEST_ARGS, "--lora-paths", f"x={tmp_path / 'none'}"]).launch()
    try:
        code = server.wait_exit(120)
        assert code not in (None, 0)
        assert "not a directory" in server.log_text()
    finally:
        server.stop()

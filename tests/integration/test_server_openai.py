"""The real server (default model, CPU) through the official `openai` client.

One server for the whole module. Greedy outputs are compared between streaming and non-streaming,
between concurrent and one-at-a-time requests; stop strings are built from the model's own output
so that one spans two tokens.
"""

from __future__ import annotations

import openai
import pytest
import requests

from tests.helpers.server import DEFAULT_TEST_ARGS, ServerProcess

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server():
    # the usage checks read prompt_tokens_details.cached_tokens, reported with --enable-cache-report
    with ServerProcess([*DEFAULT_TEST_ARGS, "--enable-cache-report"]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer():
    from srt.server_args import ServerArgs
    from srt.utils.hf_tokenizer import load_tokenizer, tokenizer_source

    return load_tokenizer(tokenizer_source(ServerArgs()))


def native(server, **body):
    r = requests.post(server.url("/generate"), json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert requests.get(server.url("/health"), timeout=10).status_code == 200
    assert requests.get(server.url("/health_generate"), timeout=60).status_code == 200
    info = requests.get(server.url("/get_model_info"), timeout=10).json()
    assert info["served_model_name"] == MODEL and info["context_len"] > 0


def test_completion_greedy_usage(client, tokenizer):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert len(r.choices) == 1 and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    assert r.choices[0].text == tokenizer.decode(tokenizer.encode(r.choices[0].text)) and r.choices[0].text


def test_completion_prompt_forms(client, tokenizer):
    ids = tokenizer.encode(PROMPT)
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(model=MODEL, prompt=[PROMPT, "1, 2, 3,"], max_tokens=5, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_text.choices[0].text
    ids_batch = client.completions.create(
        model=MODEL, prompt=[ids, tokenizer.encode("1, 2, 3,")], max_tokens=5, temperature=0
    )
    assert [c.text for c in ids_batch.choices] == [c.text for c in batch.choices]
    echo = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, echo=True)
    assert echo.choices[0].text == PROMPT + by_text.choices[0].text


def test_chat_and_streaming_match(client):
    messages = [{"role": "user", "content": "Name three colors."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    text = full.choices[0].message.content
    assert full.choices[0].message.role == "assistant" and text
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert deltas == text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_completion_streaming_matches(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    parts = [
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True
        )
        if c.choices
    ]
    assert "".join(parts) == full.choices[0].text and len(parts) > 3


def test_n2_choices(server, client):
    r = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=12,
        temperature=1.0,
        n=2,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 24
    assert r.usage.prompt_tokens == 5  # counted once, not per choice
    assert r.choices[0].text != r.choices[1].text  # each choice samples with its own seed
    # the n choices share the prompt's prefill through the radix cache (whole KV pages of it)
    page = requests.get(server.url("/get_server_info"), timeout=30).json()["page_size"]
    fresh = "A prompt seen for the first time by this server, about foxes and dogs. " * 4
    shared = client.completions.create(model=MODEL, prompt=fresh, max_tokens=2, n=3)
    shareable = (shared.usage.prompt_tokens - 1) // page * page
    assert shareable > 0 and shared.usage.prompt_tokens_details.cached_tokens >= shareable
    again = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=12,
        temperature=1.0,
        n=2,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    greedy = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0, n=2
    )
    assert greedy.choices[0].message.content == greedy.choices[1].message.content
    # streaming with n=2: each index gets its own deltas
    by_index: dict[int, str] = {0: "", 1: ""}
    for c in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, n=2, stream=True
    ):
        for ch in c.choices:
            by_index[ch.index] += ch.text
    ref = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    assert by_index == {0: ref.choices[0].text, 1: ref.choices[0].text}


def _spanning_stop(server, tokenizer, prompt: str) -> tuple[str, str, str]:
    """(full greedy text, a stop string spanning two output tokens, the text before it)."""
    out = native(server, text=prompt, sampling_params={"max_new_tokens": 32, "temperature": 0})
    text, ids = out["text"], out["output_ids"]
    pieces = [tokenizer.decode([t]) for t in ids]
    pos = 0
    for k in range(len(pieces) - 1):
        a, b = pieces[k], pieces[k + 1]
        pos += len(a)
        if a.strip() and b.strip() and a[-1].isalnum() and b[0] != " ":
            stop = a[-1] + b[0]
            first = text.find(stop)
            if first == pos - 1:  # its first occurrence is this token boundary
                return text, stop, text[:first]
    pytest.skip("no token boundary inside a word in the greedy output")


def test_stop_string_spanning_two_tokens(server, client, tokenizer):
    prompt = "Write one sentence about the ocean."
    full, stop, expected = _spanning_stop(server, tokenizer, prompt)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0, stop=[stop])
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra.get("matched_stop") == stop
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=32, temperature=0, stop=[stop], stream=True
        )
        if c.choices
    )
    assert streamed == expected
    kept = native(
        server,
        text=prompt,
        sampling_params={"max_new_tokens": 32, "temperature": 0, "stop": stop, "no_stop_trim": True},
    )
    assert kept["text"] == expected + stop
    assert kept["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert full.startswith(expected + stop)


def test_stop_token_ids(server, tokenizer):
    out = native(server, text=PROMPT, sampling_params={"max_new_tokens": 16, "temperature": 0})
    third = out["output_ids"][2]
    stopped = native(
        server,
        text=PROMPT,
        sampling_params={"max_new_tokens": 16, "temperature": 0, "stop_token_ids": [third]},
    )
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": third}
    assert stopped["output_ids"] == out["output_ids"][:3]
    assert stopped["text"] == tokenizer.decode(out["output_ids"][:2])  # the stop token's text is not included


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0.0 and 1 <= len(top) <= 3
        assert value == pytest.approx(max(top.values()), abs=1e-4)  # greedy picks the most likely token
        assert token in top


def test_chat_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_seed_reproducibility(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0)
    a = client.completions.create(seed=1234, **kw).choices[0].text
    b = client.completions.create(seed=1234, **kw).choices[0].text
    assert a == b
    others = {client.completions.create(seed=s, **kw).choices[0].text for s in (1, 2)}
    assert len(others | {a}) > 1


def test_native_generate_batch_and_stream(server):
    outs = native(server, text=["Hello", "1, 2, 3,"], sampling_params={"max_new_tokens": 4, "temperature": 0})
    assert isinstance(outs, list) and [o["meta_info"]["completion_tokens"] for o in outs] == [4, 4]
    r = requests.post(
        server.url("/generate"),
        json={"text": "Hello", "stream": True, "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
        stream=True,
        timeout=60,
    )
    events = [line[6:] for line in r.iter_lines() if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    import json

    chunks = [json.loads(e) for e in events[:-1]]
    # SGLang's default: each chunk holds the output so far (see test_server_flags for deltas)
    assert all(b["text"].startswith(a["text"]) for a, b in zip(chunks, chunks[1:]))
    assert chunks[-1]["text"] == outs[0]["text"] and chunks[-1]["output_ids"] == outs[0]["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_priority_without_the_flag_is_a_400(server):
    for path, body in (
        ("/generate", {"text": "Hi", "priority": 1}),
        ("/v1/completions", {"model": MODEL, "prompt": "Hi", "priority": 1}),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "priority": 1},
        ),
    ):
        r = requests.post(server.url(path), json=body, timeout=30)
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert err["param"] == "priority" and "--enable-priority-scheduling" in err["message"]


def test_metrics_and_server_info(server, client):
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    text = requests.get(server.url("/metrics"), timeout=30).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    label = f'{{model_name="{MODEL}"}}'
    for gauge in (
        "num_running_reqs",
        "num_queue_reqs",
        "token_usage",
        "cache_hit_rate",
        "gen_throughput",
        "available_kv_tokens",
        "max_total_num_tokens",
    ):
        assert f"srt:{gauge}{label}" in values, gauge
    assert values[f"srt:prompt_tokens_total{label}"] >= 5
    assert values[f"srt:generation_tokens_total{label}"] >= 4
    assert values[f"srt:num_retracted_reqs_total{label}"] >= 0
    for hist in (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "queue_time_seconds",
    ):
        assert f"srt:{hist}_count{label}" in values, hist
    assert values[f"srt:time_to_first_token_seconds_count{label}"] >= 1
    assert values[f"srt:e2e_request_latency_seconds_count{label}"] >= 1
    info = requests.get(server.url("/get_server_info"), timeout=30).json()
    assert info["max_total_num_tokens"] == 16384 and info["port"] == server.port
    st = info["internal_states"][0]
    assert {"num_running_reqs", "num_queued_reqs", "token_usage", "cache_hit_rate", "available_size"} <= set(
        st
    )
    # the default model serves with its GGUF blocks kept: ~100 MB of weights, not ~540 MB; where
    # memory allows (--gguf-float32-rows) also float32 copies of its 121 matmul weights
    assert st["quantization"] == "gguf"
    copies = st["float32_copy_bytes"]
    assert copies == 0 or 4 * 134e6 <= copies <= 4 * 136e6, copies
    assert 50e6 < st["weight_bytes"] - copies <= 120e6, st["weight_bytes"]
    assert st["weight_bytes"] < st["scheduler_rss_bytes"] < 4 * 2**30
    # SmolLM2-135M: 30 layers x 3 KV heads x 64 x (K, V) float32 per token, plus a padding page
    per_token = 30 * 3 * 64 * 2 * 4
    assert 16384 * per_token < st["kv_pool_bytes"] <= (16384 + 64) * per_token
    assert st["vocab_size"] == 49152

"""SGLang's serving flags on the real server (default model, CPU): --stream-interval, the
cumulative /generate stream, --chat-template, --enable-priority-scheduling, and usage without
--enable-cache-report. One server for the module."""

from __future__ import annotations

import json

import openai
import pytest
import requests

from tests.helpers.server import DEFAULT_TEST_ARGS, ServerProcess

MODEL = "SmolLM2-135M-Instruct"
INTERVAL = 4
N_STREAM = 96


@pytest.fixture(scope="module")
def server():
    args = [
        *DEFAULT_TEST_ARGS,
        "--stream-interval", str(INTERVAL), "--chat-template", "qwen", "--enable-priority-scheduling",
    ]  # fmt: skip
    with ServerProcess(args) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0)


def generate_stream(server, **body) -> list[dict]:
    r = requests.post(server.url("/generate"), json={**body, "stream": True}, stream=True, timeout=120)
    assert r.status_code == 200, r.text
    events = [line[6:] for line in r.iter_lines() if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_generate_streams_the_output_so_far_every_interval_tokens(server):
    # long enough (a few hundred ms of decode) that a consumer stalled by a busy 2-core machine
    # cannot merge the whole stream into one or two chunks
    params = {"max_new_tokens": N_STREAM, "temperature": 0, "ignore_eos": True}
    full = requests.post(
        server.url("/generate"), json={"text": "Once upon a time", "sampling_params": params}, timeout=120
    ).json()
    chunks = generate_stream(server, text="Once upon a time", sampling_params=params, priority=2)
    # the first token at once, then 4 at a time, the rest with the finish: 1 + ceil(95 / 4) chunks
    # (fewer if the HTTP side lags and merges some)
    assert 3 <= len(chunks) <= 1 + -(-(N_STREAM - 1) // INTERVAL)
    assert all(c["meta_info"]["completion_tokens"] % INTERVAL == 1 for c in chunks[:-1])
    for a, b in zip(chunks, chunks[1:]):
        assert b["text"].startswith(a["text"])
    assert all(len(c["output_ids"]) == c["meta_info"]["completion_tokens"] for c in chunks)
    assert chunks[-1]["text"] == full["text"] and chunks[-1]["output_ids"] == full["output_ids"]


def test_openai_streams_deltas_in_groups(client):
    kw = dict(model=MODEL, prompt="The capital of France is", max_tokens=16, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    parts = [c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices]
    assert "".join(parts) == full
    assert len(parts) <= 1 + -(-15 // INTERVAL) + 1  # + a finish-only chunk at most


def test_chat_template_replaces_the_tokenizers(server, client):
    from srt.server_args import ServerArgs
    from srt.utils.hf_tokenizer import load_tokenizer, tokenizer_source

    tokenizer = load_tokenizer(tokenizer_source(ServerArgs()))
    qwen_prompt = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0
    )
    assert r.usage.prompt_tokens == len(tokenizer.encode(qwen_prompt, add_special_tokens=False))
    own = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert own != qwen_prompt  # the model's own template differs (its default system prompt)


def test_usage_has_no_cache_details_without_the_flag(server):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "priority": 1}
    usage = requests.post(server.url("/v1/completions"), json=body, timeout=60).json()["usage"]
    assert usage["prompt_tokens_details"] is None and usage["completion_tokens"] == 2
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 2}}
    out = requests.post(server.url("/generate"), json=body, timeout=60).json()
    assert out["meta_info"]["cached_tokens"] >= 0  # /generate always reports it
    bad = requests.post(server.url("/generate"), json={**body, "a_newer_field": 1}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "a_newer_field"


def test_priority_is_accepted_with_the_flag(server, client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, extra_body={"priority": 9}
    )
    assert r.choices[0].finish_reason in ("length", "stop")
    bad = requests.post(server.url("/generate"), json={"text": "x", "priority": "high"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"

"""64 concurrent streaming chat requests against the real server (default model, CPU).

All complete with correct usage, and each greedy output equals the output of the same prompt sent
alone (continuous batching, the radix cache and streaming change nothing about the result).
"""

from __future__ import annotations

import asyncio

import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(default_server):
    return default_server  # tests/integration/conftest.py


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer():
    from srt.server_args import ServerArgs
    from srt.utils.hf_tokenizer import load_tokenizer, tokenizer_source

    return load_tokenizer(tokenizer_source(ServerArgs()))


async def _chat_stream(aclient, content: str) -> tuple[str, object]:
    text, usage = "", None
    stream = await aclient.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage
    return text, usage


@pytest.mark.slow
def test_64_concurrent_streaming_chats_match_sequential(server, client, tokenizer):
    prompts = [f"Give me a fun fact about the number {i}." for i in range(64)]

    async def run_all():
        aclient = openai.AsyncOpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*[_chat_stream(aclient, p) for p in prompts])
        finally:
            await aclient.close()

    results = asyncio.run(run_all())
    for p, (_, usage) in zip(prompts, results):
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        assert usage is not None and usage.prompt_tokens == len(
            tokenizer.encode(chat, add_special_tokens=False)
        )
        assert 1 <= usage.completion_tokens <= 16
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    for i, p in enumerate(prompts):  # the same prompts, one at a time
        ref = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": p}], max_tokens=16, temperature=0
        )
        assert results[i][0] == ref.choices[0].message.content, p
        assert results[i][1].completion_tokens == ref.usage.completion_tokens

"""Request fields end to end: the real server (default model, CPU) through the official `openai`
client and POST /generate. Fields that shape the prompt are honoured (the usage's prompt tokens
are those of the prompt the chat template renders with them), fields srt cannot honour are a 400
naming them. One server for the module."""

from __future__ import annotations

import openai
import pytest
import requests

MODEL = "SmolLM2-135M-Instruct"
USER = {"role": "user", "content": "Name a colour."}
PARTIAL = {"role": "assistant", "content": "My favourite colour is"}


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


def _prompt_tokens(tokenizer, messages, **kw) -> int:
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kw)
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_continue_final_message_and_add_generation_prompt(client, tokenizer):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[USER, PARTIAL],
        max_tokens=3,
        temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    expected = _prompt_tokens(tokenizer, [USER, PARTIAL], continue_final_message=True)
    assert r.usage.prompt_tokens == expected
    r = client.chat.completions.create(
        model=MODEL, messages=[USER], max_tokens=2, extra_body={"add_generation_prompt": False}
    )
    assert r.usage.prompt_tokens == _prompt_tokens(tokenizer, [USER], add_generation_prompt=False)
    assert r.usage.prompt_tokens < _prompt_tokens(tokenizer, [USER], add_generation_prompt=True)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"continue_final_message": True}, "continue_final_message"),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
    ],
)
def test_invalid_prompt_options_are_400(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[USER, PARTIAL], max_tokens=2, extra_body=extra)
    assert e.value.body["param"] == param


def test_chat_template_kwargs_are_accepted(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[USER],
        max_tokens=2,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert r.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"metadata": {"k": "v"}}, "metadata"),
        ({"verbosity": "low"}, "verbosity"),
        (
            {"stream_options": {"include_obfuscation": True}, "stream": True},
            "stream_options.include_obfuscation",
        ),
        (
            {"messages": [USER, {"role": "assistant", "content": None, "refusal": "no"}, USER]},
            "messages[1].refusal",
        ),
    ],
)
def test_client_fields_srt_cannot_honour_are_400(client, kwargs, param):
    body = {"model": MODEL, "messages": [USER], "max_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**body)
    assert e.value.body["param"] == param


def test_informational_fields_are_accepted(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[USER], max_tokens=2, user="u1", safety_identifier="s1", prompt_cache_key="k"
    )
    assert r.usage.completion_tokens >= 1


@pytest.mark.parametrize(
    "field, value, code",
    [("video_data", ["cat.mp4"], "unsupported_field"), ("max_tokens", 3, "unknown_field")],
)
def test_generate_refuses_fields_it_cannot_honour(server, field, value, code):
    r = requests.post(server.url("/generate"), json={"text": "hi", field: value}, timeout=60)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"] and r.json()["error"]["code"] == code
    ok = requests.post(
        server.url("/generate"),
        json={"text": "hi", "image_data": None, "sampling_params": {"max_new_tokens": 1}},
        timeout=60,
    )
    assert ok.status_code == 200, ok.text


def test_a_text_model_refuses_images(server):
    """The default model takes no images: /generate's image_data and a chat image part are a 400
    naming the cause (nothing is fetched)."""
    r = requests.post(server.url("/generate"), json={"text": "hi", "image_data": "cat.png"}, timeout=60)
    assert r.status_code == 400, r.text
    assert (
        "takes no image input" in r.json()["error"]["message"]
        and r.json()["error"]["param"] == "image_data[0]"
    )
    part = {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/cat.png"}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": [part]}], "max_tokens": 2}
    r = requests.post(server.url("/v1/chat/completions"), json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert "takes no image input" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "messages[0].content[0].image_url"

"""Error handling of the real server: status codes and OpenAI error bodies, and isolation
(a bad request never disturbs the others). The server runs with --api-key, --max-queued-requests
and --max-request-body-bytes.
"""

from __future__ import annotations

import threading

import openai
import pytest
import requests

from tests.helpers.server import DEFAULT_TEST_ARGS, ServerProcess

MODEL = "SmolLM2-135M-Instruct"
KEY = "sk-test-key"
MAX_QUEUED = 4
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY = 2 << 20


@pytest.fixture(scope="module")
def server():
    args = [
        "--api-key",
        KEY,
        "--max-queued-requests",
        str(MAX_QUEUED),
        "--max-request-body-bytes",
        str(MAX_BODY),
    ]
    with ServerProcess([*DEFAULT_TEST_ARGS, *args]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key=KEY, max_retries=0)


def assert_error_body(body: dict, status: int, *needles: str, param: str | None = None) -> None:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    for n in needles:
        assert n in err["message"], (n, err["message"])
    if param is not None:
        assert err["param"] == param
    assert err["type"] == ("server_error" if status >= 500 else err["type"])


def post(server, path: str, body, headers=AUTH):
    kw = {"json": body} if isinstance(body, (dict, list)) else {"data": body}
    return requests.post(
        server.url(path), headers={**headers, "Content-Type": "application/json"}, timeout=60, **kw
    )


@pytest.mark.parametrize(
    "body, param, needles",
    [
        ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens", ["max_tokens", "0"]),
        ({"model": MODEL, "prompt": "x", "max_tokens": -5}, "max_tokens", ["-5"]),
        ({"model": MODEL, "prompt": "x", "temperature": -0.5}, "temperature", ["temperature", "-0.5"]),
        ({"model": MODEL, "prompt": "x", "top_p": 0.0}, "top_p", ["top_p", "(0, 1]"]),
        ({"model": MODEL, "prompt": "x", "top_p": 1.5}, "top_p", ["top_p", "1.5"]),
        ({"model": MODEL, "prompt": "x", "n": 0}, "n", ["n must be in [1, 128]"]),
        ({"model": MODEL, "prompt": "x", "n": 3134}, "n", ["n must be in [1, 128]"]),
        ({"model": MODEL, "prompt": "x", "temperature": "hot"}, "temperature", ["temperature"]),
        ({"model": MODEL, "prompt": "x", "max_tokens": "10"}, "max_tokens", ["max_tokens"]),
        ({"model": MODEL, "prompt": []}, "prompt", ["prompt"]),
        ({"model": MODEL, "prompt": "x", "frequency_penalty": 3}, "frequency_penalty", ["[-2, 2]"]),
    ],
)
def test_completion_400(server, body, param, needles):
    r = post(server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    assert_error_body(r.json(), 400, *needles, param=param)


def test_several_bad_values_are_each_reported(server):
    r = post(
        server,
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "temperature": -1, "top_p": 2, "presence_penalty": 9},
    )
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "temperature" in msg and "top_p" in msg and "presence_penalty" in msg


def test_malformed_json_400(server):
    r = post(server, "/v1/chat/completions", b'{"model": "x", "messages": [')
    assert r.status_code == 400
    assert_error_body(r.json(), 400, "JSON")
    for path, body in [  # a lone surrogate escape: Python's json.dumps writes one for such a str
        ("/v1/completions", b'{"model": "x", "prompt": "a\\ud800"}'),
        ("/v1/chat/completions", b'{"model": "x", "messages": [{"role": "user", "content": "\\udc00 b"}]}'),
        ("/generate", b'{"text": "a\\ud800"}'),
    ]:
        r = post(server, path, body)
        assert r.status_code == 400
        assert_error_body(r.json(), 400, "malformed JSON body", "unpaired UTF-16 surrogate escape")


def test_context_length_400_gives_the_numbers(server):
    ctx = requests.get(server.url("/get_model_info"), headers=AUTH, timeout=10).json()["context_len"]
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "Hello world", "max_tokens": ctx})
    assert r.status_code == 400
    err = r.json()["error"]
    assert str(ctx) in err["message"] and str(ctx + 2) in err["message"] and "max_tokens" in err["message"]
    assert err["code"] == "context_length_exceeded"
    long_prompt = "hello " * (ctx + 10)
    r = post(
        server,
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": long_prompt}]},
    )
    assert r.status_code == 400 and str(ctx) in r.json()["error"]["message"]


def test_a_prompt_too_long_for_any_tokenization_is_400_before_tokenizing(server):
    """A 200 MB prompt once took the tokenizer minutes and 12 GiB before the context check."""
    ctx = requests.get(server.url("/get_model_info"), headers=AUTH, timeout=10).json()["context_len"]
    text = "#" * (ctx * 100)  # the default tokenizer's tokens cover at most 81 characters
    for path, body in [("/generate", {"text": text}), ("/tokenize", {"prompt": text})]:
        r = post(server, path, body)
        assert r.status_code == 400, (path, r.text[:200])
        assert_error_body(r.json(), 400, f"{len(text)} characters", str(ctx), param="prompt")
        assert r.json()["error"]["code"] == "context_length_exceeded"


def _chunks(body: bytes, size: int = 1 << 16):
    return (body[i : i + size] for i in range(0, len(body), size))  # sent without a Content-Length


def test_a_body_past_the_bound_is_413_with_or_without_a_length_and_the_server_goes_on(server):
    big = b'{"model": "m", "prompt": "' + b"a" * MAX_BODY + b'"}'
    for path in ("/v1/completions", "/v1/chat/completions", "/generate", "/v1/embeddings"):
        for body in (big, _chunks(big)):
            r = post(server, path, body)
            assert r.status_code == 413, (path, r.text[:300])
            assert_error_body(r.json(), 413, f"--max-request-body-bytes={MAX_BODY}")
            assert r.json()["error"]["code"] == "request_too_large"
    assert post(server, "/v1/completions", big, headers={}).status_code == 401  # the key comes first
    with requests.Session() as s:  # the connection that got a 413 serves the next request
        r = s.post(server.url("/v1/completions"), data=big, headers=AUTH)
        assert r.status_code == 413
        r = s.post(
            server.url("/v1/completions"),
            json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
            headers=AUTH,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_a_body_of_many_bad_items_is_a_short_400(server):
    """Such a body (a list of token ids ending in a string) once cost the server 1.3 GiB per MiB."""
    ids = [1] * 200_000
    for path, body in [
        ("/v1/completions", {"model": "m", "prompt": [*ids, "a"]}),
        ("/v1/chat/completions", {"model": "m", "messages": [{}] * 200_000}),
        ("/detokenize", {"tokens": [*ids, "a"]}),
    ]:
        r = post(server, path, body)
        assert r.status_code == 400 and len(r.content) < 2000, (path, r.text[:300])
        assert_error_body(r.json(), 400)


def test_a_request_for_more_sequences_than_the_bound_is_400_before_tokenizing(server):
    """20,000 prompts with n = 128 (a 600 KB body) once took 3.4 GiB and a minute of the event loop."""
    for path, body, param in [
        ("/generate", {"text": ["hi"] * 600, "sampling_params": {"n": 128, "max_new_tokens": 1}}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": ["hi"] * 70_000, "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": ["hi"] * 1000, "n": 100, "max_tokens": 1}, "prompt"),
        ("/tokenize", {"prompt": ["hi"] * 70_000}, "prompt"),
    ]:
        r = post(server, path, body)
        assert r.status_code == 400, (path, r.text[:300])
        assert_error_body(r.json(), 400, "--max-sequences-per-request=65536", param=param)
    r = post(server, "/generate", {"text": ["hi"] * 2, "sampling_params": {"n": 2, "max_new_tokens": 1}})
    assert r.status_code == 200 and len(r.json()) == 4  # (--max-queued-requests is 4 here)


def test_chat_400(server):
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": []})
    assert r.status_code == 400
    assert_error_body(r.json(), 400, "messages", param="messages")
    r = post(
        server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "pirate", "content": "arr"}]}
    )
    assert r.status_code == 400
    assert_error_body(r.json(), 400, "pirate")
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": "hello"})
    assert r.status_code == 400


def test_top_logprobs_beyond_the_bound_are_400_and_within_it_are_served(server):
    """A count near the vocabulary would cost the server gigabytes per request (--max-top-logprobs-num)."""
    body = {"text": "Hello", "top_logprobs_num": 49152, "sampling_params": {"max_new_tokens": 2}}
    r = post(server, "/generate", body)
    assert r.status_code == 400
    assert_error_body(r.json(), 400, "--max-top-logprobs-num", "49152", param="top_logprobs_num")
    r = post(server, "/generate", {**body, "top_logprobs_num": 20})
    assert r.status_code == 200, r.text
    assert [len(step) for step in r.json()["meta_info"]["output_top_logprobs"]] == [20, 20]


def test_thousands_of_stop_strings_are_400_without_echoing_them(server):
    """The detokenizer looks for every stop string after each step: 20,000 of 200 characters took it 18
    CPU-s over a 300-token request, and every stream waits on the detokenizer."""
    stops = [f"stop-{i}" for i in range(20000)]
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4, "stop": stops})
    assert r.status_code == 400
    assert_error_body(r.json(), 400, "at most 64 strings", "20000 given", param="stop")
    assert len(r.content) < 1000
    r = post(server, "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 4, "stop": stops[:64]}})
    assert r.status_code == 200, r.text


def test_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=-1
        )
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-9", prompt="x")
    assert e.value.status_code == 404 and "gpt-9" in e.value.body["message"]
    assert e.value.body["code"] == "model_not_found"


def test_models_retrieve_and_unknown_routes(server, client):
    """OpenAI's "retrieve model" answers the served model's card (under any name the ``model``
    field takes); an unknown model, an unknown path and a wrong method answer in OpenAI's error
    shape, not FastAPI's ``{"detail": ...}``."""
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.owned_by == "srt"
    assert client.models.retrieve("default").id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-9")
    assert e.value.body["code"] == "model_not_found" and MODEL in e.value.body["message"]
    r = requests.get(server.url("/v1/nope"), headers=AUTH, timeout=10)
    assert r.status_code == 404
    assert_error_body(r.json(), 404, "Invalid URL (GET /v1/nope)")
    r = requests.get(server.url("/v1/chat/completions"), headers=AUTH, timeout=10)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert_error_body(r.json(), 405, "GET /v1/chat/completions", "takes POST")


def test_api_key_401(server):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    r = post(server, "/v1/completions", body, headers={})
    assert r.status_code == 401
    assert_error_body(r.json(), 401, "API key")
    r = post(server, "/v1/completions", body, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url("/v1"), api_key="wrong", max_retries=0).models.list()
    assert requests.get(server.url("/health"), timeout=10).status_code == 200  # probes need no key
    assert requests.get(server.url("/get_server_info"), timeout=10).status_code == 401


def test_queue_full_429_with_retry_after(server):
    batch = {"text": ["a"] * (MAX_QUEUED + 1), "sampling_params": {"max_new_tokens": 1}}
    r = post(server, "/generate", batch)
    assert r.status_code == 429
    assert int(r.headers["Retry-After"]) >= 1
    assert_error_body(r.json(), 429, "--max-queued-requests")
    ok = post(server, "/generate", {"text": ["a"] * MAX_QUEUED, "sampling_params": {"max_new_tokens": 1}})
    assert ok.status_code == 200 and len(ok.json()) == MAX_QUEUED


def test_bad_requests_do_not_disturb_a_running_one(server, client):
    kw = dict(model=MODEL, prompt="Tell me about the sea.", max_tokens=24, temperature=0)
    reference = client.completions.create(**kw).choices[0].text
    result: dict[str, str] = {}

    def stream() -> None:
        result["text"] = "".join(
            c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices
        )

    t = threading.Thread(target=stream)
    t.start()
    bad = [
        {"model": MODEL, "prompt": "x", "temperature": -1},
        {"model": MODEL, "prompt": "x", "max_tokens": 10**6},
        {"model": MODEL, "prompt": [49152 + 5]},  # token id outside the vocabulary
        {"model": MODEL, "prompt": "x", "stop_token_ids": [-1]},
    ]
    for body in bad:
        r = post(server, "/v1/completions", body)
        assert r.status_code == 400, r.text
    assert post(server, "/generate", b"\x00\x01").status_code == 400
    t.join(timeout=120)
    assert result["text"] == reference
    assert requests.get(server.url("/health"), timeout=10).status_code == 200

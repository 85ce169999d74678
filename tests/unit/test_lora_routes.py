"""Multi-LoRA on the real app (`create_app`) over a stand-in engine front end: the OpenAI routes'
adapter selection (``model`` "<served>:<adapter>" / "<adapter>", ``lora_path``), the echoed
``model``, /v1/models, /generate's ``lora_path`` and the /load_lora_adapter and
/unload_lora_adapter routes (bodies, errors, admin key) against a fake scheduler."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from srt.entrypoints.http.app import create_app
from srt.managers.io_struct import LoadLoRAAdapterReq, LoRAAdapterReqOutput
from srt.managers.tokenizer.lora_registry import LoRARegistry
from srt.server_args import ServerArgs
from tests.helpers.lora_fakes import fake_lora_reply

ADMIN = "sk-admin"
OUTPUT = {
    "index": 0,
    "text": "ok",
    "output_ids": [5, 6],
    "meta_info": {
        "id": "r",
        "finish_reason": {"type": "stop", "matched": 2},
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "cached_tokens": 0,
    },
}


class StubTM:
    """The tokenizer manager as the routes see it: records each request, answers ``OUTPUT``; its
    adapters' load / unload requests go to a fake scheduler (``busy`` adapters are in use; a
    path under /bad does not load)."""

    def __init__(self, enable_lora: bool = True, busy: tuple[str, ...] = (), **args: Any) -> None:
        self.server_args = ServerArgs(model_path="/models/tiny", enable_lora=enable_lora, **args)
        self.model_name = "tiny"
        self.context_len = 2048
        self.tokenizer = None
        self.loaded = {"a": "/p/a"} if enable_lora else {}
        self.busy = busy
        self.sent: list = []
        self.seen: list = []
        self.lora_registry = LoRARegistry(
            enable_lora, [f"{k}={v}" for k, v in self.loaded.items()], self.send
        )

    async def send(self, req) -> LoRAAdapterReqOutput:
        self.sent.append(req)
        return fake_lora_reply(req, self.loaded, self.busy, users=2)

    async def prepare(self, obj, prefill_only=None):
        self.seen.append(obj)
        self.lora_registry.check_all(s.lora_path for s in obj.expand())  # as the input processor does
        return type("Prep", (), {"stream": obj.stream, "is_batch": obj.is_batch})()

    async def run(self, prep):
        yield OUTPUT


def client(**kw: Any) -> tuple[TestClient, StubTM]:
    tm = StubTM(**kw)
    return TestClient(create_app(tm), raise_server_exceptions=False), tm


def completion(c: TestClient, **body: Any):
    return c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, **body})


# ---------------------------------------------------------------- OpenAI routes
@pytest.mark.parametrize(
    ("body", "adapter", "echo"),
    [
        ({"model": "tiny"}, None, "tiny"),
        ({}, None, "tiny"),
        ({"model": "default"}, None, "default"),
        ({"model": "tiny:a"}, "a", "tiny:a"),  # SGLang's syntax
        ({"model": "a"}, "a", "a"),  # vLLM's
        ({"model": "/models/tiny:a"}, "a", "/models/tiny:a"),
        ({"model": "tiny", "lora_path": "a"}, "a", "tiny"),  # SGLang's extra_body
        ({"model": "tiny:a", "lora_path": "a"}, "a", "tiny:a"),
        ({"model": "tiny:a", "lora_path": [None]}, "a", "tiny:a"),
    ],
)
def test_completions_select_the_adapter_and_echo_the_model(body, adapter, echo):
    c, tm = client()
    r = completion(c, **body)
    assert r.status_code == 200, r.text
    assert tm.seen[-1].lora_path == adapter
    assert r.json()["model"] == echo


def test_chat_and_responses_select_the_adapter_too():
    c, tm = client()

    def chat_template(messages, **kw):
        return "prompt"

    tm.apply_chat_template = chat_template
    tm.chat_template_renders_tools = lambda: True
    messages = [{"role": "user", "content": "hi"}]
    r = c.post("/v1/chat/completions", json={"model": "tiny:a", "messages": messages})
    assert r.status_code == 200, r.text
    assert tm.seen[-1].lora_path == "a" and r.json()["model"] == "tiny:a"
    r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "lora_path": "a"})
    assert r.status_code == 200 and tm.seen[-1].lora_path == "a"
    r = c.post("/v1/responses", json={"model": "a", "input": "hi"})
    assert r.status_code == 200, r.text
    assert tm.seen[-1].lora_path == "a" and r.json()["model"] == "a"
    r = c.post("/v1/responses", json={"model": "tiny", "input": "hi", "lora_path": "zz"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"


@pytest.mark.parametrize(
    ("kw", "body", "status", "param", "words"),
    [
        ({}, {"model": "zz"}, 404, "model", "does not exist"),  # neither served nor an adapter
        ({}, {"model": "other:a"}, 404, "model", "does not exist"),
        ({}, {"model": "tiny:zz"}, 400, "model", "unknown LoRA adapter 'zz'; loaded adapters: a"),
        ({}, {"lora_path": "zz"}, 400, "lora_path", "unknown LoRA adapter"),
        ({}, {"model": "tiny:a", "lora_path": "b"}, 400, "lora_path", "another adapter"),
        ({}, {"prompt": ["x", "y"], "lora_path": ["a"]}, 400, "lora_path", "1 entries for 2 prompts"),
        ({"enable_lora": False}, {"model": "tiny:a"}, 400, "model", "--enable-lora"),
        ({"enable_lora": False}, {"lora_path": "a"}, 400, "lora_path", "--enable-lora"),
        ({"enable_lora": False}, {"model": "a"}, 404, "model", "does not exist"),
    ],
)
def test_adapter_errors(kw, body, status, param, words):
    c, tm = client(**kw)
    r = completion(c, **body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"]


def test_models_lists_each_adapter_after_the_base_model():
    c, _ = client()
    c.post("/load_lora_adapter", json={"lora_name": "b", "lora_path": "/p/b"})
    data = c.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["tiny", "a", "b"]
    assert data[0]["root"] == "/models/tiny" and data[0]["parent"] is None
    assert {k: data[2][k] for k in ("object", "owned_by", "root", "parent")} == {
        "object": "model",
        "owned_by": "srt",
        "root": "/p/b",
        "parent": "tiny",
    }
    assert isinstance(data[2]["created"], int)
    c.post("/unload_lora_adapter", json={"lora_name": "a"})
    assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["tiny", "b"]


def test_retrieve_model_gives_the_card_of_what_a_name_runs():
    """GET /v1/models/{model}: each name the ``model`` field takes gives the card that /v1/models
    lists for what it runs (the base model, or the adapter); an unknown name or adapter is a 404."""
    c, _ = client()
    listed = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
    for name, card in [
        ("tiny", "tiny"),
        ("default", "tiny"),
        ("/models/tiny", "tiny"),
        ("a", "a"),
        ("tiny:a", "a"),
    ]:
        r = c.get(f"/v1/models/{name}")
        assert r.status_code == 200 and r.json() == listed[card], name
    for name in ("nope", "tiny:zz", "b"):
        r = c.get(f"/v1/models/{name}")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", name
    c.post("/load_lora_adapter", json={"lora_name": "b", "lora_path": "/p/b"})
    assert c.get("/v1/models/b").json()["root"] == "/p/b"


# ---------------------------------------------------------------- /generate
def test_generate_takes_lora_path():
    c, tm = client()
    r = c.post("/generate", json={"text": ["x", "y"], "lora_path": ["a", None]})
    assert r.status_code == 200 and tm.seen[-1].lora_path == ["a", None]
    r = c.post("/generate", json={"text": "x", "lora_path": "zz"})
    assert r.status_code == 400 and "loaded adapters: a" in r.json()["error"]["message"]
    r = c.post("/generate", json={"text": "x", "lora_id": "zz"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_id"


# ---------------------------------------------------------------- load / unload
def test_load_then_unload():
    c, tm = client()
    r = c.post("/load_lora_adapter", json={"lora_name": "b", "lora_path": "/p/b", "pinned": True})
    assert r.status_code == 200
    assert r.json() == {
        "success": True,
        "message": "",
        "error_message": None,
        "loaded_adapters": {"a": "/p/a", "b": "/p/b"},
    }
    assert tm.sent == [LoadLoRAAdapterReq(lora_name="b", lora_path="/p/b", pinned=True)]
    assert completion(c, model="tiny:b").status_code == 200
    r = c.post("/unload_lora_adapter", json={"lora_name": "b"})
    assert r.status_code == 200 and r.json()["loaded_adapters"] == {"a": "/p/a"}
    assert completion(c, model="tiny:b").status_code == 400


def test_scheduler_refusals_are_400_with_sglangs_body():
    c, tm = client(busy=("a",))
    r = c.post("/load_lora_adapter", json={"lora_name": "c", "lora_path": "/bad/c"})
    assert r.status_code == 400
    body = r.json()
    assert body["success"] is False and body["error_message"] == body["message"] == "no adapter_config.json"
    assert body["loaded_adapters"] == {"a": "/p/a"} and body["error"]["code"] == "lora_not_updated"
    r = c.post("/unload_lora_adapter", json={"lora_name": "a"})
    assert r.status_code == 400 and "used by 2 requests" in r.json()["message"]
    assert completion(c, model="a").status_code == 200  # kept


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        ("/load_lora_adapter", {"lora_path": "/p/x"}, "lora_name", "Field required"),
        ("/load_lora_adapter", {"lora_name": "x"}, "lora_path", "Field required"),
        ("/load_lora_adapter", {"lora_name": " ", "lora_path": "/p/x"}, "lora_name", "non-empty"),
        ("/load_lora_adapter", {"lora_name": "x", "lora_path": ""}, "lora_path", "non-empty"),
        ("/load_lora_adapter", {"lora_name": "a", "lora_path": "/p/a"}, "lora_name", "already loaded"),
        ("/load_lora_adapter", {"lora_name": 3, "lora_path": "/p/x"}, "lora_name", "string"),
        ("/unload_lora_adapter", {}, "lora_name", "Field required"),
        ("/unload_lora_adapter", {"lora_name": ""}, "lora_name", "non-empty"),
        ("/unload_lora_adapter", {"lora_name": "zz"}, "lora_name", "unknown LoRA adapter"),
    ],
)
def test_bad_bodies_are_400_before_anything_is_sent(path, body, param, words):
    c, tm = client()
    r = c.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and words in r.json()["error"]["message"]
    assert tm.sent == []


def test_lora_routes_need_enable_lora():
    c, tm = client(enable_lora=False)
    for path, body in [
        ("/load_lora_adapter", {"lora_name": "b", "lora_path": "/p/b"}),
        ("/unload_lora_adapter", {"lora_name": "a"}),
    ]:
        r = c.post(path, json=body)
        assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]
    assert tm.sent == []


def test_lora_routes_are_admin_routes():
    c, _ = client(api_key="sk-user", admin_api_key=ADMIN)
    body = {"lora_name": "b", "lora_path": "/p/b"}
    user = {"Authorization": "Bearer sk-user"}
    assert c.post("/load_lora_adapter", json=body, headers=user).status_code == 403
    assert c.post("/unload_lora_adapter", json={"lora_name": "a"}, headers=user).status_code == 403
    admin = {"Authorization": f"Bearer {ADMIN}"}
    assert c.post("/load_lora_adapter", json=body, headers=admin).status_code == 200


def test_openapi_describes_the_lora_bodies():
    c, _ = client()
    doc = c.get("/openapi.json").json()
    ref = doc["paths"]["/load_lora_adapter"]["post"]["requestBody"]["content"]["application/json"]
    assert ref["schema"]["$ref"].endswith("/LoadLoRAAdapterRequest")
    schema = doc["components"]["schemas"]["LoadLoRAAdapterRequest"]
    assert set(schema["required"]) == {"lora_name", "lora_path"}
    assert "/unload_lora_adapter" in doc["paths"]


def test_embedding_and_score_routes_run_the_base_model_only():
    c, _ = client()
    for path, body in [
        ("/v1/embeddings", {"input": "hi"}),
        ("/v1/score", {"query": "q", "items": ["a"], "label_token_ids": [1]}),
        ("/v1/rerank", {"query": "q", "documents": ["a"]}),
    ]:
        for model in ("a", "tiny:a"):
            r = c.post(path, json={**body, "model": model})
            assert r.status_code == 404, (path, model, r.text)
            assert "LoRA adapter" in r.json()["error"]["message"]
    ctx = c.app.state.ctx
    assert ctx.model_not_found("tiny", adapters=False) is None
    assert ctx.model_not_found("tiny:", adapters=False) is None

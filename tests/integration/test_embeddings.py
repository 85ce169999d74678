"""Embeddings, rerank and score end to end.

One embedding server of the default model (--is-embedding, last-token pooling) for the module,
driven through the official `openai` client and plain HTTP; transformers' float32 forward of the
same model is the numeric reference (final hidden states, next-token probabilities). One
``Engine`` of a tiny random Qwen3 saved with a sentence-transformers mean-pooling config checks
the auto-detection and mean pooling against transformers.
"""

from __future__ import annotations

import base64
import json
import struct

import openai
import pytest
import requests
import torch

from tests.helpers.hf_reference import load_default_hf_model, load_default_tokenizer
from tests.helpers.server import DEFAULT_TEST_ARGS, ServerProcess
from tests.helpers.tiny_models import build_tiny_hf_model
from tests.helpers.tolerance import assert_reordered_close, reduction_len

MODEL = "SmolLM2-135M-Instruct"
TEXTS = ["The capital of France is Paris.", "Cats sleep most of the day.", "hello"]


@pytest.fixture(scope="module")
def server():
    with ServerProcess([*DEFAULT_TEST_ARGS, "--is-embedding"]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def hf():
    return load_default_hf_model(), load_default_tokenizer()


def _hf_last_hidden(hf, text: str) -> torch.Tensor:
    model, tok = hf
    with torch.inference_mode():
        return model.model(torch.tensor([tok(text)["input_ids"]])).last_hidden_state[0, -1]


def _post(server, path: str, body: dict) -> requests.Response:
    return requests.post(server.url(path), json=body, timeout=120)


def test_embeddings_match_transformers(client, hf):
    r = client.embeddings.create(model=MODEL, input=TEXTS)
    assert [d.index for d in r.data] == [0, 1, 2]
    _, tok = hf
    assert r.usage.prompt_tokens == sum(len(tok(t)["input_ids"]) for t in TEXTS) == r.usage.total_tokens
    for text, d in zip(TEXTS, r.data):
        ref = torch.nn.functional.normalize(_hf_last_hidden(hf, text), dim=0)
        got = torch.tensor(d.embedding)
        assert abs(got.norm().item() - 1.0) < 1e-5
        assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()


def test_single_base64_dimensions_and_raw(client, server, hf):
    batch = client.embeddings.create(model=MODEL, input=TEXTS).data
    one = client.embeddings.create(model=MODEL, input=TEXTS[1]).data[0].embedding
    assert torch.allclose(torch.tensor(one), torch.tensor(batch[1].embedding), atol=1e-5)
    b64 = _post(server, "/v1/embeddings", {"input": TEXTS[1], "encoding_format": "base64"}).json()
    raw = base64.b64decode(b64["data"][0]["embedding"])
    floats = struct.unpack(f"<{len(raw) // 4}f", raw)
    assert torch.allclose(torch.tensor(floats), torch.tensor(one), atol=1e-6)
    small = client.embeddings.create(model=MODEL, input=TEXTS[1], dimensions=64).data[0].embedding
    ref = torch.nn.functional.normalize(torch.tensor(one[:64]), dim=0)
    assert len(small) == 64 and torch.allclose(torch.tensor(small), ref, atol=1e-5)
    _, tok = hf
    ids = tok(TEXTS[1])["input_ids"]
    by_ids = client.embeddings.create(model=MODEL, input=[ids]).data[0].embedding
    assert torch.allclose(torch.tensor(by_ids), torch.tensor(one), atol=1e-5)
    enc = _post(server, "/encode", {"text": TEXTS[2], "normalize": False}).json()
    # not normalized: the last hidden state itself, at its own magnitude
    ref = _hf_last_hidden(hf, TEXTS[2])
    assert_reordered_close(torch.tensor(enc["embedding"]), ref, reduction_len(hf[0].config), what="/encode")
    assert enc["meta_info"]["prompt_tokens"] == len(tok(TEXTS[2])["input_ids"])


def test_rerank_and_score(server, client, hf):
    docs = ["Paris is the capital of France.", "Bananas are yellow.", "France's capital city is Paris."]
    r = _post(server, "/v1/rerank", {"query": "capital of France", "documents": docs, "top_n": 2}).json()
    scores = [x["relevance_score"] for x in r["results"]]
    assert len(scores) == 2 and scores == sorted(scores, reverse=True)
    embs = [
        torch.tensor(d.embedding)
        for d in client.embeddings.create(model=MODEL, input=["capital of France", *docs]).data
    ]
    cos = [float(embs[0] @ e) for e in embs[1:]]
    assert [x["index"] for x in r["results"]] == sorted(range(3), key=lambda i: -cos[i])[:2]
    assert r["results"][0]["document"]["text"] == docs[r["results"][0]["index"]]
    assert abs(r["results"][0]["relevance_score"] - max(cos)) < 1e-4 and r["usage"]["prompt_tokens"] > 0

    model, tok = hf
    labels = [tok(" yes")["input_ids"][-1], tok(" no")["input_ids"][-1]]
    query, items = "Is Paris in France? Answer:", [" Yes, it is.", " No."]
    body = {"query": query, "items": items, "label_token_ids": labels}
    s = _post(server, "/v1/score", body).json()
    soft = _post(server, "/v1/score", {**body, "apply_softmax": True}).json()
    for item, probs, sprobs in zip(items, s["scores"], soft["scores"]):
        with torch.inference_mode():
            logits = model(torch.tensor([tok(query + item)["input_ids"]])).logits[0, -1]
        ref = torch.softmax(logits.float(), dim=-1)[labels]
        assert torch.allclose(torch.tensor(probs), ref, rtol=1e-3, atol=1e-6)
        assert torch.allclose(torch.tensor(sprobs), ref / ref.sum(), atol=1e-4)
    cos_score = _post(server, "/v1/score", {"text_1": "capital of France", "text_2": docs}).json()
    assert [round(x, 4) for x in cos_score["scores"]] == [round(c, 4) for c in cos]


@pytest.mark.parametrize(
    "path,body,status",
    [
        ("/v1/embeddings", {"input": ""}, 400),
        ("/v1/embeddings", {"input": []}, 400),
        ("/v1/embeddings", {"input": "hi " * 9000}, 400),
        ("/v1/embeddings", {"input": "hi", "dimensions": 100000}, 400),
        ("/v1/embeddings", {"input": 5}, 400),
        ("/v1/embeddings", {"input": "hi", "encoding_format": "int8"}, 400),
        ("/v1/embeddings", {"input": "hi", "model": "nope"}, 404),
        ("/v1/embeddings", {"input": ["hi"] * 2049}, 400),
        ("/encode", {"input_ids": [[5, 6]] * 2049}, 400),
        ("/v1/rerank", {"query": "q", "documents": []}, 400),
        ("/v1/score", {"query": "q", "items": ["a"], "label_token_ids": [10**9]}, 400),
        ("/generate", {"text": "hi"}, 400),
        ("/v1/completions", {"model": MODEL, "prompt": "hi"}, 400),
    ],
)
def test_bad_requests_are_4xx(server, path, body, status):
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    assert set(r.json()["error"]) >= {"message", "type", "param", "code"}


def test_more_inputs_than_the_openai_bound_are_refused_before_any_is_embedded(server):
    for path, body, param in [
        ("/v1/embeddings", {"input": ["hi"] * 2049}, "input"),
        ("/encode", {"text": ["hi"] * 5000}, "text"),
    ]:
        err = _post(server, path, body).json()["error"]
        assert err["param"] == param and "at most 2048" in err["message"], err
        assert str(len(body[param])) in err["message"]


def test_no_kv_leak(server, client):
    client.embeddings.create(model=MODEL, input=TEXTS * 4)
    assert requests.get(server.url("/health_generate"), timeout=60).status_code == 200
    info = requests.get(server.url("/get_server_info"), timeout=30).json()
    st = info["internal_states"][0]
    assert st["num_running_reqs"] == 0 and st["num_queued_reqs"] == 0
    assert st["available_size"] + st["evictable_size"] == st["max_total_num_tokens"]
    assert requests.get(server.url("/get_model_info"), timeout=10).json()["is_generation"] is False


def test_tiny_mean_pooled_checkpoint(tmp_path):
    from srt import Engine

    hf = build_tiny_hf_model("qwen3", seed=3)
    hf.save_pretrained(str(tmp_path))
    (tmp_path / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            ]
        )
    )
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    prompts = [[5, 9, 13, 200, 7], list(range(3, 40)), [11]]
    llm = Engine(
        str(tmp_path),
        skip_tokenizer_init=True,
        max_total_tokens=2048,
        chunked_prefill_size=16,
        log_level="warning",
    )
    try:
        assert llm.server_args.is_embedding
        outs = llm.encode(input_ids=prompts, normalize=False)
        with pytest.raises(ValueError):
            llm.generate(input_ids=prompts[0], sampling_params={"max_new_tokens": 1})
    finally:
        llm.shutdown()
    for p, o in zip(prompts, outs):
        with torch.inference_mode():
            ref = hf.model(torch.tensor([p])).last_hidden_state[0].mean(dim=0)
        got = torch.tensor(o["embedding"])
        assert_reordered_close(got, ref, reduction_len(hf.config), what="mean-pooled embedding")

"""Speculative decoding (--speculative-algorithm NGRAM) end to end: the Engine with the default
model, its processes and the real kernels.

* Greedy: the exactness prompts give transformers' tokens (near-tie rule of
  tests/helpers/hf_reference.py); the copy-heavy workload of benchmarks/data gives the tokens of
  an Engine without speculation (divergence only at a near-tie of that run), with most tokens
  coming from accepted drafts.
* Sampling: seeded requests draw the tokens they draw without speculation; over many seeds the
  first three tokens follow the model's distribution (chi-square against the distribution
  computed from the model's own logprobs, top_k 3 at temperature 1).
* Outputs: stop strings, n > 1, logprobs per token, meta_info's spec_verify_ct and
  spec_accept_length; through the HTTP server, streaming (several tokens per chunk), a
  constrained request and the Prometheus histogram.
* --tp-size 2 with speculation (the ranks must draft alike; under --dp-size each scheduler drafts
  on its own, as one process does).
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import requests
import torch

from srt import Engine
from tests.helpers.hf_reference import assert_tokens_match, default_model_references, default_prompt_set
from tests.helpers.server import DEFAULT_TEST_ARGS, ServerProcess

REPO = Path(__file__).resolve().parents[2]
SPEC = dict(speculative_algorithm="NGRAM", speculative_max_batch_size=256)


@pytest.fixture(scope="module")
def engines():
    on = Engine(max_total_tokens=32768, log_level="warning", **SPEC)
    off = Engine(max_total_tokens=32768, log_level="warning")
    yield on, off
    on.shutdown()
    off.shutdown()


def _top(meta: dict) -> list[dict[int, float]]:
    return [{tid: lp for lp, tid, _ in pos} for pos in meta["output_top_logprobs"]]


def test_greedy_matches_transformers(engines):
    on, _ = engines
    prompts, _ = default_prompt_set(24, seed=0, min_len=5, max_len=400)
    refs = default_model_references(prompts, 48)
    outs = on.generate(
        input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
    )
    near_ties = sum(
        assert_tokens_match(o["output_ids"], r.token_ids, r.top_logprobs) for o, r in zip(outs, refs)
    )
    assert near_ties <= 1
    assert max(o["meta_info"]["spec_accept_length"] for o in outs) > 1.0


def _copy_prompts(engine: Engine, n: int) -> list[str]:
    rows = [json.loads(line) for line in (REPO / "benchmarks/data/spec_copy.jsonl").read_text().splitlines()]
    tok = engine.tokenizer
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": r["prompt"]}], tokenize=False, add_generation_prompt=True
        )
        for r in rows[:n]
    ]


def _assert_same_or_near_tie(a: dict, b: dict) -> int:
    """``a``'s tokens equal ``b``'s, or differ first where ``b`` had a near-tie."""
    n = min(len(a["output_ids"]), len(b["output_ids"]))
    if a["output_ids"][:n] == b["output_ids"][:n]:
        assert len(a["output_ids"]) == len(b["output_ids"])
        return 0
    return assert_tokens_match(a["output_ids"][:n], b["output_ids"][:n], _top(b["meta_info"]))


def test_copy_workload_same_tokens_as_without(engines):
    on, off = engines
    prompts = _copy_prompts(on, 6)
    params = {"temperature": 0, "max_new_tokens": 200}
    kw = dict(return_logprob=True, top_logprobs_num=5)
    got = on.generate(prompts, params, **kw)
    want = off.generate(prompts, params, **kw)
    assert sum(_assert_same_or_near_tie(g, w) for g, w in zip(got, want)) <= 1
    steps = sum(g["meta_info"]["spec_verify_ct"] for g in got)
    tokens = sum(len(g["output_ids"]) - 1 for g in got)
    assert tokens / steps > 2.0, "the copy workload should accept most drafts"
    for g in got:  # a logprob per token, each the sampled token's
        meta = g["meta_info"]
        assert [t for _, t, _ in meta["output_token_logprobs"]] == g["output_ids"]
        assert [max(d, key=d.get) for d in _top(meta)] == g["output_ids"]


def test_seeded_sampling_same_tokens_as_without(engines):
    """Sampling noise is drawn per (seed, output position): a seeded request draws the same
    tokens with speculation (a draw can flip only where float noise moves a boundary)."""
    on, off = engines
    prompts = _copy_prompts(on, 3)
    differ = 0
    for seed in range(2):
        params = {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 100, "seed": seed}
        got, want = on.generate(prompts, params), off.generate(prompts, params)
        differ += sum(g["output_ids"] != w["output_ids"] for g, w in zip(got, want))
    assert differ <= 1


def _chi_square_p(observed: list[int], expected: list[float]) -> float:
    """p-value of Pearson's statistic, cells with expected < 5 pooled into one."""
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for o, e in zip(observed, expected):
        if e < 5:
            pool_o, pool_e = pool_o + o, pool_e + e
        else:
            obs.append(o)
            exp.append(e)
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    df = len(obs) - 1
    return float(
        torch.special.gammaincc(
            torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)
        )
    )


def test_sampling_follows_the_model_distribution(engines):
    """Three tokens at temperature 1, top_k 3, over 600 seeds: the joint distribution of the 27
    possible continuations matches the one computed from the model's logprobs, and drafts were
    verified along the way (the prompt repeats, so the n-gram drafts are often right)."""
    on, _ = engines
    prompt = on.tokenizer.encode("red green blue red green blue red green blue red green")

    def top3(ids: list[int]) -> dict[int, float]:
        out = on.generate(
            input_ids=ids,
            sampling_params={"temperature": 0, "max_new_tokens": 1},
            return_logprob=True,
            top_logprobs_num=3,
        )
        lps = {tid: lp for lp, tid, _ in out["meta_info"]["output_top_logprobs"][0]}
        z = math.log(sum(math.exp(v) for v in lps.values()))
        return {t: math.exp(v - z) for t, v in lps.items()}

    p1 = top3(prompt)
    p2 = {a: top3(prompt + [a]) for a in p1}
    p3 = {(a, b): top3(prompt + [a, b]) for a in p1 for b in p2[a]}
    cells = {(a, b, c): p1[a] * p2[a][b] * p3[(a, b)][c] for a in p1 for b in p2[a] for c in p3[(a, b)]}
    n = 600
    params = [
        {"temperature": 1.0, "top_k": 3, "max_new_tokens": 3, "ignore_eos": True, "seed": s} for s in range(n)
    ]
    outs = on.generate(input_ids=[prompt] * n, sampling_params=params)
    counts = dict.fromkeys(cells, 0)
    for o in outs:
        key = tuple(o["output_ids"])
        assert key in counts, f"{key}: a continuation outside the top-3 tree"
        counts[key] += 1
    keys = list(itertools.chain(cells))
    p = _chi_square_p([counts[k] for k in keys], [n * cells[k] for k in keys])
    assert p > 1e-3, (p, counts)
    accepted = sum(o["meta_info"]["spec_accept_length"] > 1 for o in outs)
    assert accepted > n // 10, f"only {accepted} requests accepted a draft"


def test_stop_strings_n_and_metrics(engines):
    on, off = engines
    prompt = _copy_prompts(on, 2)[1]  # the JSON edit
    params = {"temperature": 0, "max_new_tokens": 200, "stop": ['"count"']}
    got, want = on.generate(prompt, params), off.generate(prompt, params)
    assert got["text"] == want["text"] and '"count"' not in got["text"]
    assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
    many = on.generate(prompt, {"temperature": 0.8, "max_new_tokens": 60, "n": 3, "seed": 7})
    assert len(many) == 3 and all(m["meta_info"]["spec_verify_ct"] >= 1 for m in many)
    meta = got["meta_info"]
    assert meta["spec_verify_ct"] >= 1 and meta["spec_accept_length"] >= 1.0
    assert "spec_verify_ct" not in want["meta_info"]


def test_server_streams_several_tokens_per_chunk(engines):
    """Through the HTTP server: a streamed chat completion equals the non-streamed one and the
    tokens of an Engine without speculation; accepted drafts arrive as multi-token chunks; a
    constrained request (no drafts) still works; /metrics has the accept-length histogram."""
    _, off = engines
    prompt_text = json.loads((REPO / "benchmarks/data/spec_copy.jsonl").read_text().splitlines()[1])["prompt"]
    messages = [{"role": "user", "content": prompt_text}]
    with ServerProcess(DEFAULT_TEST_ARGS + ["--speculative-algorithm", "NGRAM"]) as srv:
        body = {"model": "default", "messages": messages, "temperature": 0, "max_tokens": 200}
        full = requests.post(srv.url("/v1/chat/completions"), json=body, timeout=120).json()
        text = full["choices"][0]["message"]["content"]
        chunks = []
        with requests.post(
            srv.url("/v1/chat/completions"), json={**body, "stream": True}, stream=True, timeout=120
        ) as r:
            for line in r.iter_lines():
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
                    if delta:
                        chunks.append(delta)
        assert "".join(chunks) == text
        assert len(chunks) < full["usage"]["completion_tokens"] - 5, "drafts should arrive several at a time"
        prompt = off.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert off.generate(prompt, {"temperature": 0, "max_new_tokens": 200})["text"] == text
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        constrained = requests.post(
            srv.url("/v1/chat/completions"),
            json={
                **body,
                "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
            },
            timeout=120,
        ).json()
        assert isinstance(json.loads(constrained["choices"][0]["message"]["content"])["n"], int)
        metrics = requests.get(srv.url("/metrics"), timeout=30).text
        assert "srt:spec_accept_length_bucket" in metrics


def test_tensor_parallel(engines):
    """The ranks draft alike (drafts depend only on the tokens): tp 2 serves the copy workload
    with the tokens of one process without speculation (near-tie rule)."""
    _, off = engines
    prompts = _copy_prompts(off, 3)
    params = {"temperature": 0, "max_new_tokens": 120}
    kw = dict(return_logprob=True, top_logprobs_num=5)
    want = off.generate(prompts, params, **kw)
    eng = Engine(max_total_tokens=16384, log_level="warning", tp_size=2, **SPEC)
    try:
        got = eng.generate(prompts, params, **kw)
    finally:
        eng.shutdown()
    assert sum(_assert_same_or_near_tie(g, w) for g, w in zip(got, want)) <= 1
    assert max(g["meta_info"]["spec_accept_length"] for g in got) > 1.5

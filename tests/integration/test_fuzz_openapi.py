"""The HTTP API fuzzed from its own OpenAPI document (schemathesis, a few hundred cases): no 5xx,
no response outside the document, no request past its deadline, and the server healthy with its
KV pool whole afterwards (benchmarks/fuzz_openapi.py; its docstring has the longer run). Also the
document itself: every POST route that reads a body declares it, and the names are pinned."""

from __future__ import annotations

import os
import sys
import tempfile

import pytest
import requests

from tests.helpers.server import REPO_ROOT, ServerProcess

sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
from fuzz_openapi import FUZZ_SERVER_ARGS, run_fuzz  # noqa: E402

pytest.importorskip("schemathesis", reason="schemathesis is in the [test] extras")


@pytest.fixture(scope="module")
def server():
    with tempfile.TemporaryDirectory(prefix="srt-fuzz-") as cwd:
        with ServerProcess(FUZZ_SERVER_ARGS, env={"PYTHONPATH": REPO_ROOT}, cwd=cwd) as s:
            yield s


def test_document_declares_every_body_and_error(server):
    from srt.entrypoints.http.openapi import NO_BODY

    doc = requests.get(server.url("/openapi.json"), timeout=30).json()
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert {"4XX", "503"} <= set(op["responses"]), (method, path)
            if method == "post" and path not in NO_BODY:
                assert "requestBody" in op, f"POST {path} parses a body the document does not declare"
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert "SmolLM2-135M-Instruct" in chat["model"]["enum"]
    tokenize = doc["paths"]["/tokenize"]["post"]["responses"]["200"]
    assert "Detokenize" in tokenize["links"]


def test_fuzz_every_route(server):
    result = run_fuzz(server.base_url, max_examples=12, phases="fuzzing,stateful", request_timeout_s=60)
    assert result.exit_code == 0, result.output[-6000:]
    assert result.cases >= 200, result.output[-3000:]
    assert not result.problems, result.problems
    assert server.proc.poll() is None


def test_huge_n_is_refused_at_once(server):
    """Regression (found by the fuzzer): n=3134 queued thousands of copies and stalled the server."""
    body = {"model": "default", "prompt": "x", "n": 3134, "max_tokens": 4}
    r = requests.post(server.url("/v1/completions"), json=body, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text

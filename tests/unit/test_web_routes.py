"""The web page's routes on the real app (`create_app`) over a stand-in engine front end: the
page and its files (served without the API key), --disable-web-ui (GET / is 404 again) and the
/dashboard_state body built from the scheduler state and the request histograms."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from srt.entrypoints.http.app import create_app
from srt.managers.tokenizer.lora_registry import LoRARegistry
from srt.managers.tokenizer.metrics import TokenizerMetrics
from srt.server_args import ServerArgs

KEY = "sk-unit"
STATE = {
    "num_running_reqs": 2,
    "num_queued_reqs": 1,
    "token_usage": 0.25,
    "max_total_num_tokens": 1024,
    "available_size": 700,
    "evictable_size": 68,
    "num_generated_tokens": 99,
    "step_histograms": {
        "scheduling_seconds": {"bounds": [0.1], "cumulative": [3], "sum": 0.01, "count": 3},
        "forward_seconds": {"bounds": [0.1], "cumulative": [3], "sum": 0.2, "count": 3},
    },
}


def _client(**args) -> TestClient:
    async def get_internal_state():
        return STATE

    metrics = TokenizerMetrics("tiny")
    metrics.observe_first_token(0.03)
    tm = SimpleNamespace(
        server_args=ServerArgs(**args),
        model_name="tiny",
        scheduler_info={"max_total_num_tokens": 1024, "page_size": 16, "context_len": 2048},
        metrics=metrics,
        num_in_flight=3,
        get_internal_state=get_internal_state,
        lora_registry=LoRARegistry(),
    )
    return TestClient(create_app(tm))


def test_flag_from_the_cli():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert ServerArgs.from_cli_args(parser.parse_args(["--disable-web-ui"])).disable_web_ui
    assert not ServerArgs.from_cli_args(parser.parse_args([])).disable_web_ui


def test_page_and_files():
    c = _client()
    r = c.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in r.headers["content-security-policy"]
    assert 'data-api-key="no"' in r.text
    for name in ("api.js", "markdown.js", "charts.js", "chat.js", "dashboard.js", "main.js", "style.css"):
        assert f"/web/{name}" in r.text
        assert c.get(f"/web/{name}").status_code == 200, name
    assert c.get("/web/missing.js").status_code == 404
    assert c.get("/web/..%2Fapp.py").status_code == 404


def test_disable_web_ui():
    c = _client(disable_web_ui=True)
    assert c.get("/").status_code == 404
    assert c.get("/web/main.js").status_code == 404
    assert c.get("/dashboard_state").status_code == 404
    # with a key, unknown paths answer 401 as any other
    assert _client(disable_web_ui=True, api_key=KEY).get("/").status_code == 401


def test_api_key_guards_data_not_files():
    c = _client(api_key=KEY)
    r = c.get("/")
    assert r.status_code == 200 and 'data-api-key="yes"' in r.text
    assert c.get("/web/chat.js").status_code == 200
    assert c.get("/dashboard_state").status_code == 401
    assert c.get("/v1/models").status_code == 401
    assert c.get("/dashboard_state", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


@pytest.mark.parametrize("api_key", [None, KEY])
def test_dashboard_state(api_key):
    headers = {"Authorization": f"Bearer {KEY}"} if api_key else {}
    body = _client(api_key=api_key).get("/dashboard_state", headers=headers).json()
    s = body["scheduler"]
    assert (s["num_running_reqs"], s["num_queued_reqs"], s["num_generated_tokens"]) == (2, 1, 99)
    assert s["step"]["forward_seconds"] == {"sum": 0.2, "count": 3}
    assert s["cache_hit_rate"] is None  # a figure the state lacks stays null
    ttft = body["requests"]["ttft"]
    assert ttft["count"] == 1 and len(ttft["bounds"]) == len(ttft["cumulative"])
    assert ttft["cumulative"][ttft["bounds"].index(0.05)] == 1 and ttft["cumulative"][0] == 0
    assert body["requests"]["in_flight"] == 3
    cfg = body["config"]
    assert cfg["model"] == "tiny" and cfg["page_size"] == 16 and cfg["api_key"] is bool(api_key)

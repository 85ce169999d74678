"""API keys on the real app (`create_app`) over a stand-in engine front end, walking the whole
route table: without a key only /health, /metrics and the web page's files answer; --api-key opens
every other route; with --admin-api-key the admin routes take only that key (a user key gets 403)
and it opens every route. Also the TLS flag checks and /get_server_info's redaction."""

from __future__ import annotations

import subprocess
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from srt.configs.tls import check_tls_files
from srt.entrypoints.http.app import create_app
from srt.entrypoints.http.auth import ADMIN_PATHS, PUBLIC_PATHS, redacted_args
from srt.entrypoints.http.web_routes import is_public_path
from srt.managers.tokenizer.lora_registry import LoRARegistry
from srt.server_args import ServerArgs
from srt.utils.errors import ConfigError

USER, ADMIN = "sk-user", "sk-admin"


def _app(**args):
    tm = SimpleNamespace(server_args=ServerArgs(**args), model_name="tiny", lora_registry=LoRARegistry())
    return create_app(tm)


def _calls(app) -> list[tuple[str, str]]:
    """(method, concrete path) of every route of the app (its OpenAPI document lists them all)."""
    paths = app.openapi()["paths"]
    out = [(m.upper(), p.replace("{name}", "x")) for p, ops in paths.items() for m in ops]
    return [*out, ("GET", "/openapi.json")]


def _status(client: TestClient, method: str, path: str, key: str | None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return client.request(method, path, headers=headers, json={}).status_code


def _public(path: str) -> bool:
    return path in PUBLIC_PATHS or is_public_path(path)


def test_api_key_covers_every_route_but_health_metrics_and_page_files():
    app = _app(api_key=USER)
    client = TestClient(app, raise_server_exceptions=False)
    calls = _calls(app)
    assert len(calls) >= 25
    for method, path in calls:
        refused = {_status(client, method, path, None), _status(client, method, path, "sk-wrong")}
        if _public(path):
            assert 401 not in refused, (method, path)
        else:
            assert refused == {401}, (method, path)
            assert _status(client, method, path, USER) != 401, (method, path)
    assert _status(client, "GET", "/no/such/route", None) == 401  # unknown paths too


def test_admin_key_guards_admin_routes_and_opens_every_route():
    app = _app(api_key=USER, admin_api_key=ADMIN)
    client = TestClient(app, raise_server_exceptions=False)
    admin_calls = [(m, p) for m, p in _calls(app) if p in ADMIN_PATHS]
    assert {p for _, p in admin_calls} == set(ADMIN_PATHS)
    for method, path in _calls(app):
        assert _status(client, method, path, ADMIN) not in (401, 403), (method, path)
        if path in ADMIN_PATHS:
            assert _status(client, method, path, USER) == 403, (method, path)
            assert _status(client, method, path, None) == 401, (method, path)
    body = client.post("/flush_cache", headers={"Authorization": f"Bearer {USER}"}).json()
    assert body["error"]["code"] == "admin_api_key_required"


def test_admin_key_alone_leaves_user_routes_open():
    client = TestClient(_app(admin_api_key=ADMIN), raise_server_exceptions=False)
    assert _status(client, "GET", "/version", None) == 200
    assert _status(client, "POST", "/abort_request", None) == 401
    assert _status(client, "GET", "/metrics", None) != 401


def test_keys_are_compared_in_constant_time():
    import inspect

    from srt.entrypoints.http import auth

    assert "hmac.compare_digest" in inspect.getsource(auth._matches)


def test_server_info_never_echoes_keys():
    out = redacted_args(ServerArgs(api_key=USER, admin_api_key=ADMIN))
    assert out["api_key"] == out["admin_api_key"] == "<redacted>"
    assert redacted_args(ServerArgs())["api_key"] is None


@pytest.fixture(scope="module")
def cert_pair(tmp_path_factory) -> tuple[str, str]:
    d = tmp_path_factory.mktemp("tls")
    key, cert = str(d / "key.pem"), str(d / "cert.pem")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
         "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return key, cert


def test_tls_flags_are_checked_at_start(cert_pair, tmp_path):
    key, cert = cert_pair
    check_tls_files(None, None)
    check_tls_files(key, cert)
    with pytest.raises(ConfigError, match="--ssl-certfile is missing"):
        check_tls_files(key, None)
    with pytest.raises(ConfigError, match="is not a file"):
        check_tls_files(str(tmp_path / "none.pem"), cert)
    with pytest.raises(ConfigError, match="PEM pair"):
        check_tls_files(cert, cert)  # a certificate where the key should be

"""HTTPS and keys on a real server: --ssl-keyfile / --ssl-certfile with a self-signed certificate
made here (openssl), --api-key and --admin-api-key. The openai client talks HTTPS with the key;
plain HTTP on the port gets nowhere; /health needs no key; the admin routes take only the admin
key; /get_server_info never shows a key."""

from __future__ import annotations

import shutil
import ssl
import subprocess
import time

import httpx
import pytest
import requests

from tests.helpers.server import DEFAULT_TEST_ARGS, ServerProcess

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")

USER, ADMIN = "sk-user-key", "sk-admin-key"


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    key, cert = str(d / "key.pem"), str(d / "cert.pem")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
         "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    args = [*DEFAULT_TEST_ARGS, "--ssl-keyfile", key, "--ssl-certfile", cert]
    server = ServerProcess([*args, "--api-key", USER, "--admin-api-key", ADMIN]).launch()
    url = f"https://127.0.0.1:{server.port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.proc.poll() is None, server.log_tail()
            try:
                if requests.get(url + "/health", verify=cert, timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                assert time.monotonic() < deadline, server.log_tail()
                time.sleep(0.5)
        yield server, url, cert
    finally:
        server.stop()


def _get(url: str, cert: str, path: str, key: str | None, method: str = "GET") -> requests.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.request(method, url + path, headers=headers, verify=cert, timeout=60)


def test_openai_client_over_https_with_the_key(tls_server):
    _, url, cert = tls_server
    verify = ssl.create_default_context(cafile=cert)
    c = openai.OpenAI(base_url=url + "/v1", api_key=USER, http_client=httpx.Client(verify=verify))
    out = c.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0
    )
    assert out.choices[0].message.content
    bad = openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong", http_client=httpx.Client(verify=verify))
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_plain_http_and_unverified_certificates_get_nowhere(tls_server):
    server, url, _ = tls_server
    with pytest.raises(requests.RequestException):
        requests.get(f"http://127.0.0.1:{server.port}/health", timeout=5).raise_for_status()
    with pytest.raises(requests.exceptions.SSLError):
        requests.get(url + "/health", timeout=5)  # the system CAs do not know a self-signed cert


def test_keys_per_route(tls_server):
    _, url, cert = tls_server
    assert _get(url, cert, "/health", None).status_code == 200
    assert _get(url, cert, "/metrics", None).status_code == 200
    assert _get(url, cert, "/get_model_info", None).status_code == 401
    assert _get(url, cert, "/get_model_info", USER).status_code == 200
    assert _get(url, cert, "/flush_cache", USER, "POST").status_code == 403
    assert _get(url, cert, "/flush_cache", ADMIN, "POST").status_code == 200
    info = _get(url, cert, "/get_server_info", USER).json()
    assert info["api_key"] == info["admin_api_key"] == "<redacted>"
    assert USER not in str(info) and ADMIN not in str(info)

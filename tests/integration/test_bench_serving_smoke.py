"""bench_serving end to end: against srt's real server, and against a fake streaming server whose
timings are known (so the measured TTFT/TPOT, the failure count and the concurrency cap can be
checked)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from srt.bench_serving import benchmark
from srt.benchmark.datasets import DatasetRow
from srt.benchmark.metrics import parse_result_block
from tests.helpers.fake_openai_server import FakeOpenAIServer, free_port

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def _rows(n: int, output_len: int = 8) -> list[DatasetRow]:
    return [DatasetRow(f"prompt number {i} " + "word " * 20, 23, output_len) for i in range(n)]


def _run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("backend", ["srt", "openai", "openai-chat"])
def test_measures_known_timings_and_counts_failures(backend):
    ttft, itl, n_out = 0.05, 0.01, 8
    with FakeOpenAIServer(ttft_s=ttft, itl_s=itl, fail_every=4) as srv:
        res = _run(
            benchmark(
                _rows(7, n_out),
                backend=backend,
                base_url=srv.base_url,
                warmup_requests=1,
                flush_cache=True,
                max_concurrency=4,
            )
        )
        bodies = srv.requests
        assert srv.flush_count == 1
    m = res.metrics
    # 8 requests reached the server (1 warmup + 7); requests 4 and 8 failed: warmup ok, 2 failures counted
    assert len(bodies) == 8
    assert (m.completed, m.failed) == (5, 2)
    assert res.errors and "HTTP 500" in res.errors[0]
    assert m.total_output == 5 * n_out
    expected_text = "".join(f"w{j} " for j in range(n_out))
    assert all(o.generated_text == expected_text for o in res.outputs if o.success)
    assert 0.9 * ttft * 1000 <= m.median_ttft_ms < ttft * 1000 + 40  # sleep() granularity
    assert 0.9 * itl * 1000 <= m.median_tpot_ms < itl * 1000 + 15
    assert itl * 1000 <= m.median_itl_ms < itl * 1000 + 15
    assert m.p99_ttft_ms >= m.median_ttft_ms
    body = bodies[-1]
    if backend == "srt":
        assert body["sampling_params"] == {"temperature": 0.0, "max_new_tokens": n_out, "ignore_eos": True}
        assert body["stream"] is True
    else:
        assert body["max_tokens"] == n_out and body["ignore_eos"] is True and body["model"] == "fake-model"
    assert bodies[0].get("max_tokens", bodies[0].get("sampling_params", {}).get("max_new_tokens")) == n_out


@pytest.mark.parametrize(
    "backend,cumulative", [("srt", True), ("srt", False), ("sglang", True), ("sglang", False)]
)
def test_concurrency_cap_and_native_stream_text(backend, cumulative):
    with FakeOpenAIServer(ttft_s=0.03, itl_s=0.01, cumulative_native_text=cumulative) as srv:
        res = _run(
            benchmark(
                _rows(6, 5), backend=backend, base_url=srv.base_url, max_concurrency=2, warmup_requests=0
            )
        )
    m = res.metrics
    assert m.completed == 6 and m.total_output == 30
    assert all(o.generated_text == "w0 w1 w2 w3 w4 " for o in res.outputs)
    e2e = 0.03 + 4 * 0.01
    assert m.duration_s >= 3 * e2e  # 6 requests, 2 at a time
    assert m.concurrency <= 2.0 + 1e-6


def test_ttft_is_the_first_token_even_when_its_text_is_empty():
    """A token that decodes to nothing yet (half a UTF-8 character; an id past the tokenizer's
    vocabulary, as random weights give) is still the first token: TTFT does not wait for text."""
    ttft, itl = 0.05, 0.04
    with FakeOpenAIServer(ttft_s=ttft, itl_s=itl, empty_tokens=3) as srv:
        res = _run(benchmark(_rows(2, 6), backend="vllm", base_url=srv.base_url, warmup_requests=0))
    m = res.metrics
    assert m.completed == 2 and m.total_output == 12
    assert ttft * 1000 <= m.median_ttft_ms < (ttft + itl) * 1000  # not after the 3 empty chunks
    assert all(o.generated_text == "w3 w4 w5 " for o in res.outputs)


def test_poisson_rate_spreads_arrivals():
    with FakeOpenAIServer(ttft_s=0.0, itl_s=0.0) as srv:
        res = _run(
            benchmark(
                _rows(10, 2),
                backend="openai",
                base_url=srv.base_url,
                request_rate=20.0,
                seed=0,
                warmup_requests=0,
            )
        )
    sends = sorted(o.send_time for o in res.outputs)
    assert res.metrics.completed == 10
    assert sends[-1] - sends[0] > 0.1  # mean span 9/20 s; all-at-once would be ~0


def test_unreachable_server_is_a_counted_failure():
    url = f"http://127.0.0.1:{free_port()}"
    res = _run(benchmark(_rows(3), backend="openai", base_url=url, warmup_requests=0))
    assert res.metrics.completed == 0 and res.metrics.failed == 3
    assert "ClientConnectorError" in res.errors[0]


# ---------------- srt's own server ----------------
def _server_available() -> bool:
    return (REPO / "srt" / "launch_server.py").exists() and (
        REPO / "srt" / "entrypoints" / "http_server.py"
    ).exists()


def _wait_health(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError("server did not become healthy")


@pytest.mark.skipif(not _server_available(), reason="srt's HTTP server is not in the tree yet")
def test_bench_serving_against_srt_server(tmp_path):
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115
    server = subprocess.Popen(
        [sys.executable, "-m", "srt.launch_server", "--port", str(port), "--max-total-tokens", "4096"],
        stdout=log, stderr=subprocess.STDOUT, env=ENV, cwd=REPO,
    )  # fmt: skip
    out, png = tmp_path / "runs.jsonl", tmp_path / "plot.png"
    try:
        _wait_health(base_url, server, timeout=120)
        n = 4
        cmd = [
            sys.executable, "-m", "srt.bench_serving", "--backend", "srt", "--port", str(port),
            "--dataset-name", "random", "--num-prompts", str(n), "--random-input-len", "32",
            "--random-output-len", "8", "--random-range-ratio", "0.5", "--max-concurrency", "2",
            "--flush-cache", "--disable-tqdm", "--output-file", str(out), "--plot", str(png),
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=REPO, timeout=180)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        parsed = parse_result_block(proc.stdout)
        requested = int(proc.stdout.split("#Output tokens:")[1].split()[0])
        assert parsed["Backend"] == "srt" and parsed["Max request concurrency"] == 2
        assert parsed["Successful requests"] == n and parsed["Failed requests"] == 0, proc.stdout
        assert parsed["Total generated tokens"] == requested  # ignore_eos: every requested token
        assert parsed["Output token throughput (tok/s)"] > 0 and parsed["Median TTFT (ms)"] > 0
        rec = json.loads(out.read_text().splitlines()[-1])
        assert rec["completed"] == n and rec["total_output"] == requested
        assert png.stat().st_size > 10_000

        # the OpenAI routes of the same server, in-process (no second tokenizer load)
        for backend in ("openai", "openai-chat"):
            # a route's first request pays its lazy imports while the tokens are produced, which can
            # merge a short stream into one chunk; the streaming assertion is about warm requests,
            # long enough that a consumer stalled by a busy machine cannot merge a whole stream
            _run(benchmark(_rows(1, 2), backend=backend, base_url=base_url, max_concurrency=1))
            res = _run(benchmark(_rows(3, 48), backend=backend, base_url=base_url, max_concurrency=3))
            assert (res.metrics.completed, res.metrics.failed) == (3, 0), res.errors
            assert res.metrics.total_output == 3 * 48
            assert all(len(o.chunk_times) >= 2 for o in res.outputs)  # streamed, not one blob
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()

"""Run SGLang's router (the ``sglang-router`` package: ``python -m sglang_router.launch_router``)
in front of srt servers, for integration tests and benchmarks.

    with RouterProcess([a.base_url, b.base_url], policy="round_robin") as router:
        requests.post(router.url("/generate"), json=...)

`router_unavailable()` says why the router cannot run here (None when it can). The router listens
on a free loopback port (and its Prometheus exporter on another); `start` waits until it lists
every worker as healthy. Health checks run every second and one failure marks a worker down, so
a killed worker leaves the rotation at once.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
import time

import requests

from tests.helpers.server import free_port

_MODULE = "sglang_router.launch_router"


@functools.cache
def router_unavailable() -> str | None:
    """Why the router cannot run on this machine, or None."""
    try:
        proc = subprocess.run(
            [sys.executable, "-m", _MODULE, "--help"], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"the sglang-router launcher did not run: {e!r}"
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return f"sglang-router is not usable here (pip install sglang-router): {tail[0]}"
    return None


class RouterProcess:
    def __init__(self, worker_urls: list[str], policy: str = "round_robin", extra: list[str] | None = None):
        self.worker_urls = list(worker_urls)
        self.policy = policy
        self.extra = list(extra or [])
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="sglang-router-", suffix=".log", delete=False)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        return self.base_url + path

    def start(self, timeout_s: float = 120.0) -> RouterProcess:
        cmd = [
            sys.executable, "-m", _MODULE,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--policy", self.policy,
            "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
            "--log-level", "warn",
            *(["--worker-urls", *self.worker_urls] if self.worker_urls else []),
            *self.extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        self.wait_workers(self.worker_urls, timeout_s)
        return self

    def workers(self) -> list[dict]:
        return requests.get(self.url("/workers"), timeout=10).json()["workers"]

    def wait_workers(self, urls: list[str], timeout_s: float = 60.0) -> None:
        """Wait until the router lists every one of ``urls`` as healthy."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                healthy = {w["url"] for w in self.workers() if w.get("is_healthy")}
                if set(urls) <= healthy:
                    return
            except (requests.RequestException, ValueError, KeyError):
                pass
            time.sleep(0.3)
        raise TimeoutError(f"router did not list {urls} as healthy:\n{self.log_tail()}")

    def add_worker(self, url: str, timeout_s: float = 60.0) -> None:
        """Add a worker through the router's API (POST /workers) and wait until it is healthy."""
        r = requests.post(self.url("/workers"), json={"url": url}, timeout=30)
        assert r.status_code in (200, 201, 202), r.text
        self.wait_workers([*self.worker_urls, url], timeout_s)
        self.worker_urls.append(url)

    def log_tail(self, n: int = 40) -> str:
        with open(self._log.name, errors="replace") as f:
            return "\n".join(f.read().splitlines()[-n:])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        if os.path.exists(self._log.name):
            os.unlink(self._log.name)

    def __enter__(self) -> RouterProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

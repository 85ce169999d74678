"""Run the real server (``python -m srt.launch_server``) as a subprocess for integration tests.

    with ServerProcess(["--max-total-tokens", "16384"]) as server:
        requests.get(server.url("/health"))

The server listens on a free loopback port; `start` waits for ``GET /health`` == 200 (failing
fast, with the server's log tail, if the process exits); `stop` sends SIGTERM, waits, and kills
whatever is left of the process tree. Logs go to a temporary file (``server.log_text()``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import psutil
import requests

from tests.helpers import overlap

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# a small KV pool keeps start-up fast and memory low on CI machines
DEFAULT_TEST_ARGS = ["--max-total-tokens", "16384", "--log-level", "warning"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(
        self,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
        startup_timeout_s: float = 300.0,
        cwd: str | None = None,
    ) -> None:
        self.args = list(DEFAULT_TEST_ARGS if args is None else args)
        self.port = free_port()
        self.env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
        self.startup_timeout_s = startup_timeout_s
        self.cwd = cwd or REPO_ROOT  # the server's working directory (relative paths it writes)
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="srt-server-", suffix=".log", delete=False)

    # ------------------------------------------------------------------ life cycle
    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        return self.base_url + path

    def launch(self) -> ServerProcess:
        """Start the process without waiting for it to be ready."""
        cmd = [
            sys.executable,
            "-m",
            "srt.launch_server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *overlap.server_args(self.args),
        ]
        self.proc = subprocess.Popen(
            cmd, cwd=self.cwd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT
        )
        return self

    def start(self) -> ServerProcess:
        self.launch()
        self.wait_ready()
        return self

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with code {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(self.url("/health"), timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"server not ready after {self.startup_timeout_s} s:\n{self.log_tail()}")

    def wait_exit(self, timeout_s: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> int | None:
        """Signal the server, wait for it, then kill anything left of its tree. Returns its exit code."""
        if self.proc is None:
            return None
        tree = self.process_tree()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        code = self.wait_exit(timeout_s)
        if code is None:
            self.proc.kill()
            code = self.wait_exit(5)
        for p in tree:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        return code

    def process_tree(self) -> list[psutil.Process]:
        """The server process and all its descendants (alive now)."""
        if self.proc is None or self.proc.poll() is not None:
            return []
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def children(self) -> list[psutil.Process]:
        return self.process_tree()[1:]

    # ------------------------------------------------------------------ logs
    def log_text(self) -> str:
        with open(self._log.name, errors="replace") as f:
            return f.read()

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        os.unlink(self._log.name)


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those of ``procs`` still running (zombies count as gone)."""
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait until every process in ``procs`` is gone; return those still alive after the timeout."""
    deadline = time.monotonic() + timeout_s
    left = alive(procs)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = alive(left)
    return left

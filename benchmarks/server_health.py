"""Starting servers for a benchmark, standard library only: a free port, and waiting until a
server's health route answers (shared by ``compare_servers.py`` and ``gpu/serving.py``)."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, n: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])


def wait_healthy(
    url: str, proc: subprocess.Popen, timeout_s: float, log: Path | None = None, interval_s: float = 1.0
) -> float:
    """Seconds until ``GET url`` answers 200; raises if the server exits or the time runs out
    (with the tail of ``log``, when given)."""
    tail = (lambda: f"; log tail:\n{log_tail(log)}") if log is not None else (lambda: "")  # noqa: E731
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode}{tail()}")
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return time.monotonic() - t0
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(interval_s)
    raise RuntimeError(f"no healthy answer from {url} in {timeout_s:.0f} s{tail()}")

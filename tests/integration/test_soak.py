"""benchmarks/soak.py, 160 requests (fewer than --quick) against a real server it starts: hostile
requests (disconnects,
aborts, deadlines, streams, n>1, stop strings, shared prefixes), then every outcome well-formed,
the KV pool, radix locks and request rows back to idle, RSS growth within 10%, server healthy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_quick_soak_passes(tmp_path):
    result = tmp_path / "soak.json"
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "soak.py"),
        "--num-requests",
        "160",
        "--max-total-tokens",
        "4096",
        # the 5% bound is the full soak's (RSS sampled after 1,000 requests); after 30 requests the
        # allocators' one-time growth (measured: 1-4% here) is a larger share of the total
        "--max-rss-growth",
        "0.10",
        "--result-json",
        str(result),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    got = json.loads(result.read_text())
    assert got["requests"] == 160 and got["violations"] == 0 and got["idle check"] == "ok"
    kinds = got["outcomes"]
    # the hostile actions really happened and were answered as such
    assert kinds.get("disconnected", 0) > 0 and kinds.get("aborted", 0) > 0 and kinds["complete"] > 50
    if got["deadlines"] == "supported":
        assert kinds.get("timeout", 0) > 0

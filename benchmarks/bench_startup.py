"""Server start-up: seconds from launch to a healthy ``/health``, one source tree or two alternated.

Each start runs ``python -m srt.launch_server`` from a tree (its own working directory, so its
own ``srt``), polls ``/health`` until 200, then reads the scheduler child (the child with the
most CPU time) before stopping the server: its CPU seconds and its RSS at that moment. With
``--trees A,B`` the two trees alternate, the order swapped every round, so a drift of the host
falls on both; the summary gives each tree's medians and A's median ready time over B's.

    python benchmarks/bench_startup.py --rounds 6
    git worktree add /tmp/base <commit> && ln -s $PWD/.venv /tmp/base/.venv
    python benchmarks/bench_startup.py --trees /tmp/base,. --rounds 6
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import cpu_model, format_table  # noqa: E402
from benchmarks.server_health import free_port, wait_healthy  # noqa: E402


def start_once(tree: str, server_args: list[str], timeout_s: float = 300.0) -> dict:
    """One start of the server in ``tree``: ready seconds, the scheduler's CPU seconds and RSS."""
    port = free_port()
    argv = [sys.executable, "-m", "srt.launch_server", "--port", str(port), *server_args]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", proc, timeout_s, interval_s=0.02)
        ready_s = time.perf_counter() - t0
        children = psutil.Process(proc.pid).children(recursive=True)
        scheduler = max(children, key=lambda p: sum(p.cpu_times()[:2]))
        cpu = scheduler.cpu_times()
        return {
            "ready_s": ready_s,
            "cpu_s": cpu.user + cpu.system,
            "rss_mib": scheduler.memory_info().rss / 2**20,
        }
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", default=".", help="One source tree, or two (comma list) to alternate.")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--server-args", default="--max-total-tokens 16384 --log-level warning")
    args = ap.parse_args()
    trees = [str(Path(t).resolve()) for t in args.trees.split(",")]
    server_args = shlex.split(args.server_args)
    runs: dict[str, list[dict]] = {t: [] for t in trees}
    for i in range(args.rounds):
        for tree in trees if i % 2 == 0 else trees[::-1]:
            runs[tree].append(start_once(tree, server_args))
    print(f"CPU: {cpu_model()}; server args: {args.server_args}; {args.rounds} starts per tree")
    rows = []
    for tree, rs in runs.items():
        ready = [r["ready_s"] for r in rs]
        rows.append(
            [
                tree,
                ", ".join(f"{x:.2f}" for x in ready),
                f"{statistics.median(ready):.2f}",
                f"{statistics.median(r['cpu_s'] for r in rs):.2f}",
                f"{statistics.median(r['rss_mib'] for r in rs):.0f}",
            ]
        )
    print(format_table(["tree", "ready s", "median", "scheduler CPU s", "scheduler RSS MiB"], rows))
    if len(trees) == 2:
        a, b = (statistics.median(r["ready_s"] for r in runs[t]) for t in trees)
        print(f"ready time, {trees[0]} / {trees[1]}: {a / b:.2f}x")


if __name__ == "__main__":
    main()

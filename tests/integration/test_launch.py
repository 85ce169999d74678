"""The launch function's process guarantees: a child failing at start-up fails the launch with its
message (no hang, nothing left behind), and children die with a SIGKILLed parent (no orphans)."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from tests.helpers.server import DEFAULT_TEST_ARGS, REPO_ROOT, ServerProcess, wait_gone


def test_child_failing_at_startup_fails_the_launch():
    from srt.server_args import ServerArgs
    from srt.utils.hf_tokenizer import tokenizer_source

    srv = ServerProcess(
        [
            *DEFAULT_TEST_ARGS,
            "--model-path",
            "/nonexistent/model-dir",
            "--tokenizer-path",
            tokenizer_source(ServerArgs()),
        ]
    )
    srv.launch()
    t0 = time.monotonic()
    seen: dict[int, psutil.Process] = {}
    while srv.proc.poll() is None and time.monotonic() - t0 < 120:
        seen.update({p.pid: p for p in srv.process_tree()})
        time.sleep(0.2)
    code = srv.wait_exit(5)
    try:
        assert code == 1, srv.log_tail()
        log = srv.log_text()
        assert "scheduler process failed to start" in log and "/nonexistent/model-dir" in log
        assert len(seen) >= 2  # the scheduler was really started
        assert wait_gone(list(seen.values()), 5.0) == []
    finally:
        srv.stop()


@pytest.mark.parametrize("launched_from", ["main", "thread"])
def test_children_die_with_a_sigkilled_parent(launched_from):
    """No orphans: the parent-death signal (or, when launched from a worker thread, the children's
    getppid() watchdog) takes the children down when the parent is SIGKILLed."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.launch_and_wait", launched_from],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        children = [psutil.Process(int(pid)) for pid in line.split()]
        assert len(children) == 2, line
        time.sleep(1.5)  # the launching thread is gone by now: the children must still be alive
        assert len(wait_gone(children, 0.0)) == 2
        proc.kill()
        proc.wait(timeout=10)
        assert wait_gone(children, 5.0) == []
    finally:
        proc.kill()

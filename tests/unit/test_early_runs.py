"""tests/helpers/early_runs.py: queued runs start at low priority in order, a test gets their exit
status and output, a run never queued runs when asked for, a queued one asked for jumps the queue
at normal priority, a run past its wait is killed, and closing kills what is still going."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import early_runs
from tests.helpers.early_runs import Command, EarlyRuns

pytestmark = pytest.mark.no_lane(
    "checks the scheduling policy of the children it starts, which a low-priority lane would change"
)

REPORT = "import os, sys; print(os.sched_getscheduler(0), os.environ.get('SRT_TEST_EARLY_RUN')); sys.exit(int(sys.argv[1]))"
IDLE, OTHER = os.SCHED_IDLE, os.SCHED_OTHER


def _py(code: str, *args: str, timeout: float = 60.0) -> Command:
    return Command([sys.executable, "-c", code, *args], timeout=timeout)


def _started(runs: EarlyRuns, key: str):
    deadline = time.monotonic() + 10
    while runs._runs[key].proc is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return runs._runs[key].proc


def _policy_becomes(pid: int, policy: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if os.sched_getscheduler(pid) == policy:
            return True
        time.sleep(0.01)
    return False


def test_queued_runs_start_idle_in_order_and_give_their_status_and_output():
    runs = EarlyRuns()
    code = "import sys, time; time.sleep(2); print('out'); print('err', file=sys.stderr); sys.exit(3)"
    try:
        runs.schedule([("a", _py(code)), ("b", _py(REPORT, "0"))])
        proc = _started(runs, "a")
        assert proc is not None and _policy_becomes(proc.pid, IDLE)
        assert runs._runs["b"].proc is None  # one at a time
        a = runs.result("a", _py("raise SystemExit(9)"))  # the queued command runs, not this one
        b = runs.result("b", _py("raise SystemExit(9)"))
    finally:
        runs.close()
    assert (a.returncode, a.stdout, a.stderr) == (3, "out\n", "err\n")
    assert b.returncode == 0 and b.stdout.split()[1] == "1"  # a child knows it is one


def test_waiting_on_a_run_gives_every_thread_of_its_group_the_normal_policy_back(tmp_path):
    # at SCHED_IDLE the run may get no CPU for a long while (the lane's workers, promoted, hold
    # both cores), so it lives until the test says so rather than for a fixed time
    done = tmp_path / "done"
    spawn = (
        "import os, subprocess, sys, time\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "while not os.path.exists(sys.argv[1]):\n"
        "    time.sleep(0.05)\n"
        "g.kill()\n"
        "g.wait()\n"
    )
    runs = EarlyRuns()
    try:
        runs.schedule([("a", _py(spawn, str(done), timeout=600))])
        proc = _started(runs, "a")
        assert proc is not None and _policy_becomes(proc.pid, IDLE)
        deadline, grandchildren = time.monotonic() + 300, []
        while not grandchildren and time.monotonic() < deadline:
            grandchildren = [int(p.name) for p in Path("/proc").glob("[0-9]*") if _ppid(p) == proc.pid]
            time.sleep(0.05)
        assert grandchildren and all(os.sched_getscheduler(g) == IDLE for g in grandchildren)
        waiter = threading.Thread(target=runs.wait, args=("a",))
        waiter.start()
        assert _policy_becomes(proc.pid, OTHER)
        assert all(_policy_becomes(g, OTHER) for g in grandchildren)
        done.touch()
        waiter.join()
    finally:
        done.touch()
        runs.close()


def _ppid(proc_dir: Path) -> int:
    try:
        return int((proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def test_a_run_never_queued_runs_when_asked_at_normal_priority():
    runs = EarlyRuns()
    try:
        out = runs.result("x", _py(REPORT, "0"))
    finally:
        runs.close()
    assert out.returncode == 0 and out.stdout.split() == [str(OTHER), "1"]


def test_a_queued_run_asked_for_jumps_the_queue_at_normal_priority():
    runs = EarlyRuns()
    try:  # the first run holds the queue, so the second is still queued when asked for
        runs.schedule([("slow", _py("import time; time.sleep(30)")), ("next", _py(REPORT, "0"))])
        t = time.monotonic()
        out = runs.result("next", _py("raise SystemExit(9)"))
        took = time.monotonic() - t
    finally:
        runs.close()
    assert out.stdout.split()[0] == str(OTHER) and took < 20


def test_a_run_past_its_wait_is_killed_and_says_so():
    runs = EarlyRuns()
    try:
        out = runs.result("hang", _py("import time; time.sleep(60)", timeout=0.5))
    finally:
        runs.close()
    assert out.returncode < 0 and "killed after 0 s of waiting" in out.stderr


def test_close_kills_the_running_run_and_drops_the_queue():
    runs = EarlyRuns()
    runs.schedule([("slow", _py("import time; time.sleep(60)")), ("never", _py("pass"))])
    proc = _started(runs, "slow")
    runs.close()
    assert proc is not None and proc.wait(10) < 0
    assert runs._runs["never"].proc is None


class _Item:
    def __init__(self, *marks):
        self._marks = [pytest.mark.early_run(*m).mark for m in marks]

    def iter_markers(self, name):
        return (m for m in self._marks if m.name == name)


def test_requested_runs_follow_the_items_each_key_once_and_drop_nothing_to_run():
    a, b = _py("pass"), _py("pass")
    items = [
        _Item(("a", lambda: a)),
        _Item(("none", lambda: None)),
        _Item(("b", lambda: b), ("a", lambda: pytest.fail("a key is asked once"))),
    ]
    assert early_runs.requested(items) == [("a", a), ("b", b)]


def test_children_and_collect_only_start_nothing(monkeypatch, pytestconfig):
    monkeypatch.setattr(pytestconfig.option, "collectonly", False)
    monkeypatch.delenv(early_runs.CHILD_ENV, raising=False)
    assert early_runs.enabled(pytestconfig)
    monkeypatch.setenv(early_runs.CHILD_ENV, "1")
    assert not early_runs.enabled(pytestconfig)
    monkeypatch.delenv(early_runs.CHILD_ENV)
    monkeypatch.setattr(pytestconfig.option, "collectonly", True)
    assert not early_runs.enabled(pytestconfig)

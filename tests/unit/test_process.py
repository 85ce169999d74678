"""ProcessSupervisor: start-up failures raise LaunchError with the child's message (never hang),
late deaths are reported once, stop() leaves nothing."""

from __future__ import annotations

import threading
import time

import psutil
import pytest

from srt.utils.errors import LaunchError
from srt.utils.process import ProcessSupervisor
from tests.helpers import child_targets as t


@pytest.fixture
def sup():
    s = ProcessSupervisor(log_level="error")
    yield s
    s.stop(timeout_s=2)


def test_ready_messages_are_returned(sup):
    sup.start("a", t.ready_then_wait, ("A",))
    sup.start("b", t.ready_then_wait, ("B",))
    ready = sup.wait_ready(timeout_s=60)
    assert ready == {"a": {"status": "ready", "tag": "A"}, "b": {"status": "ready", "tag": "B"}}
    procs = [psutil.Process(pid) for pid in sup.pids().values()]
    sup.stop(timeout_s=2)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs)


def test_exception_in_child_fails_the_launch_with_its_traceback(sup):
    sup.start("scheduler", t.raise_error, ("weights are missing",))
    with pytest.raises(LaunchError) as e:
        sup.wait_ready(timeout_s=60)
    assert e.value.process_name == "scheduler"
    assert "ValueError: weights are missing" in str(e.value) and "Traceback" in str(e.value)


def test_silent_death_fails_the_launch_instead_of_hanging(sup):
    sup.start("ok", t.ready_then_wait, ("x",))
    sup.start("detokenizer", t.exit_silently, (3,))
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match="exited with code 3"):
        sup.wait_ready()  # no timeout: liveness alone must end the wait
    assert time.monotonic() - t0 < 30


def test_a_child_killed_by_sigkill_names_the_out_of_memory_killer(sup):
    sup.start("scheduler", t.kill_self, ())
    with pytest.raises(LaunchError, match=r"exited with code -9 .*out-of-memory killer"):
        sup.wait_ready(timeout_s=60)


def test_start_up_timeout(sup):
    sup.start("slow", t.hang, (60.0,))
    with pytest.raises(LaunchError, match="not ready after"):
        sup.wait_ready(timeout_s=1.0)


def test_late_death_is_reported_once(sup):
    sup.start("scheduler", t.ready_then_exit, (7,))
    sup.start("detokenizer", t.ready_then_wait, ("d",))
    sup.wait_ready(timeout_s=60)
    calls: list[tuple[str, int | None]] = []
    done = threading.Event()

    def on_death(name: str, code: int | None) -> None:
        calls.append((name, code))
        done.set()

    sup.start_monitor(on_death)
    assert done.wait(30)
    sup.stop(timeout_s=2)  # a stop after the death is not reported again
    time.sleep(0.2)
    assert calls == [("scheduler", 7)]

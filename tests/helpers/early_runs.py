"""Child processes started as soon as collection ends, one after another at low priority, so that
they run on the cores the main run leaves idle (server start-ups, round trips over sockets, waits)
instead of adding their time to its own: the lowered kernel runs (tests/unit/test_isa_lowering.py)
and the transformers references of the exactness modules (``hf_reference.warm_command``).

Low priority is Linux's SCHED_IDLE policy (niceness 19 where it is missing): such a process runs
only on a core no other process wants, and gives it up at once when one does. Niceness alone is
not enough: a niced process still gets its slices, and a slice taken from one of the main run's
OpenMP threads stalls every op of the other at its barrier (transformers' forward of the default
model, thousands of small ops, ran 10x slower beside niced kernel tests).

A test, or a module through ``pytestmark``, asks for one with the marker
``early_run(key, command)``: ``command()`` gives the child's ``Command``, or None where there is
nothing to run (the test would skip; the references are cached). tests/conftest.py queues the runs
of the selected items in collection order and starts them (``schedule``); the test then takes the
run's ``Outcome`` with ``result(key, command)`` (or only waits for it with ``wait(key)``): it waits
while the run goes on, at normal priority from then on, and runs it there and then if it was never
started. A run is judged only by the test that asked for it; one still
going when the session ends is killed with its process group.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

# the queued runs' launcher: SCHED_IDLE (else niceness 19), then the command
_IDLE_EXEC = (
    "import os, sys\n"
    "try:\n"
    "    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
    "except (AttributeError, OSError):\n"
    "    os.nice(19)\n"
    "os.execvp(sys.argv[1], sys.argv[1:])"
)
# A run gets a process group of its own (killed as one), in this session: with Linux's autogroup
# scheduling (sched_autogroup_enabled) every session is a group that the CPU is shared between
# fairly, so in a new session of its own a SCHED_IDLE run took half the cores from the main run
# (an exactness test of the default model 2.7x slower beside the unit lane), where in the same
# session it takes only what the session leaves idle.
_OWN_GROUP: dict = {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}
CHILD_ENV = "SRT_TEST_EARLY_RUN"  # set in every early run: a child pytest starts none of its own
MARKER = "early_run"


@dataclass(frozen=True)
class Command:
    argv: list[str]
    env: dict[str, str] | None = None
    cwd: str | None = None
    timeout: float = 900.0  # from when a test starts waiting on it


@dataclass(frozen=True)
class Outcome:
    returncode: int
    stdout: str
    stderr: str


class _Run:
    def __init__(self, key: str, command: Command) -> None:
        self.key, self.command = key, command
        self.proc: subprocess.Popen | None = None
        self.out = tempfile.TemporaryFile()
        self.err = tempfile.TemporaryFile()

    def start(self, idle: bool) -> None:
        env = {**(self.command.env or os.environ), CHILD_ENV: "1"}
        argv = [sys.executable, "-c", _IDLE_EXEC, *self.command.argv] if idle else self.command.argv
        self.proc = subprocess.Popen(
            argv, env=env, cwd=self.command.cwd, stdout=self.out, stderr=self.err, **_OWN_GROUP
        )

    def finish(self, timeout: float) -> Outcome:
        assert self.proc is not None
        if self.proc.poll() is None:
            _normal_priority(self.proc.pid)  # from now on the suite waits on it
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            code = self.proc.wait()
            self.err.write(f"\n[early run {self.key!r} killed after {timeout:.0f} s of waiting]\n".encode())
        return Outcome(code, _read(self.out), _read(self.err))

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _normal_priority(pgid: int) -> None:
    """Every thread of process group ``pgid`` back to the normal policy at this process's niceness,
    where the OS allows it (leaving SCHED_IDLE it does; undoing niceness 19 needs CAP_SYS_NICE)."""
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            tids = [int(task.name) for task in (stat.parent / "task").iterdir()]
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
        for tid in tids:
            try:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            except (AttributeError, OSError):
                pass
            try:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
            except OSError:
                pass


def _read(f) -> str:
    f.seek(0)
    return f.read().decode(errors="replace")


class EarlyRuns:
    """The queue of one pytest session's early runs and the thread that works through it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queued: list[_Run] = []
        self._runs: dict[str, _Run] = {}
        self._closed = False
        self._thread: threading.Thread | None = None

    def schedule(self, runs: Iterable[tuple[str, Command]]) -> None:
        with self._lock:
            for key, command in runs:
                if key not in self._runs:
                    self._runs[key] = run = _Run(key, command)
                    self._queued.append(run)
            if self._queued and self._thread is None:
                self._thread = threading.Thread(target=self._work, name="early-runs", daemon=True)
                self._thread.start()

    def _work(self) -> None:
        while True:
            with self._lock:
                if self._closed or not self._queued:
                    return
                run = self._queued.pop(0)
                run.start(idle=True)
            run.proc.wait()

    def _claim(self, key: str) -> _Run | None:
        """The run of ``key``, started now at normal priority if it was still queued."""
        with self._lock:
            run = self._runs.get(key)
            if run is not None and run.proc is None:
                self._queued.remove(run)
                run.start(idle=False)
            return run

    def result(self, key: str, command: Command) -> Outcome:
        run = self._claim(key)
        if run is None:  # never scheduled (the marker's item was not selected): run it here
            with self._lock:
                self._runs[key] = run = _Run(key, command)
                run.start(idle=False)
        return run.finish(command.timeout)

    def promote(self, key: str) -> None:
        """``key``'s run at normal priority from now on: started now if still queued."""
        run = self._claim(key)
        if run is not None and run.proc is not None and run.proc.poll() is None:
            _normal_priority(run.proc.pid)

    def returncode(self, key: str) -> int | None:
        """``key``'s exit status; None while it is queued or going (or was never scheduled)."""
        run = self._runs.get(key)
        return None if run is None or run.proc is None else run.proc.poll()

    def kill(self, key: str) -> None:
        run = self._runs.get(key)
        if run is not None:
            run.kill()

    def wait(self, key: str, timeout: float = 1800.0) -> None:
        """Wait for ``key``'s run if it is queued or going (its outcome left to whoever asks)."""
        run = self._claim(key)
        if run is not None:
            run.finish(timeout)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._queued.clear()
            runs = list(self._runs.values())
        for run in runs:
            run.kill()


RUNS = EarlyRuns()


def requested(items: Iterable[pytest.Item]) -> list[tuple[str, Command]]:
    """The early runs the selected items ask for (markers ``early_run(key, command)``), in order,
    each key once; those whose ``command()`` is None left out."""
    seen: dict[str, Callable[[], Command | None]] = {}
    for item in items:
        for mark in item.iter_markers(MARKER):
            key, command = mark.args
            seen.setdefault(key, command)
    runs = []
    for key, command in seen.items():
        cmd = command()
        if cmd is not None:
            runs.append((key, cmd))
    return runs


def enabled(config: pytest.Config) -> bool:
    """Early runs start in a main run that will run tests: not in a child of one, not when only
    collecting."""
    return os.environ.get(CHILD_ENV) != "1" and not config.option.collectonly


result = RUNS.result
wait = RUNS.wait

"""Child processes that report readiness, die with their parent, and are supervised.

Life cycle of a child started by `ProcessSupervisor.start`:

1. multiprocessing ``spawn`` runs `run_child` in the new interpreter. It arms the parent-death
   guards (Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` plus a thread watching ``os.getppid()``),
   ignores SIGINT (a terminal's Ctrl-C reaches the whole process group; the parent decides), and
   calls ``target(*args, pipe_writer)``.
2. The target sends exactly one start-up message through ``pipe_writer``:
   ``{"status": "ready", ...capacity...}`` or ``{"status": "error", "message": traceback}``.
   An exception escaping the target is sent as an error message too (if nothing was sent yet)
   and the child exits with code 1.
3. The parent waits for every child with `ProcessSupervisor.wait_ready`, polling each pipe *and*
   each child's liveness, so a child that dies silently fails the launch instead of hanging it.
4. After start-up a monitor thread blocks on the children's sentinels (no polling) and calls
   ``on_death(name, exitcode)`` once if a child exits while the supervisor is not stopping.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NoReturn

import psutil

from srt.utils.errors import LaunchError
from srt.utils.logging_utils import configure_logging
from srt.utils.transformers_import import cache_import_structure
from srt.utils.watchdog import register_stack_dump_signal

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent *thread* exits.

    Returns False where unsupported (non-Linux, or libc without prctl). Note the Linux semantics:
    the signal fires when the thread that forked us exits, so parents that start children from a
    short-lived thread must not arm it (see `ProcessSupervisor`).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def start_parent_watchdog(parent_pid: int, interval_s: float = 1.0) -> threading.Thread:
    """Exit this process (code 1) soon after ``parent_pid`` stops being our parent.

    Fallback to the parent-death signal (macOS, or when the signal is not armed). One wake-up per
    ``interval_s``; negligible CPU.
    """

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent_pid:
                os._exit(1)

    t = threading.Thread(target=watch, name="srt-parent-watchdog", daemon=True)
    t.start()
    return t


def kill_process_tree(pid: int, include_parent: bool = True, timeout_s: float = 3.0) -> None:
    """SIGTERM ``pid``'s descendants (and ``pid`` itself if ``include_parent``), SIGKILL stragglers."""
    try:
        parent = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    try:
        procs = parent.children(recursive=True)
    except psutil.NoSuchProcess:
        procs = []
    if include_parent:
        procs.append(parent)
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=timeout_s)


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Keep ``spawn`` from re-importing the user's ``__main__`` in the child.

    The children only run srt code, so a user script without an ``if __name__ == "__main__":``
    guard (or a notebook) must not be executed again in them. ``spawn`` decides what to re-import
    from ``__main__.__spec__`` / ``__main__.__file__`` while ``Process.start`` runs (synchronously);
    hide both for that moment.
    """
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main is not None and k in main.__dict__}
    try:
        for k in saved:
            if k == "__spec__":
                main.__spec__ = None
            else:
                del main.__dict__[k]
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)


@dataclass
class ChildSpec:
    """What `run_child` needs: ``target(*args, pipe_writer)`` runs in the child."""

    name: str
    target: Callable[..., Any]
    args: tuple = ()
    parent_pid: int = 0
    use_pdeathsig: bool = True
    log_level: str = "info"


def exit_child_on_error(pipe_writer: Any, ready_sent: bool, log: logging.Logger, what: str) -> NoReturn:
    """From a child target's ``except`` block: log the traceback as ``what`` failed, send it
    through ``pipe_writer`` as the start-up error when no ready message was sent yet, and exit 1."""
    tb = traceback.format_exc()
    log.error("%s failed:\n%s", what, tb)
    if not ready_sent:
        try:
            pipe_writer.send({"status": "error", "message": tb})
        except (OSError, ValueError):
            pass
    sys.exit(1)


def run_child(spec: ChildSpec, pipe_writer: multiprocessing.connection.Connection) -> None:
    """Entry point of every child process (see the module docstring)."""
    cache_import_structure()  # before anything imports transformers (srt/utils/transformers_import.py)
    if spec.use_pdeathsig:
        set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != spec.parent_pid:  # the parent died before the guard was armed
        os._exit(1)
    start_parent_watchdog(spec.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    register_stack_dump_signal()  # the hang watchdog's stack dump (srt/utils/watchdog.py)
    configure_logging(spec.log_level, process_name=spec.name, logger_name="")
    try:
        spec.target(*spec.args, pipe_writer)
    except BaseException:  # noqa: BLE001 - report anything, including SystemExit from the target
        tb = traceback.format_exc()
        logging.getLogger(__name__).error("%s process crashed:\n%s", spec.name, tb)
        try:
            pipe_writer.send({"status": "error", "message": tb})
        except (OSError, ValueError):
            pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


@dataclass
class _Child:
    name: str
    process: mp.process.BaseProcess
    reader: multiprocessing.connection.Connection
    info: dict[str, Any] | None = None


def exit_message(exitcode: int | None) -> str:
    """Why a child that exited before it was ready stopped, as far as its exit code says."""
    message = f"the process exited with code {exitcode} before it was ready (see its log above)"
    if exitcode == -signal.SIGKILL:
        message += (
            "; it was killed by SIGKILL, which on Linux is most often the kernel's out-of-memory "
            "killer (`dmesg` says): the model, its KV pool or its load may need more memory than "
            "this machine has"
        )
    return message


@dataclass
class ProcessSupervisor:
    """Starts, waits for, watches and stops the child processes of one launch."""

    log_level: str = "info"
    children: list[_Child] = field(default_factory=list)
    _stopping: threading.Event = field(default_factory=threading.Event)
    _monitor: threading.Thread | None = None

    def start(self, name: str, target: Callable[..., Any], args: tuple) -> None:
        """Spawn ``target(*args, pipe_writer)`` as child ``name`` (returns at once)."""
        ctx = mp.get_context("spawn")
        reader, writer = ctx.Pipe(duplex=False)
        # PR_SET_PDEATHSIG fires when the *thread* that spawned the child exits: only arm it when
        # spawning from the main thread (which lives as long as the process); otherwise rely on
        # the getppid() watchdog alone.
        use_pdeathsig = threading.current_thread() is threading.main_thread()
        spec = ChildSpec(name, target, args, os.getpid(), use_pdeathsig, self.log_level)
        proc = ctx.Process(target=run_child, args=(spec, writer), name=f"srt-{name}", daemon=False)
        with _main_module_hidden():
            proc.start()
        writer.close()  # the child holds the only write end: EOF on the reader means it is gone
        self.children.append(_Child(name, proc, reader))

    def wait_ready(self, names: list[str] | None = None, timeout_s: float | None = None) -> dict[str, dict]:
        """Block until each child (or those in ``names``) sent its ready message.

        Returns ``{name: ready_message}``. Raises `LaunchError` with the child's message when a child
        reports an error, exits, or (with ``timeout_s``) takes too long; never hangs on a dead child.
        """
        pending = [c for c in self.children if c.info is None and (names is None or c.name in names)]
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            ready = multiprocessing.connection.wait(
                [c.reader for c in pending] + [c.process.sentinel for c in pending], timeout=1.0
            )
            for c in list(pending):
                msg: Any = None
                if c.reader in ready or c.reader.poll():
                    try:
                        msg = c.reader.recv()
                    except (EOFError, OSError):
                        msg = None
                if msg is None:
                    if not c.process.is_alive() or c.process.sentinel in ready:
                        c.process.join(timeout=1.0)
                        raise LaunchError(c.name, exit_message(c.process.exitcode))
                    continue
                if not isinstance(msg, dict) or msg.get("status") != "ready":
                    message = msg.get("message", repr(msg)) if isinstance(msg, dict) else repr(msg)
                    raise LaunchError(c.name, message)
                c.info = msg
                pending.remove(c)
            if deadline is not None and time.monotonic() > deadline and pending:
                raise LaunchError(pending[0].name, f"not ready after {timeout_s:.0f} s")
        return {c.name: c.info for c in self.children if c.info is not None}

    def start_monitor(self, on_death: Callable[[str, int | None], None]) -> None:
        """Call ``on_death(name, exitcode)`` (from a daemon thread) when the first child exits
        unexpectedly. Blocks on the process sentinels: no polling."""

        def monitor() -> None:
            sentinels = {c.process.sentinel: c for c in self.children}
            ready = multiprocessing.connection.wait(list(sentinels))
            if self._stopping.is_set():
                return
            child = sentinels[ready[0]]
            child.process.join(timeout=1.0)
            if self._stopping.is_set():
                return
            on_death(child.name, child.process.exitcode)

        self._monitor = threading.Thread(target=monitor, name="srt-child-monitor", daemon=True)
        self._monitor.start()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def pids(self) -> dict[str, int | None]:
        return {c.name: c.process.pid for c in self.children}

    def stop(self, timeout_s: float = 3.0) -> None:
        """Stop every child (SIGTERM, then SIGKILL after ``timeout_s``) and its descendants."""
        self._stopping.set()
        for c in self.children:
            if c.process.pid is not None and c.process.is_alive():
                kill_process_tree(c.process.pid, include_parent=True, timeout_s=timeout_s)
            c.process.join(timeout=timeout_s)
            c.reader.close()

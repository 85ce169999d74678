"""The hang watchdog (``--watchdog-timeout``): a heartbeat in shared memory and its watcher.

    scheduler process (rank 0)                      main process
    HeartbeatWriter.publish(step, has_work,  -->  [mmap file ipc_dir/scheduler_heartbeat]
        summary) at each step start and                 |
        when the loop goes idle                         v
                                                 Watchdog thread: HeartbeatReader.read() every
                                                 interval -> HangDetector.observe(beat, now)

The watcher never talks to the scheduler: it reads a file-backed shared mapping, so a scheduler
thread stuck in a forward (even one holding its GIL inside a C call) cannot stop it. When the
detector trips, the watcher logs the scheduler's last published state summary, dumps the Python
stacks of the main process (``faulthandler.dump_traceback``) and of every child (the stack-dump
signal, `STACK_DUMP_SIGNAL`, which each child registers with `register_stack_dump_signal`;
faulthandler's handler runs without the GIL), then calls ``on_hang(message)``.

Progress is a *started step*: the step counter moves. The scheduler publishes the step number
with ``has_work`` True when a step begins, and ``has_work`` False right before it blocks waiting
for messages. The detector trips when ``has_work`` is True and the step counter has not moved for
``timeout_s`` since the step began: a single step (forward) longer than the timeout is a hang; an
idle scheduler never trips.

Heartbeat layout (little endian, `HEARTBEAT_BYTES` in all): ``seq u64`` (seqlock: odd while the
writer is mid-update), ``step u64``, ``timestamp f64`` (``time.monotonic()``, one clock for every
process on Linux), ``has_work u32``, ``summary_len u32``, then ``summary_len`` bytes of JSON.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import mmap
import os
import signal
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("srt.watchdog")

HEARTBEAT_BYTES = 8192
_HEADER = struct.Struct("<QQdII")
SUMMARY_CAPACITY = HEARTBEAT_BYTES - _HEADER.size
STACK_DUMP_SIGNAL = signal.SIGUSR1


def heartbeat_path(ipc_dir: str, rank: int = 0) -> str:
    """The heartbeat file of scheduler ``rank`` inside a launch's private ipc directory."""
    return os.path.join(ipc_dir, f"scheduler_heartbeat_{rank}")


def register_stack_dump_signal() -> None:
    """Make `STACK_DUMP_SIGNAL` print every thread's Python stack of this process to stderr.

    faulthandler's handler is C code that needs no GIL, so it works while a thread is stuck."""
    faulthandler.register(STACK_DUMP_SIGNAL, file=sys.stderr, all_threads=True, chain=False)


@dataclass(slots=True, frozen=True)
class Beat:
    """One heartbeat: the last step started, when, whether work was pending, a state summary."""

    step: int
    timestamp: float
    has_work: bool
    summary: dict[str, Any] = field(default_factory=dict)


def encode_beat(beat: Beat, seq: int = 0) -> bytes:
    """The bytes of ``beat`` (header + JSON summary). A summary longer than `SUMMARY_CAPACITY`
    is replaced by ``{"truncated": <its length>}``."""
    body = json.dumps(beat.summary, separators=(",", ":"), default=str).encode()
    if len(body) > SUMMARY_CAPACITY:
        body = json.dumps({"truncated": len(body)}).encode()
    return _HEADER.pack(seq, beat.step, beat.timestamp, int(beat.has_work), len(body)) + body


def decode_beat(buf: bytes | memoryview) -> tuple[int, Beat] | None:
    """``(seq, beat)`` from bytes written by `encode_beat`; None for an all-zero (never written)
    or malformed buffer."""
    if len(buf) < _HEADER.size:
        return None
    seq, step, ts, has_work, n = _HEADER.unpack_from(buf, 0)
    if seq == 0 or n > len(buf) - _HEADER.size:
        return None
    try:
        summary = json.loads(bytes(buf[_HEADER.size : _HEADER.size + n])) if n else {}
    except ValueError:
        return None
    return seq, Beat(step, ts, bool(has_work), summary if isinstance(summary, dict) else {})


def create_heartbeat_file(path: str) -> None:
    """Create (or reset) the zero-filled heartbeat file; the main process does this before it
    starts the scheduler."""
    with open(path, "wb") as f:
        f.write(b"\0" * HEARTBEAT_BYTES)


class HeartbeatWriter:
    """The scheduler's side: one writer per file (seqlock: readers retry a torn read)."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "r+b")  # noqa: SIM115 - kept open for the process's life
        self._mm = mmap.mmap(self._file.fileno(), HEARTBEAT_BYTES)
        self._seq = 0

    def publish(self, step: int, has_work: bool, summary: dict[str, Any]) -> None:
        data = encode_beat(Beat(step, time.monotonic(), has_work, summary))
        self._seq += 1
        self._mm[0:8] = struct.pack("<Q", 2 * self._seq - 1)  # odd: update in progress
        self._mm[8 : len(data)] = data[8:]
        self._mm[0:8] = struct.pack("<Q", 2 * self._seq)

    def close(self) -> None:
        self._mm.close()
        self._file.close()


class HeartbeatReader:
    """The watcher's side: a read-only mapping of the file."""

    def __init__(self, path: str) -> None:
        with open(path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), HEARTBEAT_BYTES, access=mmap.ACCESS_READ)

    def read(self, retries: int = 5) -> Beat | None:
        """The last complete beat, or None (never written, or only torn reads)."""
        for _ in range(retries):
            seq = struct.unpack_from("<Q", self._mm, 0)[0]
            if seq == 0:
                return None
            if seq % 2 == 0:
                buf = self._mm[:]
                if struct.unpack_from("<Q", self._mm, 0)[0] == seq:
                    got = decode_beat(buf)
                    return got[1] if got is not None else None
            time.sleep(0.001)
        return None

    def close(self) -> None:
        self._mm.close()


@dataclass(slots=True)
class HangDetector:
    """Decides, from successive beats, whether the scheduler is hung (pure; see module doc)."""

    timeout_s: float
    _step: int | None = None
    _since: float = 0.0

    def observe(self, beat: Beat | None, now: float) -> float | None:
        """Seconds without progress when that is at least ``timeout_s`` while work is pending,
        else None. ``now`` is ``time.monotonic()`` (the clock of ``beat.timestamp``)."""
        if beat is None or not beat.has_work:
            self._step = None
            return None
        if beat.step != self._step:
            self._step = beat.step
            self._since = min(beat.timestamp, now)
            return None
        stalled = now - self._since
        return stalled if stalled >= self.timeout_s else None


def format_summary(beat: Beat, stalled_s: float) -> str:
    """The one-line state summary the watchdog logs."""
    return json.dumps({"seconds_since_progress": round(stalled_s, 1), "step": beat.step, **beat.summary})


class Watchdog:
    """The watcher thread (daemon). ``child_pids()`` names the processes whose stacks to dump
    (every scheduler rank and the detokenizer); ``on_hang(message)`` runs once, after the dumps."""

    def __init__(
        self,
        reader: HeartbeatReader,
        timeout_s: float,
        child_pids: Callable[[], dict[str, int | None]],
        on_hang: Callable[[str], None],
        interval_s: float | None = None,
        dump_wait_s: float = 0.5,
    ) -> None:
        self.reader = reader
        self.detector = HangDetector(timeout_s)
        self.child_pids = child_pids
        self.on_hang = on_hang
        self.interval_s = interval_s if interval_s is not None else min(1.0, max(timeout_s / 4, 0.05))
        self.dump_wait_s = dump_wait_s
        self._stop = threading.Event()
        self.fired = threading.Event()
        self._thread = threading.Thread(target=self._run, name="srt-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            beat = self.reader.read()
            stalled = self.detector.observe(beat, time.monotonic())
            if stalled is not None and beat is not None and not self._stop.is_set():
                self._fire(beat, stalled)
                return

    def _fire(self, beat: Beat, stalled_s: float) -> None:
        self.fired.set()
        timeout = self.detector.timeout_s
        logger.error(
            "watchdog: the scheduler made no progress for %.1f s while it has work "
            "(--watchdog-timeout %g); scheduler state: %s",
            stalled_s,
            timeout,
            format_summary(beat, stalled_s),
        )
        dump_all_stacks(self.child_pids(), self.dump_wait_s)
        self.on_hang(
            f"the scheduler made no progress for {stalled_s:.0f} s (--watchdog-timeout {timeout:g}); "
            "in-flight requests are failed and the engine is shutting down"
        )


def dump_all_stacks(child_pids: dict[str, int | None], wait_s: float = 0.5) -> None:
    """Print the Python stacks of this process and of each child to stderr, one after another
    (each child is given ``wait_s`` to write its dump before the next is signalled)."""
    logger.error("watchdog: Python stacks of the main process (pid %d):", os.getpid())
    sys.stderr.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    for name, pid in child_pids.items():
        if pid is None:
            continue
        logger.error("watchdog: Python stacks of the %s process (pid %d):", name, pid)
        try:
            os.kill(pid, STACK_DUMP_SIGNAL)
        except ProcessLookupError:
            logger.error("watchdog: the %s process is gone", name)
            continue
        time.sleep(wait_s)

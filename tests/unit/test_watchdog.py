"""The hang watchdog's pieces without a server: the heartbeat encoding and its shared file, the
hang decision, the watcher thread, the stack dump of a process stuck holding its GIL, and the
test-only fault hook's parsing."""

from __future__ import annotations

import json
import logging
import struct
import subprocess
import sys
import time

import pytest

from srt.utils.errors import ConfigError
from srt.utils.fault import FaultHook
from srt.utils.watchdog import (
    HEARTBEAT_BYTES,
    SUMMARY_CAPACITY,
    Beat,
    HangDetector,
    HeartbeatReader,
    HeartbeatWriter,
    Watchdog,
    create_heartbeat_file,
    decode_beat,
    dump_all_stacks,
    encode_beat,
)


def test_beat_round_trips_and_an_unwritten_buffer_is_none():
    beat = Beat(17, 123.5, True, {"num_queued_reqs": 3, "batch": {"forward_mode": "DECODE", "batch_size": 8}})
    data = encode_beat(beat, seq=4)
    assert decode_beat(data) == (4, beat)
    padded = data + b"\0" * (HEARTBEAT_BYTES - len(data))
    assert decode_beat(padded) == (4, beat)
    assert decode_beat(b"\0" * HEARTBEAT_BYTES) is None
    assert decode_beat(data[:10]) is None


def test_an_oversized_summary_is_replaced_not_overflowed():
    beat = Beat(1, 0.0, True, {"x": "y" * (SUMMARY_CAPACITY + 10)})
    data = encode_beat(beat, seq=2)
    assert len(data) <= HEARTBEAT_BYTES
    _, got = decode_beat(data)
    assert got.step == 1 and got.has_work and set(got.summary) == {"truncated"}


def test_writer_and_reader_share_the_file(tmp_path):
    path = str(tmp_path / "hb")
    create_heartbeat_file(path)
    reader = HeartbeatReader(path)
    assert reader.read() is None  # nothing published yet
    writer = HeartbeatWriter(path)
    writer.publish(5, True, {"num_running_reqs": 2})
    got = reader.read()
    assert got.step == 5 and got.has_work and got.summary == {"num_running_reqs": 2}
    assert abs(got.timestamp - time.monotonic()) < 5
    writer.publish(6, False, {})  # a shorter summary overwrites a longer one cleanly
    got = reader.read()
    assert (got.step, got.has_work, got.summary) == (6, False, {})
    writer.close()
    reader.close()


def test_a_torn_write_is_not_read(tmp_path):
    path = str(tmp_path / "hb")
    create_heartbeat_file(path)
    with open(path, "r+b") as f:  # a writer stopped mid-update: odd sequence number
        f.write(struct.pack("<Q", 3) + encode_beat(Beat(9, 1.0, True, {}))[8:])
    assert HeartbeatReader(path).read(retries=2) is None


def test_an_idle_scheduler_never_trips():
    d = HangDetector(timeout_s=3)
    for t in range(0, 1000, 10):
        assert d.observe(Beat(42, 0.0, False, {}), float(t)) is None
    assert d.observe(None, 2000.0) is None


def test_steps_that_keep_coming_never_trip_even_when_slow_overall():
    d = HangDetector(timeout_s=3)
    for step in range(100):  # one step every 2 s for 200 s
        t = 2.0 * step
        assert d.observe(Beat(step, t, True, {}), t + 1.9) is None


def test_a_single_step_longer_than_the_timeout_is_a_hang():
    d = HangDetector(timeout_s=3)
    assert d.observe(Beat(7, 100.0, True, {}), 100.5) is None
    assert d.observe(Beat(7, 100.0, True, {}), 102.9) is None
    stalled = d.observe(Beat(7, 100.0, True, {}), 103.2)
    assert stalled == pytest.approx(3.2)


def test_going_idle_or_progressing_resets_the_clock():
    d = HangDetector(timeout_s=3)
    d.observe(Beat(1, 0.0, True, {}), 0.0)
    assert d.observe(Beat(1, 0.0, False, {}), 10.0) is None  # idle since: not a hang
    assert d.observe(Beat(2, 10.0, True, {}), 10.0) is None  # new work starts the clock again
    assert d.observe(Beat(2, 10.0, True, {}), 12.0) is None
    assert d.observe(Beat(2, 10.0, True, {}), 13.5) == pytest.approx(3.5)


class FakeReader:
    def __init__(self, beat: Beat | None) -> None:
        self.beat = beat

    def read(self) -> Beat | None:
        return self.beat


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_the_watcher_fires_once_with_the_state_and_only_while_work_is_pending():
    records = Records()
    logging.getLogger("srt.watchdog").addHandler(records)
    hangs: list[str] = []
    reader = FakeReader(Beat(3, time.monotonic(), False, {}))
    wd = Watchdog(reader, 0.3, lambda: {}, hangs.append, interval_s=0.02).start()
    time.sleep(0.6)
    assert hangs == []  # idle the whole time
    reader.beat = Beat(
        4, time.monotonic(), True, {"num_running_reqs": 1, "batch": {"forward_mode": "EXTEND"}}
    )
    deadline = time.monotonic() + 10
    while not hangs and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)
    wd.stop()
    logging.getLogger("srt.watchdog").removeHandler(records)
    assert len(hangs) == 1 and "no progress" in hangs[0]
    summary = [m for m in records.messages if "scheduler state" in m]
    assert len(summary) == 1
    state = json.loads(summary[0].split("scheduler state: ", 1)[1])
    assert state["step"] == 4 and state["batch"] == {"forward_mode": "EXTEND"}
    assert state["seconds_since_progress"] >= 0.3


STUCK_CHILD = """
import sys
from srt.utils.fault import stall_forward_holding_gil
from srt.utils.watchdog import register_stack_dump_signal
register_stack_dump_signal()
print("ready", flush=True)
stall_forward_holding_gil()
"""


def test_a_process_stuck_in_c_holding_its_gil_still_dumps_its_stack():
    child = subprocess.Popen(
        [sys.executable, "-c", STUCK_CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        time.sleep(0.3)  # inside libc sleep now
        dump_all_stacks({"stuck": child.pid}, wait_s=1.0)
    finally:
        child.kill()
        _, err = child.communicate(timeout=30)
    assert "most recent call first" in err and "stall_forward_holding_gil" in err


def test_fault_hook_parsing():
    assert FaultHook.parse(None).kind is None and FaultHook.parse("").kind is None
    hook = FaultHook.parse("stall_forward_after:3")
    assert (hook.kind, hook.after) == ("stall_forward_after", 3)
    assert FaultHook.parse("stall_forward_gil_after:0").kind == "stall_forward_gil_after"
    for bad in ("stall_forward_after", "stall_forward_after:x", "explode:1", "stall_forward_after:-1"):
        with pytest.raises(ConfigError):
            FaultHook.parse(bad)
    off = FaultHook()
    for _ in range(5):
        off.before_forward()  # no fault armed: returns at once

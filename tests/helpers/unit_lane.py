"""The unit lane: the selected unit tests run in a child pytest on the cores the integration tests
leave idle, and the main run reports their outcomes when it reaches them.

An integration test spends much of its time waiting (a server starting, a round trip over a
socket, one busy core of two), while the unit tests mostly keep one core busy at a time. In a run
that selects both, the unit tests of ``tests/unit`` go to one child pytest, queued behind the
other early runs (tests/helpers/early_runs.py) at low priority, so it takes only the cycles the
main run leaves. Each of its test reports is written, serialized as pytest serializes them, to a
file as it is made. When the main run reaches a lane test it waits for that test's reports (the
child runs at normal priority from then on) and logs them as its own: the progress line, the
failures and skips, ``--durations`` and ``--junitxml`` read them as if the test had run here.

A test that failed in the lane is run again alone in a child at normal priority, and that run's
reports are the ones logged; the lane's failure is named in the run's summary, so starvation at
low priority never fails a run silently and never passes one either. Where the lane child ends
without reporting some tests (it crashed, or was killed), those tests go to a new child at normal
priority, once; one that is still unreported after it fails, saying so.

Tests stay in the main run when they ask for an early run of their own, or carry the marker
``no_lane(reason)`` (they read the process's priority or thread count, or time themselves). The
lane is off in a run that selects no integration test (it would have no idle time to use), in a
child of a run, when only collecting, and with ``SRT_TEST_LANE=0``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.helpers import early_runs

LANE_KEY = "unit-lane"
MARKER = "no_lane"
ENV = "SRT_TEST_LANE"  # "0": off
OUT_ENV = "SRT_TEST_LANE_OUT"  # in a lane child: where its reports go
IDS_ENV = "SRT_TEST_LANE_IDS"  # in a lane child: the node ids it runs, one a line
RUN_ENV = "SRT_TEST_LANE_RUN"  # in a lane child: "lane", "alone" (a failed test again) or "rest"
UNIT_DIR = "tests/unit/"
STALL_S = 900.0  # a child that reports nothing this long while the main run waits is killed


def eligible(item: pytest.Item) -> bool:
    return (
        item.nodeid.startswith(UNIT_DIR)
        and item.get_closest_marker(MARKER) is None
        and item.get_closest_marker(early_runs.MARKER) is None
    )


def enabled(config: pytest.Config, items: list[pytest.Item]) -> bool:
    return (
        early_runs.enabled(config)
        and os.environ.get(ENV, "1") != "0"
        and any(not i.nodeid.startswith(UNIT_DIR) for i in items)
        and any(eligible(i) for i in items)
    )


# ---------------------------------------------------------------- the child's side


def child_filter(items: list[pytest.Item]) -> list[pytest.Item]:
    """In a lane child: the items it was given, in collection order."""
    wanted = set(Path(os.environ[IDS_ENV]).read_text().splitlines())
    return [i for i in items if i.nodeid in wanted]


_CONFIG: list[pytest.Config] = []


def configure(config: pytest.Config) -> None:
    _CONFIG[:] = [config]


def child_write(report: pytest.TestReport) -> None:
    """In a lane child: one report, serialized, appended to the lane's file and flushed."""
    config = _CONFIG[0]
    data = config.hook.pytest_report_to_serializable(config=config, report=report)
    line = json.dumps(data, default=repr) + "\n"
    with open(os.environ[OUT_ENV], "a", encoding="utf-8") as f:
        f.write(line)


def in_child() -> bool:
    return OUT_ENV in os.environ


# ---------------------------------------------------------------- the main run's side


def _command(nodeids: list[str], out: Path, rootdir: Path, kind: str) -> early_runs.Command:
    ids = out.with_suffix(".ids")
    ids.write_text("\n".join(nodeids) + "\n")
    files = list(dict.fromkeys(n.split("::", 1)[0] for n in nodeids))
    env = {**os.environ, OUT_ENV: str(out), IDS_ENV: str(ids), RUN_ENV: kind}
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(rootdir), *files]
    return early_runs.Command(argv, env=env, cwd=str(rootdir))


@dataclass
class _Child:
    """One child pytest of the lane and what it has reported so far."""

    key: str
    out: Path
    nodeids: list[str]
    reports: dict[str, list[dict]] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)
    _offset: int = 0

    def read(self) -> None:
        try:
            with open(self.out, encoding="utf-8") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        complete = chunk[: chunk.rfind("\n") + 1]
        self._offset += len(complete.encode("utf-8"))
        for line in complete.splitlines():
            data = json.loads(line)
            self.reports.setdefault(data["nodeid"], []).append(data)
            if data.get("when") == "teardown":
                self.done.add(data["nodeid"])


class Lane:
    def __init__(self) -> None:
        self.active = False
        self.nodeids: set[str] = set()
        self.dir: Path | None = None
        self.rootdir = Path.cwd()
        self.children: list[_Child] = []
        self.rerun: list[tuple[str, str]] = []  # (nodeid, how the lane's run failed)
        self.lost: list[str] = []
        self.waited_s = 0.0

    # -- set-up
    def schedule(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        if not enabled(config, items):
            return
        ids = [i.nodeid for i in items if eligible(i)]
        self.dir = Path(tempfile.mkdtemp(prefix="srt-unit-lane-"))
        self.rootdir = config.rootpath
        self._start("lane", ids)
        self.nodeids, self.active = set(ids), True

    def _start(self, kind: str, nodeids: list[str]) -> _Child:
        """A new child for ``nodeids``, queued behind the early runs (a wait starts it at once)."""
        assert self.dir is not None
        key = LANE_KEY if kind == "lane" else f"{LANE_KEY}-{kind}-{len(self.children)}"
        child = _Child(key, self.dir / f"{key}.jsonl", nodeids)
        self.children.append(child)
        early_runs.RUNS.schedule([(key, _command(nodeids, child.out, self.rootdir, kind))])
        return child

    # -- the main run reaching a lane test
    def reports(self, config: pytest.Config, nodeid: str) -> list[pytest.TestReport]:
        start = time.monotonic()
        try:
            data = self._wait(self.children[0], nodeid)
            if data is not None and any(d["outcome"] == "failed" for d in data):
                self.rerun.append((nodeid, _failure_line(data)))
                data = self._alone(nodeid)
            elif data is None:
                data = self._after_loss(nodeid)
        finally:
            self.waited_s += time.monotonic() - start
        if data is None:
            self.lost.append(nodeid)
            return [_lost_report(nodeid)]
        return [_report(config, d) for d in data]

    def _wait(self, child: _Child, nodeid: str) -> list[dict] | None:
        """``nodeid``'s reports from ``child``, waiting while it runs (at normal priority); None
        when it ended, or stalled, without them."""
        early_runs.RUNS.promote(child.key)
        last_progress = time.monotonic()
        while True:
            seen = len(child.done)
            child.read()
            if nodeid in child.done:
                return child.reports[nodeid]
            if len(child.done) > seen:
                last_progress = time.monotonic()
            if early_runs.RUNS.returncode(child.key) is not None:
                child.read()
                return child.reports[nodeid] if nodeid in child.done else None
            if time.monotonic() - last_progress > STALL_S:
                early_runs.RUNS.kill(child.key)
                return None
            time.sleep(0.02)

    def _alone(self, nodeid: str) -> list[dict] | None:
        """A run of ``nodeid`` alone in a new child at normal priority."""
        return self._wait(self._start("alone", [nodeid]), nodeid)

    def _after_loss(self, nodeid: str) -> list[dict] | None:
        """The first child ended without ``nodeid``: every test it did not report goes to one new
        child (once)."""
        recovery = next((c for c in self.children if "-rest-" in c.key), None)
        if recovery is None:
            first = self.children[0]
            recovery = self._start("rest", [n for n in first.nodeids if n not in first.done])
        if nodeid not in recovery.nodeids:
            return None
        data = self._wait(recovery, nodeid)
        if data is not None and any(d["outcome"] == "failed" for d in data):
            self.rerun.append((nodeid, _failure_line(data)))
            data = self._alone(nodeid)
        return data

    def close(self) -> None:
        """The lane's files removed (its children are killed with the other early runs)."""
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)

    def summary(self) -> list[str]:
        if not self.active:
            return []
        lines = [
            f"{len(self.nodeids)} unit tests ran in the lane; the main run waited {self.waited_s:.0f} s for them"
        ]
        lines += [f"failed in the lane, then run again alone: {n} ({why})" for n, why in self.rerun]
        lines += [f"never reported by the lane: {n}" for n in self.lost]
        return lines


def _report(config: pytest.Config, data: dict) -> pytest.TestReport:
    report = config.hook.pytest_report_from_serializable(config=config, data=data)
    if isinstance(report.longrepr, list):  # a skip's (path, line, reason), a list after JSON
        report.longrepr = tuple(report.longrepr)
    return report


def _failure_line(data: list[dict]) -> str:
    """The first failed phase of a test's reports and its error's message."""
    for d in data:
        if d["outcome"] == "failed":
            longrepr = d.get("longrepr")
            crash = longrepr.get("reprcrash") if isinstance(longrepr, dict) else None
            text = crash["message"] if crash else str(longrepr or "")
            return f"{d['when']}: {(text.strip().splitlines() or [''])[0][:200]}"
    return ""


def _lost_report(nodeid: str) -> pytest.TestReport:
    return pytest.TestReport(
        nodeid,
        (nodeid.split("::", 1)[0], None, nodeid),
        {},
        "failed",
        "the unit lane's children ended without running this test",
        "call",
    )


LANE = Lane()

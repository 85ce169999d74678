"""The unit lane: the selected unit tests run in child pytest workers on the cores the integration
tests leave idle, and the main run reports their outcomes when it reaches them.

An integration test spends much of its time waiting (a server starting, a round trip over a
socket, one busy core of two), while the unit tests mostly keep one core busy at a time. In a run
that selects both, the unit tests of ``tests/unit`` go to the lane: ``WORKERS`` pytest workers
started together, queued behind the other early runs (tests/helpers/early_runs.py) at low
priority, so they take only the cycles the main run leaves. The workers take the modules one at a
time (a module is claimed by creating a file), the first from the first module on, the second
from the last back. Each test report is written, serialized as pytest serializes them, to the
worker's file as it is made. When the main run reaches a lane test it waits for that test's
reports (the workers run at normal priority from then on, a core each) and logs them as its own:
the progress line, the failures and skips, ``--durations`` and ``--junitxml`` read them as if the
test had run here.

A test that failed in the lane is run again alone in a child at normal priority, and that run's
reports are the ones logged; the lane's failure is named in the run's summary, so starvation at
low priority never fails a run silently and never passes one either. Where the lane ends without
reporting some tests (a worker crashed, or was killed), those tests go to a new child at normal
priority, once; one that is still unreported after it fails, saying so.

Tests stay in the main run when they ask for an early run of their own, or carry the marker
``no_lane(reason)`` (they read their own process's priority or CPU placement). The lane is off in
a run that selects no integration test (it would have no idle time to use), in a child of a run,
when only collecting, and with ``SRT_TEST_LANE=0``.
"""

from __future__ import annotations

import hashlib
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
CLAIMS_ENV = "SRT_TEST_LANE_CLAIMS"  # in a lane worker: where it claims the modules it runs
ORDER_ENV = "SRT_TEST_LANE_ORDER"  # in a lane worker: "reverse" walks the modules last to first
WORKERS = 2  # the lane's pytest workers: at the end of a run they have both cores to themselves
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
    """In a lane child: the items it was given, in collection order, or module by module from the
    last with ``SRT_TEST_LANE_ORDER=reverse`` (each module's items still in order)."""
    wanted = set(Path(os.environ[IDS_ENV]).read_text().splitlines())
    items = [i for i in items if i.nodeid in wanted]
    if os.environ.get(ORDER_ENV) != "reverse":
        return items
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(_module(item.nodeid), []).append(item)
    return [item for group in reversed(modules.values()) for item in group]


_CLAIMED: set[str] = set()


def claim(item: pytest.Item) -> bool:
    """In a lane worker: whether to run ``item``: its module is this worker's, claimed now if no
    worker had it yet (a file created exclusively in the lane's claims directory)."""
    claims = os.environ.get(CLAIMS_ENV)
    module = _module(item.nodeid)
    if claims is None or module in _CLAIMED:
        return True
    name = hashlib.sha1(module.encode()).hexdigest()
    try:
        os.close(os.open(os.path.join(claims, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    _CLAIMED.add(module)
    return True


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


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


def _pytest(rootdir: Path, nodeids: list[str]) -> list[str]:
    files = list(dict.fromkeys(_module(n) for n in nodeids))
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(rootdir), *files]


# the lane's launcher: its workers (argv, environment), waited for; they share its process group
_LAUNCH = (
    "import json, os, subprocess, sys\n"
    "workers = [subprocess.Popen(a, env={**os.environ, **e}) for a, e in json.loads(sys.argv[1])]\n"
    "sys.exit(max(w.wait() for w in workers))"
)


def _command(nodeids: list[str], outs: list[Path], rootdir: Path, kind: str) -> early_runs.Command:
    """One pytest child for ``nodeids`` (``outs`` one file), or the lane's workers (several: they
    take the modules one at a time, the first walking them in order, the second from the last)."""
    ids = outs[0].with_suffix(".ids")
    ids.write_text("\n".join(nodeids) + "\n")
    env = {**os.environ, IDS_ENV: str(ids), RUN_ENV: kind}
    argv = _pytest(rootdir, nodeids)
    if len(outs) == 1:
        return early_runs.Command(argv, env={**env, OUT_ENV: str(outs[0])}, cwd=str(rootdir))
    claims = outs[0].parent / "claims"
    claims.mkdir()
    workers = [
        (argv, {OUT_ENV: str(out), CLAIMS_ENV: str(claims), ORDER_ENV: "reverse" if w % 2 else "forward"})
        for w, out in enumerate(outs)
    ]
    launch = [sys.executable, "-c", _LAUNCH, json.dumps(workers)]
    return early_runs.Command(launch, env=env, cwd=str(rootdir))


@dataclass
class _Child:
    """One child of the lane (a pytest, or the lane's workers) and what it has reported so far."""

    key: str
    outs: list[Path]
    nodeids: list[str]
    reports: dict[str, list[dict]] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)
    _offsets: dict[Path, int] = field(default_factory=dict)

    def read(self) -> None:
        for out in self.outs:
            try:
                with open(out, "rb") as f:
                    f.seek(self._offsets.get(out, 0))
                    chunk = f.read()
            except FileNotFoundError:
                continue
            complete = chunk[: chunk.rfind(b"\n") + 1]
            self._offsets[out] = self._offsets.get(out, 0) + len(complete)
            for line in complete.decode("utf-8").splitlines():
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
        self.children: list[_Child] = []  # the lane first, then the children started after it
        self._rest: _Child | None = None  # the child given what the lane left unreported
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
        n = WORKERS if kind == "lane" else 1
        child = _Child(key, [self.dir / f"{key}.{w}.jsonl" for w in range(n)], nodeids)
        self.children.append(child)
        early_runs.RUNS.schedule([(key, _command(nodeids, child.outs, self.rootdir, kind))])
        return child

    # -- the main run reaching a lane test
    def reports(self, config: pytest.Config, nodeid: str) -> list[pytest.TestReport]:
        start = time.monotonic()
        try:
            data = self._wait(self.children[0], nodeid)
            if data is None:
                data = self._after_loss(nodeid)
            if data is not None and any(d["outcome"] == "failed" for d in data):
                self.rerun.append((nodeid, _failure_line(data)))
                data = self._alone(nodeid)
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
        """The lane ended without ``nodeid``: every test it did not report goes to one new child
        (once), whose reports for ``nodeid`` these are (None where it has none)."""
        if self._rest is None:
            lane = self.children[0]
            self._rest = self._start("rest", [n for n in lane.nodeids if n not in lane.done])
        if nodeid not in self._rest.nodeids:
            return None
        return self._wait(self._rest, nodeid)

    def close(self) -> None:
        """The lane's files removed (its children are killed with the other early runs)."""
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)

    def summary(self) -> list[str]:
        if not self.active:
            return []
        lines = [
            f"{len(self.nodeids)} unit tests ran in the lane ({WORKERS} workers); the main run waited {self.waited_s:.0f} s for them"
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
        (_module(nodeid), None, nodeid),
        {},
        "failed",
        "the unit lane's children ended without running this test",
        "call",
    )


LANE = Lane()

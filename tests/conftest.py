"""Suite-wide hooks: the report's closing section names the instruction sets the native CPU ops
ran in this run (the main run's, and each lowered run's from tests/unit/test_isa_lowering.py);
under SRT_TEST_OVERLAP_SCHEDULE=1 overlap scheduling is on by default (tests/helpers/overlap.py);
the early runs the selected tests ask for start when collection ends and stop with the session
(tests/helpers/early_runs.py); the unit tests run in the unit lane's workers and are reported
here as the main run reaches them (tests/helpers/unit_lane.py)."""

from __future__ import annotations

import pytest

from tests.helpers import early_runs, isa, overlap, unit_lane
from tests.helpers.isa import ISA_RUNS


def pytest_configure(config: pytest.Config) -> None:
    config.stash[ISA_RUNS] = []
    unit_lane.configure(config)
    if overlap.forced():
        overlap.force_default_on()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if unit_lane.in_child():
        items[:] = unit_lane.child_filter(items)


def pytest_collection_finish(session: pytest.Session) -> None:
    if early_runs.enabled(session.config):
        early_runs.RUNS.schedule(early_runs.requested(session.items))
        unit_lane.LANE.schedule(session.config, session.items)  # queued behind the early runs


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    """A lane test: its reports from the lane, logged as if it had run here. In a lane worker, a
    test of a module the other worker took: not run (nor reported) here."""
    if unit_lane.in_child():
        return None if unit_lane.claim(item) else True
    if not unit_lane.LANE.active or item.nodeid not in unit_lane.LANE.nodeids:
        return None
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for report in unit_lane.LANE.reports(item.config, item.nodeid):
        item.ihook.pytest_runtest_logreport(report=report)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if unit_lane.in_child():
        unit_lane.child_write(report)


def pytest_sessionfinish(session: pytest.Session) -> None:
    early_runs.RUNS.close()
    unit_lane.LANE.close()


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    lines = list(config.stash.get(ISA_RUNS, []))
    if isa.cpu_isa.cache_info().currsize:  # only when some test asked
        lines.insert(0, f"this run: ops ran {isa.cpu_isa()} (CPU: {isa.hardware_isa()})")
    if lines:
        terminalreporter.section("native CPU kernels by instruction set")
        for line in lines:
            terminalreporter.write_line(line)
    if lane := unit_lane.LANE.summary():
        terminalreporter.section("unit lane")
        for line in lane:
            terminalreporter.write_line(line)

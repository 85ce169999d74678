"""Suite-wide hooks: the report's closing section names the instruction sets the native CPU ops
ran in this run (the main run's, and each lowered run's from tests/unit/test_isa_lowering.py);
under SRT_TEST_OVERLAP_SCHEDULE=1 overlap scheduling is on by default (tests/helpers/overlap.py);
the early runs the selected tests ask for start when collection ends and stop with the session
(tests/helpers/early_runs.py)."""

from __future__ import annotations

import pytest

from tests.helpers import early_runs, isa, overlap
from tests.helpers.isa import ISA_RUNS


def pytest_configure(config: pytest.Config) -> None:
    config.stash[ISA_RUNS] = []
    if overlap.forced():
        overlap.force_default_on()


def pytest_collection_finish(session: pytest.Session) -> None:
    if early_runs.enabled(session.config):
        early_runs.RUNS.schedule(early_runs.requested(session.items))


def pytest_sessionfinish(session: pytest.Session) -> None:
    early_runs.RUNS.close()


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    lines = list(config.stash.get(ISA_RUNS, []))
    if isa.cpu_isa.cache_info().currsize:  # only when some test asked
        lines.insert(0, f"this run: ops ran {isa.cpu_isa()} (CPU: {isa.hardware_isa()})")
    if lines:
        terminalreporter.section("native CPU kernels by instruction set")
        for line in lines:
            terminalreporter.write_line(line)

"""The unit lane (tests/helpers/unit_lane.py), run for real: a pytest run of a small project with
this repository's tests/conftest.py, whose unit tests pass, skip, fail, fail only in the lane's
child, and end the lane's child; the run's outcomes must be those of the tests, each reported once,
with the lane's reruns named in the summary."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.helpers import early_runs, unit_lane

REPO = Path(__file__).resolve().parents[2]

UNIT = """
    import os, sys, pytest

    RUN = os.environ.get("SRT_TEST_LANE_RUN")

    def test_passes():
        print("pid", os.getpid())
        assert os.environ.get("SRT_TEST_EARLY_RUN") == "1"  # it ran in a child

    def test_skips():
        pytest.skip("nothing to do here")

    def test_fails():
        assert 1 + 1 == 3

    def test_fails_only_in_the_lane():
        assert RUN != "lane"

    @pytest.mark.parametrize("n", [1, 2])
    def test_param(n):
        assert n in (1, 2)

    @pytest.mark.no_lane("reads this process")
    def test_stays_in_the_main_run():
        assert os.environ.get("SRT_TEST_EARLY_RUN") != "1"
"""

CRASH = """
    import os

    def test_before():
        pass

    def test_crashes_the_lane():
        if os.environ.get("SRT_TEST_LANE_RUN") == "lane":
            os._exit(3)

    def test_after():
        pass
"""

INTEGRATION = """
    import time

    def test_slow():
        time.sleep(1.0)
"""


def _project(tmp_path: Path, unit: dict[str, str]) -> Path:
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    (tmp_path / "tests" / "integration").mkdir()
    for name, text in unit.items():
        (tmp_path / "tests" / "unit" / name).write_text(textwrap.dedent(text))
    (tmp_path / "tests" / "integration" / "test_b.py").write_text(textwrap.dedent(INTEGRATION))
    (tmp_path / "conftest.py").write_text("from tests.conftest import *  # noqa: F401,F403\n")
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nmarkers =\n    no_lane(reason): x\n    early_run(key, command): x\n"
    )
    return tmp_path


def _run(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SRT_TEST_LANE", early_runs.CHILD_ENV))}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-rA",
            "-p",
            "no:cacheprovider",
            f"--junitxml={root / 'j.xml'}",
            *args,
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _outcomes(out: str) -> dict[str, list[str]]:
    got: dict[str, list[str]] = {}
    for outcome, nodeid in re.findall(r"^(PASSED|FAILED|SKIPPED|ERROR) (\S+?)(?: -|$)", out, re.M):
        got.setdefault(nodeid, []).append(outcome)
    return got


MODULE = """
    import os, pathlib

    def test_records_its_worker():
        log = pathlib.Path(__file__).parents[2] / "workers.log"
        with open(log, "a") as f:
            f.write(f"{pathlib.Path(__file__).name} {os.environ.get('SRT_TEST_LANE_ORDER')} {os.getpid()}\\n")
"""


def test_outcomes_come_from_the_lane(tmp_path):
    names = [f"test_m{i}.py" for i in range(4)]
    root = _project(tmp_path, {"test_a.py": UNIT, **dict.fromkeys(names, MODULE)})
    proc = _run(root)
    out = proc.stdout
    assert proc.returncode == 1, out
    got = _outcomes(out)
    unit = "tests/unit/test_a.py::"
    assert got[unit + "test_passes"] == ["PASSED"]
    assert got[unit + "test_fails"] == ["FAILED"]
    assert got[unit + "test_fails_only_in_the_lane"] == ["PASSED"]  # its rerun alone passed
    assert got[unit + "test_param[1]"] == got[unit + "test_param[2]"] == ["PASSED"]
    assert got[unit + "test_stays_in_the_main_run"] == ["PASSED"]
    assert got["tests/integration/test_b.py::test_slow"] == ["PASSED"]
    assert "nothing to do here" in out
    assert "assert (1 + 1) == 3" in out  # the lane's failure shown in full
    assert (
        "failed in the lane, then run again alone: tests/unit/test_a.py::test_fails_only_in_the_lane" in out
    )
    assert "failed in the lane, then run again alone: tests/unit/test_a.py::test_fails " in out
    assert "10 unit tests ran in the lane (2 workers)" in out
    assert "1 failed, 10 passed, 1 skipped" in out
    junit = (root / "j.xml").read_text()
    assert junit.count("<testcase ") == 12
    # the workers took the modules between them, each module once
    rows = [line.split() for line in (root / "workers.log").read_text().splitlines()]
    assert sorted(r[0] for r in rows) == names
    assert {r[1] for r in rows} <= {"forward", "reverse"}
    assert len({r[2] for r in rows}) == len({r[1] for r in rows})  # one process per worker


def test_a_lane_that_ends_early_is_finished_by_another_child(tmp_path):
    root = _project(tmp_path, {"test_a.py": "def test_first():\n    pass\n", "test_c.py": CRASH})
    proc = _run(root)
    assert proc.returncode == 0, proc.stdout
    got = _outcomes(proc.stdout)
    for name in (
        "test_a.py::test_first",
        "test_c.py::test_before",
        "test_c.py::test_crashes_the_lane",
        "test_c.py::test_after",
    ):
        assert got["tests/unit/" + name] == ["PASSED"], proc.stdout
    assert "never reported" not in proc.stdout


def test_no_lane_without_integration_tests(tmp_path):
    root = _project(tmp_path, {"test_a.py": UNIT})
    proc = _run(root, "tests/unit", "-k", "passes or stays")
    assert "unit lane" not in proc.stdout
    got = _outcomes(proc.stdout)
    assert got["tests/unit/test_a.py::test_stays_in_the_main_run"] == ["PASSED"]
    assert got["tests/unit/test_a.py::test_passes"] == ["FAILED"]  # ran here, not in a child


def test_child_reads_partial_lines(tmp_path):
    out = tmp_path / "r.jsonl"
    child = unit_lane._Child("k", [out], ["a", "b"])
    line = json.dumps({"nodeid": "a", "when": "teardown", "outcome": "passed"})
    out.write_text(json.dumps({"nodeid": "a", "when": "call", "outcome": "passed"}) + "\n" + line[:10])
    child.read()
    assert child.done == set() and len(child.reports["a"]) == 1
    with open(out, "a") as f:
        f.write(line[10:] + "\n")
    child.read()
    assert child.done == {"a"} and [d["when"] for d in child.reports["a"]] == ["call", "teardown"]

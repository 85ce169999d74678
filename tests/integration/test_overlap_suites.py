"""The scheduler and server suites again with overlap scheduling on (SRT_TEST_OVERLAP_SCHEDULE=1,
tests/helpers/overlap.py): aborts, deadlines, control requests, stream intervals and priorities
in-process with the KV-checking fake model; grammars, stop strings, streaming and the OpenAI routes
with the default model. Each run is a child pytest that must pass in full. The Engine's suite and
the server-flag suite are left out of this run (they add a minute): overlap lives in the scheduler,
which the Engine and the HTTP server reach the same way, and the exactness suites
(test_scheduler_exactness.py, test_serving_modes_helper.py) run the real model with overlap on."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.helpers import overlap
from tests.helpers.server import DEFAULT_TEST_ARGS

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUITES = [
    "tests/integration/test_scheduler_abort.py",
    "tests/integration/test_scheduler_deadlines.py",
    "tests/integration/test_scheduler_control.py",
    "tests/integration/test_scheduler_flags.py",
    "tests/integration/test_structured_output.py",
    "tests/integration/test_server_openai.py",
]


def test_servers_get_the_flag_only_under_the_variable(monkeypatch):
    monkeypatch.delenv(overlap.ENV, raising=False)
    assert overlap.server_args(DEFAULT_TEST_ARGS) == DEFAULT_TEST_ARGS
    monkeypatch.setenv(overlap.ENV, "1")
    assert overlap.server_args(DEFAULT_TEST_ARGS)[-1] == "--enable-overlap-schedule"
    chosen = [*DEFAULT_TEST_ARGS, "--disable-overlap-schedule"]
    assert overlap.server_args(chosen) == chosen
    assert "--enable-overlap-schedule" not in overlap.server_args(["--tp-size", "2"])


def test_scheduler_and_server_suites_pass_with_overlap_on():
    env = {**os.environ, overlap.ENV: "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SUITES]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) > 60, tail

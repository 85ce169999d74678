"""Fuzz srt's HTTP API from its own OpenAPI document (GET /openapi.json) with schemathesis.

    python benchmarks/fuzz_openapi.py                     # thousands of cases (about 10-20 min)
    python benchmarks/fuzz_openapi.py --max-examples 20 --phases fuzzing,stateful   # shorter
    python benchmarks/fuzz_openapi.py --url http://host:port   # a server already running

Every route and method of the document is exercised (request bodies from the routes' request
types, `srt.entrypoints.http.openapi`), in schemathesis' coverage, fuzzing and stateful phases
(the stateful phase follows the document's links: /tokenize's tokens into /detokenize). A run
passes when:

- no response is a 5xx (``not_a_server_error``);
- every response matches the document: its status code, media type, headers and body schema
  (``status_code_conformance``, ``content_type_conformance``, ``response_headers_conformance``,
  ``response_schema_conformance``);
- no request outlives ``--request-timeout`` seconds (a hang is a network error, a failure);
- afterwards the server is healthy (GET /health is 200), the scheduler idle with its KV pool
  whole (free + evictable == total, nothing locked) and every slot free after /flush_cache.

Without ``--url`` the script starts a server with a short context (``--context-length 64``: a
generation that asks for "as many tokens as fit" ends within seconds on a CPU) in a temporary
working directory (the profiler's relative output directories land there). The CI test
(tests/integration/test_fuzz_openapi.py) runs the same function with a few hundred cases.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import requests

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.helpers.server import REPO_ROOT, ServerProcess  # noqa: E402

CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
)
FUZZ_SERVER_ARGS = ["--max-total-tokens", "4096", "--context-length", "64", "--log-level", "warning"]


@dataclass
class FuzzResult:
    exit_code: int  # schemathesis' (0: every check passed on every case)
    cases: int  # test cases generated and sent
    output: str  # schemathesis' report
    problems: list[str] = field(default_factory=list)  # server state after the run

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.problems


def _st() -> str:
    return os.path.join(os.path.dirname(sys.executable), "st")


def scheduler_state(url: str) -> dict:
    states = requests.get(url + "/get_server_info", timeout=30).json()["internal_states"]
    return states[0]


def server_problems(url: str, idle_timeout_s: float = 60.0) -> list[str]:
    """What is wrong with the server after a run: unhealthy, not idle, KV slots held."""
    problems = []
    health = requests.get(url + "/health", timeout=30).status_code
    if health != 200:
        return [f"/health answered {health}"]
    deadline = time.monotonic() + idle_timeout_s
    s = scheduler_state(url)
    while (s["num_running_reqs"] or s["num_queued_reqs"]) and time.monotonic() < deadline:
        time.sleep(0.2)
        s = scheduler_state(url)
    total = s["max_total_num_tokens"]
    if s["num_running_reqs"] or s["num_queued_reqs"]:
        problems.append(f"not idle: {s['num_running_reqs']} running, {s['num_queued_reqs']} queued")
    if s["available_size"] + s["evictable_size"] != total or s.get("protected_size", 0):
        problems.append(f"KV pool not whole: {s}")
    requests.post(url + "/stop_profile", timeout=60)  # a profile the fuzzer started and left running
    flushed = requests.post(url + "/flush_cache", timeout=60)
    if flushed.status_code != 200 or scheduler_state(url)["available_size"] != total:
        problems.append(f"after /flush_cache ({flushed.status_code}) not every slot is free")
    return problems


def run_fuzz(
    url: str,
    max_examples: int,
    phases: str = "examples,coverage,fuzzing,stateful",
    request_timeout_s: float = 60.0,
    workers: int = 2,
    seed: int | None = 0,
) -> FuzzResult:
    cmd = [
        _st(), "run", url + "/openapi.json",
        "--checks", ",".join(CHECKS),
        "--phases", phases,
        "--max-examples", str(max_examples),
        "--request-timeout", str(request_timeout_s),
        "--workers", str(workers),
        "--suppress-health-check", "all",
        "--no-color",
        *(["--seed", str(seed)] if seed is not None else []),
    ]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="srt-fuzz-st-") as cwd:  # its example database goes there
        env = {**os.environ, "NO_COLOR": "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd)
    output = proc.stdout + proc.stderr
    found = re.search(r"(\d+) generated", output)
    return FuzzResult(proc.returncode, int(found.group(1)) if found else 0, output, server_problems(url))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="fuzz this running server instead of starting one")
    p.add_argument("--max-examples", type=int, default=100, help="cases per operation and phase")
    p.add_argument("--phases", default="examples,coverage,fuzzing,stateful")
    p.add_argument("--request-timeout", type=float, default=60.0, help="a request slower than this fails")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=None)
    args = p.parse_args(argv)
    kwargs = dict(
        max_examples=args.max_examples,
        phases=args.phases,
        request_timeout_s=args.request_timeout,
        workers=args.workers,
        seed=args.seed,
    )
    if args.url:
        result = run_fuzz(args.url.rstrip("/"), **kwargs)
    else:
        with tempfile.TemporaryDirectory(prefix="srt-fuzz-") as cwd:
            env = {"PYTHONPATH": REPO_ROOT}
            with ServerProcess(FUZZ_SERVER_ARGS, env=env, cwd=cwd) as server:
                result = run_fuzz(server.base_url, **kwargs)
    print(result.output)
    print(f"cases: {result.cases}; schemathesis exit code {result.exit_code}")
    for problem in result.problems:
        print("server problem:", problem)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())

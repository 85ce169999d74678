"""The step runner of ``make gpu-check`` (``benchmarks/gpu/gpu_check.py``): a ``Step`` is a child
process with its own time budget (and a minimum below which it is skipped); a ``Check`` is one
run, its folder, deadline and JSON record, rewritten (with ``summary.md``) after every step and
copied to ``$OUT`` when set. A step that overruns is stopped with its process group; its log's
tail and the JSON it wrote or printed last are kept. Standard library only."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.gpu import report
from benchmarks.gpu.wheels import REPO

LOG_TAIL = 4000


@dataclass(slots=True)
class Step:
    name: str
    argv: list[str]
    budget_s: float  # the most it may run
    min_s: float  # skipped when less than this is left
    result_file: Path | None = None  # JSON it writes (read even after a timeout)
    extra: dict = field(default_factory=dict)  # recorded with the step


class Check:
    """One run: its folder, deadline, JSON record and the environment of its steps."""

    def __init__(self, run_dir: Path, budget_s: float, out_dir: Path | None) -> None:
        self.run_dir, self.out_dir = run_dir, out_dir
        self.start = time.monotonic()
        self.deadline = self.start + budget_s
        self.record: dict = {
            "schema": "srt-gpu-check/1",
            "started_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "budget_s": budget_s,
            "status": "running",
            "steps": {},
        }
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
        run_dir.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def note(self, name: str, status: str, detail: str = "", **extra) -> None:
        self.record["steps"][name] = {"status": status, "detail": detail, **extra}
        self.write()

    def run(self, step: Step) -> dict | None:
        """Run ``step`` within its budget; returns the JSON it wrote or printed last (None if none)."""
        left = self.left()
        if left < step.min_s:
            self.note(
                step.name, "skipped", f"{left:.0f} s left of the run's budget, needs {step.min_s:.0f} s"
            )
            return None
        budget = min(step.budget_s, left)
        log = self.run_dir / f"{step.name.replace(':', '_')}.log"
        self.note(step.name, "running", f"started with a {budget:.0f} s budget")
        t0 = time.monotonic()
        try:
            rc, timed_out = _run_with_timeout(step.argv, log, budget, self.env)
        except BaseException:  # stopped from outside: keep what the step printed and wrote
            self._finish(step, log, t0, budget, None, "interrupted", "the run was stopped during this step")
            raise
        if timed_out:
            return self._finish(
                step, log, t0, budget, rc, "timeout", f"stopped after its {budget:.0f} s budget"
            )
        return self._finish(step, log, t0, budget, rc, "ok" if rc == 0 else "failed", "")

    def _finish(
        self, step: Step, log: Path, t0: float, budget: float, rc: int | None, status: str, detail: str
    ) -> dict | None:
        """Record a finished step; returns the JSON it wrote (``result_file``) or printed last."""
        text = log.read_text(errors="replace") if log.is_file() else ""
        data = _read_json(step.result_file) if step.result_file else _last_json_line(text)
        if status == "failed":
            detail = f"exit status {rc}: {_last_line(text)}"
        wall = round(time.monotonic() - t0, 1)
        extra = {"wall_s": wall, "budget_s": round(budget), "rc": rc, "log": text[-LOG_TAIL:]}
        if status == "interrupted" and data:
            extra["result"] = data
        self.note(step.name, status, detail, **extra)
        return data

    def write(self) -> None:
        self.record["elapsed_s"] = round(time.monotonic() - self.start, 1)
        files = {
            "gpu_check.json": json.dumps(self.record, indent=1),
            "summary.md": report.summary_markdown(self.record),
        }
        if self.out_dir is not None:  # the step logs, each cut to its end (the device tool returns 8 files)
            logs = sorted(self.run_dir.glob("*.log"))
            files["steps.log"] = "".join(
                f"===== {p.name}\n{p.read_text(errors='replace')[-20000:]}\n" for p in logs
            )
        for folder in filter(None, (self.run_dir, self.out_dir)):
            folder.mkdir(parents=True, exist_ok=True)
            for name, text in files.items():
                (folder / name).write_text(text)


def _run_with_timeout(argv: list[str], log: Path, budget: float, env: dict) -> tuple[int, bool]:
    """Run ``argv`` in its own process group (same session: whoever ends this run's session ends
    it too) with output to ``log``; (exit status, timed out). An exception here (SIGTERM turned
    into SystemExit, Ctrl-C) stops the child's group before it propagates."""
    with log.open("w") as f:
        f.write(f"$ {' '.join(argv)}\n")
        f.flush()
        proc = subprocess.Popen(
            argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO, preexec_fn=os.setpgrp
        )
        try:
            return proc.wait(timeout=budget), False
        except subprocess.TimeoutExpired:
            return _stop_group(proc), True
        except BaseException:
            _stop_group(proc)
            raise


def _stop_group(proc: subprocess.Popen) -> int:
    """SIGTERM to the child's process group, SIGKILL if it lingers; its exit status."""
    for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            return proc.wait(timeout=grace)
        except ProcessLookupError:
            return proc.wait()
        except subprocess.TimeoutExpired:
            continue
    return -9


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _last_json_line(text: str) -> dict | None:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def _last_line(text: str) -> str:
    lines = [s for s in text.strip().splitlines() if s.strip()]
    return lines[-1][:300] if lines else ""

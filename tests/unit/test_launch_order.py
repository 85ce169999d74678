"""The order of a launch's first seconds: ``python -m srt.launch_server`` starts the scheduler (the
last child to be ready) before it imports its HTTP app, which it imports while the children start
(`launch_subprocesses`' ``while_starting``)."""

from __future__ import annotations

import asyncio
import functools
import json
import subprocess
import sys

import psutil

from srt.entrypoints.launch import launch_subprocesses
from srt.server_args import ServerArgs
from tests.helpers.fake_scheduler import run_fake_scheduler_after_file


def test_the_launch_path_imports_no_app_torch_or_transformers_before_the_children_start():
    code = (
        "import sys, json; import srt.launch_server, srt.entrypoints.http_server, srt.entrypoints.launch; "
        "print(json.dumps({m: m in sys.modules for m in ('fastapi', 'uvicorn', 'starlette', 'torch', 'transformers')}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout) == dict.fromkeys(
        ("fastapi", "uvicorn", "starlette", "torch", "transformers"), False
    )


def test_while_starting_runs_once_the_children_started_and_before_they_are_ready(tmp_path):
    gate = tmp_path / "gate"
    seen = []

    def while_starting() -> None:
        seen.append({c.pid for c in psutil.Process().children()})
        gate.write_text("")  # the scheduler becomes ready only now

    entry = functools.partial(run_fake_scheduler_after_file, str(gate))
    args = ServerArgs(log_level="warning", skip_tokenizer_init=True)
    tm, info = launch_subprocesses(args, scheduler_entry=entry, while_starting=while_starting)
    try:
        assert len(seen) == 1 and set(tm.launcher.child_pids.values()) <= seen[0]  # both were running
        assert info.get("max_total_num_tokens")
    finally:
        asyncio.run(tm.close())  # its sockets: a zmq context left to the collector would block the exit
        tm.launcher.shutdown()

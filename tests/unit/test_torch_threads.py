"""Helper threads of the scheduler run torch single-threaded (srt/utils/torch_threads.py): a
torch op on such a thread starts no second OpenMP pool (which would throttle the model's own
team, see the module), the creating thread keeps its thread count, and a plain thread pool's
worker, for contrast, does start one. Runs in a fresh interpreter (its own OpenMP runtime)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_SCRIPT = """
import json, os
from concurrent.futures import ThreadPoolExecutor
import torch
from srt.utils.torch_threads import single_threaded_executor

torch.set_num_threads(2)
x = torch.randn(256, 256)

def work():
    y = torch.randn(1 << 21)
    y.exp_()  # an at::parallel_for over 2M elements
    (x @ x).sum()  # MKL
    return torch.get_num_threads()

def threads():
    return len(os.listdir("/proc/self/task"))

work()  # the main thread's own team exists
r = {"start": threads()}
pool = single_threaded_executor(1, "helper")
r["created"] = threads()
r["helper_threads"] = pool.submit(work).result()
r["after_helper"] = threads()
r["main_threads"] = torch.get_num_threads()
probe = ThreadPoolExecutor(1)  # (every pool stays referenced: a collected one ends its thread)
r["new_thread_default"] = probe.submit(torch.get_num_threads).result()
r["before_plain"] = threads()
plain = ThreadPoolExecutor(1)
plain.submit(work).result()
r["after_plain"] = threads()
print(json.dumps(r))
"""


def test_helper_threads_start_no_second_openmp_pool():
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["created"] == r["start"] + 1  # the helper thread itself
    assert r["helper_threads"] == 1
    assert r["after_helper"] == r["created"]  # its torch ops started no OpenMP worker
    assert r["main_threads"] == 2 and r["new_thread_default"] == 2  # torch's counts put back
    # a plain worker's ops do start a team of its own: the thread, and at least one OpenMP worker
    assert r["after_plain"] >= r["before_plain"] + 2

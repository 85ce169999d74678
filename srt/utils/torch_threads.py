"""Helper threads of the scheduler process: torch single-threaded there.

libgomp (torch's OpenMP runtime) keeps one pool of worker threads per thread that starts a
parallel region. A second pool (a helper thread running a torch op, or an MKL call, with torch's
default thread count) makes libgomp count more threads than CPUs, and from then on every team,
the model's own included, spins only about a thousand iterations before it sleeps on a futex
between parallel regions. A forward runs hundreds of regions with Python in between, so nearly
each one then pays a sleep and a wake-up: a batch-1 decode step went from 26 to 36 ms on a 2-core
machine when the grammar backend loaded on its worker thread.

`single_threaded_executor` is the thread pool for such helpers: each worker sets torch's thread
count to 1 for itself (no team, no pool) before its first task, and the creating thread's count
and torch's default for later threads are put back as they were.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch


def _one_torch_thread() -> None:
    torch.set_num_threads(1)  # this thread's OpenMP and MKL counts, and torch's default for new threads
    torch.get_num_threads()  # torch's per-thread initialisation runs now, with 1


def single_threaded_executor(max_workers: int, thread_name_prefix: str) -> ThreadPoolExecutor:
    """A ``ThreadPoolExecutor`` whose workers run torch (and MKL) on one thread. Its workers are
    started here, so that torch's default thread count can be restored right after."""
    n = torch.get_num_threads()
    pool = ThreadPoolExecutor(max_workers, thread_name_prefix, initializer=_one_torch_thread)
    # every worker starts (and runs the initializer) before the restore: a pool starts one thread
    # per submitted task until it has max_workers, and these tasks hold each worker until all ran
    barrier = threading.Barrier(max_workers)
    for f in [pool.submit(barrier.wait) for _ in range(max_workers)]:
        f.result()
    torch.set_num_threads(n)  # the creating thread's count, and the default for other threads
    return pool

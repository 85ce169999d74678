"""A ``run_ranks`` target (tests/helpers/tp_worker.py) for the shared-memory collectives' dead-peer
check: rank 1 leaves right after the segment is mapped; rank 0 then all-reduces and reports what
it got and how long it waited."""

from __future__ import annotations

import time

import torch

from srt.distributed.shm_comm import ShmComm


def all_reduce_after_peer_exit(rank: int, tp_size: int) -> tuple[str, float]:
    comm = ShmComm.create(rank, tp_size, slot_bytes=1 << 16, timeout_s=60.0)
    if rank != 0:
        return "left", 0.0
    time.sleep(1.0)  # rank 1's process is gone by now
    t0 = time.monotonic()
    try:
        comm.all_reduce(torch.ones(8))
    except RuntimeError as e:
        return str(e), time.monotonic() - t0
    return "no error", time.monotonic() - t0

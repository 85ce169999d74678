"""Start-up of one tensor-parallel rank's process group, and the rank-0 input broadcast.

    rank r: TCPStore(dist_init_addr; rank 0 hosts it) -> set "srt_rank_<r>_ready"
    rank 0: waits (up to --dist-timeout) until every rank's key is there, else LaunchError naming
            the missing ranks (torch's own store timeout does not say which rank is missing)
    all:    init_process_group(gloo on CPU | nccl on CUDA, store, rank, world) -> the DEFAULT
            group is the TP group; plus a gloo group for Python objects (the default one on CPU)

`TPGroup.broadcast_messages` is what the scheduler loop calls once per iteration: rank 0 passes
the raw input messages it received, every rank gets that same list back. A peer that is gone
(exited, or silent for --dist-timeout) raises `GroupLostError`.

Runs in the scheduler process only (imports torch.distributed).
"""

from __future__ import annotations

import datetime
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from srt.utils.errors import LaunchError
from srt.utils.tp_layout import parse_dist_init_addr

logger = logging.getLogger("srt.scheduler")

READY_KEY = "srt_rank_{}_ready"
_POLL_S = 0.2


class GroupLostError(RuntimeError):
    """A collective of the TP group failed: a peer rank exited or stopped answering."""


@dataclass
class TPGroup:
    """This process's place in the TP group (``torch.distributed`` is initialised)."""

    rank: int
    size: int
    backend: str
    object_group: Any  # gloo ProcessGroup for broadcast_object_list

    def broadcast_messages(self, messages: list[bytes] | None) -> list[bytes]:
        """Rank 0 gives ``messages``; every rank returns rank 0's list (others pass None)."""
        box: list[Any] = [messages if self.rank == 0 else None]
        try:
            dist.broadcast_object_list(box, src=0, group=self.object_group)
        except (RuntimeError, dist.DistError) as e:
            raise GroupLostError(f"rank {self.rank}: the tensor-parallel group failed: {e}") from e
        return box[0]

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def wait_for_ranks(store: Any, world_size: int, timeout_s: float) -> list[int]:
    """Poll ``store`` for every rank's ready key until all are there or ``timeout_s`` passed;
    returns the ranks still missing (empty on success)."""
    deadline = time.monotonic() + timeout_s
    missing = list(range(world_size))
    while True:
        missing = [r for r in missing if not store.check([READY_KEY.format(r)])]
        if not missing or time.monotonic() >= deadline:
            return missing
        time.sleep(_POLL_S)


def _open_store(host: str, port: int, rank: int, world_size: int, timeout_s: float) -> Any:
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        return dist.TCPStore(host, port, world_size, rank == 0, timeout, wait_for_workers=False)
    except (RuntimeError, dist.DistError) as e:
        if rank == 0:
            raise LaunchError(
                "scheduler",
                f"rank 0 could not open the rendezvous store at {host}:{port} (--dist-init-addr): {e}",
            ) from e
        raise LaunchError(
            f"scheduler-tp{rank}",
            f"rank {rank} could not reach rank 0's rendezvous at {host}:{port} within {timeout_s:g} s "
            f"(--dist-timeout); is node 0 started with the same --dist-init-addr? ({e})",
        ) from e


def rendezvous(addr: str, rank: int, world_size: int, timeout_s: float) -> Any:
    """Meet at ``addr`` (``host:port``); returns the TCPStore once every rank has joined.

    Raises `LaunchError`: on rank 0 naming the ranks that did not join within ``timeout_s``; on
    other ranks when rank 0's store cannot be reached within ``timeout_s``."""
    host, port = parse_dist_init_addr(addr)
    store = _open_store(host, port, rank, world_size, timeout_s)
    store.set(READY_KEY.format(rank), "1")
    if rank == 0:
        missing = wait_for_ranks(store, world_size, timeout_s)
        if missing:
            names = ", ".join(str(r) for r in missing)
            raise LaunchError(
                "scheduler",
                f"tensor-parallel rendezvous at {addr} timed out after {timeout_s:g} s (--dist-timeout): "
                f"rank(s) {names} of {world_size} never joined; start every node with the same "
                "--tp-size, --nnodes and --dist-init-addr.",
            )
    return store


def init_tp_group(
    addr: str, rank: int, world_size: int, timeout_s: float, device: str, local_rank: int
) -> TPGroup:
    """Rendezvous, then ``init_process_group`` (gloo on CPU, nccl on CUDA with device
    ``cuda:<local_rank>``); collectives time out after ``timeout_s``."""
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    store = rendezvous(addr, rank, world_size, timeout_s)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    object_group = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    logger.info("tensor parallel: rank %d of %d joined (%s, rendezvous %s)", rank, world_size, backend, addr)
    return TPGroup(rank, world_size, backend, object_group)


_PEER_LOST_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "shared-memory collective",  # srt/distributed/shm_comm.py: a peer exited or never arrived
)


def is_group_failure(exc: BaseException) -> bool:
    """True when ``exc`` says a peer of the group is gone (a failed collective anywhere: the
    input broadcast or a layer's all-reduce), as opposed to a bug in this rank."""
    if isinstance(exc, GroupLostError | dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in _PEER_LOST_MARKERS)

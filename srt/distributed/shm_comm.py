"""``ShmComm``: all-reduce and all-gather through shared memory, for TP ranks on one host.

gloo's collectives go through TCP loopback: about half a millisecond each, and a decode step of
a 30-layer model makes 62 of them. Ranks that share a host can instead exchange activations
through one shared-memory segment and meet at a barrier made of sequence flags:

    segment = flags[size] (int64, one per rank) | 2 rounds x size slots x ``slot_bytes``

A collective is one round ``seq`` (counting up, the same on every rank): each rank copies its
part into its slot of buffer ``seq % 2``, stores ``seq`` in its flag, spins until every flag is
``>= seq``, then reads every slot (sum in rank order 0, 1, ..., so every rank computes the same
bits; or the concatenation for a gather). Two buffers make that safe without a second barrier: a
rank can only reuse buffer ``seq % 2`` in round ``seq + 2`` after every rank has set its flag for
``seq + 1``, i.e. after every rank finished reading round ``seq``. Tensors larger than a slot go
in slot-sized pieces, one round each.

Memory ordering: a rank's slot is written (torch copy) before its flag (a separate store), and
read after the other flags were seen; x86's total store order keeps those in order, so this is
enabled on x86-64 only (`supported`), and everywhere else the caller keeps gloo.

The waiting rank spins on the flags and yields its CPU (``os.sched_yield``) after a few thousand
polls, so an oversubscribed host still makes progress. A peer that dies mid-collective would make
the others wait forever: while yielding, the waiting rank checks every ``_LIVENESS_S`` that the
late ranks' processes (pids exchanged at `create`) still exist, and raises a RuntimeError naming
the dead ones at once; a peer that is alive but stuck fails the wait after ``timeout_s``. Either
way the scheduler process then dies and takes its group down, as a failed gloo collective does.

The segment is a file under /dev/shm created by rank 0 and unlinked as soon as every rank has
mapped it, so nothing is left behind whatever way the processes end.
"""

from __future__ import annotations

import mmap
import os
import platform
import socket
import tempfile
import time
import uuid

import numpy as np
import torch
import torch.distributed as dist

DEFAULT_SLOT_BYTES = 4 << 20
_SPINS_BEFORE_YIELD = 2000
_MAX_CACHED_VIEWS = 256
_LIVENESS_S = 0.2


def supported() -> bool:
    """True where the flag protocol's ordering holds (x86-64) and /dev/shm exists."""
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir("/dev/shm")


class ShmComm:
    """Shared-memory collectives of rank ``rank`` of ``size`` (see the module docstring).
    Build it with `create` (a collective over the default gloo group); every rank must call the
    same collectives in the same order."""

    def __init__(self, rank: int, size: int, buf: mmap.mmap, slot_bytes: int, timeout_s: float) -> None:
        self.rank, self.size = rank, size
        self.slot_bytes = slot_bytes
        self.timeout_s = timeout_s
        self._mm = buf
        header = 8 * size
        self._flags = np.frombuffer(buf, dtype=np.int64, count=size)
        data = torch.frombuffer(buf, dtype=torch.uint8, offset=header, count=2 * size * slot_bytes)
        self._slots = data.view(2, size, slot_bytes)
        self._seq = 0
        self._views: dict[tuple[int, int, torch.dtype], list[torch.Tensor]] = {}  # (parity, numel, dtype)
        self.pids: list[int] | None = None  # the ranks' pids, when this process can see them

    @classmethod
    def create(
        cls, rank: int, size: int, slot_bytes: int = DEFAULT_SLOT_BYTES, timeout_s: float = 300.0
    ) -> ShmComm:
        """Map one segment on every rank (rank 0 creates it; the name travels over the default
        group, which must be initialised)."""
        total = 8 * size + 2 * size * slot_bytes
        names: list[str | None] = [None]
        if rank == 0:
            path = os.path.join("/dev/shm", f"srt-tp-{uuid.uuid4().hex}")
            with open(path, "wb") as f:
                f.truncate(total)
            names[0] = path
        dist.broadcast_object_list(names, src=0)
        path = names[0]
        assert path is not None
        with open(path, "r+b") as f:
            buf = mmap.mmap(f.fileno(), total)
        dist.barrier()  # every rank mapped it: the name is no longer needed
        if rank == 0:
            os.unlink(path)
        pids: list[int | None] = [None] * size
        dist.all_gather_object(pids, os.getpid())
        comm = cls(rank, size, buf, slot_bytes, timeout_s)
        if all(p is not None and _alive(p) for p in pids):  # else another pid namespace: no checks
            comm.pids = [int(p) for p in pids if p is not None]
        return comm

    @staticmethod
    def same_host() -> bool:
        """True when every rank of the default group runs on this host (a collective)."""
        hosts: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(hosts, socket.gethostname() + ":" + _boot_id())
        return len(set(hosts)) == 1

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` (CPU, contiguous or not) over the ranks, in place; returns ``x``."""
        contiguous = x.is_contiguous()
        flat = x.view(-1) if contiguous else x.contiguous().view(-1)
        step = self.slot_bytes // flat.element_size()
        n = flat.numel()
        for start in range(0, n, step):
            part = flat if n <= step else flat[start : start + step]
            slots = self._round(part)
            torch.add(slots[0], slots[1], out=part)
            for r in range(2, self.size):
                part.add_(slots[r])
        if not contiguous:
            x.copy_(flat.view_as(x))
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``x`` (same shape and dtype on every rank), in rank order; None when
        ``x`` does not fit in one slot (the caller then uses gloo)."""
        flat = x.contiguous().view(-1)
        if flat.numel() * flat.element_size() > self.slot_bytes:
            return None
        slots = self._round(flat)
        return [s.clone().view_as(x) for s in slots]

    def _round(self, part: torch.Tensor) -> list[torch.Tensor]:
        """One round: publish ``part`` (flat, at most a slot), wait for every rank, return the
        ranks' parts as views of the shared buffer (valid until the round after next)."""
        self._seq += 1
        seq = self._seq
        key = (seq & 1, part.numel(), part.dtype)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= _MAX_CACHED_VIEWS:
                self._views.clear()
            nbytes = part.numel() * part.element_size()
            bufs = self._slots[seq & 1]
            views = self._views[key] = [bufs[r, :nbytes].view(part.dtype) for r in range(self.size)]
        views[self.rank].copy_(part)
        self._flags[self.rank] = seq
        self._wait(seq)
        return views

    def _wait(self, seq: int) -> None:
        flags = self._flags
        spins = 0
        deadline = next_check = 0.0
        while int(flags.min()) < seq:
            spins += 1
            if spins < _SPINS_BEFORE_YIELD:
                continue
            os.sched_yield()
            now = time.monotonic()
            if deadline == 0.0:
                deadline, next_check = now + self.timeout_s, now + _LIVENESS_S
                continue
            if now > deadline:
                late = [r for r in range(self.size) if int(flags[r]) < seq]
                raise RuntimeError(f"tensor-parallel shared-memory collective: rank(s) {late} did not arrive")
            if self.pids is not None and now > next_check:
                next_check = now + _LIVENESS_S
                dead = [r for r in range(self.size) if int(flags[r]) < seq and not _alive(self.pids[r])]
                if dead:
                    raise RuntimeError(f"tensor-parallel shared-memory collective: rank(s) {dead} exited")


def _boot_id() -> str:
    """This machine's boot id (two containers may share a hostname, not a /dev/shm)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return tempfile.gettempdir()


def _alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie (a killed child its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False

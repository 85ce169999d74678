"""``TPInfo``: this process's place in its tensor-parallel group, and the collectives the
sharded layers need, over torch.distributed's default process group.

The default group is the TP group (world size == tp size, rank == tp rank); whoever starts the
scheduler processes calls ``torch.distributed.init_process_group`` (gloo on CPU, NCCL on CUDA)
before building the ModelRunner. With ``size == 1`` every collective returns its input unchanged
and torch.distributed is never touched, so a single-rank model runs exactly as without TP.

Every rank must call the same collectives in the same order (each layer's forward does, since
all ranks run identical batches).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from srt.distributed.shm_comm import ShmComm
from srt.distributed.shm_comm import supported as shm_supported

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TPInfo:
    """Rank ``rank`` of ``size`` ranks (``0 <= rank < size``). ``shm``: the shared-memory
    collectives (`with_shared_memory`) that replace gloo's all-reduce and all-gather when every
    rank runs on this host."""

    rank: int = 0
    size: int = 1
    shm: ShmComm | None = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"bad tensor-parallel rank {self.rank} of {self.size}")

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def check_group(self) -> None:
        """Raise ``RuntimeError`` unless the default process group matches this TPInfo."""
        if not self.enabled:
            return
        if not dist.is_initialized():
            raise RuntimeError(
                f"tensor parallelism (size {self.size}) needs torch.distributed.init_process_group first"
            )
        if dist.get_world_size() != self.size or dist.get_rank() != self.rank:
            raise RuntimeError(
                f"default process group is rank {dist.get_rank()} of {dist.get_world_size()}, "
                f"expected rank {self.rank} of {self.size}"
            )

    def with_shared_memory(self, device: str, enabled: bool = True) -> TPInfo:
        """This TPInfo with shared-memory collectives when ``enabled``, the tensors live on the CPU,
        the host supports them and every rank is on this host (decided by a collective, so every
        rank decides the same); otherwise this TPInfo unchanged (gloo / NCCL). Logs which."""
        if not self.enabled:
            return self
        if not enabled or device != "cpu" or not shm_supported():
            logger.info("tensor-parallel collectives: %s", dist.get_backend())
            return self
        if not ShmComm.same_host():
            logger.info("tensor-parallel collectives: gloo (ranks on more than one host)")
            return self
        logger.info("tensor-parallel collectives: shared memory (all ranks on this host)")
        return dataclasses.replace(self, shm=ShmComm.create(self.rank, self.size))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``."""
        if self.shm is not None:
            return self.shm.all_reduce(x)
        if self.enabled:
            dist.all_reduce(x)
        return x

    def all_gather_last_dim(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """``[..., sizes[rank]]`` on each rank -> ``[..., sum(sizes)]``, the ranks' parts in rank
        order. Uneven parts are padded to ``max(sizes)`` for the collective and cut after."""
        if not self.enabled:
            return x
        width = max(sizes)
        local = x.contiguous()
        if local.shape[-1] < width:
            local = torch.nn.functional.pad(local, (0, width - local.shape[-1]))
        parts = self.shm.all_gather(local) if self.shm is not None else None
        if parts is None:
            parts = [torch.empty_like(local) for _ in range(self.size)]
            dist.all_gather(parts, local)
        return torch.cat([p[..., :n] for p, n in zip(parts, sizes, strict=True)], dim=-1)

    def all_reduce_min(self, value: int) -> int:
        """The smallest ``value`` over the ranks (e.g. the KV pool size every rank can hold)."""
        if not self.enabled:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        if dist.get_backend() == "nccl":
            t = t.cuda()
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

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

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class TPInfo:
    """Rank ``rank`` of ``size`` ranks (``0 <= rank < size``)."""

    rank: int = 0
    size: int = 1

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

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``."""
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

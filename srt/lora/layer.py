"""The batched low-rank update of one step.

``LoRABatch.build`` turns the batch's per-sequence adapter slots into row groups once per step:
for each slot used, the rows of its sequences, as a slice when they are one run of rows, else as
an index tensor. Each ``Linear`` an adapter touches carries a ``LinearLoRA`` (``linear.lora``):
its update per slot (``LinearLoRAWeights``, set when an adapter takes a slot) and a reference to
the ``LoRAState`` the runner sets each step. Its ``__call__(x, out)`` adds, per slot group, the
update of those rows, one pair of matmuls per adapter (the way MoE groups tokens by expert)::

    run of rows a..b:   out[a:b] += (x[a:b] @ A.T) @ B.T        (in place, no copies)
    scattered rows i:   out.index_add_(0, i, (x[i] @ A.T) @ B.T)

Rows of the base model (slot -1) and slots the layer has no update for cost nothing. When every
group is a run of rows (the scheduler orders a decode batch's requests by slot) and the native CPU
kernels are loaded, the whole layer's update is one call (``torch.ops.srt_cpu.lora_segments_``,
srt/kernels/cpu/lora.cpp: the same ATen ops from C++).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from srt.kernels import cpu as cpu_kernels
from srt.lora.adapter import LinearLoRAWeights


@dataclass(frozen=True)
class LoRABatch:
    """One step's rows per adapter slot (``groups``: (slot, slice or int64 row indices))."""

    num_rows: int
    groups: tuple[tuple[int, slice | torch.Tensor], ...]
    runs_only: bool = False  # every group a slice (one run of rows)
    version: int = 0  # the adapters' slot tables' version (LoRAManager.version) when built

    @classmethod
    def build(
        cls, slots: list[int], rows_per_seq: list[int], device: torch.device | str, version: int = 0
    ) -> LoRABatch | None:
        """``slots[i]``: sequence i's slot (-1: the base model); ``rows_per_seq[i]``: its rows this
        step, in order. None when no sequence runs an adapter."""
        runs: dict[int, list[tuple[int, int]]] = {}
        start = 0
        for slot, n in zip(slots, rows_per_seq):
            if slot >= 0 and n:
                spans = runs.setdefault(slot, [])
                if spans and spans[-1][1] == start:
                    spans[-1] = (spans[-1][0], start + n)
                else:
                    spans.append((start, start + n))
            start += n
        if not runs:
            return None
        groups: list[tuple[int, slice | torch.Tensor]] = []
        for slot, spans in runs.items():
            if len(spans) == 1:
                groups.append((slot, slice(*spans[0])))
            else:
                idx = torch.cat([torch.arange(a, b) for a, b in spans]).to(device)
                groups.append((slot, idx))
        return cls(start, tuple(groups), all(isinstance(rows, slice) for _, rows in groups), version)


class LoRAState:
    """What every LinearLoRA of a model reads: the current step's ``LoRABatch`` (None: no row
    runs an adapter)."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None


class LinearLoRA:
    """The adapters' updates of one Linear, per slot (see the module docstring)."""

    def __init__(self, state: LoRAState) -> None:
        self.state = state
        self.slots: dict[int, LinearLoRAWeights] = {}

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        batch = self.state.batch
        if batch is None or not self.slots:
            return out
        x2, out2 = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
        if x2.shape[0] != batch.num_rows:
            raise RuntimeError(f"LoRA: a linear ran {x2.shape[0]} rows of a {batch.num_rows}-row batch")
        if batch.runs_only and x2.device.type == "cpu" and cpu_kernels.native_available():
            self._native(batch, x2, out2)
            return out
        for slot, rows in batch.groups:
            w = self.slots.get(slot)
            if w is None:
                continue
            if isinstance(rows, slice):
                out2[rows].addmm_(x2[rows] @ w.A.t(), w.B.t())
            else:
                out2.index_add_(0, rows, (x2.index_select(0, rows) @ w.A.t()) @ w.B.t())
        return out

    def _native(self, batch: LoRABatch, x: torch.Tensor, out: torch.Tensor) -> None:
        a: list[torch.Tensor] = []
        b: list[torch.Tensor] = []
        starts: list[int] = []
        ends: list[int] = []
        for slot, rows in batch.groups:
            w = self.slots.get(slot)
            if w is not None:
                a.append(w.A)
                b.append(w.B)
                starts.append(rows.start)  # type: ignore[union-attr]
                ends.append(rows.stop)  # type: ignore[union-attr]
        if a:
            torch.ops.srt_cpu.lora_segments_(out, x, a, b, starts, ends)

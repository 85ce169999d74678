"""W8A8 matmuls (a compressed-tensors W8A8 checkpoint's layers): which int8 kernels this CPU has and
the codes and scales back from their packed weights.

``gguf_pack_w8a8(data, layout)`` packs Q8_0 rows of one scale each once at load, in one of two
layouts: ``"groups"`` (w8a8_linear.cpp: groups of 4 rows for AVX-512 VNNI tiles) or ``"amx"``
(w8a8_amx.cpp: panels of 64 rows for ATen's brgemm on AMX-INT8 tiles); ``gguf_linear_w8a8``
takes either and gives the same outputs bit for bit.
"""

from __future__ import annotations

import torch

from srt.kernels.cpu import _op_registered


def w8a8_fast() -> bool:
    """Whether ``gguf_linear_w8a8`` (w8a8_linear.cpp: int8 rows of one scale each times x quantized
    to int8 per row) has its vector path here (AVX-512 VNNI, not lowered by SRT_CPU_ISA)."""
    return _op_registered("gguf_w8a8_fast") and bool(torch.ops.srt_cpu.gguf_w8a8_fast())


def w8a8_amx() -> bool:
    """Whether this CPU has AMX-INT8 tiles for ``gguf_linear_w8a8`` (CPUID, ``SRT_CPU_ISA`` not
    lowered, oneDNN not capped below AMX). Whether the tiles run without trapping is the bf16
    probe's to say (srt/configs/bf16_probe.py: it runs AMX tiles in a child process)."""
    return _op_registered("gguf_w8a8_amx") and bool(torch.ops.srt_cpu.gguf_w8a8_amx())


def unpack_w8a8(packed: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``gguf_pack_w8a8``'s groups or AMX panels -> (int8 codes ``[rows, cols]``, float32 scales
    ``[rows]``)."""
    if packed.shape[1] == 256 + 64 * cols:  # panels of 64 rows: 64 scales, then codes [K / 4, 64, 4]
        panels = packed.shape[0]
        scales = packed[:, :256].contiguous().view(torch.float32).reshape(-1)[:rows]
        codes = packed[:, 256:].reshape(panels, cols // 4, 64, 4).permute(0, 2, 1, 3)
        return codes.reshape(panels * 64, cols)[:rows].view(torch.int8).contiguous(), scales.clone()
    groups = packed.shape[0]
    scales = packed[:, :16].contiguous().view(torch.float32).reshape(-1)[:rows]
    codes = (packed[:, 16:].reshape(groups, -1, 4, 64) ^ 0x80).view(torch.int8)
    codes = codes.permute(0, 2, 1, 3).reshape(groups * 4, -1)[:rows, :cols]
    return codes.contiguous(), scales.clone()

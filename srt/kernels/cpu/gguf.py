"""Linear layers and dequantization on GGUF-quantized weights, kept in their GGUF blocks.

A quantized weight [N, K] is stored as GGUF stores it: uint8 [N, K / block_size * type_size],
each row K / block_size blocks of ``type_size`` bytes (``block_info``; Q4_0, Q4_1, Q8_0: 32
weights with one fp16 scale; Q4_K, Q5_K, Q6_K: super-blocks of 256 with 6/8-bit sub-block
scales). The native ops (gguf_linear.cpp, row functions gguf_simple.cpp / gguf_kquant.cpp)
dequantize exactly as ``gguf.quants`` does and accumulate in float32:

    quant_linear(x [..., K] f32, data, qtype, bias) -> [..., N]   x @ dequantize(data).T + bias
    dequantize(data [R, bpr] u8, qtype, cols) -> [R, cols] f32     bit for bit gguf.quants

``quant_linear`` picks a native path by the number of rows M of x: for a few rows (decode,
M <= 4) each thread streams a contiguous range of weight rows once and applies every block to all
rows from registers (bound by the weight bytes read); for 5..12 rows it dequantizes a few weight
rows at a time into an L1 buffer and runs float dot products; for more (prefill, big decode
batches) it dequantizes tiles of weights into a cache-sized float32 buffer and runs a
register-blocked GEMM against x packed once per call. Types without a native kernel (or no
extension at all) take the references ``dequantize_ref`` / ``quant_linear_ref`` (gguf.quants in
numpy, then ``F.linear``), which are also the tests' oracle.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as _gguf_dequantize

from srt.kernels.cpu import _op_registered, native_available

__all__ = [
    "QTYPE_NAMES",
    "block_info",
    "dequantize",
    "dequantize_ref",
    "native_qtypes",
    "pack_x8",
    "pack_x8_ref",
    "quant_linear",
    "quant_linear_ref",
    "quant_linear_x8",
    "unpack_x8",
    "x8_qtypes",
]

# the types with native kernels (ggml type id -> name)
QTYPE_NAMES: dict[int, str] = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}

_native: frozenset[int] | None = None  # cached once the library is loaded (it stays loaded)

# The x8 layout (gguf_x8.h): header bytes (2-byte fields) and code bytes per block of the types
# that have it. Rows go 8 to a group; per block, the 8 rows' header fields side by side, then
# code byte j of row r at 8 * header + 8 j + r; a group is 8 * bpr bytes (zero rows pad the last).
X8_BLOCK_PARTS: dict[int, tuple[int, int]] = {2: (2, 16), 3: (4, 16), 8: (2, 32)}


def block_info(qtype: int) -> tuple[int, int]:
    """(weights per block, bytes per block) of a ggml type; ValueError for an unknown type."""
    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    except (ValueError, KeyError):
        raise ValueError(f"unknown ggml quantization type {qtype}") from None


def native_qtypes() -> frozenset[int]:
    """The types the native ops handle on this CPU; empty without the extension."""
    global _native
    if _native is None:
        if not (native_available() and _op_registered("gguf_linear")):
            return frozenset()
        _native = frozenset(int(q) for q in torch.ops.srt_cpu.gguf_qtypes())
    return _native


def _row_bytes(qtype: int, cols: int) -> int:
    bs, ts = block_info(qtype)
    if cols <= 0 or cols % bs:
        raise ValueError(f"{QTYPE_NAMES.get(qtype, qtype)}: row length {cols} is not a multiple of {bs}")
    return cols // bs * ts


def dequantize_ref(data: torch.Tensor, qtype: int, cols: int) -> torch.Tensor:
    """gguf.quants' numpy dequantization: uint8 [R, bpr] -> float32 [R, cols] (or [bpr] -> [cols])."""
    bpr = _row_bytes(qtype, cols)
    if data.dtype != torch.uint8 or data.shape[-1] != bpr:
        raise ValueError(
            f"expected uint8 rows of {bpr} bytes for {cols} weights, got {data.dtype} {tuple(data.shape)}"
        )
    raw = data.detach().cpu().contiguous().numpy()
    out = _gguf_dequantize(raw.reshape(-1, bpr), GGMLQuantizationType(qtype))
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(*data.shape[:-1], cols)


def quant_linear_ref(
    x: torch.Tensor, data: torch.Tensor, qtype: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Dequantize the whole weight, then ``F.linear`` (float32)."""
    if x.dtype != torch.float32:
        raise ValueError(f"quant_linear: x must be float32, got {x.dtype}")
    return F.linear(x, dequantize_ref(data, qtype, x.shape[-1]), bias)


def dequantize(data: torch.Tensor, qtype: int, cols: int) -> torch.Tensor:
    """uint8 [R, bpr] (or one row [bpr]) -> float32 [R, cols] ([cols]), bit for bit gguf.quants."""
    if qtype in native_qtypes():
        return torch.ops.srt_cpu.gguf_dequantize(data.contiguous(), qtype, cols)
    return dequantize_ref(data, qtype, cols)


def quant_linear(
    x: torch.Tensor, data: torch.Tensor, qtype: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] float32 @ W.T (+ bias) -> [..., N], W [N, K] the GGUF rows ``data`` [N, bpr]."""
    if qtype in native_qtypes():
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        out = torch.ops.srt_cpu.gguf_linear(x2, data, qtype, bias)
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], out.shape[-1])
    return quant_linear_ref(x, data, qtype, bias)


# ------------------------------------------------------------------ x8 layout
def x8_qtypes() -> frozenset[int]:
    """The types the native ops can keep in the x8 layout (decode matmuls 8 rows per vector)."""
    if not _op_registered("gguf_linear_x8"):
        return frozenset()
    return native_qtypes() & frozenset(X8_BLOCK_PARTS)


def pack_x8_ref(data: torch.Tensor, qtype: int) -> torch.Tensor:
    """GGUF rows uint8 [N, bpr] -> x8 groups uint8 [ceil(N / 8), 8 * bpr] (pure torch)."""
    header, codes = X8_BLOCK_PARTS[qtype]
    n, bpr = data.shape
    ts = header + codes
    nb, groups = bpr // ts, (n + 7) // 8
    rows = torch.zeros(groups * 8, bpr, dtype=torch.uint8)
    rows[:n] = data
    blocks = rows.view(groups, 8, nb, ts)
    head = blocks[..., :header].reshape(groups, 8, nb, header // 2, 2).permute(0, 2, 3, 1, 4)
    code = blocks[..., header:].permute(0, 2, 3, 1)  # [G, nb, codes, 8]
    rec = torch.cat((head.reshape(groups, nb, -1), code.reshape(groups, nb, -1)), dim=2)
    return rec.reshape(groups, 8 * bpr).contiguous()


def pack_x8(data: torch.Tensor, qtype: int) -> torch.Tensor:
    return torch.ops.srt_cpu.gguf_pack_x8(data.contiguous(), qtype)


def unpack_x8(
    packed: torch.Tensor, qtype: int, rows: int, cols: int, ids: torch.Tensor | None = None
) -> torch.Tensor:
    """GGUF rows ``ids`` (all when None) of an x8-packed weight of ``rows`` x ``cols``."""
    return torch.ops.srt_cpu.gguf_unpack_x8(packed, qtype, rows, cols, ids)


def quant_linear_x8(
    x: torch.Tensor, packed: torch.Tensor, qtype: int, rows: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``quant_linear`` on an x8-packed weight of ``rows`` rows: x [M, K] float32 -> [M, rows]."""
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    return torch.ops.srt_cpu.gguf_linear_x8(x2, packed, qtype, rows, bias)

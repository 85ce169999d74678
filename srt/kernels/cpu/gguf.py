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
rows from registers (bound by the weight bytes read), except that Q4_K and Q6_K at 1-2 rows on a
CPU with AVX-512 VNNI take ``gguf_linear_a24`` (each block of 32 activations as 24-bit fixed point,
whose three bytes go through integer dot products: float32-level error, ``a24_qtypes()``); on
AVX-512 CPUs Q4_K and Q6_K from there up to 27 rows take register tiles (x packed once in groups
of up to 8 rows, the weights dequantized in registers 3 rows at a time, float32 FMAs; a row's sums
do not depend on the other rows); the other types at 5..12 rows dequantize a few weight rows at a
time into an L1 buffer and run float dot products; for more (prefill, big decode batches) a
dequantized tile of weights at a time goes into a cache-sized float32 buffer for a
register-blocked GEMM against x packed once per call. Types without a native kernel (or no
extension at all) take the references ``dequantize_ref`` / ``quant_linear_ref`` (gguf.quants in
numpy, then ``F.linear``), which are also the tests' oracle.

With int8-quantized activations (gguf_q8act.cpp: integer dot products, as llama.cpp runs its
quantized matmuls):

    quant_linear_q8a(x [..., K] f32, data, qtype, bias) -> [..., N]
    quantize_activations_ref(x [M, K]) -> (q int8 [M, K], d [M, K / 32], s [M, K / 32])

Each row of x is cut into blocks of 32: d = max|x| / 127 (float32), q = round-half-even(x / d)
clamped to [-127, 127] (d = 0 and q = 0 for a block whose d is 0), s = the float32 sum of the 32
values (in the fixed order ``_block_sums`` spells out). With dw, m, d, dmin, sc a weight block's
fp16 and 6/8-bit fields and dx, s those of the matching x block, each block contributes

    Q8_0   (dw dx) sum(q qx)
    Q4_0   (dw dx) (sum(q qx) - 8 sum(qx))
    Q4_1   (dw dx) sum(q qx) + m s
    Q4_K, Q5_K, per sub-block of 32:      ((d sc) dx) sum(q qx) - (dmin m) s
    Q6_K, per group of 16 (q in 0..63):   ((d sc) dx) (sum16(q qx) - 32 sum16(qx))

The integer sums are exact, so the native op equals ``quant_linear_q8a_ref`` (float64) up to
float32 summation order; against the float32 ``quant_linear`` it differs by the activations'
rounding (about 5e-3 of the output's norm for Gaussian x). ``q8a_qtypes()`` lists the types with a
native int8 path; the native op runs any other type through the float32 ``gguf_linear``.
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
    "a24_qtypes",
    "block_info",
    "dequantize",
    "dequantize_ref",
    "native_qtypes",
    "pack_x8",
    "pack_x8_ref",
    "q8a_qtypes",
    "quant_linear",
    "quant_linear_q8a",
    "quant_linear_q8a_ref",
    "quant_linear_ref",
    "quant_linear_x8",
    "quantize_activations_ref",
    "unpack_x8",
    "x8_qtypes",
]

# the types with native kernels (ggml type id -> name)
QTYPE_NAMES: dict[int, str] = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}

_qtype_cache: dict[str, frozenset[int]] = {}  # lister op -> its types, once the library is loaded

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


def _op_qtypes(op: str, lister: str) -> frozenset[int]:
    """``torch.ops.srt_cpu.<lister>()`` once the library that has ``op`` is loaded (cached: it
    stays loaded); empty without the extension."""
    got = _qtype_cache.get(lister)
    if got is None:
        if not (native_available() and _op_registered(op)):
            return frozenset()
        got = _qtype_cache[lister] = frozenset(int(q) for q in getattr(torch.ops.srt_cpu, lister)())
    return got


def native_qtypes() -> frozenset[int]:
    """The types the native ops handle on this CPU; empty without the extension."""
    return _op_qtypes("gguf_linear", "gguf_qtypes")


def a24_qtypes() -> frozenset[int]:
    """The types ``quant_linear`` runs through ``gguf_linear_a24`` for 1-2 rows on this CPU (Q4_K and
    Q6_K with AVX-512 VNNI); empty otherwise."""
    return _op_qtypes("gguf_linear_a24", "gguf_a24_qtypes")


def x8_a24_qtypes() -> frozenset[int]:
    """The types ``quant_linear_x8`` runs through the 24-bit path (``gguf_linear_x8_a24``) for decode
    batches (1-12 rows) on this CPU (Q4_0 and Q4_1 with AVX-512 VNNI and VBMI); empty otherwise."""
    return _op_qtypes("gguf_linear_x8_a24", "gguf_x8_a24_qtypes")


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


def _on_rows(op, x: torch.Tensor, data: torch.Tensor, qtype: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``op`` (a native GGUF matmul taking x ``[M, K]`` with a contiguous last dim) on x
    ``[..., K]``, the leading dims flattened into rows and restored on the output."""
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = op(x2, data, qtype, bias)
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], out.shape[-1])


def quant_linear(
    x: torch.Tensor, data: torch.Tensor, qtype: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] float32 @ W.T (+ bias) -> [..., N], W [N, K] the GGUF rows ``data`` [N, bpr]."""
    if qtype in native_qtypes():
        return _on_rows(torch.ops.srt_cpu.gguf_linear, x, data, qtype, bias)
    return quant_linear_ref(x, data, qtype, bias)


# ------------------------------------------------------------------ x8 layout
def moe_available() -> bool:
    """Whether the extension has ``moe_experts`` (srt/kernels/cpu/moe.cpp)."""
    return native_available() and _op_registered("moe_experts")


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


def float32_panels(data: torch.Tensor, qtype: int, rows: int, cols: int, x8: bool) -> torch.Tensor:
    """``pack_linear_weight(dequantize(...), 0)`` of GGUF rows ``data`` (x8 groups when ``x8``) in
    one pass per panel, bit for bit; native types only."""
    return torch.ops.srt_cpu.gguf_float32_panels(data, qtype, rows, cols, x8, 0)


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


# ---------------------------------------------------------------- int8-quantized activations

Q8A_BLOCK = 32  # activations per quantization block


def q8a_qtypes() -> frozenset[int]:
    """The types ``gguf_linear_q8a`` runs with integer dot products on this CPU; empty without
    the extension (other types take its float32 path)."""
    return _op_qtypes("gguf_linear_q8a", "gguf_q8a_qtypes")


def q8a_gemm_rows(qtype: int) -> int:
    """From how many activation rows on ``gguf_linear_q8a`` runs ``qtype`` as an int8 GEMM faster
    than the float32 one (0: never on this CPU, or without the extension)."""
    got = _gemm_rows_cache.get(qtype)
    if got is None:
        if not (native_available() and _op_registered("gguf_q8a_gemm_rows")):
            return 0
        got = _gemm_rows_cache[qtype] = int(torch.ops.srt_cpu.gguf_q8a_gemm_rows(qtype))
    return got


_gemm_rows_cache: dict[int, int] = {}


def q8a_takes(qtype: int, rows: int, int8_max_rows: int) -> bool:
    """Whether a matmul of ``rows`` rows quantizes its input to int8 when int8 activations are on
    (``int8_max_rows`` > 0): at most ``int8_max_rows`` rows, or a type with an int8 GEMM from its
    row count on (the native ops' ``q8a_takes``)."""
    if int8_max_rows <= 0:
        return False
    if rows <= int8_max_rows:
        return True
    from_rows = q8a_gemm_rows(qtype)
    return 0 < from_rows <= rows


def _block_sums(xb: torch.Tensor) -> torch.Tensor:
    """float32 sums of blocks [..., 32] in the native kernels' order: 8 lane sums of x[l], x[l+8],
    x[l+16], x[l+24] (in that order), then lanes l and l+4, then (0 + 2) + (1 + 3)."""
    p = ((xb[..., 0:8] + xb[..., 8:16]) + xb[..., 16:24]) + xb[..., 24:32]
    h = p[..., :4] + p[..., 4:]
    return (h[..., 0] + h[..., 2]) + (h[..., 1] + h[..., 3])


def quantize_activations_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x float32 [M, K] (K a multiple of 32) -> (q int8 [M, K], d float32 [M, K / 32], s float32
    [M, K / 32]): bit for bit what the native ops compute (module docstring)."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] % Q8A_BLOCK:
        raise ValueError(
            f"quantize_activations_ref: x must be float32 [M, 32 k], got {x.dtype} {tuple(x.shape)}"
        )
    xb = x.detach().cpu().reshape(x.shape[0], -1, Q8A_BLOCK)
    d = torch.from_numpy(xb.abs().amax(dim=-1).numpy() / np.float32(127))  # IEEE float32 division
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round(xb / safe[..., None]).clamp_(-127, 127)  # torch.round: half to even
    q = torch.where(d[..., None] > 0, q, torch.zeros_like(q))
    return q.to(torch.int8).reshape(x.shape), d, _block_sums(xb)


def _set_fp16(blocks: np.ndarray, offset: int, value: float) -> None:
    blocks[:, offset : offset + 2] = np.array([value], dtype=np.float16).view(np.uint8)


def _codes_and_scales(
    data: torch.Tensor, qtype: int, cols: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The integer codes of a GGUF weight as they enter the int8 dot products, decoded with
    gguf.quants (the blocks dequantized with unit scales): (codes int64 [N, cols] (Q4_0: q - 8,
    Q6_K: q - 32, else q), scales float32 [N, groups] (one per 32 weights, per 16 for Q6_K: dw,
    or d * sc), minimums float32 [N, cols / 32] (Q4_1: m; Q4_K, Q5_K: -(dmin * m)) or None)."""
    ts = block_info(qtype)[1]
    raw = data.detach().cpu().contiguous().numpy().reshape(-1, ts)
    n = data.shape[0]
    unit = raw.copy()
    qt = GGMLQuantizationType(qtype)
    if qtype in (2, 3, 8):  # d = 1 (and m = 0): the codes
        _set_fp16(unit, 0, 1.0)
        if qtype == 3:
            _set_fp16(unit, 2, 0.0)
        scales = raw[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(n, -1)
        mins = raw[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(n, -1) if qtype == 3 else None
    elif qtype in (12, 13):  # d = 1, dmin = 0, every 6-bit scale 1 (scale bytes 1,1,1,1, 1,1,1,1, 0x11 x 4)
        from gguf.quants import Q4_K

        _set_fp16(unit, 0, 1.0)
        _set_fp16(unit, 2, 0.0)
        unit[:, 4:12] = 1
        unit[:, 12:16] = 0x11
        sc, m = Q4_K.get_scale_min(raw[:, 4:16].copy())
        d = raw[:, 0:2].copy().view(np.float16).astype(np.float32)
        dmin = raw[:, 2:4].copy().view(np.float16).astype(np.float32)
        scales = (d * sc.astype(np.float32)).reshape(n, -1)
        mins = -(dmin * m.astype(np.float32)).reshape(n, -1)
    elif qtype == 14:  # d = 1, every int8 group scale 1
        _set_fp16(unit, 208, 1.0)
        unit[:, 192:208] = 1
        d = raw[:, 208:210].copy().view(np.float16).astype(np.float32)
        scales = (d * raw[:, 192:208].copy().view(np.int8).astype(np.float32)).reshape(n, -1)
        mins = None
    else:
        raise ValueError(f"no int8-activation formula for ggml type {qtype}")
    codes = _gguf_dequantize(unit, qt).reshape(n, cols)
    return codes.astype(np.int64), scales, mins


def _q8a_dot64(x: torch.Tensor, data: torch.Tensor, qtype: int, absolute: bool = False) -> torch.Tensor:
    """float64 [M, N]: the int8-activation formula (module docstring) from exact integer sums;
    with ``absolute``, the sum of the terms' magnitudes at the finest grain the kernels round at
    (|scale| sum |code qx| per block, |minimum s|): the yardstick of float32 summation error."""
    cols = x.shape[-1]
    bpr = _row_bytes(qtype, cols)
    if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != bpr:
        raise ValueError(
            f"expected uint8 rows of {bpr} bytes for {cols} weights, got {data.dtype} {tuple(data.shape)}"
        )
    q, d, s = quantize_activations_ref(x)
    codes, scales, mins = _codes_and_scales(data, qtype, cols)
    n, m = codes.shape[0], x.shape[0]
    group = cols // scales.shape[1]  # 32, or 16 for Q6_K
    qx = q.to(torch.float64).reshape(m, -1, group)
    cw = torch.from_numpy(codes).to(torch.float64).reshape(n, -1, group)
    if absolute:
        qx, cw = qx.abs(), cw.abs()
    isum = torch.einsum("mgj,ngj->mng", qx, cw)  # exact: integers far below 2^53
    dx = d.to(torch.float64).repeat_interleave(Q8A_BLOCK // group, dim=1)  # per group
    sc = torch.from_numpy(scales).to(torch.float64)
    scale = sc[None, :, :] * dx[:, None, :]
    y = ((scale.abs() if absolute else scale) * isum).sum(-1)
    if mins is not None:
        mn = torch.from_numpy(mins).to(torch.float64)
        s64 = s.to(torch.float64)
        y = y + (s64.abs() @ mn.abs().T if absolute else s64 @ mn.T)
    return y


def quant_linear_q8a_ref(
    x: torch.Tensor, data: torch.Tensor, qtype: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The int8-activation matmul in float64 (codes through gguf.quants, activations through
    ``quantize_activations_ref``), rounded to float32: x [..., K] -> [..., N] (+ bias)."""
    if x.dtype != torch.float32:
        raise ValueError(f"quant_linear_q8a: x must be float32, got {x.dtype}")
    x2 = x.reshape(-1, x.shape[-1])
    y = _q8a_dot64(x2, data, qtype)
    if bias is not None:
        y = y + bias.to(torch.float64)
    return y.to(torch.float32).reshape(*x.shape[:-1], data.shape[0])


def quant_linear_q8a(
    x: torch.Tensor, data: torch.Tensor, qtype: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``quant_linear`` with the activations quantized to int8 blocks: the native
    ``gguf_linear_q8a`` when the extension has it (it runs types outside ``q8a_qtypes()`` in
    float32), else ``quant_linear_q8a_ref``."""
    if qtype in native_qtypes() and _op_registered("gguf_linear_q8a"):
        return _on_rows(torch.ops.srt_cpu.gguf_linear_q8a, x, data, qtype, bias)
    return quant_linear_q8a_ref(x, data, qtype, bias)

"""Weights kept in their GGUF blocks (``--quantization gguf``).

The loader yields a ``GGUFTensor`` (the tensor's raw blocks, ``uint8 [rows, row_bytes]``, and
its ggml type) for every matrix it keeps quantized; the layer it belongs to (``Linear``, the
token embedding, the LM head) moves it into a ``QuantizedWeight`` and drops its float32
parameter. A ``QuantizedWeight`` is the layer's whole ``[out, in]`` weight as row segments, one
per ggml type (fused projections may mix types: a Q4_K_M file stores q/k as Q4_K and v as
Q6_K), each a uint8 buffer of GGUF blocks, exactly the file's bytes::

    rows [0, a)   Q4_K blocks  (buffer data0, uint8 [a, in / 256 * 144])
    rows [a, out) Q6_K blocks  (buffer data1, uint8 [out - a, in / 256 * 210])

A part that arrives as float32 (a tensor type without a kernel, dequantized by the loader)
becomes a float segment (ggml type 0). Adjacent parts of one type are merged once loading is
done (``finalize``), so a layer whose parts share a type runs one kernel call.

Where memory allows (``keep_float32_copy``, ``--gguf-float32-rows``), a weight also keeps a float32
copy in srt's packed panels: matmuls of many rows (prefill, big decode batches) are bound by
arithmetic, where dequantizing blocks costs more than the bandwidth it saves, so from that many
rows on they run srt's float32 kernel on the copy.

A weight that is one segment of Q4_0, Q4_1 or Q8_0 is regrouped once, at ``finalize``, into the
x8 layout (``srt/kernels/cpu/gguf_x8.h``: the same bytes, 8 rows interleaved per block, so a decode
matmul computes 8 rows per vector); its row lookups unpack the rows they need.

The matmul (``linear``) and the row lookup of an embedding (``rows``) go through
``srt.kernels.cpu.gguf``: native kernels that dequantize blocks in registers, or the numpy
reference when the extension is not built (the loader keeps weights quantized only for the
types the native kernels cover, so the reference path serves tests and odd cases).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from srt.kernels.cpu import gguf as gguf_kernels
from srt.kernels.cpu import w8a8 as w8a8_kernels
from srt.utils.errors import WeightLoadError

F32_TYPE = 0  # ggml's type id of float32
Q8_0_TYPE = 8
# native_segments' type of a token_int8 weight (gguf_pack_w8a8's groups on gguf_linear_w8a8): not a
# ggml type, decode_layers.cpp's kW8A8
W8A8_TYPE = -3
# int8 activations pay off up to about 8 rows (bench_gguf_linear --q8a); above, the float32 paths
INT8_MAX_ROWS = 8


@dataclass(frozen=True, slots=True)
class ScaledRows:
    """A checkpoint matrix ``[rows, cols]`` as exact values times one float32 scale a row: an FP8
    layer's float8 codes (``codes``, float32, every one exact in bf16 as well) and its row's (or
    tensor's) scale (``scale [rows]``). A ``Linear`` keeps the codes as its weight and multiplies
    its outputs by the scales (``Linear.output_scale``)."""

    codes: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def value(self) -> torch.Tensor:
        """The matrix itself, float32 (exact: a 4-bit-mantissa code times a float32 scale)."""
        return self.codes * self.scale.unsqueeze(1)


@dataclass(frozen=True, slots=True)
class BlockScaledCodes:
    """A checkpoint matrix ``[rows, cols]`` as float8_e4m3 codes (``codes``, the checkpoint's bytes)
    and one float32 scale a block of ``block = (block_rows, block_cols)`` (``scale [ceil(rows /
    block_rows), ceil(cols / block_cols)]``): transformers' fine-grained FP8. A ``Linear`` keeps the
    codes and the scales where its backend widens them in cache (``stores_fp8_blocks``), else the
    values."""

    codes: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def value(self) -> torch.Tensor:
        """The matrix itself, float32 (exact: a 4-bit-mantissa code times a bf16 or float32 scale,
        rounded to float32 once)."""
        return self.codes.float() * expand_block_scale(self.scale, self.block, self.codes.shape)


def expand_block_scale(scale: torch.Tensor, block: tuple[int, int], shape: tuple[int, ...]) -> torch.Tensor:
    """A block scale grid as one scale an element of a ``shape`` matrix, float32."""
    rows, cols = shape
    return scale.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """A checkpoint matrix ``[rows, cols]`` kept as GGUF blocks of ggml type ``qtype``:
    ``data`` is ``uint8 [rows, cols / block_size * type_size]``, row-major, the file's bytes."""

    qtype: int
    rows: int
    cols: int
    data: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def type_name(self) -> str:
        return gguf_kernels.QTYPE_NAMES.get(self.qtype, str(self.qtype))


class QuantizedWeight(nn.Module):
    """A layer's weight ``[out_features, in_features]`` in row segments of GGUF blocks (see the
    module docstring). Fill it with ``add``, then ``finalize`` once every row is there."""

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.out_features = out_features
        self.in_features = in_features
        self._parts: list[tuple[int, int, torch.Tensor]] = []  # (row offset, qtype, data) while loading
        self.segments: list[tuple[int, int, int]] = []  # (row offset, rows, qtype), buffers data0, data1, ...
        # (data, qtype, x8 rows or 0) of a weight that is one segment of a type with a native
        # kernel: the decode path calls the op directly (a step runs a few hundred small matmuls)
        self._native: tuple[torch.Tensor, int, int] | None = None
        self.x8_rows = 0  # > 0: data0 holds the x8 layout of that many rows
        self.int8_max_rows = 0  # > 0: matmuls of at most that many rows quantize x to int8
        # > 0: matmuls of at least that many rows run on the float32 copy (keep_float32_copy)
        self.float32_rows = 0
        # a W8A8 layer on the int8 kernel (use_token_int8): x quantized per token inside it
        self.token_int8 = False

    # ------------------------------------------------------------------ loading
    def add(self, row_offset: int, part: GGUFTensor | torch.Tensor, name: str) -> None:
        """Place ``part`` (quantized, or a float32 ``[rows, in]`` tensor) at rows ``row_offset..``."""
        if isinstance(part, GGUFTensor):
            rows, cols, qtype, data = part.rows, part.cols, part.qtype, part.data
        else:
            rows, cols = part.shape
            qtype, data = F32_TYPE, part.detach().to(torch.float32).contiguous()
        if cols != self.in_features or row_offset < 0 or row_offset + rows > self.out_features:
            raise WeightLoadError(
                f"weight {name}: rows {row_offset}..{row_offset + rows} x {cols} columns do not fit "
                f"the layer's [{self.out_features}, {self.in_features}]"
            )
        self._parts.append((row_offset, qtype, data))

    def finalize(self) -> None:
        """Check that the parts cover every row once and merge neighbours of one type into
        segments (no-op when already final)."""
        if not self._parts:
            if not self.segments:
                raise WeightLoadError(
                    f"quantized weight [{self.out_features}, {self.in_features}] got no rows"
                )
            return
        parts = sorted(self._parts, key=lambda p: p[0]) + [(self.out_features, -1, None)]
        merged: list[tuple[int, int, list[torch.Tensor]]] = []
        row = 0
        for offset, qtype, data in parts[:-1]:
            if offset != row:
                raise WeightLoadError(
                    f"quantized weight [{self.out_features}, {self.in_features}]: rows {row}..{offset} "
                    "missing or loaded twice"
                )
            if merged and merged[-1][1] == qtype:
                merged[-1][2].append(data)
            else:
                merged.append((offset, qtype, [data]))
            row = offset + data.shape[0]
        if row != self.out_features:
            raise WeightLoadError(
                f"quantized weight [{self.out_features}, {self.in_features}]: rows {row}..{self.out_features} missing"
            )
        self._parts = []
        self.segments = []
        for i, (offset, qtype, datas) in enumerate(merged):
            data = datas[0] if len(datas) == 1 else torch.cat(datas)
            self.register_buffer(f"data{i}", data.contiguous(), persistent=False)
            self.segments.append((offset, data.shape[0], qtype))
        if len(self.segments) == 1 and self.segments[0][2] in gguf_kernels.native_qtypes():
            qtype = self.segments[0][2]
            if qtype in gguf_kernels.x8_qtypes():
                self.register_buffer("data0", gguf_kernels.pack_x8(self._data(0), qtype), persistent=False)
                self.x8_rows = self.out_features
            self._native = (self._data(0), qtype, self.x8_rows)

    def _data(self, i: int) -> torch.Tensor:
        return getattr(self, f"data{i}")

    def use_token_int8(self, layout: str = "groups") -> bool:
        """A W8A8 checkpoint's layer (its inputs quantized to int8 per token, ``Linear.token_quant``):
        from now on every matmul runs ``gguf_linear_w8a8`` (x quantized per token inside it, integer
        dot products) where the weight is one segment of Q8_0 rows whose blocks share the row's scale
        and this CPU has that kernel's vector path. The rows are regrouped for it
        (``gguf_pack_w8a8``: the int8 codes and one float32 scale a row, the checkpoint's bytes), in
        ``layout``: "groups" (AVX-512 VNNI) or "amx" (panels for AMX-INT8 tiles).
        Returns whether it does (else the caller keeps quantizing x itself before the float32
        kernels)."""
        if self._native is None or self._native[1] != Q8_0_TYPE or not w8a8_kernels.w8a8_fast():
            return False
        data, qtype, x8_rows = self._native
        if x8_rows:
            data = gguf_kernels.unpack_x8(data, qtype, x8_rows, self.in_features)
        scales = data.view(self.out_features, -1, 34)[:, :, :2]
        if not bool(scales.eq(scales[:, :1]).all()):
            return False
        self.register_buffer(
            "data0", torch.ops.srt_cpu.gguf_pack_w8a8(data.contiguous(), layout), persistent=False
        )
        self.x8_rows = 0
        self._native = (self._data(0), W8A8_TYPE, self.out_features)
        self.token_int8 = True
        return True

    def use_int8_activations(self, max_rows: int = INT8_MAX_ROWS) -> None:
        """From now on, matmuls of at most ``max_rows`` rows, and those of types with an int8 GEMM
        (Q4_K on AVX-512 VNNI CPUs) from its row count on, quantize x to int8 per block of 32
        (``gguf_linear_q8a``, ``gguf_kernels.q8a_takes``; changes numerics). Its kernels read the GGUF layout, so an x8-packed
        weight is unpacked back."""
        q8a = gguf_kernels.q8a_qtypes()
        if self.token_int8:  # quantized per token already
            return
        if self._native is None:  # several segments (never x8): each takes the int8 path
            if self.native_segments is not None and all(q in q8a for _, _, q in self.segments):
                self.int8_max_rows = max_rows
            return
        if self.segments[0][2] not in q8a:
            return
        data, qtype, x8_rows = self._native
        if x8_rows:
            self.register_buffer(
                "data0", gguf_kernels.unpack_x8(data, qtype, x8_rows, self.in_features), persistent=False
            )
            self.x8_rows = 0
        self._native = (self._data(0), qtype, 0)
        self.int8_max_rows = max_rows

    def keep_float32_copy(self, min_rows: int) -> int:
        """Keep the weight also as float32 panels for srt's packed kernel (``pack_linear_weight``
        of ``dequantize()``: the same values); from now on matmuls of at least ``min_rows`` rows run
        on them (``packed_linear``), smaller ones on the blocks. Returns the copy's bytes."""
        if min_rows <= 0:
            raise ValueError(f"min_rows must be > 0, got {min_rows}")
        if self._native is not None:  # one pass from the blocks to the panels
            data, qtype, x8_rows = self._native
            panels = gguf_kernels.float32_panels(
                data, qtype, self.out_features, self.in_features, x8_rows > 0
            )
        else:
            panels = torch.ops.srt_cpu.pack_linear_weight(self.dequantize(), 0)
        self.register_buffer("float32_panels", panels, persistent=False)
        self.float32_rows = min_rows
        return panels.numel() * panels.element_size()

    @property
    def float32_copy(self) -> torch.Tensor | None:
        """The float32 panels ``keep_float32_copy`` made (``packed_linear``'s layout), or None."""
        return self.float32_panels if self.float32_rows else None

    @property
    def native_blocks(self) -> tuple[torch.Tensor, int, int] | None:
        """``(data, qtype, x8_rows)`` when the whole weight is one segment of a type the native
        ops handle (``gguf_linear(x, data, qtype)``, or ``gguf_linear_x8(x, data, qtype, x8_rows)``
        when ``x8_rows`` > 0), else None."""
        return self._native

    @property
    def native_segments(self) -> list[tuple[torch.Tensor, int, int]] | None:
        """``(data, qtype, x8_rows)`` of each row segment in order when every segment is of a type
        the native ops handle (a Q4_K_M projection mixing Q4_K and Q6_K rows), else None."""
        if self._native is not None:
            return [self._native]
        native = gguf_kernels.native_qtypes()
        if not self.segments or any(q not in native for _, _, q in self.segments):
            return None
        return [(self._data(i), q, 0) for i, (_, _, q) in enumerate(self.segments)]

    @property
    def qtypes(self) -> list[int]:
        return [q for _, _, q in self.segments]

    # ------------------------------------------------------------------ compute
    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., in] @ weight.T + bias`` -> ``[..., out]`` in x's dtype (with ``token_int8``, x
        quantized to int8 per row first, the int8 kernel taking float32 or bf16 rows; the other
        kernels compute on float32 activations)."""
        if self.token_int8:
            x2 = x.reshape(-1, self.in_features)
            if x2.dtype not in (torch.float32, torch.bfloat16):
                x2 = x2.float()
            out = torch.ops.srt_cpu.gguf_linear_w8a8(
                x2.contiguous(), self._data(0), self.out_features, bias, ""
            )
            return out.view(*x.shape[:-1], self.out_features).to(x.dtype)
        if x.dtype != torch.float32:  # a bf16 model's layer the int8 kernel does not take
            out = self.linear(x.float(), None if bias is None else bias.float())
            return out.to(x.dtype)
        if (
            self.float32_rows
            and x.dtype == torch.float32
            and x.numel() >= self.float32_rows * self.in_features
        ):
            x2 = x.reshape(-1, self.in_features).contiguous()
            out = torch.ops.srt_cpu.packed_linear(x2, self.float32_panels, self.out_features, bias, "")
            return out.view(*x.shape[:-1], self.out_features)
        if self._native is not None and x.dim() == 2 and x.dtype == torch.float32:
            data, qtype, x8_rows = self._native
            if gguf_kernels.q8a_takes(qtype, x.shape[0], self.int8_max_rows):
                return torch.ops.srt_cpu.gguf_linear_q8a(x, data, qtype, bias)
            if x8_rows:
                return torch.ops.srt_cpu.gguf_linear_x8(x, data, qtype, x8_rows, bias)
            return torch.ops.srt_cpu.gguf_linear(x, data, qtype, bias)
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32:
            x2 = x2.float()
        if len(self.segments) == 1:
            out = self._segment_linear(0, x2, bias)
        else:
            out = torch.cat([self._segment_linear(i, x2, None) for i in range(len(self.segments))], dim=1)
            if bias is not None:
                out += bias
        return out.view(*x.shape[:-1], self.out_features)

    def _segment_linear(self, i: int, x2: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        qtype = self.segments[i][2]
        if qtype == F32_TYPE:
            return F.linear(x2, self._data(i), bias)
        if gguf_kernels.q8a_takes(qtype, x2.shape[0], self.int8_max_rows):
            return gguf_kernels.quant_linear_q8a(x2, self._data(i), qtype, bias)
        if self.x8_rows:
            return gguf_kernels.quant_linear_x8(x2, self._data(i), qtype, self.x8_rows, bias)
        return gguf_kernels.quant_linear(x2, self._data(i), qtype, bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Float32 rows ``ids`` of the weight (an embedding lookup), dequantizing only those."""
        flat = ids.reshape(-1)
        if len(self.segments) != 1 or self.token_int8:
            return self.dequantize().index_select(0, flat).view(*ids.shape, self.in_features)
        qtype, data = self.segments[0][2], self._data(0)
        if self.x8_rows:
            picked = gguf_kernels.unpack_x8(data, qtype, self.x8_rows, self.in_features, flat)
        else:
            picked = data.index_select(0, flat)
        out = picked if qtype == F32_TYPE else gguf_kernels.dequantize(picked, qtype, self.in_features)
        return out.view(*ids.shape, self.in_features)

    def dequantize(self) -> torch.Tensor:
        """The whole weight as float32 ``[out, in]`` (tests, tools)."""
        if self.token_int8:
            codes, scales = w8a8_kernels.unpack_w8a8(self._data(0), self.out_features, self.in_features)
            return codes.float() * scales.unsqueeze(1)
        parts = []
        for i, (_, _, qtype) in enumerate(self.segments):
            data = self._data(i)
            if self.x8_rows:
                data = gguf_kernels.unpack_x8(data, qtype, self.x8_rows, self.in_features)
            parts.append(
                data if qtype == F32_TYPE else gguf_kernels.dequantize(data, qtype, self.in_features)
            )
        if len(parts) > 1:
            return torch.cat(parts)
        return parts[0].clone() if parts[0] is self._data(0) else parts[0]  # never the stored rows

    def extra_repr(self) -> str:
        kinds = ", ".join(
            f"rows {o}..{o + n}: {gguf_kernels.QTYPE_NAMES.get(q, 'F32' if q == F32_TYPE else q)}"
            for o, n, q in self.segments
        )
        return f"[{self.out_features}, {self.in_features}] {kinds}"

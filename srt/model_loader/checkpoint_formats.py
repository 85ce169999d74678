"""Each quantized-checkpoint format's tensors of one linear layer read as signed codes, scales and
zero points (srt/model_loader/quantized_checkpoint.py turns them into GGUF blocks or a float
matrix). A layer reads as ``Codes``: ``codes`` int8 ``[N, K]``, ``scale`` float32 ``[N, G]`` (one a
group of ``K/G`` columns) and ``zero`` float32 ``[N, G]`` or None, meaning the value
``(codes - zero) * scale``; codes and zeros are signed, i.e. stored unsigned less ``2^(bits-1)``.

- compressed-tensors: ``weight`` int8 ``[N, K]`` and ``weight_scale`` ``[N, 1]``; or
  ``weight_packed`` int32 ``[N, K*b/32]`` (32/b codes of b bits a word, code ``i`` in bits
  ``b*i``, stored as ``code + 2^(b-1)``), ``weight_shape`` ``[N, K]``, ``weight_scale`` ``[N, G]``
  and, with zero points, ``weight_zero_point`` int32 ``[ceil(N*b/32), G]`` packed the same way
  along the rows.
- AWQ (AutoAWQ's GEMM layout): ``qweight`` int32 ``[K, N/8]`` and ``qzeros`` int32 ``[G, N/8]``
  whose words hold 8 unsigned 4-bit fields of columns ``0 2 4 6 1 3 5 7`` (field ``i`` in bits
  ``4*i``), ``scales`` float16 ``[G, N]``; value ``(q - z) * s``.
- GPTQ: ``qweight`` int32 ``[K*b/32, N]`` packed along K (field ``i`` of word ``r`` is row
  ``r*32/b + i``), ``qzeros`` int32 ``[G, N*b/32]`` packed along N (stored as ``z - 1`` in the
  gptq format, as ``z`` in gptq_v2), ``scales`` float16 ``[G, N]``, ``g_idx`` int32 ``[K]`` (each
  column's group); value ``(q - z[g_idx]) * s[g_idx]``. Groups that are not runs of columns
  (activation order) read with one group a column.
- FP8 (compressed-tensors float-quantized, or transformers' fine-grained ``fp8``): ``weight``
  float8_e4m3 ``[N, K]`` with ``weight_scale`` (one a row or a tensor): read as the codes and
  a scale a row (``ScaledRows``: the layer keeps the codes, exact in bf16, and scales its outputs);
  or with ``weight_scale_inv`` (one a block of ``weight_block_size``, edge blocks cut): read as
  the codes and the block scales (``BlockScaledCodes``: the layer keeps both where its backend
  widens them in cache, else their float32 values).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from srt.configs.quant_config import AWQ, GPTQ, QuantScheme
from srt.layers.quantized_weight import BlockScaledCodes, ScaledRows
from srt.utils.errors import WeightLoadError

_AWQ_COLUMNS = (0, 4, 1, 5, 2, 6, 3, 7)  # field i of an AWQ word holds column (0 2 4 6 1 3 5 7)[i]


class Codes(NamedTuple):
    codes: torch.Tensor  # int8 [N, K], signed
    scale: torch.Tensor  # float32 [N, G]
    zero: torch.Tensor | None  # float32 [N, G], signed; None: symmetric


def leaves(scheme: QuantScheme) -> tuple[str, ...]:
    """The leaf names of a quantized layer's tensors in ``scheme``'s checkpoints (besides an
    8-bit ``weight``)."""
    if scheme.method in (AWQ, GPTQ):
        return ("qweight", "qzeros", "scales", "g_idx")
    if scheme.fp8:
        return ("weight_scale", "weight_scale_inv")
    return ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")


def needed(scheme: QuantScheme) -> set[str]:
    """The leaves that complete one layer."""
    if scheme.method in (AWQ, GPTQ):
        return {"qweight", "qzeros", "scales"} | ({"g_idx"} if scheme.act_order else set())
    if scheme.fp8:
        return {"weight", "weight_scale_inv" if scheme.block is not None else "weight_scale"}
    packed = scheme.format == "pack-quantized"
    need = {"weight_packed", "weight_scale", "weight_shape"} if packed else {"weight", "weight_scale"}
    if not scheme.symmetric:
        need.add("weight_zero_point")
    return need


def fp8_values(
    prefix: str, parts: dict[str, torch.Tensor], scheme: QuantScheme
) -> ScaledRows | BlockScaledCodes:
    """float8 codes and their row's or tensor's scale (``ScaledRows``: the codes float32, exact), or
    their block's (``BlockScaledCodes``: the codes as the checkpoint's float8)."""
    n, k = parts["weight"].shape
    if scheme.block is None:
        codes = parts["weight"].float()
        scale = parts["weight_scale"].float()
        if scale.numel() not in (1, n):
            raise WeightLoadError(f"{prefix}.weight_scale: {scale.numel()} scales for {n} rows")
        return ScaledRows(codes, scale.reshape(-1).expand(n).contiguous())
    bn, bk = scheme.block
    scale = parts["weight_scale_inv"].float()
    if tuple(scale.shape) != (-(-n // bn), -(-k // bk)):
        raise WeightLoadError(
            f"{prefix}.weight_scale_inv: shape {tuple(scale.shape)} for a {n} x {k} weight in blocks of {bn}x{bk}"
        )
    return BlockScaledCodes(parts["weight"], scale, (bn, bk))


def read_codes(prefix: str, parts: dict[str, torch.Tensor], scheme: QuantScheme) -> Codes:
    """One integer layer's ``Codes`` (see the module docstring)."""
    if scheme.method == AWQ:
        return _awq(prefix, parts)
    if scheme.method == GPTQ:
        return _gptq(prefix, parts, scheme)
    return _compressed_tensors(prefix, parts, scheme)


def unpack(packed: torch.Tensor, cols: int, bits: int) -> torch.Tensor:
    """int32 ``[R, ceil(cols*bits/32)]``, 32/bits codes a word (``code + 2^(bits-1)`` in bits
    ``bits*i``; bits 4 or 8) -> int8 ``[R, cols]`` signed codes."""
    return (_fields(packed, bits).reshape(packed.shape[0], -1)[:, :cols] - (1 << (bits - 1))).to(torch.int8)


def check_zero(name: str, zero: torch.Tensor) -> None:
    """compressed-tensors' zero points of a symmetric scheme: all zero (each packed field ``2^(b-1)``)."""
    if zero.is_floating_point() or zero.dtype == torch.int8:
        nonzero = bool(zero.ne(0).any())
    else:  # packed: each field holds zero + 8 (int4) or zero + 128 (int8)
        nonzero = not bool(zero.eq(0x88888888 - 2**32).all() or zero.eq(0x80808080 - 2**32).all())
    if nonzero:
        raise WeightLoadError(f"{name}: nonzero zero points in a symmetric scheme")


def check_g_idx(name: str, g_idx: torch.Tensor, groups: int) -> None:
    """A GPTQ ``g_idx`` of a scheme without activation order: each group a run of columns."""
    if not _runs(g_idx, groups):
        raise WeightLoadError(
            f"{name}: the groups are not runs of columns although desc_act is false; the checkpoint is "
            "inconsistent"
        )


def _fields(words: torch.Tensor, bits: int) -> torch.Tensor:
    """The unsigned ``bits``-bit fields of int32 words, low first: ``[..., 32/bits]`` int32."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    return (words.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)


def _compressed_tensors(prefix: str, parts: dict[str, torch.Tensor], scheme: QuantScheme) -> Codes:
    if scheme.format != "pack-quantized":
        codes = parts["weight"]
    else:
        n, k = (int(v) for v in parts["weight_shape"].tolist())
        codes = unpack(parts["weight_packed"], k, scheme.bits)[:n]
    zero = None
    if "weight_zero_point" in parts and scheme.symmetric:
        check_zero(f"{prefix}.weight_zero_point", parts["weight_zero_point"])
    elif "weight_zero_point" in parts:  # int4 only (parse_quantization refuses asymmetric int8)
        zero = unpack(parts["weight_zero_point"].t(), codes.shape[0], scheme.bits).t().float()
    return Codes(codes, parts["weight_scale"].float(), zero)


def _awq(prefix: str, parts: dict[str, torch.Tensor]) -> Codes:
    """AutoAWQ GEMM: fields in the column order 0 2 4 6 1 3 5 7, unsigned codes and zeros."""
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    n = qweight.shape[1] * 8
    if tuple(qzeros.shape) != (scales.shape[0], qweight.shape[1]) or scales.shape[1] != n:
        raise WeightLoadError(
            f"{prefix}: AWQ qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and scales "
            f"{tuple(scales.shape)} do not fit one another"
        )

    def columns(words: torch.Tensor) -> torch.Tensor:  # [R, N/8] words -> [R, N] unsigned codes
        return _fields(words, 4)[..., list(_AWQ_COLUMNS)].reshape(words.shape[0], n)

    codes = (columns(qweight) - 8).t().contiguous().to(torch.int8)
    zero = (columns(qzeros) - 8).t().float()
    return Codes(codes, scales.t().float(), zero)


def _gptq(prefix: str, parts: dict[str, torch.Tensor], scheme: QuantScheme) -> Codes:
    """GPTQ: codes packed along K, zeros along N (less one in the gptq format)."""
    bits, half = scheme.bits, 1 << (scheme.bits - 1)
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    per_word = 32 // bits
    k, n = qweight.shape[0] * per_word, qweight.shape[1]
    groups = scales.shape[0]
    if scales.shape[1] != n or tuple(qzeros.shape) != (groups, n // per_word) or k % groups:
        raise WeightLoadError(
            f"{prefix}: GPTQ qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and scales "
            f"{tuple(scales.shape)} do not fit one another"
        )
    codes = (_fields(qweight, bits).permute(0, 2, 1).reshape(k, n) - half).t().contiguous().to(torch.int8)
    stored = _fields(qzeros, bits).reshape(groups, n)
    zero = (stored + (1 if scheme.format == "gptq" else 0) - half).t().float()
    scale = scales.t().float()
    g_idx = parts.get("g_idx")
    if scheme.act_order and g_idx is not None and not _runs(g_idx, groups):  # one group a column
        g = g_idx.long()
        scale, zero = scale[:, g], zero[:, g]
    elif g_idx is not None:
        check_g_idx(f"{prefix}.g_idx", g_idx, groups)
    if bool(zero.eq(0).all()):  # symmetric (as GPTQ's sym writes it): Q4_0 / Q8_0 blocks
        zero = None
    return Codes(codes, scale, zero)


def _runs(g_idx: torch.Tensor, groups: int) -> bool:
    """Each of ``groups`` groups a run of the same number of columns, in order."""
    k = g_idx.numel()
    return torch.equal(g_idx.long(), torch.arange(k) // (k // groups))

"""Tensor parallelism over a quantized HF checkpoint (compressed-tensors, AWQ, GPTQ, FP8).

Each rank reads every tensor whole, one layer at a time; the converter
(``quantized_checkpoint.convert_weights``) turns each quantized layer's tensors into its weight
exactly as for one rank, and the rank's slice (``ShardPlan``) is cut from that weight, whatever
the checkpoint's own packing (AWQ packs along the outputs, GPTQ along the inputs, block FP8 in
tiles)::

    float values            rows / columns
    GGUF blocks (int8, int4)  rows; columns in whole blocks of 32, else the rank's part dequantized
                              to float32 (logged; that layer loses its blocks on this rank)
    FP8 codes + row scales  rows of both; columns of the codes
    FP8 codes + block scales  rows / columns in whole blocks of the scale grid, else the part's
                              values (float32)

The scales go with their rows, so every rank's layer holds exactly the values of its part of the
one-rank layer. A layer that quantizes its inputs per token (W8A8) does so on its own slice of
the input on a row-parallel layer (as vLLM and SGLang do), so under TP those layers' activations
round slightly differently from one rank's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from srt.configs.quant_config import QuantScheme
from srt.kernels.cpu.gguf import block_info
from srt.layers.quantized_weight import BlockScaledCodes, GGUFTensor, ScaledRows, expand_block_scale
from srt.model_loader.quantized_checkpoint import convert_weights
from srt.model_loader.sharding import ShardPlan, TensorSlice
from srt.model_loader.weight_utils import safetensors_weights_iterator

logger = logging.getLogger(__name__)

Weight = torch.Tensor | GGUFTensor | ScaledRows | BlockScaledCodes
Ranges = tuple[tuple[int, int], ...]


def sharded_quantized_iterator(
    model_dir: str, plan: ShardPlan, scheme: QuantScheme, keep_blocks: bool, done: set[str]
) -> Iterator[tuple[str, Weight]]:
    """``convert_weights`` of the directory's tensors, each cut to this rank's slice."""
    weights = convert_weights(safetensors_weights_iterator(model_dir), scheme, keep_blocks, done)
    for name, t in weights:
        if plan.skip(name):
            continue
        rows = plan.fused_rows(name)
        if rows is not None:
            yield name, take_rows(t, rows, name)
            continue
        s = plan.lookup(name)
        yield name, t if s is None else take(t, s, name)


def take(t: Weight, s: TensorSlice, name: str) -> Weight:
    """The ``s`` part of a converted weight (or any plain tensor)."""
    if s.dim == 0:
        return take_rows(t, ((s.start, s.size),), name)
    return take_columns(t, s.start, s.size, name)


def take_rows(t: Weight, ranges: Ranges, name: str) -> Weight:
    """Rows ``a .. a + n`` of each ``(a, n)`` of ``ranges``, concatenated."""
    if isinstance(t, torch.Tensor):
        return _cat_rows(t, ranges)
    if isinstance(t, GGUFTensor):
        data = _cat_rows(t.data, ranges)
        return GGUFTensor(t.qtype, data.shape[0], t.cols, data)
    if isinstance(t, ScaledRows):
        return ScaledRows(_cat_rows(t.codes, ranges), _cat_rows(t.scale, ranges))
    bn = t.block[0]
    rows = t.codes.shape[0]
    whole = all(_aligned(r, bn, rows) for r in ranges) and all(n % bn == 0 for _, n in ranges[:-1])
    if whole:
        blocks = tuple((a // bn, -(-(a + n) // bn) - a // bn) for a, n in ranges)
        return BlockScaledCodes(_cat_rows(t.codes, ranges), _cat_rows(t.scale, blocks), t.block)
    _log_values(name, "rows", ranges, bn)
    return _cat_rows(_values(t), ranges)


def take_columns(t: Weight, start: int, size: int, name: str) -> Weight:
    """Columns ``start .. start + size``."""
    end = start + size
    if isinstance(t, torch.Tensor):
        return t[:, start:end].contiguous()
    if isinstance(t, ScaledRows):
        return ScaledRows(t.codes[:, start:end].contiguous(), t.scale)
    if isinstance(t, GGUFTensor):
        bs, ts = block_info(t.qtype)
        if _aligned((start, size), bs, t.cols):
            data = t.data[:, start // bs * ts : -(-end // bs) * ts].contiguous()
            return GGUFTensor(t.qtype, t.rows, size, data)
        _log_values(name, "columns", ((start, size),), bs)
        return _gguf_values(t)[:, start:end].contiguous()
    bk = t.block[1]
    if _aligned((start, size), bk, t.codes.shape[1]):
        scale = t.scale[:, start // bk : -(-end // bk)].contiguous()
        return BlockScaledCodes(t.codes[:, start:end].contiguous(), scale, t.block)
    _log_values(name, "columns", ((start, size),), bk)
    return _values(t)[:, start:end].contiguous()


def _aligned(r: tuple[int, int], unit: int, length: int) -> bool:
    a, n = r
    return a % unit == 0 and (n % unit == 0 or a + n == length)


def _cat_rows(t: torch.Tensor, ranges: Ranges) -> torch.Tensor:
    if len(ranges) == 1:
        a, n = ranges[0]
        return t[a : a + n].contiguous()
    return torch.cat([t[a : a + n] for a, n in ranges])


def _values(t: BlockScaledCodes) -> torch.Tensor:
    return t.codes.float() * expand_block_scale(t.scale, t.block, tuple(t.codes.shape))


def _gguf_values(t: GGUFTensor) -> torch.Tensor:
    from gguf import dequantize

    return torch.from_numpy(dequantize(t.data.numpy(), t.qtype).astype("float32")).reshape(t.rows, t.cols)


def _log_values(name: str, what: str, ranges: Ranges, unit: int) -> None:
    logger.warning(
        "%s: this rank's %s %s do not keep whole blocks of %d; its part is dequantized to float32",
        name,
        what,
        [(a, a + n) for a, n in ranges],
        unit,
    )

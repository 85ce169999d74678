"""Weight readers for one tensor-parallel rank: each yields only the rank's slice of every
checkpoint tensor (``ShardPlan``, ``srt/model_loader/sharding.py``), read from the file without
materializing the whole tensor.

    safetensors  ``safe_open(...).get_slice(name)[a:b]`` (rows) or ``[:, a:b]`` (columns)
    GGUF         the file mmap'd read-only; a tensor's bytes viewed in place, then
                 rows:     whole rows of blocks [a, b) copied (no alignment needed)
                 columns:  whole blocks of every row (bytes [a / bs * ts, b / bs * ts)) when a
                           and b are multiples of the type's block size bs; otherwise the rows
                           are dequantized to float32 and cut (logged: that matrix loses its
                           quantized form on this rank)

A MoE layer's merged expert tensor ``[E, rows, cols]`` is cut the same way in every expert's
matrix (the rank's rows of gate/up, columns of down). Names, dequantization and llama.cpp's q/k
un-permutation are those of ``gguf.py``; the
un-permutation runs per local head (the rank's rows are whole heads). Each yielded tensor is a
fresh copy owned by the caller.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np
import torch

from srt.configs.gguf_header import GGUFTensorInfo, gguf_architecture, open_gguf
from srt.kernels.cpu.gguf import block_info
from srt.layers.quantized_weight import GGUFTensor
from srt.model_loader.gguf import _PLAIN_DTYPES, gguf_to_hf_name, is_matrix, postprocess_tensor
from srt.model_loader.sharding import ShardPlan, TensorSlice
from srt.model_loader.weight_utils import safetensors_files

logger = logging.getLogger(__name__)


def sharded_safetensors_iterator(model_dir: str, plan: ShardPlan) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, this rank's slice)`` for every tensor of the directory's safetensors files."""
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if plan.skip(name):
                    continue
                rows = plan.fused_rows(name)
                if rows is not None:
                    part = f.get_slice(name)
                    yield name, torch.cat([part[a : a + n] for a, n in rows])
                    continue
                s = plan.lookup(name)
                if s is None:
                    yield name, f.get_tensor(name)
                    continue
                part = f.get_slice(name)
                end = s.start + s.size
                yield name, (part[s.start : end] if s.dim == 0 else part[:, s.start : end]).contiguous()


def _raw_view(mm: np.memmap, info: GGUFTensorInfo) -> np.ndarray:
    """The tensor's bytes in place: plain types as their dtype and shape, quantized ones as
    ``uint8 [rows, bytes per row]``."""
    data = mm[info.offset : info.offset + info.nbytes]
    dtype = _PLAIN_DTYPES.get(info.qtype)
    if dtype is not None:
        return data.view(dtype).reshape(info.shape)
    rows = int(np.prod(info.shape[:-1]))
    return data.reshape(*info.shape[:-1], info.nbytes // max(rows, 1))


def _column_slice(
    raw: np.ndarray, info: GGUFTensorInfo, s: TensorSlice, name: str
) -> tuple[np.ndarray, bool]:
    """Columns ``s`` of a matrix (of each expert's, for a 3-D ``[E, rows, cols]``): ``(array, still blocks)``."""
    from gguf import dequantize

    end = s.start + s.size
    if info.qtype in _PLAIN_DTYPES:
        return np.array(raw[..., s.start : end]), False
    bs, ts = block_info(info.qtype)
    if s.start % bs == 0 and end % bs == 0:
        return np.array(raw[..., s.start // bs * ts : end // bs * ts]), True
    logger.warning(
        "%s: columns %d..%d are not aligned to blocks of %d; dequantized to float32 on this rank",
        name,
        s.start,
        end,
        bs,
    )
    return dequantize(np.array(raw), info.qtype)[..., s.start : end].astype(np.float32), False


def _read_slice(
    raw: np.ndarray, info: GGUFTensorInfo, s: TensorSlice | None, name: str
) -> tuple[np.ndarray, bool]:
    """The rank's part of a tensor: ``(array, still blocks)`` (plain types: not blocks)."""
    blocks = info.qtype not in _PLAIN_DTYPES
    if s is None:
        return np.array(raw), blocks
    if s.dim == 0:  # rows (of each expert's matrix, for a 3-D tensor)
        end = s.start + s.size
        return np.array(raw[:, s.start : end] if raw.ndim == 3 else raw[s.start : end]), blocks
    return _column_slice(raw, info, s, name)


def sharded_gguf_iterator(
    gguf_file: str, hf_config, keep_quantized: frozenset[int], plan: ShardPlan
) -> Iterator[tuple[str, torch.Tensor | GGUFTensor]]:
    """``gguf_weights_iterator`` for one rank: ``(hf_name, the rank's slice)``, matrices of the
    types in ``keep_quantized`` as ``GGUFTensor`` blocks where the slice keeps whole blocks."""
    from gguf import dequantize

    gf = open_gguf(gguf_file)
    arch = gguf_architecture(gf)
    mm = np.memmap(gguf_file, dtype=np.uint8, mode="r")
    try:
        for info in gf.tensors:
            hf_name = gguf_to_hf_name(info.name, arch)
            if hf_name is None or plan.skip(hf_name):
                continue
            rows = plan.fused_rows(hf_name)
            if rows is not None:  # a fused tensor: the rank's rows of each part (whole rows of blocks)
                raw = _raw_view(mm, info)
                arr, blocks = (
                    np.concatenate([raw[a : a + n] for a, n in rows]),
                    info.qtype not in _PLAIN_DTYPES,
                )
            else:
                arr, blocks = _read_slice(_raw_view(mm, info), info, plan.lookup(hf_name), hf_name)
            keep = blocks and info.qtype in keep_quantized and is_matrix(hf_name, arr.shape)
            if keep:
                tensor = torch.from_numpy(arr)
            elif blocks:
                tensor = torch.from_numpy(dequantize(arr, info.qtype).astype(np.float32, copy=False))
            else:
                tensor = torch.from_numpy(arr.astype(np.float32, copy=False))
            del arr
            tensor = postprocess_tensor(arch, hf_name, tensor, hf_config)
            if keep:
                cols = tensor.shape[-1] // block_info(info.qtype)[1] * block_info(info.qtype)[0]
                tensor = tensor.reshape(-1, tensor.shape[-1])  # experts: E * rows rows
                yield hf_name, GGUFTensor(info.qtype, tensor.shape[0], cols, tensor.contiguous())
            else:
                yield hf_name, tensor
    finally:
        del mm

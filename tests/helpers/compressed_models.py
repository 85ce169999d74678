"""Tiny random models written as compressed-tensors checkpoints (llm-compressor's format), the
way ``ModelCompressor`` saves them: int8 codes and one scale a row (``int-quantized``, W8A8),
float8_e4m3 codes and one scale a row (``float-quantized``, FP8_DYNAMIC and FP8), or
codes packed by compressed-tensors' own ``pack_to_int32`` (``pack-quantized``): int8 with one
scale a row (W8A16), int4 with one scale (and zero point) a group of 32 (W4A16). The codes are rounded from the float weights
with min-max scales (what a data-free ``QuantizationModifier`` run computes); ``lm_head`` is
left in float, as the usual ``ignore: ["lm_head"]``.

transformers loads these folders itself (through compressed-tensors), which is the reference.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

SCHEMES = ("w8a8", "w8a16", "w4a16", "w4a16_asym", "fp8_dynamic", "fp8")
FP8_SCHEMES = ("fp8_dynamic", "fp8")


def _weights_args(scheme: str) -> dict:
    if scheme in FP8_SCHEMES:
        return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "group_size": None}
    if scheme.startswith("w8"):
        return {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "group_size": None}
    sym = scheme == "w4a16"
    return {"num_bits": 4, "type": "int", "symmetric": sym, "strategy": "group", "group_size": 32}


def quantization_config(scheme: str) -> dict:
    weights = {**_weights_args(scheme), "dynamic": False, "actorder": None, "block_structure": None,
               "observer": "minmax", "observer_kwargs": {}}  # fmt: skip
    acts = None
    if scheme == "fp8_dynamic":
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True,
                "group_size": None, "actorder": None, "block_structure": None, "observer": None,
                "observer_kwargs": {}}  # fmt: skip
    if scheme == "w8a8":
        acts = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True,
                "group_size": None, "actorder": None, "block_structure": None, "observer": None,
                "observer_kwargs": {}}  # fmt: skip
    return {
        "quant_method": "compressed-tensors",
        "format": {"w8a8": "int-quantized", "fp8_dynamic": "float-quantized", "fp8": "float-quantized"}.get(
            scheme, "pack-quantized"
        ),
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": acts,
                "output_activations": None,
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
    }


def _quantize(w: torch.Tensor, scheme: str, pow2_scales: bool = False) -> dict[str, torch.Tensor]:
    """The compressed tensors of one float32 weight [N, K], by leaf name (``pow2_scales``: FP8 scales
    and int8 scales rounded up to powers of two)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    n, k = w.shape
    if scheme in FP8_SCHEMES:
        scale = w.abs().amax(1, keepdim=True).clamp_min(1e-8) / 448
        if pow2_scales:
            scale = torch.exp2(torch.ceil(torch.log2(scale)))
        return {"weight": (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn), "weight_scale": scale}
    if scheme.startswith("w8"):
        scale = w.abs().amax(1, keepdim=True).clamp_min(1e-8) / 127
        if pow2_scales:
            scale = torch.exp2(torch.ceil(torch.log2(scale)))
        codes = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
        if scheme == "w8a8":
            return {"weight": codes, "weight_scale": scale}
        return {
            "weight_packed": pack_to_int32(codes, 8),
            "weight_scale": scale,
            "weight_shape": torch.tensor([n, k]),
        }
    g = w.view(n, k // 32, 32)
    if scheme == "w4a16":
        scale = g.abs().amax(-1).clamp_min(1e-8) / 7
        codes = torch.round(g / scale.unsqueeze(-1)).clamp(-8, 7).to(torch.int8).view(n, k)
        return {
            "weight_packed": pack_to_int32(codes, 4),
            "weight_scale": scale,
            "weight_shape": torch.tensor([n, k]),
        }
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp_min(1e-8)
    zero = (torch.round(-lo / scale) - 8).clamp(-8, 7)
    codes = (torch.round(g / scale.unsqueeze(-1)) + zero.unsqueeze(-1)).clamp(-8, 7).to(torch.int8).view(n, k)
    return {
        "weight_packed": pack_to_int32(codes, 4),
        "weight_scale": scale,
        "weight_shape": torch.tensor([n, k]),
        "weight_zero_point": pack_to_int32(zero.to(torch.int8), 4, packed_dim=0),
    }


def save_compressed(model, path: str | os.PathLike, scheme: str, pow2_scales: bool = False) -> str:
    """Write ``model`` (a float transformers model) at ``path`` as a ``scheme`` checkpoint (one of
    ``SCHEMES``); its dtype is the one of the scales and float tensors. ``pow2_scales``: an FP8 or
    int8 scheme's scales are powers of two, so a code times its scale is exact in bf16 (transformers'
    decompressed bf16 weights are then the very values srt multiplies). Returns the path."""
    path = str(path)
    os.makedirs(path, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    dtype = next(model.parameters()).dtype
    linears = {
        name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and name != "lm_head"
    }
    for name, t in model.state_dict().items():
        prefix, _, leaf = name.rpartition(".")
        if prefix in linears and leaf == "weight":
            for sub, v in _quantize(t.float(), scheme, pow2_scales).items():
                tensors[f"{prefix}.{sub}"] = v.to(dtype) if v.dtype == torch.float32 else v
        else:
            tensors[name] = t.contiguous()
    if getattr(model.config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = quantization_config(scheme)
    config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")  # as llm-compressor writes it
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return path

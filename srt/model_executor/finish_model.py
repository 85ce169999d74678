"""What a loaded model gets once the pools are sized (``finish_model``, called by the ModelRunner
at start-up and after a weight update): the rope tables cut to the positions a request can reach,
then the fused CUDA kernels or the native decode layers (they capture the tables)."""

from __future__ import annotations

import logging

import torch
from torch import nn

from srt.distributed import TPInfo
from srt.layers.fused_kernels import FusedKernels, bind_fused_kernels, fused_kernels_off_reason
from srt.layers.rotary_embedding import limit_positions

logger = logging.getLogger("srt.model_executor.model_runner")


def finish_model(
    model: nn.Module,
    positions: int,
    device: torch.device,
    dtype: torch.dtype,
    tp: TPInfo,
    disable_fused_kernels: bool,
    disable_native_decode_layers: bool,
) -> None:
    freed = limit_positions(model, positions)
    if freed:
        logger.info(
            "rope tables cut to %d positions (the pool's): %.1f MiB freed", positions, freed / (1 << 20)
        )
    _bind_fused_kernels(model, device, dtype, disable_fused_kernels)
    _enable_native_decode(model, tp, disable_native_decode_layers)


def _bind_fused_kernels(model: nn.Module, device: torch.device, dtype: torch.dtype, disabled: bool) -> None:
    """On CUDA in bf16/fp16, the norms, activations and ropes take FlashInfer's fused kernels."""
    why = fused_kernels_off_reason(device, dtype, disabled)
    if why is not None:
        (logger.info if device.type == "cuda" else logger.debug)("fused kernels off: %s", why)
        return
    logger.info("fused kernels (FlashInfer) in %d layers", bind_fused_kernels(model, FusedKernels()))


def _enable_native_decode(model: nn.Module, tp: TPInfo, disabled: bool) -> None:
    """Hand the model's decode layers to the native call where it applies (llama_native.py);
    the native stack holds its own references to the blocks, so a new model needs its own."""
    enable_native = getattr(model, "enable_native_decode", None)
    if enable_native is None:
        return
    if disabled:
        logger.info("native decode layers off: --disable-native-decode-layers")
    elif tp.enabled:
        logger.info("native decode layers off: tensor parallelism all-reduces between layers")
    else:
        logger.info(enable_native())

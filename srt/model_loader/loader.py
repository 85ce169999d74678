"""get_model: build the model for a ModelConfig and fill its weights.

    model class (registry, by HF architecture) -> parameters allocated uninitialized on the
    target device, every projection on the given linear backend -> weights streamed in:
        safetensors: safetensors_weights_iterator(model dir)   (stored dtype, cast on copy)
        gguf:        gguf_weights_iterator(file, hf_config)    (dequantized float32)
        dummy:       init_dummy_weights(model, seed)           (seeded random, nothing read)
    -> eval mode, no gradients -> weights prepacked for the linear backend (``prepare_weights``).

Peak memory is the parameters plus one checkpoint tensor (and its dequantization
temporaries); no state dict is ever materialized.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from srt.configs.model_config import LOAD_FORMATS, ModelConfig
from srt.layers.linear import Linear
from srt.layers.linear_backend import LinearBackend
from srt.layers.logits_processor import LogitsProcessor
from srt.model_loader.weight_utils import (
    init_dummy_weights,
    release_free_memory,
    safetensors_weights_iterator,
    weight_bytes,
)
from srt.models.registry import get_model_class
from srt.utils.errors import ConfigError

logger = logging.getLogger(__name__)


def prepare_weights(model: nn.Module) -> None:
    """Let every linear layer, and the LM head's ``logits_processor``, prepack its loaded weight
    for its backend (a no-op for backends without a packed form)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.prepare_weights()
    logits = getattr(model, "logits_processor", None)
    lm_head = getattr(model, "lm_head", None)
    if isinstance(logits, LogitsProcessor) and lm_head is not None:
        logits.prepare_weights(lm_head.weight)


def get_model(
    model_config: ModelConfig,
    load_format: str | None = None,
    device: str | torch.device = "cpu",
    seed: int = 0,
    linear_backend: LinearBackend | None = None,
) -> nn.Module:
    """The model of ``model_config`` with weights loaded, in eval mode.

    ``load_format`` (default: ``model_config.load_format``) is one of safetensors, gguf, dummy
    (``auto`` means the config's). ``seed`` only matters for dummy weights. ``linear_backend``
    runs the model's matmuls (``F.linear`` when None)."""
    fmt = model_config.load_format if load_format in (None, "auto") else load_format
    if fmt not in LOAD_FORMATS:
        raise ConfigError(f"unknown load format {fmt!r}")
    if fmt == "gguf" and model_config.gguf_file is None:
        raise ConfigError(f"load format gguf needs a .gguf model, got {model_config.model_path}")
    if fmt == "safetensors" and model_config.gguf_file is not None:
        raise ConfigError("load format safetensors was requested for a .gguf model")
    model_cls = get_model_class(model_config.architecture)
    t0 = time.perf_counter()
    with torch.device(device):
        model = model_cls(model_config.hf_config, model_config.dtype, linear_backend)
    if fmt == "dummy":
        init_dummy_weights(model, seed)
    elif fmt == "gguf":
        from srt.model_loader.gguf import gguf_weights_iterator

        model.load_weights(gguf_weights_iterator(model_config.gguf_file, model_config.hf_config))
    else:
        model.load_weights(safetensors_weights_iterator(model_config.model_path))
    model.eval()
    model.requires_grad_(False)
    prepare_weights(model)
    release_free_memory()
    logger.info(
        "Loaded %s (%s weights, %s) in %.1f s: %.1f MiB",
        model_config.architecture,
        fmt,
        model_config.dtype,
        time.perf_counter() - t0,
        weight_bytes(model) / 2**20,
    )
    return model

"""What ``--dtype auto`` means on CPU, decided without torch (the main process stays free of it).

The dtype follows the checkpoint, as far as the CPU computes it fast:

    checkpoint (config.json's ``torch_dtype`` / ``dtype``)   CPU                                  served in
    bfloat16 or float16                                       AMX-BF16 or AVX512-BF16, probe ok    bfloat16
    bfloat16 or float16                                       AVX2 only (or the bf16 probe failed)  float32
    float32, or none written                                  any                                  float32
    a GGUF file (the default model included)                  any                                  float32
    W8A8 (int8 weights and per-token int8 activations)        as its declared dtype above, and      bfloat16
                                                              AVX-512 VNNI (srt's int8 kernel)
    other int8 / int4 (W8A16, W4A16, AWQ, GPTQ)               any                                  float32
    FP8 (a scale a row, a tensor or a block)                   as its declared dtype above

An FP8 checkpoint's codes are exact in bf16, so it is served like a checkpoint of its declared
dtype: in bf16 on a CPU with bf16 arithmetic, the codes kept in one byte and widened to bf16 in
cache where the CPU has AVX512-VBMI (srt's fp8 linear; a block's scale applied as they widen, the
bf16 weights transformers dequantizes to), in bf16 elsewhere; the scales of rows or tensors
multiply the layers' outputs. With float32 activations a block-scaled checkpoint is dequantized to
float32.

A W8A8 checkpoint's layers quantize their inputs to int8 per token inside srt's int8 kernel, which
takes and returns bf16 as it does float32 (the same codes from the widened rows), so such a
checkpoint is served in its declared bf16 like any bf16 one: attention, norms and the KV cache in
bf16 (the unquantized LM head and embeddings are the checkpoint's bf16). The weight-only schemes'
kernels (GGUF blocks times float32 activations) keep float32.

bfloat16 halves the weights' memory and the bytes each decoded token reads, and runs batched
matmuls on the CPU's bf16 units (srt's bf16 linear: ``vdpbf16ps`` for a few rows, oneDNN's brgemm,
which takes AMX tiles where the CPU has them, for more). A float16 checkpoint is served in bf16
(its values rounded to bf16's 8-bit mantissa: what vLLM's CPU backend does too). On a CPU without
bf16 arithmetic float32 is faster to compute with, so activations stay float32. The bf16 probe
(srt/configs/bf16_probe.py) runs in a child, so a CPU that advertises AMX and traps falls back with
a logged reason, never a crash. ``--dtype float32`` / ``bfloat16`` are taken as given.

Where bf16 arithmetic is missing, a bf16 checkpoint's linear weights are still stored in bf16
(``--weight-dtype auto``, ``resolve_weight_dtype``): srt's bf16 linear widens them to float32 in
registers (a 16-bit shift), so the arithmetic is float32's on the checkpoint's own values, with half
the memory and half the bytes each decoded token reads. ``--dtype float32`` keeps float32 weights.
"""

from __future__ import annotations

import json
import logging
import os

from srt.configs.cpu_features import cpu_bf16_units, cpu_flags
from srt.configs.quant_config import (
    QuantScheme,
    UnsupportedQuantizationError,
    parse_quantization,
    read_quantization_config,
)
from srt.utils.errors import ConfigError

logger = logging.getLogger(__name__)

_HALF = ("bfloat16", "float16")


def checkpoint_dtype(model_path: str | None) -> str | None:
    """The dtype a HF checkpoint directory declares (``torch_dtype``, or ``dtype`` as transformers 5
    writes it; a multimodal config's ``text_config`` too), normalized to ``float32`` /
    ``bfloat16`` / ``float16``; None for a GGUF file, no path, or no such field."""
    if not model_path or not os.path.isdir(model_path):
        return None
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    for c in (cfg, cfg.get("text_config") or {}):
        value = c.get("torch_dtype") or c.get("dtype")
        if isinstance(value, str):
            value = value.removeprefix("torch.")
            return {"float": "float32", "half": "float16", "bf16": "bfloat16"}.get(value, value)
    return None


def _scheme(qc: dict | None) -> QuantScheme | None:
    """The checkpoint's quantization scheme; None without one, or for a config srt cannot serve (its
    error comes where the quantization is resolved)."""
    if qc is None:
        return None
    try:
        return parse_quantization(qc)
    except UnsupportedQuantizationError:
        return None


def resolve_cpu_dtype(model_path: str | None, load_format: str, bf16_usable=None) -> tuple[str, str]:
    """``--dtype auto`` on CPU -> (dtype, why): see the module docstring. ``bf16_usable`` (a callable,
    default: the child-process probe) is asked only where the checkpoint and the CPU call for bf16."""
    if load_format == "gguf" or (model_path or "").endswith(".gguf") or not model_path:
        return "float32", "GGUF weights run on their own kernels with float32 activations"
    qc = read_quantization_config(model_path)
    scheme = _scheme(qc)
    fp8 = scheme is not None and scheme.fp8
    w8a8 = scheme is not None and scheme.w8a8
    if qc is not None and not (fp8 or w8a8):
        return (
            "float32",
            "the checkpoint's quantized layers run on srt's GGUF-block kernels with float32 activations",
        )
    declared = checkpoint_dtype(model_path)
    if (fp8 or w8a8) and declared in _HALF:  # served like a checkpoint of its declared dtype
        declared = f"{declared} ({'FP8 codes and scales' if fp8 else 'W8A8'})"
    if declared is None or not declared.startswith(_HALF):
        return "float32", f"the checkpoint is {declared or 'float32 (no dtype declared)'}"
    units = cpu_bf16_units()
    if units is None:
        return "float32", f"the checkpoint is {declared} but this CPU has no bf16 arithmetic (AVX2 only)"
    if w8a8 and "avx512_vnni" not in cpu_flags():
        return "float32", f"the checkpoint is {declared} but this CPU has no AVX-512 VNNI for the int8 kernel"
    if bf16_usable is None:
        from srt.configs.bf16_probe import cpu_bf16_usable as bf16_usable
    if not bf16_usable():
        return "float32", f"the checkpoint is {declared} but the bf16 probe failed on this CPU ({units})"
    return "bfloat16", f"the checkpoint is {declared} and this CPU computes in bf16 ({units})"


def resolve_weight_dtype(
    requested: str,
    dtype: str,
    dtype_auto: bool,
    model_path: str | None,
    device: str,
    linear_backend: str,
    dequantized: bool = False,
    codes_in_bf16: bool = False,
) -> str:
    """``--weight-dtype``: auto is bfloat16 where ``--dtype auto`` served a bf16 checkpoint in float32
    on the native linear backend (a CPU without bf16 arithmetic: the checkpoint's values stored in
    bf16, widened to float32 in registers), else the model dtype; bfloat16 given by hand needs float32
    activations on CPU, that backend and a bf16 checkpoint. ``dequantized``: a quantized checkpoint
    dequantized at load, whose values bf16 would round (auto: the model dtype; bfloat16 refused),
    unless ``codes_in_bf16``: an FP8 checkpoint with a scale a row or a tensor, whose layers keep
    their float8 codes (exact in bf16) and scale their outputs, served like a bf16 checkpoint (auto:
    bfloat16 storage under the conditions above). ``ConfigError`` otherwise."""
    if codes_in_bf16 and dtype == "float32" and requested in ("auto", "bfloat16"):
        exact = checkpoint_dtype(model_path) == "bfloat16" and device == "cpu" and linear_backend == "native"
        if exact:
            logger.info(
                "--weight-dtype %s: bfloat16 (the FP8 codes, exact in bf16; scales on the outputs)", requested
            )
            return "bfloat16"
    if dequantized and requested == "bfloat16" and dtype == "float32":
        raise ConfigError(
            "--weight-dtype bfloat16 would round a quantized checkpoint's dequantized weights; use auto."
        )
    if requested == "auto" and dequantized:
        return dtype
    if requested == "auto":
        storage = dtype_auto and checkpoint_dtype(model_path) == "bfloat16" and device == "cpu"
        if storage and dtype == "float32" and linear_backend == "native":
            logger.info(
                "--weight-dtype auto: bfloat16 (the checkpoint's values, widened to float32 in registers)"
            )
            return "bfloat16"
        return dtype
    if requested == "bfloat16" and dtype == "float32":
        if device != "cpu" or linear_backend != "native":
            raise ConfigError(
                "--weight-dtype bfloat16 with float32 activations needs --device cpu and --linear-backend "
                f"native, got --device {device} --linear-backend {linear_backend}."
            )
        declared = checkpoint_dtype(model_path)
        if declared != "bfloat16":  # rounding a checkpoint's weights would serve other weights
            raise ConfigError(
                f"--weight-dtype bfloat16 stores a bf16 checkpoint's weights as they are; this checkpoint is "
                f"{declared or 'not a bf16 one'}: use --weight-dtype auto."
            )
        return requested
    if requested != dtype:
        raise ConfigError(
            f"--weight-dtype {requested} does not go with --dtype {dtype}: use auto, or bfloat16 with "
            "--dtype float32 (bf16 storage for float32 activations)."
        )
    return requested

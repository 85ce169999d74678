"""A checkpoint's ``quantization_config`` (config.json), read without torch: the schemes srt
serves, and a start-up error naming any other, so that no quantized checkpoint is ever served as
if its integer codes were float weights.

Served (srt/model_loader/compressed_tensors.py converts the tensors at load):
- ``compressed-tensors`` (llm-compressor's format, RedHatAI's ``*-quantized.w8a8`` /
  ``*.w8a16`` / ``*.w4a16`` checkpoints):
  - ``int-quantized`` / ``naive-quantized``, 8-bit int weights, symmetric, one scale a row
    (``strategy: channel``): W8A16, or W8A8 with dynamic per-token int8 activations;
  - ``float-quantized``, float8_e4m3 weights with one scale a row or a tensor, and dynamic
    per-token float8 activations or none (FP8_DYNAMIC, FP8): dequantized at load (float32);
  - ``pack-quantized``, 4-bit int weights in groups of 32, 64 or 128 (or one group a row),
    symmetric or with zero points: W4A16; or 8-bit ones, one scale a row: W8A16 (as llm-compressor
    writes weight-only int8).

- ``awq`` (AutoAWQ's GEMM layout, as transformers and most 4-bit Hub checkpoints have it): int4
  with zero points in groups of 32, 64 or 128: W4A16;
- ``gptq`` (AutoGPTQ / GPTQModel, ``checkpoint_format`` gptq or gptq_v2): int4 or int8 in groups
  (a multiple of 32) or one group a row, symmetric or not; activation order (``desc_act``) only
  dequantized at load (``--quantization none``: float32 weights);
- ``fp8`` (transformers' fine-grained FP8, as Qwen3-*-FP8 and DeepSeek ship it): float8_e4m3
  weights with one scale a block (``weight_block_size``) or a tensor, dynamic activations:
  dequantized at load (float32), as transformers itself does on a CPU.

Everything else (other ``quant_method`` values: bitsandbytes, hqq, ...; other ``format`` values,
static activation scales, sparsity, a quantized KV cache) raises ``UnsupportedQuantizationError``
naming the method and the scheme.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from srt.utils.errors import ConfigError

logger = logging.getLogger(__name__)

COMPRESSED_TENSORS = "compressed-tensors"
AWQ, GPTQ, FP8 = "awq", "gptq", "fp8"
KEPT_METHODS = (COMPRESSED_TENSORS, AWQ, GPTQ)  # checkpoint methods whose layers srt keeps as blocks
_SERVED = (
    f"{COMPRESSED_TENSORS} (int8, int4, FP8), {AWQ} (int4), {GPTQ} (int4, int8) and {FP8} (block or tensor)"
)
_INT8_FORMATS = ("int-quantized", "naive-quantized")
_INT4_FORMATS = ("pack-quantized",)
_FP8_FORMATS = ("float-quantized",)
_GROUP_SIZES = (32, 64, 128)


class UnsupportedQuantizationError(ConfigError):
    """A checkpoint quantized in a way srt does not serve (method and scheme named)."""


@dataclass(frozen=True)
class QuantScheme:
    """What a supported ``quantization_config`` says about the quantized linear layers."""

    method: str  # "compressed-tensors", "awq", "gptq" or "fp8"
    # compressed-tensors: "int-quantized" / "naive-quantized" / "pack-quantized" / "float-quantized";
    # awq: "gemm"; gptq: "gptq" / "gptq_v2" (zero points stored less one, or not); fp8: "e4m3"
    format: str
    bits: int  # 8 or 4
    group_size: int | None  # None: one scale a row (strategy channel) or a tensor (FP8)
    symmetric: bool
    token_quant: str | None  # the inputs' dynamic per-token quantization: "int8" (W8A8), "fp8", None
    act_order: bool = False  # GPTQ desc_act: groups follow g_idx, not the column order
    block: tuple[int, int] | None = None  # fp8: one scale a block of rows x columns

    @property
    def fp8(self) -> bool:
        return self.format in _FP8_FORMATS or self.method == FP8

    @property
    def w8a8(self) -> bool:
        """int8 weights times activations quantized to int8 per token: srt's int8 kernel, which takes
        float32 or bf16 rows."""
        return not self.fp8 and self.token_quant == "int8"

    @property
    def name(self) -> str:
        if self.fp8:
            return "FP8_DYNAMIC" if self.token_quant else "FP8 weights"
        return f"W{self.bits}A{8 if self.token_quant else 16}"

    def describe(self) -> str:
        if self.method == FP8:
            scales = (
                "one scale a tensor" if self.block is None else f"blocks of {self.block[0]}x{self.block[1]}"
            )
            return f"{self.method} {self.format} {self.name} (float8_e4m3, {scales})"
        groups = "per channel" if self.group_size is None else f"groups of {self.group_size}"
        if self.act_order:
            groups += " in activation order"
        zero = "symmetric" if self.symmetric else "with zero points"
        kind = "float8_e4m3" if self.fp8 else f"int{self.bits}"
        return f"{self.method} {self.format} {self.name} ({kind}, {groups}, {zero})"


def keeps_blocks(quantization: str) -> bool:
    """A resolved ``--quantization`` that keeps matmul weights as GGUF blocks on srt's kernels."""
    return quantization == "gguf" or quantization in KEPT_METHODS


def resolve_quantization(
    requested: str, model_path: str | None, load_format: str, device: str, dtype: str
) -> str:
    """``--quantization`` resolved (``dtype`` is resolved already): auto is gguf for a GGUF model on
    CPU in float32, the checkpoint's method (compressed-tensors, awq, gptq) for an int8 / int4
    checkpoint on CPU in float32, or a W8A8 one in bf16 too (its quantized layers on srt's
    GGUF-block kernels; W8A8's on the int8 kernel, which takes bf16 rows), else none (a quantized
    checkpoint then dequantized at load).
    ``ConfigError`` for a choice that does not fit the model, ``UnsupportedQuantizationError`` for
    a quantized checkpoint srt does not serve."""
    gguf_model = load_format == "gguf" or (
        load_format == "auto" and not model_path
    )  # no path: the default GGUF
    qc = None if gguf_model else read_quantization_config(model_path)
    scheme = None if qc is None else parse_quantization(qc)
    cpu_float32 = device == "cpu" and dtype == "float32"
    blocks_fit = cpu_float32 or (
        device == "cpu" and dtype == "bfloat16" and scheme is not None and scheme.w8a8
    )
    if requested == "auto":
        if gguf_model and cpu_float32:
            return "gguf"
        if scheme is not None and blocks_fit and not scheme.fp8:
            _check_kept(scheme)
            return scheme.method
        if (
            scheme is not None
            and scheme.fp8
            and device == "cpu"
            and not (scheme.block and dtype == "float32")
        ):
            logger.info(
                "%s: float8 codes and scales kept (codes in one byte where the CPU widens them on vectors), "
                "%s activations",
                scheme.describe(),
                dtype,
            )
        elif scheme is not None:
            logger.info("%s: dequantized at load (%s in %s)", scheme.describe(), device, dtype)
        return "none"
    if requested == "gguf" and not gguf_model:
        raise ConfigError("--quantization gguf needs a .gguf model (or --load-format gguf).")
    if requested in KEPT_METHODS and (scheme is None or scheme.method != requested or scheme.fp8):
        raise ConfigError(
            f"--quantization {requested} needs a checkpoint with that quant_method, int8 or int4 (FP8 "
            "checkpoints are dequantized at load: --quantization none)."
        )
    if requested != "none" and keeps_blocks(requested) and not blocks_fit:
        raise ConfigError(
            f"--quantization {requested} runs on CPU with float32 activations (--device cpu --dtype float32; "
            "a W8A8 checkpoint's bfloat16 too); use --quantization none to dequantize the weights instead."
        )
    if requested not in ("gguf", "none") + KEPT_METHODS:
        raise ConfigError(
            f"--quantization must be auto, gguf, {', '.join(KEPT_METHODS)} or none, got {requested!r}."
        )
    if scheme is not None and requested != "none":
        _check_kept(scheme)
    return requested


def _check_kept(scheme: QuantScheme) -> None:
    """A scheme srt can read but not keep as blocks (GPTQ in activation order) is an error that says
    how to serve it anyway."""
    if scheme.act_order:
        raise UnsupportedQuantizationError(
            f"{scheme.describe()}: a GPTQ checkpoint in activation order (desc_act) cannot be kept as "
            "4-bit blocks (its groups are not runs of columns); serve it dequantized to float32 with "
            "--quantization none (8x the memory of its int4 weights)"
        )


def read_quantization_config(model_dir: str | None) -> dict[str, Any] | None:
    """``config.json``'s ``quantization_config`` of a model folder (None: none, or no folder)."""
    if not model_dir or not os.path.isdir(model_dir):
        return None
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise UnsupportedQuantizationError(f"config.json: quantization_config must be an object, got {qc!r}")
    return qc


def parse_quantization(qc: dict[str, Any]) -> QuantScheme:
    """The scheme of a ``quantization_config``; ``UnsupportedQuantizationError`` naming what srt
    cannot serve."""
    method = str(qc.get("quant_method", "")).lower()
    if method in _OTHER_PARSERS:
        return _OTHER_PARSERS[method](qc)
    if method != COMPRESSED_TENSORS:
        detail = _scheme_words(qc)
        raise UnsupportedQuantizationError(
            f"the checkpoint is quantized with quant_method {method or '(none)'!r}{detail}, which srt does "
            f"not serve; srt serves {_SERVED}"
        )
    fmt = str(qc.get("format", ""))
    where = f"{COMPRESSED_TENSORS} format {fmt!r}"
    if fmt not in _INT8_FORMATS + _INT4_FORMATS + _FP8_FORMATS:
        raise UnsupportedQuantizationError(
            f"{where} is not served (sparse, NVFP4 / MXFP4 and mixed formats are not supported yet); "
            f"srt serves {', '.join(_INT8_FORMATS + _INT4_FORMATS + _FP8_FORMATS)}"
        )
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if qc.get(key):
            raise UnsupportedQuantizationError(f"{where}: {key} is not supported, got {qc[key]!r}")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise UnsupportedQuantizationError(f"{where}: config_groups is missing or empty")
    schemes = {_group_scheme(name, g, fmt, where) for name, g in groups.items()}
    if len(schemes) > 1:
        raise UnsupportedQuantizationError(
            f"{where}: config groups with different schemes are not supported: "
            + "; ".join(sorted(s.describe() for s in schemes))
        )
    return schemes.pop()


def _scheme_words(qc: dict[str, Any]) -> str:
    """A few words on a foreign scheme for the error message (bits, group size, format)."""
    words = [
        f"{k}={qc[k]!r}"
        for k in ("bits", "group_size", "fmt", "format", "version", "load_in_4bit")
        if k in qc
    ]
    return f" ({', '.join(words)})" if words else ""


def _group_scheme(name: str, group: dict[str, Any], fmt: str, where: str) -> QuantScheme:
    here = f"{where}, config group {name!r}"
    if not isinstance(group, dict):
        raise UnsupportedQuantizationError(f"{here} must be an object")
    w = group.get("weights") or {}
    if fmt in _FP8_FORMATS:
        return _fp8_scheme(group, w, here)
    bits = w.get("num_bits")
    strategy = w.get("strategy")
    wanted_bits = (8,) if fmt in _INT8_FORMATS else (4, 8)
    if w.get("type") != "int" or bits not in wanted_bits:
        raise UnsupportedQuantizationError(
            f"{here}: weights of type {w.get('type')!r} with {bits} bits are not served by this format "
            f"(int{' or int'.join(map(str, wanted_bits))} expected)"
        )
    if w.get("dynamic") or w.get("actorder") or w.get("block_structure"):
        raise UnsupportedQuantizationError(
            f"{here}: dynamic weights, activation ordering (actorder) and block structures are not supported"
        )
    group_size = None
    if strategy == "group" and bits == 4 and w.get("group_size") in _GROUP_SIZES:
        group_size = int(w["group_size"])
    elif strategy != "channel":
        raise UnsupportedQuantizationError(
            f"{here}: weight strategy {strategy!r} (group_size {w.get('group_size')!r}) is not supported; "
            f"int8 needs 'channel', int4 'channel' or 'group' with a group size in {_GROUP_SIZES}"
        )
    symmetric = bool(w.get("symmetric", True))
    if bits == 8 and not symmetric:
        raise UnsupportedQuantizationError(f"{here}: asymmetric int8 weights are not supported")
    if group.get("output_activations"):
        raise UnsupportedQuantizationError(f"{here}: quantized output activations are not supported")
    return QuantScheme(COMPRESSED_TENSORS, fmt, bits, group_size, symmetric, _token_quant(group, here, "int"))


def _fp8_scheme(group: dict[str, Any], w: dict[str, Any], here: str) -> QuantScheme:
    """float8_e4m3 weights, one scale a row or a tensor (FP8 / FP8_DYNAMIC)."""
    if w.get("type") != "float" or w.get("num_bits") != 8 or w.get("strategy") not in ("channel", "tensor"):
        raise UnsupportedQuantizationError(
            f"{here}: float-quantized weights of type {w.get('type')!r}, {w.get('num_bits')} bits, strategy "
            f"{w.get('strategy')!r} are not supported (block FP8 included); srt serves FP8 per channel or tensor"
        )
    if w.get("dynamic") or w.get("actorder") or w.get("block_structure") or not w.get("symmetric", True):
        raise UnsupportedQuantizationError(
            f"{here}: dynamic, ordered, block or asymmetric FP8 weights are not supported"
        )
    if group.get("output_activations"):
        raise UnsupportedQuantizationError(f"{here}: quantized output activations are not supported")
    return QuantScheme(
        COMPRESSED_TENSORS, "float-quantized", 8, None, True, _token_quant(group, here, "float")
    )


def _token_quant(group: dict[str, Any], here: str, kind: str) -> str | None:
    """The inputs' quantization a scheme asks for: dynamic per token, int8 or float8 (matching the
    weights' kind), or none."""
    a = group.get("input_activations")
    if not a:
        return None
    if a.get("type") == kind and a.get("num_bits") == 8 and a.get("dynamic") and a.get("strategy") == "token":
        return "int8" if kind == "int" else "fp8"
    raise UnsupportedQuantizationError(
        f"{here}: input activations {a.get('type')!r} {a.get('num_bits')}-bit, strategy {a.get('strategy')!r}, "
        f"dynamic {a.get('dynamic')!r} are not supported (srt serves dynamic per-token {kind} 8-bit activations)"
    )


def _awq_scheme(qc: dict[str, Any]) -> QuantScheme:
    """AutoAWQ's GEMM layout: int4 with zero points, groups of 32, 64 or 128."""
    bits = qc.get("bits", qc.get("w_bit"))
    group = qc.get("group_size", qc.get("q_group_size"))
    version = str(qc.get("version", "gemm")).lower()
    backend = str(qc.get("backend", "autoawq")).lower()
    where = f"awq (bits={bits!r}, group_size={group!r}, version={version!r})"
    if bits != 4 or group not in _GROUP_SIZES or not qc.get("zero_point", True):
        raise UnsupportedQuantizationError(
            f"{where}: srt serves 4-bit AWQ with zero points in groups of {_GROUP_SIZES}"
        )
    if version != "gemm" or backend != "autoawq":
        raise UnsupportedQuantizationError(
            f"{where}, backend {backend!r}: only AutoAWQ's GEMM layout is served (gemv, gemv_fast, marlin, "
            "exllama and llm-awq pack their codes differently)"
        )
    return QuantScheme(AWQ, "gemm", 4, int(group), False, None)


def _gptq_scheme(qc: dict[str, Any]) -> QuantScheme:
    """AutoGPTQ / GPTQModel: int4 or int8, groups of a multiple of 32 or one a row (-1)."""
    bits, group = qc.get("bits"), qc.get("group_size", -1)
    fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
    where = f"gptq (bits={bits!r}, group_size={group!r}, checkpoint_format={fmt!r})"
    if bits not in (4, 8) or not isinstance(group, int) or (group != -1 and (group <= 0 or group % 32)):
        raise UnsupportedQuantizationError(
            f"{where}: srt serves 4- and 8-bit GPTQ in groups of a multiple of 32 (or -1, one a row)"
        )
    if fmt not in ("gptq", "gptq_v2") or qc.get("is_marlin_format"):
        raise UnsupportedQuantizationError(
            f"{where}: only the gptq and gptq_v2 checkpoint formats are served"
        )
    for key in ("dynamic", "lm_head"):
        if qc.get(key):
            raise UnsupportedQuantizationError(
                f"{where}: {key}={qc[key]!r} (per-module overrides, a quantized lm_head) is not supported"
            )
    return QuantScheme(
        GPTQ, fmt, bits, None if group == -1 else group, bool(qc.get("sym", True)), None,
        act_order=bool(qc.get("desc_act", False)),
    )  # fmt: skip


def _fp8_method_scheme(qc: dict[str, Any]) -> QuantScheme:
    """transformers' fine-grained FP8: e4m3 weights, a scale a block (or a tensor), dynamic inputs."""
    block = qc.get("weight_block_size")
    fmt = str(qc.get("fmt", "e4m3")).lower()
    where = (
        f"fp8 (fmt={fmt!r}, weight_block_size={block!r}, activation_scheme={qc.get('activation_scheme')!r})"
    )
    if fmt != "e4m3" or qc.get("activation_scheme", "dynamic") != "dynamic":
        raise UnsupportedQuantizationError(
            f"{where}: srt serves float8_e4m3 weights with dynamic activations (static input scales are "
            "not supported)"
        )
    if block is not None and not (
        isinstance(block, (list, tuple))
        and len(block) == 2
        and all(isinstance(b, int) and b > 0 for b in block)
    ):
        raise UnsupportedQuantizationError(f"{where}: weight_block_size must be two positive integers")
    return QuantScheme(FP8, fmt, 8, None, True, None, block=None if block is None else (block[0], block[1]))


_OTHER_PARSERS = {AWQ: _awq_scheme, GPTQ: _gptq_scheme, FP8: _fp8_method_scheme}

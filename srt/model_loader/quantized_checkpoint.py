"""Quantized checkpoints (srt/configs/quant_config.py says which schemes) converted at load: each
quantized linear layer's tensors (srt/model_loader/checkpoint_formats.py reads each format's)
become one matrix ``<prefix>.weight``.

The value of a code ``q`` (signed) is ``(q - zero) * scale``. Kept quantized (``keep_blocks``: the
CPU's ``--quantization compressed-tensors`` / ``awq`` / ``gptq``) the matrix becomes GGUF blocks
of 32 columns that srt's kernels run, holding the very same values: int8 -> Q8_0 (the 32 codes and
the row's or group's scale), symmetric int4 -> Q4_0 (``code + 8`` and the group's scale, in each
block of the group), int4 with zero points -> Q4_1 (scale ``d`` and offset
``m = -(8 + zero) * d``). GGUF keeps ``d`` and ``m`` as float16: a scale float16 rounds by more
than 2^-10 of itself (below about 3e-5 or above 65504) is an error naming the tensor, never a
silent change (``--quantization none`` dequantizes instead). A matrix whose K or group is not a
multiple of 32, int8 with zero points and every matrix without ``keep_blocks`` is dequantized
to float32 (the layer then holds float weights of the model's dtype). FP8 matrices come as their
codes and scales (``ScaledRows``, ``BlockScaledCodes``) for the layer to keep or dequantize.

Tensors a supported scheme never writes (static activation scales, compressed-tensors' ``g_idx``
of activation ordering) are errors; an incomplete set of a layer's tensors is an error at the end.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch

from srt.configs.cpu_features import cpu_flags
from srt.configs.device import probe_bf16
from srt.configs.quant_config import GPTQ, QuantScheme
from srt.kernels.cpu import gguf as gguf_kernels
from srt.kernels.cpu import w8a8 as w8a8_kernels
from srt.layers.linear import Linear
from srt.layers.moe import MoEExperts
from srt.layers.quantized_weight import BlockScaledCodes, GGUFTensor, ScaledRows
from srt.model_loader import checkpoint_formats as formats
from srt.models.checkpoint_loader import STACKED_PARAMS
from srt.utils.errors import WeightLoadError

Q4_0, Q4_1, Q8_0 = 2, 3, 8  # ggml types
BLOCK = 32
_SCALE_RTOL = 2.0**-10
# leaves a supported scheme never writes: static activation scales, compressed-tensors' actorder
_REFUSED_LEAVES = (
    "input_scale",
    "input_zero_point",
    "weight_g_idx",
    "input_global_scale",
    "weight_global_scale",
    "activation_scale",
)

logger = logging.getLogger(__name__)


def convert_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
    scheme: QuantScheme,
    keep_blocks: bool,
    done: set[str] | None = None,
) -> Iterator[tuple[str, torch.Tensor | GGUFTensor | ScaledRows | BlockScaledCodes]]:
    """The checkpoint's tensors with every quantized layer's set turned into its ``weight`` (see the
    module docstring); other tensors pass unchanged. ``done`` collects the quantized layers'
    checkpoint names (``model.layers.0.self_attn.q_proj``)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    done = set() if done is None else done
    leaves, needed = formats.leaves(scheme), formats.needed(scheme)
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if leaf in _REFUSED_LEAVES:
            raise WeightLoadError(
                f"{name}: {leaf} (static activation quantization or activation ordering) is not supported "
                f"with {scheme.describe()}"
            )
        fp8 = tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        if leaf == "weight" and fp8 and not (scheme.fp8 and tensor.dtype == torch.float8_e4m3fn):
            raise WeightLoadError(f"{name}: {tensor.dtype} weights in a {scheme.describe()} checkpoint")
        quant = leaf in leaves or (leaf == "weight" and (tensor.dtype == torch.int8 or fp8))
        if not quant:
            yield name, tensor
            continue
        if prefix in done:  # a leaf a complete layer does not need, written after it
            _check_late(name, leaf, tensor, scheme)
            continue
        parts = pending.setdefault(prefix, {})
        parts[leaf] = tensor
        if needed <= parts.keys():
            done.add(prefix)
            yield f"{prefix}.weight", _convert(prefix, pending.pop(prefix), scheme, keep_blocks)
    if pending:
        prefix, parts = next(iter(pending.items()))
        raise WeightLoadError(
            f"{len(pending)} quantized layers lack tensors, e.g. {prefix}: has {sorted(parts)}, "
            f"{scheme.describe()} needs {sorted(needed)}"
        )


def quantize_inputs_of(model: torch.nn.Module, quantized: set[str], kind: str) -> int:
    """A W8A8 / FP8_DYNAMIC scheme: each linear layer made of quantized checkpoint layers quantizes
    its inputs per token (``Linear.token_quant = kind``); returns how many. A fused projection
    (``qkv_proj``, ``gate_up_proj``) is made of the checkpoint modules srt/models/llama.py routes
    into it; a MoE layer's experts (``MoEExperts``) when its checkpoint experts were quantized."""
    marked = 0
    for name, module in model.named_modules():
        if isinstance(module, MoEExperts):
            layer = name.split(".mlp.")[0] + "."
            if any(q.startswith(layer) and ".experts." in q for q in quantized):
                module.token_quant = kind
                marked += 1
            continue
        if not isinstance(module, Linear):
            continue
        dotted = f"{name}."
        sources = [name] + [
            dotted.replace(fused, part)[:-1] for fused, part, _ in STACKED_PARAMS if fused in dotted
        ]
        if any(s in quantized for s in sources):
            module.token_quant = kind
            marked += 1
    return marked


def use_int8_kernels(model: torch.nn.Module) -> int:
    """After ``prepare_weights``: each linear layer that quantizes its inputs to int8 per token
    (W8A8) on Q8_0 blocks of one scale a row moves to the int8 kernel
    (``QuantizedWeight.use_token_int8``: the same per-token codes, integer dot products); returns
    how many did (none on CPUs without AVX-512 VNNI, which keep the float32 kernels), logging them
    and the weights' layout (``int8_layout``)."""
    layers = [
        m.qweight
        for m in model.modules()
        if isinstance(m, Linear) and m.token_quant == "int8" and m.qweight is not None
    ]
    layout = int8_layout() if layers else "groups"
    moved = sum(q.use_token_int8(layout) for q in layers)
    if moved:
        logger.info(
            "W8A8: %d linear layers on the int8 kernel (%s; inputs quantized per token in it)", moved, layout
        )
    return moved


def int8_layout() -> str:
    """``"amx"`` (panels for brgemm on AMX-INT8 tiles) where the CPU has those tiles and they run:
    the bf16 probe runs AMX tiles in a child process, and where they trap it caps oneDNN below AMX,
    which ``w8a8_amx`` then sees; else ``"groups"`` (the AVX-512 VNNI kernel's)."""
    if "amx_int8" not in cpu_flags() or not probe_bf16("cpu"):
        return "groups"
    return "amx" if w8a8_kernels.w8a8_amx() else "groups"


def _check_late(name: str, leaf: str, tensor: torch.Tensor, scheme: QuantScheme) -> None:
    """A leaf after its layer was complete: a symmetric scheme's zero points (all zero) or GPTQ's
    ``g_idx`` (runs of columns) carry nothing; anything else is a second copy."""
    if leaf == "weight_zero_point":
        formats.check_zero(name, tensor)
    elif leaf == "g_idx" and scheme.method == GPTQ:
        groups = -(-tensor.numel() // (scheme.group_size or tensor.numel()))
        formats.check_g_idx(name, tensor, groups)
    else:
        raise WeightLoadError(f"{name}: a second {leaf} for a layer already loaded")


def _convert(
    prefix: str, parts: dict[str, torch.Tensor], scheme: QuantScheme, keep_blocks: bool
) -> torch.Tensor | GGUFTensor | ScaledRows | BlockScaledCodes:
    """One layer's tensors -> GGUF blocks, FP8 codes and scales, or a float32 matrix."""
    if scheme.fp8:
        return formats.fp8_values(prefix, parts, scheme)
    codes, scale, zero = formats.read_codes(prefix, parts, scheme)
    n, k = codes.shape
    if scale.dim() != 2 or scale.shape[0] != n or k % scale.shape[1]:
        raise WeightLoadError(f"{prefix}: scales of shape {tuple(scale.shape)} do not fit a {n} x {k} weight")
    group = k // scale.shape[1]
    qtype = (Q8_0 if zero is None else None) if scheme.bits == 8 else Q4_0 if zero is None else Q4_1
    blocks = k % BLOCK == 0 and group % BLOCK == 0 and qtype in gguf_kernels.native_qtypes()
    if keep_blocks and blocks:
        return GGUFTensor(qtype, n, k, _blocks(prefix, qtype, codes, scale, zero, group))
    value = codes.float() if zero is None else codes.float() - zero.repeat_interleave(group, dim=1)
    return value * scale.repeat_interleave(group, dim=1)


def _half_scales(prefix: str, what: str, values: torch.Tensor) -> torch.Tensor:
    """float16 of ``values`` (GGUF's scale type), or an error where that changes one by more than
    2^-10 of itself."""
    half = values.to(torch.float16)
    err = (half.float() - values).abs()
    bad = err > _SCALE_RTOL * values.abs()
    if bool(bad.any()):
        worst = float(values[bad].abs().min())
        raise WeightLoadError(
            f"{prefix}: a {what} of {worst:.3g} does not fit GGUF's float16 blocks within 2^-10; "
            "serve the checkpoint dequantized with --quantization none"
        )
    return half


def _blocks(
    prefix: str, qtype: int, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int
) -> torch.Tensor:
    """GGUF bytes ``uint8 [N, K/32 * type size]`` of the codes (see the module docstring)."""
    n, k = codes.shape
    nb = k // BLOCK
    per_block = group // BLOCK
    d = scale.repeat_interleave(per_block, dim=1)  # [N, nb]
    parts = [_half_scales(prefix, "scale", d).view(torch.uint8).view(n, nb, 2)]
    if qtype == Q8_0:
        parts.append(codes.contiguous().view(torch.uint8).view(n, nb, BLOCK))
        return torch.cat(parts, dim=2).reshape(n, -1)
    if qtype == Q4_1:
        assert zero is not None
        m = -(8.0 + zero.repeat_interleave(per_block, dim=1)) * d
        parts.append(_half_scales(prefix, "zero-point offset", m).view(torch.uint8).view(n, nb, 2))
    unsigned = (codes.to(torch.int16) + 8).to(torch.uint8).view(n, nb, BLOCK)
    parts.append(unsigned[:, :, :16] | (unsigned[:, :, 16:] << 4))
    return torch.cat(parts, dim=2).reshape(n, -1)

"""Tiny random models written as AWQ, GPTQ and fine-grained FP8 checkpoints, their tensors laid out
the way AutoAWQ (GEMM), AutoGPTQ / GPTQModel (the gptq checkpoint format) and transformers' FP8
quantizer save them. The codes are rounded from the float weights with min-max scales; the float
tensors and scales are float16 (AWQ, GPTQ) or bfloat16 (FP8), as on the Hub; ``lm_head`` is left in
float.

The packing here follows each tool's own description, written out independently of srt's reader:
- AWQ: ``qweight[k, c]`` ORs the codes of columns ``8c + (0, 2, 4, 6, 1, 3, 5, 7)[i]`` shifted by
  ``4i``; ``qzeros`` the same over groups; value ``(q - z) * s``.
- GPTQ: ``qweight[r, n]`` ORs the codes of rows ``r*32/b + i`` shifted by ``b*i``; ``qzeros[g, c]``
  the zero points less one of columns ``c*32/b + i``; ``g_idx`` each column's group (a random
  order with ``act_order``).
- FP8: ``weight`` float8_e4m3 and ``weight_scale_inv`` one a block (``weight_block_size``).

``dequantized_model`` is the reference: the float32 model whose quantized layers hold the exact
values of the codes (computed before packing).
"""

from __future__ import annotations

import copy
import json
import os

import torch
from safetensors.torch import save_file

SCHEMES = ("awq", "gptq", "gptq_asym", "gptq_int8", "gptq_actorder")
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _groups_of(k: int, group: int, act_order: bool, seed: int) -> torch.Tensor:
    """``g_idx``: each column's group; with ``act_order`` a random order of the columns."""
    g_idx = torch.arange(k, dtype=torch.int32) // group
    if act_order:
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        g_idx = g_idx[torch.argsort(perm)]
    return g_idx


def _codes(w: torch.Tensor, g_idx: torch.Tensor, groups: int, bits: int, sym: bool):
    """Unsigned codes ``[N, K]``, float16 scales and integer zero points ``[G, N]`` of ``w``."""
    n = w.shape[0]
    maxq = 2**bits - 1
    scales = torch.empty(groups, n)
    zeros = torch.empty(groups, n)
    for g in range(groups):
        cols = w[:, g_idx == g]
        lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        if sym:
            scales[g] = (torch.maximum(-lo, hi) * 2 / maxq).clamp_min(1e-5)
            zeros[g] = (maxq + 1) // 2
        else:
            scales[g] = ((hi - lo) / maxq).clamp_min(1e-5)
            zeros[g] = torch.round(-lo / scales[g]).clamp(1, maxq)  # z = 0 is not storable in gptq v1
    scales = scales.half()
    s, z = scales.float()[g_idx.long()].t(), zeros[g_idx.long()].t()
    q = torch.clamp(torch.round(w / s) + z, 0, maxq)
    return q.to(torch.int32), scales, zeros.to(torch.int32), (q - z) * s


def _pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ ``qweight``: ``q`` is ``[K, N]``; word ``[r, n]`` holds rows ``r*32/b + i``."""
    per = 32 // bits
    out = torch.zeros(q.shape[0] // per, q.shape[1], dtype=torch.int64)
    for i in range(per):
        out |= q[i::per].to(torch.int64) << (bits * i)
    return _as_int32(out)


def _pack_cols(q: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """Words along the columns of ``q`` ``[R, C]``: field ``i`` of word ``c`` is column
    ``c*32/b + order[i]``."""
    per = 32 // bits
    order = order or tuple(range(per))
    out = torch.zeros(q.shape[0], q.shape[1] // per, dtype=torch.int64)
    for i in range(per):
        out |= q[:, order[i] :: per].to(torch.int64) << (bits * i)
    return _as_int32(out)


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _quantize(w: torch.Tensor, scheme: str, group: int, seed: int) -> tuple[dict, torch.Tensor]:
    """The checkpoint tensors of one float32 weight ``[N, K]`` by leaf, and its exact value."""
    n, k = w.shape
    bits = 8 if scheme == "gptq_int8" else 4
    g_idx = _groups_of(k, group, scheme == "gptq_actorder", seed)
    sym = scheme in ("gptq", "gptq_int8", "gptq_actorder")
    q, scales, zeros, value = _codes(w, g_idx, k // group, bits, sym)
    if scheme == "awq":
        tensors = {
            "qweight": _pack_cols(q.t(), 4, _AWQ_ORDER),
            "qzeros": _pack_cols(zeros, 4, _AWQ_ORDER),
            "scales": scales,
        }
    else:
        tensors = {
            "qweight": _pack_rows(q.t(), bits),
            "qzeros": _pack_cols((zeros - 1) & (2**bits - 1), bits),
            "scales": scales,
            "g_idx": g_idx,
        }
    return tensors, value


def quantization_config(scheme: str, group: int) -> dict:
    if scheme == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}  # fmt: skip
    return {
        "quant_method": "gptq",
        "bits": 8 if scheme == "gptq_int8" else 4,
        "group_size": group,
        "desc_act": scheme == "gptq_actorder",
        "sym": scheme != "gptq_asym",
        "static_groups": False,
        "true_sequential": True,
        "checkpoint_format": "gptq",
        "damp_percent": 0.01,
    }


def save_quantized(model, path: str | os.PathLike, scheme: str, group: int = 32):
    """Write ``model`` (float32 transformers) as a ``scheme`` checkpoint (one of ``SCHEMES``) at
    ``path``; returns ``(path, reference)``, the reference model holding the exact values."""
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, torch.Tensor] = {}
    for i, (name, t) in enumerate(model.state_dict().items()):
        prefix, _, leaf = name.rpartition(".")
        if leaf == "weight" and prefix != "lm_head" and _is_linear(model, prefix):
            parts, values[name] = _quantize(t.float(), scheme, group, seed=i)
            tensors.update({f"{prefix}.{leaf_}": v for leaf_, v in parts.items()})
        else:
            tensors[name] = t.half().contiguous()
    return _write(model, path, tensors, quantization_config(scheme, group), "float16"), _reference(
        model, values
    )


def save_block_fp8(model, path: str | os.PathLike, block: tuple[int, int] = (32, 32)) -> str:
    """Write ``model`` as a transformers fine-grained FP8 checkpoint (blocks of ``block``)."""
    tensors: dict[str, torch.Tensor] = {}
    bn, bk = block
    for name, t in model.state_dict().items():
        prefix, _, leaf = name.rpartition(".")
        if leaf == "weight" and prefix != "lm_head" and _is_linear(model, prefix):
            n, k = t.shape
            pad = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk)
            pad[:n, :k] = t.float()
            blocks = pad.view(pad.shape[0] // bn, bn, pad.shape[1] // bk, bk)
            scale = (blocks.abs().amax((1, 3)) / 448).clamp_min(1e-8)
            codes = (blocks / scale[:, None, :, None]).view_as(pad)[:n, :k].to(torch.float8_e4m3fn)
            tensors[name], tensors[f"{prefix}.weight_scale_inv"] = codes, scale
        else:
            tensors[name] = t.to(torch.bfloat16).contiguous()
    qc = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": list(block),
    }
    return _write(model, path, tensors, qc, "bfloat16")


def _is_linear(model, prefix: str) -> bool:
    return isinstance(model.get_submodule(prefix), torch.nn.Linear)


def _write(model, path, tensors: dict, qc: dict, dtype: str) -> str:
    path = str(path)
    os.makedirs(path, exist_ok=True)
    if getattr(model.config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = qc
    config["torch_dtype"] = config["dtype"] = dtype
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return path


def _reference(model, values: dict[str, torch.Tensor]):
    ref = copy.deepcopy(model).float().eval()
    state = {k: v.half().float() for k, v in ref.state_dict().items()}  # the checkpoint's float16
    state.update(values)
    ref.load_state_dict(state)
    return ref

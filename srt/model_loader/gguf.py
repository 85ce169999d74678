"""GGUF weights: tensors -> HF-named weights, streamed one at a time.

The header (metadata, tensor table) is parsed by ``srt/configs/gguf_header.py``; per tensor::

    read the raw bytes of one tensor (plain file read, no mmap: the pages do not stay in
    our resident set)
      -> ggml type in ``keep_quantized`` and a matrix: a ``GGUFTensor`` (the blocks as they are,
         uint8 [rows, row bytes]; ``--quantization gguf``)
      -> otherwise ``gguf.dequantize`` -> float32 [rows, cols]
    -> undo llama.cpp's q/k row permutation (llama only; whole rows, so blocks move unchanged)
    -> yield (HF name, tensor)

Tensor names: ``blk.N.<part>.weight`` -> ``model.layers.N.<HF part>.weight`` (tables below).
Mixture-of-experts files: the router ``ffn_gate_inp`` -> ``mlp.gate``; the experts merged over E,
``ffn_{gate,up,down}_exps`` ``[E, rows, cols]`` -> ``mlp.experts.{gate,up,down}_proj.weight``
(kept quantized as one ``GGUFTensor`` of ``E * rows`` rows, expert after expert), or in older files
one tensor per expert, ``ffn_gate.<e>`` -> ``mlp.experts.<e>.gate_proj.weight``; Qwen2-MoE's
shared expert ``ffn_*_shexp`` -> ``mlp.shared_expert.*`` and its gate ``ffn_gate_inp_shexp``
(a vector) -> ``mlp.shared_expert_gate.weight`` ``[1, H]``.

llama.cpp's converter permutes the rows of q_proj/k_proj (weights and biases) of Llama
models so its rope can rotate adjacent pairs; HF Llama rotates halves. Per head the GGUF
rows are ordered ``[half, 2]`` and the HF rows ``[2, half]``; ``reverse_llama_permute``
swaps the two axes back. Qwen2/Qwen3, Gemma and Phi-3 GGUFs are not permuted.

Gemma 2/3: the converter stores every RMSNorm weight as ``w + 1`` (llama.cpp multiplies by
the stored weight; HF by ``1 + w``); ``postprocess_tensor`` subtracts the 1 again. Their
per-layer norms are named ``attn_norm`` / ``post_attention_norm`` / ``ffn_norm`` (the MLP's
pre-norm) / ``post_ffw_norm``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator

import numpy as np
import torch

from srt.configs.gguf_header import GGUFTensorInfo, gguf_architecture, open_gguf
from srt.layers.quantized_weight import GGUFTensor
from srt.model_loader.weight_utils import readinto_exact
from srt.utils.errors import GGUFError

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # mixture of experts (Qwen2/3-MoE, Mixtral): router, experts merged over E, shared expert
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# per GGUF architecture: layer tensors whose HF name differs from (or is missing in) the table above
_GEMMA_NORMS = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_ARCH_LAYER_TENSORS: dict[str, dict[str, str]] = {"gemma2": _GEMMA_NORMS, "gemma3": _GEMMA_NORMS}
# Phi-3: fused q/k/v, and ffn_up holds gate and up stacked (gate rows first), as in the HF checkpoint
_ARCH_LAYER_TENSORS["phi3"] = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# architectures whose converter stores every RMSNorm weight as ``w + 1`` (Gemma's norms scale by 1 + w)
_NORM_PLUS_ONE_ARCHS = ("gemma2", "gemma3")
# llama.cpp-only tensors with no HF parameter (rope_freqs: precomputed rope factors; Phi-3's
# longrope factors, read into the config's rope_scaling by gguf_header)
_IGNORED_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")
# older MoE files (early Mixtral GGUFs): one tensor per expert, blk.N.ffn_gate.E.weight
_EXPERT_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")

# ggml types stored as plain numpy arrays (others are quantized blocks)
_PLAIN_DTYPES = {
    0: np.float32,
    1: np.float16,
    24: np.int8,
    25: np.int16,
    26: np.int32,
    27: np.int64,
    28: np.float64,
}


def gguf_to_hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """HF parameter name of a GGUF tensor name of a file of architecture ``arch`` (None for
    tensors with no HF counterpart)."""
    if gguf_name in _IGNORED_TENSORS:
        return None
    m = _EXPERT_RE.match(gguf_name)
    if m is not None:
        return f"model.layers.{m.group(1)}.mlp.experts.{m.group(3)}.{m.group(2)}_proj.weight"
    m = _LAYER_RE.match(gguf_name)
    if m is not None:
        part = _ARCH_LAYER_TENSORS.get(arch, {}).get(m.group(2)) or _LAYER_TENSORS.get(m.group(2))
        if part is None:
            raise GGUFError(f"unsupported GGUF tensor {gguf_name!r}")
        return f"model.layers.{m.group(1)}.{part}.{m.group(3)}"
    m = _GLOBAL_RE.match(gguf_name)
    if m is not None and m.group(1) in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[m.group(1)]}.{m.group(2)}"
    raise GGUFError(f"unsupported GGUF tensor {gguf_name!r}")


def reverse_llama_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's rope row permutation of a q/k weight ``[n_head*D, in]`` or bias ``[n_head*D]``.

    Per head, GGUF rows are ``(half, 2)``-ordered and HF rows ``(2, half)``-ordered."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def is_matrix(hf_name: str, shape: tuple[int, ...]) -> bool:
    """Whether a tensor can stay in its GGUF blocks: a weight matrix, or the experts of a MoE layer
    merged over the experts (``[E, rows, cols]``: kept as ``E * rows`` rows, expert after expert)."""
    return hf_name.endswith(".weight") and (len(shape) == 2 or (len(shape) == 3 and ".experts." in hf_name))


def postprocess_tensor(arch: str, hf_name: str, tensor: torch.Tensor, hf_config) -> torch.Tensor:
    """What the converter did to a tensor, undone: llama q/k rows are un-permuted
    (``reverse_llama_permute``), whole rows only, so quantized blocks (uint8 rows) pass too;
    Gemma norm weights (stored ``w + 1``, float) get their 1 back off; Qwen2-MoE's shared-expert
    gate, stored as a vector ``[H]``, becomes HF's ``[1, H]``."""
    if hf_name.endswith("shared_expert_gate.weight") and tensor.dim() == 1:
        return tensor.unsqueeze(0)
    if arch in _NORM_PLUS_ONE_ARCHS and hf_name.endswith("norm.weight"):
        return tensor - 1.0
    if arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
        head_dim = (
            getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        )
        return reverse_llama_permute(tensor, tensor.shape[0] // head_dim)
    return tensor


def read_tensor_data(f, info: GGUFTensorInfo) -> np.ndarray:
    """The raw data of one tensor as ``gguf.dequantize`` expects it: plain types in their
    numpy dtype and shape, quantized ones as ``uint8 [..., bytes per row]``; read with plain
    file reads from the open binary file ``f``."""
    dtype = _PLAIN_DTYPES.get(info.qtype)
    if dtype is not None:
        buf = np.empty(info.shape, dtype=dtype)
    else:
        rows = math.prod(info.shape[:-1])
        buf = np.empty((*info.shape[:-1], info.nbytes // max(rows, 1)), dtype=np.uint8)
    view = memoryview(buf.reshape(-1).view(np.uint8))
    if len(view) != info.nbytes:
        raise GGUFError(f"tensor {info.name}: {len(view)} bytes expected, header says {info.nbytes}")
    f.seek(info.offset)
    readinto_exact(f, view, GGUFError, f" in tensor {info.name}")
    return buf


def gguf_weights_iterator(
    gguf_file: str, hf_config, keep_quantized: frozenset[int] = frozenset()
) -> Iterator[tuple[str, torch.Tensor | GGUFTensor]]:
    """Yield ``(hf_name, tensor)`` for every weight of the file, one tensor at a time.

    Matrices whose ggml type is in ``keep_quantized`` come as ``GGUFTensor`` (their blocks);
    everything else is dequantized with ``gguf.dequantize`` to float32. Llama q/k rows are
    un-permuted (``postprocess_tensor``) with ``hf_config``'s head dim. Each yielded
    tensor is freshly allocated and owned by the caller (no other reference is kept)."""
    from gguf import dequantize

    gf = open_gguf(gguf_file)
    arch = gguf_architecture(gf)
    with open(gguf_file, "rb", buffering=0) as f:
        for info in gf.tensors:
            hf_name = gguf_to_hf_name(info.name, arch)
            if hf_name is None:
                continue
            raw = read_tensor_data(f, info)
            quantized = info.qtype in keep_quantized and is_matrix(hf_name, info.shape)
            if quantized:
                tensor = torch.from_numpy(raw)
            elif info.qtype in _PLAIN_DTYPES:
                tensor = torch.from_numpy(raw if raw.dtype == np.float32 else raw.astype(np.float32))
            else:
                tensor = torch.from_numpy(dequantize(raw, info.qtype).astype(np.float32, copy=False))
            del raw
            tensor = postprocess_tensor(arch, hf_name, tensor, hf_config)
            if quantized:
                rows, cols = math.prod(info.shape[:-1]), info.shape[-1]
                yield hf_name, GGUFTensor(info.qtype, rows, cols, tensor.reshape(rows, -1).contiguous())
            else:
                yield hf_name, tensor

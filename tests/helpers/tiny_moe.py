"""Tiny random-weight mixture-of-experts models (Qwen2-MoE, Qwen3-MoE, Mixtral) for tests.

``save_tiny_moe(kind, path)`` writes an HF directory transformers and srt both load;
``save_tiny_moe_gguf(kind, path, qtype)`` writes the same model as llama.cpp's converter lays it
out (Qwen: arch ``qwen2moe`` / ``qwen3moe``; Mixtral: arch ``llama`` with ``llama.expert_count``,
q/k rows permuted), the experts merged into 3-D ``ffn_{gate,up,down}_exps`` tensors (or, with
``per_expert_names``, the older one tensor per expert ``ffn_gate.<e>``) quantized to ``qtype``.

Kinds (2 layers, vocab 320, GQA 4/2 heads):

    qwen2_moe  8 experts, top-2, no renormalisation, shared expert with its sigmoid gate,
               qkv bias, tied embeddings
    qwen3_moe  8 experts, top-4, norm_topk_prob, q/k RMSNorm, head_dim 32 != hidden / heads
    mixtral    4 experts, top-2 (always renormalised)

Weights are ``tiny_models.randomize_``'s O(1)-scale draws, so router logits are O(1) and every
token spreads over several experts (routing is not trivial). ``hidden`` / ``moe_intermediate``
can be raised to 256 for K-quant experts (super-blocks of 256).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from tests.helpers.tiny_models import (
    _COMMON,
    LLAMA_CPP_LAYER_NAMES,
    llama_cpp_name,
    llama_cpp_permute,
    random_hf_model,
    save_hf_dir,
)

MOE_KINDS = ("qwen2_moe", "qwen3_moe", "mixtral")
GGUF_ARCH = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "mixtral": "llama"}


def tiny_moe_config(kind: str, hidden: int = 64, moe_intermediate: int = 32, **overrides):
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    fields = dict(_COMMON, hidden_size=hidden)
    if kind == "qwen2_moe":
        fields.update(
            architectures=["Qwen2MoeForCausalLM"],
            tie_word_embeddings=True,
            rope_theta=1000000.0,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=moe_intermediate,
            shared_expert_intermediate_size=2 * moe_intermediate,
            norm_topk_prob=False,
        )
        cls = Qwen2MoeConfig
    elif kind == "qwen3_moe":
        fields.update(
            architectures=["Qwen3MoeForCausalLM"],
            tie_word_embeddings=False,
            head_dim=32,
            rope_theta=1000000.0,
            num_experts=8,
            num_experts_per_tok=4,
            moe_intermediate_size=moe_intermediate,
            norm_topk_prob=True,
        )
        cls = Qwen3MoeConfig
    elif kind == "mixtral":
        fields.update(
            architectures=["MixtralForCausalLM"],
            tie_word_embeddings=False,
            rope_theta=10000.0,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=moe_intermediate,
            sliding_window=None,
        )
        cls = MixtralConfig
    else:
        raise ValueError(f"unknown tiny MoE kind {kind!r}; use one of {MOE_KINDS}")
    fields.update(overrides)
    return cls(**fields)


def build_tiny_moe(kind: str, seed: int = 0, **overrides):
    """A transformers MoE model (float32, eval) with ``randomize_`` weights."""
    return random_hf_model(tiny_moe_config(kind, **overrides), seed)


def save_tiny_moe(kind: str, path: str | os.PathLike, seed: int = 0, **overrides) -> str:
    return save_hf_dir(build_tiny_moe(kind, seed, **overrides), path)


_LAYER_NAMES = {
    **LLAMA_CPP_LAYER_NAMES,
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}


def _gguf_name(hf_name: str) -> str:
    return llama_cpp_name(hf_name, _LAYER_NAMES)


def _write_metadata(writer, kind: str, cfg) -> None:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_name(f"tiny-{kind}")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    if kind == "mixtral":
        writer.add_rope_dimension_count(head_dim)
        writer.add_expert_count(cfg.num_local_experts)
    else:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if kind == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)


def _quantized(array: np.ndarray, qtype) -> np.ndarray:
    """``array [..., cols]`` as GGUF blocks ``uint8 [..., row bytes]`` (K-quants by the test encoder)."""
    import gguf

    from tests.helpers.gguf_models import quantize

    rows = array.reshape(-1, array.shape[-1])
    if qtype in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0):
        blocks = gguf.quants.quantize(rows, qtype)
    else:
        blocks = quantize(rows, qtype)
    return blocks.reshape(*array.shape[:-1], -1)


def _expert_tensors(model, layer: int, per_expert: bool) -> list[tuple[str, np.ndarray]]:
    """The layer's experts as llama.cpp names them: merged ``[E, rows, cols]`` or one per expert."""
    experts = model.model.layers[layer].mlp.experts
    inter = experts.gate_up_proj.shape[1] // 2
    gate_up = experts.gate_up_proj.detach().float().numpy()
    parts = {
        "gate": gate_up[:, :inter],
        "up": gate_up[:, inter:],
        "down": experts.down_proj.detach().float().numpy(),
    }
    if per_expert:
        return [
            (f"blk.{layer}.ffn_{p}.{e}.weight", np.ascontiguousarray(w[e]))
            for p, w in parts.items()
            for e in range(w.shape[0])
        ]
    return [(f"blk.{layer}.ffn_{p}_exps.weight", np.ascontiguousarray(w)) for p, w in parts.items()]


def _set_dequantized(model, gguf_name: str, values: np.ndarray) -> None:
    """Put the dequantized values of a quantized tensor back into the transformers model."""
    _, layer, part = gguf_name.split(".", 3)[:3]
    mlp = model.model.layers[int(layer)].mlp
    w = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    with torch.no_grad():
        if part.endswith("shexp"):
            proj = {"ffn_gate_shexp": "gate_proj", "ffn_up_shexp": "up_proj", "ffn_down_shexp": "down_proj"}[
                part
            ]
            getattr(mlp.shared_expert, proj).weight.copy_(w)
            return
        which = part.split("_")[1]  # gate / up / down
        expert = gguf_name.split(".")[3] if not part.endswith("exps") else None
        inter = mlp.experts.gate_up_proj.shape[1] // 2
        if which == "down":
            target = mlp.experts.down_proj
        else:
            target = (
                mlp.experts.gate_up_proj[:, :inter]
                if which == "gate"
                else mlp.experts.gate_up_proj[:, inter:]
            )
        (target if expert is None else target[int(expert)]).copy_(w)


def save_tiny_moe_gguf(
    kind: str,
    path: str | os.PathLike,
    qtype_name: str = "Q8_0",
    seed: int = 0,
    per_expert_names: bool = False,
    **overrides,
):
    """Write a tiny ``kind`` MoE model as llama.cpp would (module docstring), experts (and the
    shared expert) as ``qtype_name`` blocks, everything else F32. Returns ``(path, hf_model)``."""
    import gguf

    qtype = gguf.GGMLQuantizationType[qtype_name]
    model = build_tiny_moe(kind, seed, **overrides)
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), GGUF_ARCH[kind])
    _write_metadata(writer, kind, cfg)
    tensors: list[tuple[str, np.ndarray, bool]] = []
    for name, tensor in model.state_dict().items():
        if ".mlp.experts." in name or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        t = tensor.detach().float()
        if kind == "mixtral" and (".q_proj." in name or ".k_proj." in name):
            t = llama_cpp_permute(
                t, cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
            )
        if name.endswith("shared_expert_gate.weight"):
            t = t.reshape(-1)  # llama.cpp stores it as a vector
        tensors.append((_gguf_name(name), t.numpy(), ".shared_expert." in name))
    for i in range(cfg.num_hidden_layers):
        tensors += [(n, w, True) for n, w in _expert_tensors(model, i, per_expert_names)]
    for name, array, quantize in tensors:
        if quantize:
            blocks = _quantized(array, qtype)
            writer.add_tensor(name, blocks, raw_dtype=qtype)
            _set_dequantized(model, name, gguf.quants.dequantize(blocks, qtype))
        else:
            writer.add_tensor(name, array.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path), model

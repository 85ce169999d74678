"""Tiny random Phi-3 models (HF directories and llama.cpp-style GGUF files) for tests.

``tiny_phi3_config(**overrides)``: Phi3ForCausalLM, hidden 64, 4 query / 2 KV heads of 16,
partial rotary 0.75 (12 rotary dims, as Phi-4-mini rotates 96 of 128), longrope with an original
context of 64 and short / long factors that differ per frequency, an untied LM head.
``WINDOW_OVERRIDES`` swaps those for the plain rope and a sliding window
(Phi-3-mini-4k's layout).

Weights follow ``tiny_models.randomize_`` (O(1) activations). ``save_tiny_phi3_gguf`` writes what
llama.cpp's converter writes for arch ``phi3`` (fused ``attn_qkv``, ``ffn_up`` holding gate and
up, no q/k permutation, ``rope_factors_long`` / ``rope_factors_short`` tensors, rotary dims in
``rope.dimension_count``, ``attention.sliding_window`` 0 for none) with every 2-D weight in
``qtype`` (Q8_0, or Q4_K / Q6_K by ``gguf_models.quantize_kquant``: rows of 256-multiples), and
returns the HF model holding the dequantized weights, the exact reference for srt's GGUF load.
"""

from __future__ import annotations

import os

import torch

from tests.helpers.tiny_models import llama_cpp_name, random_hf_model, save_hf_dir

SHORT_FACTOR = [1.0, 1.05, 1.1, 1.3, 1.6, 2.0]
LONG_FACTOR = [1.0, 1.5, 2.5, 4.0, 6.0, 8.0]
ORIGINAL_CONTEXT = 64

_BASE = dict(
    architectures=["Phi3ForCausalLM"],
    vocab_size=320,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    original_max_position_embeddings=ORIGINAL_CONTEXT,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    partial_rotary_factor=0.75,
    rope_scaling={"type": "longrope", "short_factor": SHORT_FACTOR, "long_factor": LONG_FACTOR},
    sliding_window=None,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# Phi-3-mini-4k's layout: full rotary, no rope scaling, a sliding window
WINDOW_OVERRIDES = dict(partial_rotary_factor=1.0, rope_scaling=None, sliding_window=9)


def tiny_phi3_config(**overrides):
    from transformers import Phi3Config

    fields = dict(_BASE)
    fields.update(overrides)
    if fields.get("rope_scaling") is not None:
        fields["rope_scaling"] = dict(fields["rope_scaling"])
    return Phi3Config(**fields)


def build_tiny_phi3(seed: int = 0, **overrides):
    return random_hf_model(tiny_phi3_config(**overrides), seed)


def save_tiny_phi3(path: str | os.PathLike, seed: int = 0, **overrides) -> str:
    return save_hf_dir(build_tiny_phi3(seed, **overrides), path)


_GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    return llama_cpp_name(hf_name, _GGUF_NAMES)


def _quantize(array, qtype_name: str):
    """``(blocks, dequantized float32)`` of a 2-D float32 array in ggml type ``qtype_name``."""
    import gguf

    qtype = gguf.GGMLQuantizationType[qtype_name]
    if qtype_name.endswith("_K"):
        from tests.helpers.gguf_models import quantize_kquant

        blocks = quantize_kquant(array, qtype)
    else:
        blocks = gguf.quants.quantize(array, qtype)
    return blocks, gguf.quants.dequantize(blocks, qtype).reshape(array.shape)


def _write_metadata(writer, cfg) -> None:
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    rope = cfg.rope_parameters
    writer.add_name("tiny-phi3")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_sliding_window(cfg.sliding_window or 0)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)


def save_tiny_phi3_gguf(path: str | os.PathLike, qtype: str = "Q8_0", seed: int = 0, **overrides):
    """Write the GGUF (module docstring); returns ``(path, HF model with the dequantized weights)``."""
    import math

    import gguf
    import numpy as np

    model = build_tiny_phi3(seed, **overrides)
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "phi3")
    _write_metadata(writer, cfg)
    rope = cfg.rope_parameters
    if rope.get("rope_type") == "longrope":
        scale = cfg.max_position_embeddings / cfg.original_max_position_embeddings
        orig = cfg.original_max_position_embeddings
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)))
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    state = model.state_dict()
    with torch.no_grad():
        for name, tensor in state.items():
            array = tensor.detach().float().numpy()
            if array.ndim == 2 and "embed_tokens" not in name:
                blocks, deq = _quantize(array, qtype)
                writer.add_tensor(_gguf_name(name), blocks, raw_dtype=gguf.GGMLQuantizationType[qtype])
                tensor.copy_(torch.from_numpy(np.ascontiguousarray(deq)))
            else:
                writer.add_tensor(_gguf_name(name), array.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path), model

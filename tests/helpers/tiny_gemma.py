"""Tiny random-weight Gemma 2 / Gemma 3 models (HF directories and llama.cpp-style GGUF files).

``tiny_gemma_config(kind)`` (kind ``gemma2`` or ``gemma3``), O(1)-scale weights as
``tiny_models.randomize_`` draws them, except that norm weights are zero-centred (Gemma scales
by ``1 + w``: w ~ 0.2 N(0, 1)). Both kinds attend through a sliding window of 8 (prompts of
tests cross it) mixed with global layers:

    gemma2  4 layers (sliding, global, sliding, global: transformers' default), head_dim 16,
            query_pre_attn_scalar 24 (!= head_dim), attention soft-cap 2 and final soft-cap 30 (tanh
            bends the O(1) scores and the logits of std ~8 visibly), tied embeddings
    gemma3  3 layers (sliding, sliding, global: sliding_window_pattern 3), head_dim 32 != hidden
            / heads, q/k norms, global rope 1e6 with linear scaling x8, local rope 1e4, no caps

``save_tiny_gemma_gguf`` writes the model the way llama.cpp's convert_hf_to_gguf.py would
(arch ``gemma2``/``gemma3`` metadata, norm weights stored ``w + 1``, tied head: no
``output.weight``, matrices in one quantization type, norms F32) and returns the HF state dict
srt must load from it: matrices dequantized, norms ``(w + 1) - 1`` in float32.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from tests.helpers import tiny_models
from tests.helpers.tiny_models import LLAMA_CPP_LAYER_NAMES, random_hf_model, save_hf_dir

GEMMA_KINDS = ("gemma2", "gemma3")

_COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=160,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    sliding_window=8,
    tie_word_embeddings=True,
    bos_token_id=2,
    eos_token_id=1,
    pad_token_id=0,
)


def tiny_gemma_config(kind: str, **overrides):
    """The transformers config of a tiny ``kind`` model (module docstring)."""
    from transformers import Gemma2Config, Gemma3TextConfig

    fields = dict(_COMMON)
    if kind == "gemma2":
        fields.update(
            architectures=["Gemma2ForCausalLM"],
            num_hidden_layers=4,
            head_dim=16,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=30.0,
            rope_theta=10000.0,
        )
        cls = Gemma2Config
    elif kind == "gemma3":
        fields.update(
            architectures=["Gemma3ForCausalLM"],
            num_hidden_layers=3,
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window_pattern=3,
            rope_theta=1_000_000.0,
            rope_local_base_freq=10_000.0,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
        )
        cls = Gemma3TextConfig
    else:
        raise ValueError(f"unknown tiny Gemma kind {kind!r}; use one of {GEMMA_KINDS}")
    fields.update(overrides)
    return cls(**fields)


def build_tiny_gemma(kind: str, seed: int = 0, **overrides):
    """A transformers model (float32, eval, eager attention) with zero-centred norm weights."""
    model = random_hf_model(tiny_gemma_config(kind, **overrides), seed, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.sub_(1.0)
    return model.eval()


def save_tiny_gemma(kind: str, path: str | os.PathLike, seed: int = 0, **overrides) -> str:
    """Write the HF directory of a tiny ``kind`` model to ``path``; returns the path."""
    return save_hf_dir(build_tiny_gemma(kind, seed, **overrides), path)


# HF module name (in model.layers.N.) -> llama.cpp tensor name (in blk.N.): Gemma's four norms
_GGUF_LAYER_NAMES = {
    **LLAMA_CPP_LAYER_NAMES,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def llama_cpp_name(hf_name: str) -> str:
    return tiny_models.llama_cpp_name(hf_name, _GGUF_LAYER_NAMES)


def _write_metadata(writer, kind: str, cfg) -> None:
    import gguf

    writer.add_name(f"tiny-{kind}")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_sliding_window(cfg.sliding_window)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    if kind == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    else:
        full = cfg.rope_parameters["full_attention"]
        writer.add_rope_freq_base(full["rope_theta"])
        if full.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(full["factor"])


def save_tiny_gemma_gguf(kind: str, path: str | os.PathLike, qtype: str = "Q8_0", seed: int = 0, **overrides):
    """Write a tiny ``kind`` model as llama.cpp's converter would (module docstring), every
    matrix in ``qtype`` (K-quants need hidden / intermediate / heads*head_dim multiples of 256).
    Gemma's GGUF metadata has no query_pre_attn_scalar (llama.cpp uses head_dim, except for the
    27B models), so it is set to head_dim here. Returns ``(path, hf_config, hf_state)``:
    ``hf_state`` holds the weights as srt must read them back (see the module docstring)."""
    import gguf

    from tests.helpers.gguf_models import quantize

    overrides.setdefault("query_pre_attn_scalar", overrides.get("head_dim", tiny_gemma_config(kind).head_dim))
    model = build_tiny_gemma(kind, seed, **overrides)
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), kind)
    _write_metadata(writer, kind, cfg)
    qt = gguf.GGMLQuantizationType[qtype]
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        t = tensor.detach().float().numpy()
        if name.endswith("norm.weight"):
            stored = (t + 1.0).astype(np.float32)
            writer.add_tensor(llama_cpp_name(name), stored)
            state[name] = torch.from_numpy(stored) - 1.0
        else:
            blocks = quantize(t, qt)
            writer.add_tensor(llama_cpp_name(name), blocks, raw_dtype=qt)
            state[name] = torch.from_numpy(gguf.quants.dequantize(blocks, qt).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return str(path), cfg, state


def hf_model_with(cfg, state: dict[str, torch.Tensor]):
    """A transformers model of ``cfg`` (eager attention, float32) holding ``state``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    model.load_state_dict(state)
    return model.eval()

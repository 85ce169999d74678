"""Tiny random-weight models shared by tests, and a reference attention backend.

``save_tiny_model(kind, path)`` writes an HF directory (config.json, generation_config.json,
model.safetensors; no tokenizer) that transformers and srt both load, so a test can compare
the two on identical weights. Kinds:

    llama  LlamaForCausalLM, GQA 4/2 heads, llama3 rope scaling (all three frequency bands
           exercised: original context 64, head_dim 16), untied lm_head
    qwen2  Qwen2ForCausalLM, qkv bias, tied embeddings
    qwen3  Qwen3ForCausalLM, q/k RMSNorm, head_dim 32 != hidden / heads
    mistral  MistralForCausalLM without sliding window (not in TINY_KINDS)

Weights are drawn at a scale that gives O(1) activations and logits (HF's 0.02 init would
make every logit ~0 and comparisons meaningless); norm weights and biases are random too, so
a weight routed to the wrong place changes the outputs.

``assert_same_params(model, hf_state_dict)`` checks every srt parameter against the HF
tensors it was loaded from (fused q/k/v and gate/up concatenated in shard order).

``ContiguousSDPABackend`` attends each sequence causally over its own new tokens with
``scaled_dot_product_attention``, straight from the contiguous q/k/v (no KV pool, so no
cached prefix and no decode); it is the independent reference for model tests.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

from srt.layers.forward_batch import ForwardBatch, ForwardMode

TINY_KINDS = ("llama", "qwen2", "qwen3")

_COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_config(kind: str, **overrides):
    """The transformers config of a tiny model of ``kind`` (see module docstring)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    fields = dict(_COMMON)
    if kind == "llama":
        fields.update(
            architectures=["LlamaForCausalLM"],
            tie_word_embeddings=False,
            rope_theta=10000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        cls = LlamaConfig
    elif kind == "qwen2":
        fields.update(architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True, rope_theta=1000000.0)
        cls = Qwen2Config
    elif kind == "qwen3":
        fields.update(
            architectures=["Qwen3ForCausalLM"], tie_word_embeddings=False, head_dim=32, rope_theta=1000000.0
        )
        cls = Qwen3Config
    elif kind == "mistral":
        fields.update(
            architectures=["MistralForCausalLM"],
            tie_word_embeddings=False,
            sliding_window=None,
            rope_theta=10000.0,
        )
        cls = MistralConfig
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}; use one of {TINY_KINDS} or mistral")
    fields.update(overrides)
    return cls(**fields)


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """O(1)-scale random weights in place (see module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.2 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))


def random_hf_model(config, seed: int, **from_config_kw):
    """A transformers causal LM of ``config`` (float32, eval) with ``randomize_`` weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **from_config_kw)
    randomize_(model, seed)
    return model.eval()


def save_hf_dir(model, path: str | os.PathLike) -> str:
    """Write ``model`` as an HF directory (config, safetensors) at ``path``; returns the path."""
    model.save_pretrained(str(path))
    return str(path)


def build_tiny_hf_model(kind: str, seed: int = 0, **overrides):
    """A transformers model (float32, eval) of ``kind`` with ``randomize_`` weights."""
    return random_hf_model(tiny_config(kind, **overrides), seed)


def save_tiny_model(kind: str, path: str | os.PathLike, seed: int = 0, **overrides) -> str:
    """Write the HF directory of a tiny ``kind`` model to ``path``; returns the path."""
    return save_hf_dir(build_tiny_hf_model(kind, seed, **overrides), path)


# HF module name (in model.layers.N.) -> llama.cpp tensor name (in blk.N.)
LLAMA_CPP_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


_LLAMA_CPP_GLOBAL_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}


def llama_cpp_name(hf_name: str, layer_names: dict[str, str] = LLAMA_CPP_LAYER_NAMES) -> str:
    """llama.cpp's tensor name of an HF parameter name (``layer_names``: HF module in a layer ->
    llama.cpp tensor in ``blk.N``; a family passes its own table)."""
    module, suffix = hf_name.rsplit(".", 1)
    if module in _LLAMA_CPP_GLOBAL_NAMES:
        return f"{_LLAMA_CPP_GLOBAL_NAMES[module]}.{suffix}"
    _, _, layer, part = module.split(".", 3)
    return f"blk.{layer}.{layer_names[part]}.{suffix}"


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp convert_hf_to_gguf's q/k row permutation (HF -> GGUF), written from its definition."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def save_tiny_gguf(kind: str, path: str | os.PathLike, seed: int = 0, quantize_mlp: bool = True, **overrides):
    """Write a tiny ``kind`` model as a GGUF file the way llama.cpp's converter would (Llama q/k
    rows permuted; MLP matrices Q8_0 when ``quantize_mlp``, the rest F32). Llama gets no rope
    scaling (GGUF metadata cannot express llama3's). Returns ``(path, hf_model)``."""
    import gguf
    import numpy as np

    if kind == "llama":
        overrides.setdefault("rope_scaling", None)
    model = build_tiny_hf_model(kind, seed, **overrides)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer = gguf.GGUFWriter(str(path), kind)
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
    if kind == "llama":
        writer.add_rope_dimension_count(head_dim)
    else:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        t = tensor.detach().float()
        if kind == "llama" and (".q_proj." in name or ".k_proj." in name):
            n = cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
            t = llama_cpp_permute(t, n)
        array = t.numpy().astype(np.float32)
        if quantize_mlp and ".mlp." in name:
            qtype = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(llama_cpp_name(name), gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(llama_cpp_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path), model


class ContiguousSDPABackend:
    """Per-sequence causal SDPA over the batch's own tokens (EXTEND without prefix only)."""

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        pass

    def forward(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache: bool = True):
        fb = forward_batch
        if fb.forward_mode != ForwardMode.EXTEND or any(fb.extend_prefix_lens_cpu):
            raise NotImplementedError("ContiguousSDPABackend only runs EXTEND batches without a prefix")
        h, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        out = torch.empty(q.shape[0], h * d, dtype=q.dtype)
        start = 0
        for n in fb.extend_seq_lens_cpu:
            qs = q[start : start + n].reshape(n, h, d).transpose(0, 1)
            ks = k[start : start + n].reshape(n, hkv, d).transpose(0, 1)
            vs = v[start : start + n].reshape(n, hkv, d).transpose(0, 1)
            o = F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=layer.scaling, enable_gqa=hkv != h
            )
            out[start : start + n] = o.transpose(0, 1).reshape(n, h * d)
            start += n
        return out


_FUSED_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def hf_tensor_for(srt_name: str, hf_state: dict[str, torch.Tensor]) -> torch.Tensor:
    """The HF tensor an srt parameter must equal (fused ones concatenated in shard order)."""
    for fused, parts in _FUSED_PARTS.items():
        if f".{fused}." in srt_name:
            return torch.cat([hf_state[srt_name.replace(fused, p)] for p in parts])
    return hf_state[srt_name]


def assert_same_params(model: torch.nn.Module, hf_state: dict[str, torch.Tensor]) -> None:
    names = [n for n, _ in model.named_parameters()]
    assert names, "model has no parameters"
    for name, param in model.named_parameters():
        ref = hf_tensor_for(name, hf_state)
        assert param.shape == ref.shape, name
        assert torch.equal(param, ref.to(param.dtype)), f"{name} differs"


def extend_batch(seqs: list[list[int]], backend=None, **kw) -> ForwardBatch:
    """An EXTEND ForwardBatch of whole prompts (no prefix) using ``backend``
    (default ``ContiguousSDPABackend``); extra keyword arguments go to ``ForwardBatch.build``."""
    flat = [t for s in seqs for t in s]
    fb = ForwardBatch.build(
        ForwardMode.EXTEND,
        input_ids=flat,
        req_pool_indices=list(range(len(seqs))),
        prefix_lens=[0] * len(seqs),
        extend_lens=[len(s) for s in seqs],
        out_cache_loc=list(range(len(flat))),
        **kw,
    )
    fb.attn_backend = backend if backend is not None else ContiguousSDPABackend()
    return fb

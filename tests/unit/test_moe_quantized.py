"""Quantized HF checkpoints of mixture-of-experts models: tiny random Qwen2-MoE and Mixtral whose
experts are written one per name (``mlp.experts.<e>.gate_proj`` ..., as llm-compressor, AutoAWQ
and GPTQModel write them) in compressed-tensors W4A16, AWQ and GPTQ: the experts stay quantized
(one bank of Q4_0 / Q4_1 blocks per part, srt's MoE kernels) and the logits equal those of
transformers holding the exact dequantized values, within float32 reordering (Q4_1: within its
float16 offsets). W8A8 and FP8_DYNAMIC experts quantize both matmuls' inputs per token, as the
scheme says; their reference is transformers' experts doing the same."""

from __future__ import annotations

import json
import os

import pytest
import torch

from srt.configs.model_config import ModelConfig
from srt.layers.moe import MoEExperts
from srt.model_loader import get_model
from tests.unit.test_models_moe import _assert_logits_match

Q4_0, Q4_1, Q8_0 = 2, 3, 8
TOKEN_QUANT = {"w8a8": "int8", "fp8_dynamic": "fp8"}  # the schemes' input quantization


def _w4a16(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """compressed-tensors' symmetric int4 groups of 32 (pack-quantized), and the values they hold."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    n, k = w.shape
    g = w.view(n, k // 32, 32)
    scale = (g.abs().amax(-1).clamp_min(1e-8) / 7).half().float()  # GGUF blocks keep float16 scales
    codes = torch.round(g / scale.unsqueeze(-1)).clamp(-8, 7)
    parts = {
        "weight_packed": pack_to_int32(codes.to(torch.int8).view(n, k), 4),
        "weight_scale": scale,
        "weight_shape": torch.tensor([n, k]),
    }
    return parts, (codes * scale.unsqueeze(-1)).view(n, k)


def _w8a8(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """compressed-tensors' int8 weights, one scale a row (int-quantized), and their values."""
    scale = (w.abs().amax(1, keepdim=True).clamp_min(1e-8) / 127).half().float()
    codes = torch.round(w / scale).clamp(-128, 127)
    return {"weight": codes.to(torch.int8), "weight_scale": scale}, codes * scale


def _fp8(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """compressed-tensors' float8_e4m3 weights, one scale a row (float-quantized), and their values."""
    scale = w.abs().amax(1, keepdim=True).clamp_min(1e-8) / 448
    codes = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return {"weight": codes, "weight_scale": scale}, codes.float() * scale


def _fake_quant(x: torch.Tensor, kind: str) -> torch.Tensor:
    """compressed-tensors' dynamic symmetric quantization of each row (token): int8 with scale
    max|row| / 127.5, or float8_e4m3 with scale max|row| / 448."""
    scale = x.abs().amax(-1, keepdim=True) / (127.5 if kind == "int8" else 448.0)
    scale = torch.where(scale == 0, torch.finfo(x.dtype).eps, scale)
    if kind == "int8":
        return torch.round(x / scale).clamp(-128, 127) * scale
    return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).to(x.dtype) * scale


def quantize_expert_inputs(hf, kind: str) -> None:
    """The reference of W8A8 experts: transformers' experts with both matmuls' inputs quantized
    per token (transformers' fused experts are no ``nn.Linear`` compressed-tensors would wrap)."""
    import torch.nn.functional as F

    for layer in hf.model.layers:
        experts = layer.mlp.experts

        def forward(hidden_states, top_k_index, top_k_weights, experts=experts):
            out = torch.zeros_like(hidden_states)
            for e in range(experts.num_experts):
                tok, pos = torch.where(top_k_index == e)
                if tok.numel():
                    x = _fake_quant(hidden_states[tok], kind)
                    gate, up = F.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
                    y = F.linear(_fake_quant(F.silu(gate) * up, kind), experts.down_proj[e])
                    out.index_add_(0, tok, y * top_k_weights[tok, pos, None])
            return out

        experts.forward = forward


def _quantize(w: torch.Tensor, scheme: str, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    if scheme == "w4a16":
        return _w4a16(w)
    if scheme == "w8a8":
        return _w8a8(w)
    if scheme == "fp8_dynamic":
        return _fp8(w)
    from tests.helpers.awq_gptq_models import _quantize as awq_gptq

    return awq_gptq(w, scheme, 32, seed)


def _qc(scheme: str) -> dict:
    if scheme in ("w4a16", "w8a8", "fp8_dynamic"):
        from tests.helpers.compressed_models import quantization_config
    else:
        from tests.helpers.awq_gptq_models import quantization_config

        return quantization_config(scheme, 32)
    return quantization_config(scheme)


def save_moe(kind: str, scheme: str, path, seed: int = 0):
    """A tiny ``kind`` MoE whose experts are ``scheme`` tensors, one name per expert; returns
    ``(path, transformers model holding the values the codes mean)``."""
    from safetensors.torch import save_file

    from tests.helpers.tiny_moe import build_tiny_moe

    hf = build_tiny_moe(kind, seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in hf.state_dict().items():
        prefix, _, leaf = name.rpartition(".")
        if not prefix.endswith(".experts") or leaf not in ("gate_up_proj", "down_proj"):
            tensors[name] = t.contiguous()
            continue
        param = dict(hf.named_parameters())[name]
        for e in range(t.shape[0]):
            if leaf == "down_proj":
                pieces = {"down_proj": (t[e], slice(None))}
            else:
                half = t.shape[1] // 2
                pieces = {
                    "gate_proj": (t[e, :half], slice(0, half)),
                    "up_proj": (t[e, half:], slice(half, None)),
                }
            for proj, (w, rows) in pieces.items():
                parts, values = _quantize(w.float().contiguous(), scheme, seed=e)
                tensors.update({f"{prefix}.{e}.{proj}.{k}": v.contiguous() for k, v in parts.items()})
                with torch.no_grad():
                    param[e, rows] = values
    if hf.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config = hf.config.to_dict()
    config["quantization_config"] = _qc(scheme)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    if scheme in TOKEN_QUANT:
        quantize_expert_inputs(hf, TOKEN_QUANT[scheme])
    return str(path), hf


@pytest.mark.parametrize(
    "kind,scheme,qtype",
    [("qwen2_moe", "w4a16", Q4_0), ("mixtral", "awq", Q4_1), ("qwen2_moe", "gptq", Q4_0)],
)
def test_quantized_experts_stay_blocks_and_logits_match(tmp_path, kind, scheme, qtype):
    path, hf = save_moe(kind, scheme, tmp_path / scheme, seed=3)
    model = get_model(ModelConfig(path), quantization=_qc(scheme)["quant_method"])
    for layer, hf_layer in zip(model.model.layers, hf.model.layers, strict=True):
        experts: MoEExperts = layer.mlp.experts
        assert experts.down.qtype == qtype and [b.qtype for b in experts.gate_up] == [qtype]
        for got, want in zip(
            experts.dequantized(), (hf_layer.mlp.experts.gate_up_proj, hf_layer.mlp.experts.down_proj)
        ):
            want = want.detach()
            # Q4_0 holds the values exactly; Q4_1's offset -(8 + z) s (at most 2 max|w|) rounds to
            # float16, by at most 2^-11 of itself
            atol = 0.0 if qtype == Q4_0 else 2**-10 * float(want.abs().amax())
            torch.testing.assert_close(got, want, rtol=0, atol=atol)
    if qtype == Q4_0:
        _assert_logits_match(model, hf)
    else:
        _assert_logits_close(model, hf)


@torch.inference_mode()
def _assert_logits_close(model, hf, n: int = 48) -> None:
    """Logits within the float16 rounding of Q4_1's offsets: 2^-9 of the largest, same argmax."""
    import torch.nn.functional as F

    from tests.helpers.tiny_models import extend_batch
    from tests.unit.test_models_moe import _prompt

    ids = _prompt(n, seed=1)
    ref = hf(torch.tensor([ids])).logits[0].float()
    fb = extend_batch([ids])
    hidden = model.model(fb.input_ids, fb.positions, fb)
    head = model.lm_head.weight if not model.tie_word_embeddings else model.model.embed_tokens.weight
    got = F.linear(hidden, head).float()
    assert (got - ref).abs().max() <= 2**-9 * ref.abs().max()
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2**-7 * ref.abs().max()
    assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])


@pytest.mark.parametrize("scheme", sorted(TOKEN_QUANT))
def test_experts_quantize_both_inputs_per_token(tmp_path, scheme):
    """W8A8 (Q8_0 banks) and FP8_DYNAMIC (float8 codes times their row scales, float): inputs
    quantized per token before each expert matmul (so not the native MoE op, which takes float
    inputs); logits equal the reference's within a flipped rounding or two."""
    path, hf = save_moe("qwen2_moe", scheme, tmp_path / scheme, seed=3)
    model = get_model(ModelConfig(path), quantization="compressed-tensors" if scheme == "w8a8" else "none")
    for layer in model.model.layers:
        experts: MoEExperts = layer.mlp.experts
        assert experts.token_quant == TOKEN_QUANT[scheme]
        assert experts.down.qtype == (Q8_0 if scheme == "w8a8" else 0)
    _assert_logits_close(model, hf)
    for layer in model.model.layers:  # without the input quantization the logits move further
        layer.mlp.experts.token_quant = None
    with pytest.raises(AssertionError):
        _assert_logits_close(model, hf)

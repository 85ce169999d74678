"""Qwen2-MoE, Qwen3-MoE and Mixtral in srt against transformers on identical weights: from HF
safetensors, from GGUF files written as llama.cpp would (experts kept in their Q8_0 / Q4_K
blocks), and under tensor parallelism (tp=2 equals tp=1)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from srt.configs.gguf_header import gguf_config_dict
from srt.configs.model_config import ModelConfig
from srt.layers.moe import MoEExperts, SparseMoeBlock
from srt.model_loader import get_model
from tests.helpers.tiny_models import extend_batch
from tests.helpers.tiny_moe import save_tiny_moe, save_tiny_moe_gguf
from tests.helpers.tolerance import assert_reordered_close, reduction_len


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def _assert_logits_match(model, hf, n: int = 48) -> None:
    ids = _prompt(n, seed=1)
    ref = hf(torch.tensor([ids])).logits[0].float()
    assert ref.std() > 0.5
    fb = extend_batch([ids])
    hidden = model.model(fb.input_ids, fb.positions, fb)
    head = model.lm_head.weight if not model.tie_word_embeddings else model.model.embed_tokens.weight
    assert_reordered_close(F.linear(hidden, head).float(), ref, reduction_len(hf.config))


@pytest.mark.parametrize(
    "kind,overrides",
    [("qwen2_moe", {}), ("qwen2_moe", {"mlp_only_layers": [1]}), ("qwen3_moe", {}), ("mixtral", {})],
)
def test_safetensors_logits_match_transformers(tmp_path, kind, overrides):
    from transformers import AutoModelForCausalLM

    path = save_tiny_moe(kind, tmp_path / kind, seed=11, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = get_model(ModelConfig(path))
    blocks = [layer.mlp for layer in model.model.layers]
    assert isinstance(blocks[0], SparseMoeBlock)
    assert isinstance(blocks[1], SparseMoeBlock) == (not overrides)
    assert (blocks[0].shared_expert is not None) == (kind == "qwen2_moe")
    _assert_logits_match(model, hf)


@pytest.mark.parametrize(
    "kind,qtype,kw",
    [
        ("qwen2_moe", "Q8_0", {}),
        ("qwen3_moe", "Q4_K", {"hidden": 256, "moe_intermediate": 256}),
        ("mixtral", "Q8_0", {}),
        ("mixtral", "Q4_K", {"hidden": 256, "moe_intermediate": 256, "per_expert_names": True}),
    ],
)
def test_gguf_experts_stay_quantized_and_logits_match(tmp_path, kind, qtype, kw):
    import gguf

    path, hf = save_tiny_moe_gguf(kind, os.path.join(tmp_path, "m.gguf"), qtype, seed=5, **kw)
    cfg = gguf_config_dict(path)
    assert cfg["architectures"] == hf.config.architectures
    assert cfg["num_experts_per_tok"] == hf.config.num_experts_per_tok
    model = get_model(ModelConfig(path), quantization="gguf")
    want = int(gguf.GGMLQuantizationType[qtype])
    hf_layers = hf.model.layers
    for layer, hf_layer in zip(model.model.layers, hf_layers, strict=True):
        experts: MoEExperts = layer.mlp.experts
        assert experts.down.qtype == want and [b.qtype for b in experts.gate_up] == [want]
        gate_up, down = experts.dequantized()
        assert torch.equal(gate_up, hf_layer.mlp.experts.gate_up_proj.detach())
        assert torch.equal(down, hf_layer.mlp.experts.down_proj.detach())
    _assert_logits_match(model, hf)


def test_gguf_config_fields(tmp_path):
    path, hf = save_tiny_moe_gguf("qwen2_moe", os.path.join(tmp_path, "q.gguf"), seed=1)
    cfg = gguf_config_dict(path)
    assert cfg["model_type"] == "qwen2_moe" and cfg["num_experts"] == 8
    assert cfg["shared_expert_intermediate_size"] == hf.config.shared_expert_intermediate_size
    assert cfg["norm_topk_prob"] is False and cfg["qkv_bias"] is True
    path, _ = save_tiny_moe_gguf("qwen3_moe", os.path.join(tmp_path, "q3.gguf"), seed=1)
    assert gguf_config_dict(path)["norm_topk_prob"] is True  # llama.cpp renormalises qwen3moe
    path, hf = save_tiny_moe_gguf("mixtral", os.path.join(tmp_path, "mx.gguf"), seed=1)
    cfg = gguf_config_dict(path)
    assert cfg["model_type"] == "mixtral" and cfg["num_local_experts"] == 4
    assert cfg["intermediate_size"] == hf.config.intermediate_size


def test_sharded_gguf_reader_cuts_each_expert(tmp_path):
    """A rank's merged expert tensors are every expert's rows (gate/up) or columns (down) of its
    part, still in their blocks when the cut is block-aligned."""
    from srt.distributed import TPInfo
    from srt.layers.quantized_weight import GGUFTensor
    from srt.model_loader.gguf import gguf_weights_iterator
    from srt.model_loader.shard_reader import sharded_gguf_iterator
    from srt.model_loader.sharding import shard_model
    from srt.models.registry import get_model_class

    path, hf = save_tiny_moe_gguf("qwen3_moe", os.path.join(tmp_path, "m.gguf"), "Q8_0", moe_intermediate=64)
    config = ModelConfig(path).hf_config
    keep = frozenset({8})
    full = dict(gguf_weights_iterator(path, config, keep))
    name = "model.layers.0.mlp.experts.down_proj.weight"
    e, h, i = 8, 64, 64
    for rank in (0, 1):
        model = get_model_class("Qwen3MoeForCausalLM")(config, torch.float32)
        plan = shard_model(model, TPInfo(rank, 2))
        got = dict(sharded_gguf_iterator(path, config, keep, plan))
        down, gate = got[name], got["model.layers.0.mlp.experts.gate_proj.weight"]
        assert isinstance(down, GGUFTensor) and down.shape == (e * h, i // 2)
        whole = full[name].data.view(e, h, -1)
        half = whole.shape[2] // 2
        assert torch.equal(down.data.view(e, h, -1), whole[:, :, rank * half : (rank + 1) * half])
        whole_gate = full["model.layers.0.mlp.experts.gate_proj.weight"].data.view(e, i, -1)
        assert torch.equal(gate.data.view(e, i // 2, -1), whole_gate[:, rank * 32 : (rank + 1) * 32])


def _args(model_path: str, **kw):
    from srt.server_args import ServerArgs

    return ServerArgs(
        model_path=model_path, dtype="float32", device="cpu", max_total_tokens=256, max_running_requests=8,
        num_threads=1, **kw,
    )  # fmt: skip


def test_tp2_equals_tp1(tmp_path):
    """tp=2 (experts' intermediate dims split, shared expert split, all-reduces) gives tp=1's
    logits and greedy tokens: Qwen2-MoE from safetensors, Mixtral from a Q8_0 GGUF."""
    from tests.helpers.tp_worker import drive_runner, run_ranks, run_scenarios

    qwen2 = save_tiny_moe("qwen2_moe", tmp_path / "q2", seed=3)
    mixtral, _ = save_tiny_moe_gguf("mixtral", str(tmp_path / "mx.gguf"), "Q8_0", seed=4, moe_intermediate=64)
    scenarios = [("qwen2_moe", _args(qwen2)), ("mixtral_gguf", _args(mixtral))]
    prompts = [_prompt(9, 1), _prompt(23, 2), _prompt(4, 3)]
    ref = {name: drive_runner(args, 0, prompts, 6) for name, args in scenarios}
    ranks = run_ranks(run_scenarios, 2, scenarios, prompts, 6, timeout=300)
    for rank in ranks:
        for name, _ in scenarios:
            assert rank[name]["tokens"] == ref[name]["tokens"], name
            for a, b in zip(rank[name]["logits"], ref[name]["logits"], strict=True):
                assert float(np.abs(a - b).max()) <= 2e-4, name

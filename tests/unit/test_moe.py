"""srt/layers/moe.py: routing as transformers does it, the grouped expert path against the dense
reference (float and GGUF experts kept in their blocks), batch invariance."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from srt.kernels.cpu import gguf as gguf_kernels
from srt.layers.moe import MoEExperts, SparseMoeBlock, dense_moe_reference, route_topk
from srt.layers.quantized_weight import GGUFTensor
from tests.helpers.tiny_models import randomize_
from tests.helpers.tiny_moe import _quantized, tiny_moe_config
from tests.helpers.tolerance import assert_reordered_close, reduction_len

Q8_0, Q4_K, Q6_K = (int(gguf.GGMLQuantizationType[t]) for t in ("Q8_0", "Q4_K", "Q6_K"))


def _x(t: int, h: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(t, h, generator=torch.Generator().manual_seed(seed))


def _float_experts(e: int, h: int, i: int, seed: int = 0) -> MoEExperts:
    gen = torch.Generator().manual_seed(seed)
    experts = MoEExperts(e, h, i, torch.float32)
    experts.load("gate_up", None, torch.randn(e, 2 * i, h, generator=gen) / h**0.5, "gate_up")
    experts.load("down", None, torch.randn(e, h, i, generator=gen) / i**0.5, "down")
    experts.finalize()
    return experts


def _route(x: torch.Tensor, e: int, k: int, renorm: bool = True, seed: int = 1):
    router = torch.randn(e, x.shape[1], generator=torch.Generator().manual_seed(seed)) / x.shape[1] ** 0.5
    return route_topk(x @ router.T, k, renorm)


@pytest.mark.parametrize("kind", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_router_matches_transformers(kind):
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

    config = tiny_moe_config(kind)
    router = (MixtralTopKRouter if kind == "mixtral" else Qwen2MoeTopKRouter)(config)
    randomize_(router, seed=2)
    x = _x(37, config.hidden_size)
    _, ref_w, ref_ids = router(x)
    renorm = kind == "mixtral" or config.norm_topk_prob
    w, ids = route_topk(x @ router.weight.T, config.num_experts_per_tok, renorm)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w.float(), atol=1e-6, rtol=0)
    assert len(ids.unique()) > 3  # tokens spread over the experts
    if renorm:
        torch.testing.assert_close(w.sum(-1), torch.ones(37))


@pytest.mark.parametrize("tokens,top_k", [(1, 2), (5, 4), (64, 2)])
def test_grouped_equals_dense_reference(tokens, top_k):
    experts = _float_experts(8, 64, 48)
    x = _x(tokens, 64, seed=tokens)
    w, ids = _route(x, 8, top_k, renorm=top_k == 2)
    ref = dense_moe_reference(x, experts.gate_up_proj, experts.down_proj, w, ids)
    assert_reordered_close(experts(x, w, ids), ref, 64)
    assert ref.abs().max() > 0.1


def test_experts_match_transformers_experts():
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeExperts

    config = tiny_moe_config("qwen2_moe")
    hf = Qwen2MoeExperts(config)
    randomize_(hf, seed=4)
    experts = MoEExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size, torch.float32)
    experts.load("gate_up", None, hf.gate_up_proj.detach(), "gate_up")
    experts.load("down", None, hf.down_proj.detach(), "down")
    experts.finalize()
    x = _x(33, config.hidden_size)
    w, ids = _route(x, config.num_experts, 2, renorm=False)
    with torch.no_grad():
        assert_reordered_close(experts(x, w, ids), hf(x, ids, w), reduction_len(config))


def test_grouped_path_is_batch_invariant():
    """A token's output does not depend on the other tokens of its batch (routing per token;
    each expert's rows computed row by row alike)."""
    experts = _float_experts(8, 64, 48, seed=3)
    x = _x(24, 64, seed=5)
    w, ids = _route(x, 8, 2)
    batched = experts(x, w, ids)
    alone = torch.cat([experts(x[i : i + 1], w[i : i + 1], ids[i : i + 1]) for i in range(24)])
    assert_reordered_close(batched, alone, 64)  # torch's GEMM picks its kernel by row count


def test_unused_experts_and_missing_parts():
    experts = MoEExperts(4, 32, 16, torch.float32)
    experts.load("gate", 0, torch.zeros(16, 32), "g0")
    assert experts.missing() == ["gate", "up", "down"]
    for e in range(1, 4):
        experts.load("gate", e, torch.zeros(16, 32), f"g{e}")
    assert experts.missing() == ["up", "down"]


def _gguf_experts(e: int, h: int, i: int, qtypes: tuple[int, int, int], per_expert: bool, seed: int = 0):
    """MoEExperts loaded from GGUF blocks (merged [E * rows] or per expert), and the float
    weights those blocks dequantize to."""
    gen = torch.Generator().manual_seed(seed)
    floats = {
        "gate": torch.randn(e, i, h, generator=gen) / h**0.5,
        "up": torch.randn(e, i, h, generator=gen) / h**0.5,
        "down": torch.randn(e, h, i, generator=gen) / i**0.5,
    }
    experts = MoEExperts(e, h, i, torch.float32)
    deq = {}
    for (part, w), qtype in zip(floats.items(), qtypes, strict=True):
        blocks = _quantized(w.numpy(), gguf.GGMLQuantizationType(qtype))
        deq[part] = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(qtype)).copy())
        data = torch.from_numpy(np.ascontiguousarray(blocks))
        rows, cols = w.shape[1], w.shape[2]
        if per_expert:
            for k in range(e):
                experts.load(part, k, GGUFTensor(qtype, rows, cols, data[k].contiguous()), part)
        else:
            experts.load(part, None, GGUFTensor(qtype, e * rows, cols, data.reshape(e * rows, -1)), part)
    experts.finalize()
    return experts, torch.cat([deq["gate"], deq["up"]], dim=1), deq["down"]


@pytest.mark.parametrize(
    "qtypes,per_expert",
    [
        ((Q8_0, Q8_0, Q8_0), False),
        ((Q4_K, Q4_K, Q4_K), False),
        ((Q8_0, Q8_0, Q8_0), True),
        ((Q4_K, Q8_0, Q4_K), False),
    ],
)
def test_gguf_experts_stay_blocks_and_equal_dequantized(qtypes, per_expert):
    e, h, i = 4, 256, 256
    experts, gate_up, down = _gguf_experts(e, h, i, qtypes, per_expert)
    # the blocks are kept: each expert is a row slice of one uint8 tensor, no float copy
    assert experts.down.qtype == qtypes[2] and experts.down.data.dtype == torch.uint8
    assert [b.qtype for b in experts.gate_up] == ([qtypes[0]] if qtypes[0] == qtypes[1] else list(qtypes[:2]))
    bank = experts.gate_up[0]
    assert all(m.data_ptr() == bank.data[k].data_ptr() for k, m in enumerate(bank.mats))
    assert experts.gate_up_proj.numel() == 0 and experts.down_proj.numel() == 0
    got_gu, got_down = experts.dequantized()
    assert torch.equal(got_gu, gate_up) and torch.equal(got_down, down)
    for tokens in (1, 3, 40):
        x = _x(tokens, h, seed=tokens)
        w, ids = _route(x, e, 2)
        ref = dense_moe_reference(x, gate_up, down, w, ids)
        torch.testing.assert_close(experts(x, w, ids), ref, atol=1e-4, rtol=1e-4)


def test_sparse_block_with_shared_expert_matches_transformers():
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    config = tiny_moe_config("qwen2_moe")
    hf = Qwen2MoeSparseMoeBlock(config)
    randomize_(hf, seed=6)
    block = SparseMoeBlock(
        config.hidden_size,
        config.num_experts,
        config.num_experts_per_tok,
        config.moe_intermediate_size,
        config.norm_topk_prob,
        torch.float32,
        shared_intermediate_size=config.shared_expert_intermediate_size,
    )
    sd = hf.state_dict()
    block.gate.weight.data.copy_(sd["gate.weight"])
    block.experts.load("gate_up", None, sd["experts.gate_up_proj"], "gate_up")
    block.experts.load("down", None, sd["experts.down_proj"], "down")
    block.experts.finalize()
    shared = block.shared_expert
    shared.gate_up_proj.weight.data.copy_(
        torch.cat([sd["shared_expert.gate_proj.weight"], sd["shared_expert.up_proj.weight"]])
    )
    shared.down_proj.weight.data.copy_(sd["shared_expert.down_proj.weight"])
    block.shared_expert_gate.weight.data.copy_(sd["shared_expert_gate.weight"])
    x = _x(21, config.hidden_size, seed=8)
    with torch.no_grad():
        ref = hf(x.unsqueeze(0))[0]
        assert_reordered_close(block(x), ref, reduction_len(config))
        assert_reordered_close(block.reference(x), ref, reduction_len(config))


@pytest.mark.skipif(not gguf_kernels.moe_available(), reason="the native extension is not built")
@pytest.mark.parametrize("source", ["float", "q4k", "mixed", "kquants", "q4k-int8", "mixed-int8"])
def test_native_moe_op_equals_the_op_by_op_path(source, monkeypatch):
    """``moe_experts`` (moe.cpp) runs exactly the Python grouped path's kernels in its order:
    bit for bit the same output, for float banks, one GGUF bank, gate and up of two types, and
    int8 activations for small row counts (where every expert has at most int8_max_rows rows,
    all experts in one loop per projection, moe_experts_q8a: the same bits). On AVX-512 VNNI CPUs
    the K-quant banks at up to 7 rows per expert take moe_experts_a24 likewise ("kquants": gate
    Q4_K, up and down Q6_K, so both of its activation layouts run)."""
    if source == "float":
        experts = _float_experts(8, 64, 48)
    else:
        qtypes = {"mixed": (Q4_K, Q8_0, Q4_K), "kquants": (Q4_K, Q6_K, Q6_K)}.get(
            source.split("-")[0], (Q4_K,) * 3
        )
        experts, _, _ = _gguf_experts(6, 256, 256, qtypes, per_expert=False)
    if source.endswith("int8"):
        experts.int8_max_rows = 2  # experts with 1-2 rows quantize x, the others do not
    assert experts.native_banks() is not None
    for tokens, top_k in ((1, 2), (2, 3), (7, 3), (33, 2)):
        x = _x(tokens, experts.hidden_size, seed=tokens)
        w, ids = _route(x, experts.num_experts, top_k)
        native = experts(x, w, ids)
        with monkeypatch.context() as m:
            m.setattr(gguf_kernels, "moe_available", lambda: False)
            by_ops = experts(x, w, ids)
        assert torch.equal(native, by_ops)

"""Tensor parallelism, model side: the partition rules, the sharding transformation, and tp=2
against tp=1 through real ModelRunners (2 spawned ranks on a gloo group, 1 thread each).

Equality checks: the next-token logits of a prefill and 3 decode steps agree within float32
rounding (the row-parallel sums run in another order) and the greedy tokens are identical, on
the default SmolLM2 GGUF (9 query / 3 KV heads: uneven 2+1 KV heads per rank) with its blocks
kept quantized and dequantized (``--quantization none``), on a tiny random Qwen2 with one KV
head (replicated on both ranks, its query heads split), read from safetensors, and on a tiny
Qwen2 GGUF whose row-parallel MLP shard boundary cuts a Q8_0 block (dequantized on the ranks),
a tiny Llama with an untied LM head and a vocabulary of 321 (161 + 160 rows: the logits gather
pads), a tiny Qwen3 (per-head q/k norms on the local heads), and seeded dummy weights (each rank
draws the whole parameter and keeps its part).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from srt.distributed import TPInfo, head_shard, split_range
from srt.distributed.partition import aligned_unit
from srt.model_loader.sharding import ShardPlan, TensorSlice, shard_model, vocab_sizes
from srt.models.registry import get_model_class
from srt.server_args import ServerArgs
from srt.utils.errors import ConfigError
from tests.helpers.tiny_models import save_tiny_gguf, save_tiny_model, tiny_config
from tests.helpers.tolerance import assert_reordered_close
from tests.helpers.tp_worker import drive_runner, run_ranks, run_scenarios

PROMPTS = [[1, 5, 9, 200, 300, 17], [1, 40, 41, 42, 7, 8, 9, 10, 11]]
DECODE_STEPS = 3


# ---------------------------------------------------------------- partition rules (pure)
@pytest.mark.parametrize(
    "n,tp,unit", [(10, 4, 1), (1536, 2, 256), (160, 2, 32), (3, 2, 1), (7, 7, 1), (49152, 3, 8)]
)
def test_split_range_tiles_contiguously_and_evenly(n, tp, unit):
    parts = [split_range(n, tp, r, unit) for r in range(tp)]
    assert [s for s, _ in parts] == [sum(size for _, size in parts[:r]) for r in range(tp)]
    assert sum(size for _, size in parts) == n
    sizes = [size for _, size in parts]
    assert all(size % unit == 0 for size in sizes) and max(sizes) - min(sizes) <= unit
    assert sizes == sorted(sizes, reverse=True)


def test_aligned_unit_prefers_gguf_blocks():
    assert aligned_unit(1536, 2) == 256
    assert aligned_unit(160, 2) == 32  # not a multiple of 256
    assert aligned_unit(256, 2) == 32  # one super-block cannot be split in two
    assert aligned_unit(32, 2) == 1


def test_head_shard_default_model_uneven():
    # SmolLM2-135M: 9 query heads in 3 KV groups of 3
    assert dataclasses.astuple(head_shard(9, 3, 2, 0)) == (0, 6, 0, 2)
    assert dataclasses.astuple(head_shard(9, 3, 2, 1)) == (6, 3, 2, 1)


@pytest.mark.parametrize(
    "heads,kv,tp",
    [(9, 3, 2), (9, 3, 3), (32, 8, 4), (12, 4, 3), (4, 1, 2), (14, 2, 4), (8, 2, 8), (4, 2, 4), (16, 16, 3)],
)
def test_head_shard_covers_every_query_head_with_its_kv_head(heads, kv, tp):
    group = heads // kv
    owners: list[int] = []
    for r in range(tp):
        s = head_shard(heads, kv, tp, r)
        assert s.q_count >= 1 and s.kv_count >= 1
        q_heads = range(s.q_start, s.q_start + s.q_count)
        owners += q_heads
        # each local query head's KV head is among the rank's, in the same local order
        for q in q_heads:
            assert s.kv_start <= q // group < s.kv_start + s.kv_count
        assert (s.q_start - s.kv_start * group) + s.q_count <= s.kv_count * group
        if kv < tp:
            assert (s.kv_start, s.kv_count) == (r * kv // tp, 1)
    assert sorted(owners) == list(range(heads))  # every query head on exactly one rank


def test_head_shard_refuses_ranks_without_query_heads():
    with pytest.raises(ConfigError, match="at most"):
        head_shard(4, 2, 8, 0)


def test_vocab_sizes_cover_the_vocabulary():
    assert vocab_sizes(49152, 2) == [(0, 24576), (24576, 24576)]
    assert vocab_sizes(321, 2) == [(0, 161), (161, 160)]


def test_shard_plan_row_parallel_bias_is_read_by_rank_0_only():
    for rank in (0, 1):
        plan = ShardPlan(rank)
        plan.add("m.o_proj", 1, 64, 64)
        plan.add("m.q_proj", 0, 64, 64)
        assert plan.lookup("m.o_proj.weight") == TensorSlice(1, 64, 64)
        assert plan.lookup("m.q_proj.bias") == TensorSlice(0, 64, 64)
        assert plan.lookup("m.norm.weight") is None and not plan.skip("m.norm.weight")
        assert plan.skip("m.o_proj.bias") == (rank == 1)


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_shard_model_tiny_qwen2_shapes(kv_heads):
    config = tiny_config("qwen2", num_key_value_heads=kv_heads)  # 4 query heads, head_dim 16
    for rank in (0, 1):
        model = get_model_class("Qwen2ForCausalLM")(config, torch.float32)
        plan = shard_model(model, TPInfo(rank, 2))
        attn = model.model.layers[0].self_attn
        mlp = model.model.layers[0].mlp
        # kv_heads 1: the KV head replicated, its 4 query heads split 2 + 2; kv_heads 2: one group each
        assert (attn.attn.num_heads, attn.attn.num_kv_heads) == (2, 1)
        assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
        assert attn.qkv_proj.weight.shape == (2 * 16 + 2 * 16, 64)
        assert attn.o_proj.weight.shape == (64, 32)
        assert mlp.gate_up_proj.output_sizes == ([96, 96] if rank == 0 else [64, 64])  # 160 in units of 32
        assert mlp.down_proj.weight.shape == (64, 96 if rank == 0 else 64)
        assert model.model.embed_tokens.weight.shape == (160, 64)  # tied: also the LM head
        assert plan.lookup("model.layers.1.self_attn.q_proj.weight") == TensorSlice(0, 32 * rank, 32)
        kv_start = 0 if kv_heads == 1 else 16 * rank
        assert plan.lookup("model.layers.1.self_attn.k_proj.bias") == TensorSlice(0, kv_start, 16)
        assert plan.lookup("model.layers.0.mlp.down_proj.weight") == TensorSlice(1, 96 * rank, 96 - 32 * rank)


def test_tp_info_single_rank_is_a_no_op():
    tp = TPInfo()
    x = torch.arange(6.0).view(2, 3)
    assert tp.all_reduce(x) is x and tp.all_gather_last_dim(x, [3]) is x and tp.all_reduce_min(5) == 5
    tp.check_group()  # no process group needed
    with pytest.raises(ValueError):
        TPInfo(2, 2)


# ---------------------------------------------------------------- tp=2 vs tp=1, real runners
def test_collectives_over_gloo(tp_results):
    _, ranks = tp_results
    for r in ranks:
        c = r["collectives"]
        assert c["min"] == 93  # min(100, 93)
        np.testing.assert_array_equal(c["gather"], np.array([[0.0, 1.0, 1.0]] * 2))  # uneven parts
        np.testing.assert_array_equal(c["sum"], np.full(3, 3.0))


def test_shared_memory_collectives_equal_gloo(tp_results):
    _, ranks = tp_results
    for r in ranks:
        c = r["collectives"]
        assert c["shm_used"]  # both ranks on this x86-64 host
        for key in ("shm_sum", "shm_chunked", "shm_strided"):
            np.testing.assert_allclose(c[key], c["gloo_sum"], rtol=1e-6, atol=1e-6, err_msg=key)
        np.testing.assert_array_equal(
            c["shm_repeated"], np.full(7, float(2**49))
        )  # 0 + 1, then doubled 49 times
        np.testing.assert_array_equal(c["shm_gather"], np.array([[0.0, 1.0, 1.0]] * 2))
    np.testing.assert_array_equal(ranks[0]["collectives"]["shm_sum"], ranks[1]["collectives"]["shm_sum"])


def _args(model_path: str | None, **kw) -> ServerArgs:
    return ServerArgs(
        model_path=model_path,
        dtype="float32",
        device="cpu",
        max_total_tokens=256,
        max_running_requests=8,
        num_threads=1,
        **kw,
    )


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory) -> list[tuple[str, ServerArgs]]:
    root = tmp_path_factory.mktemp("tp")
    qwen2_rep = save_tiny_model("qwen2", root / "qwen2_kv1", seed=3, num_key_value_heads=1)
    gguf_path, _ = save_tiny_gguf("qwen2", root / "qwen2.gguf", seed=4, intermediate_size=32)
    llama = save_tiny_model("llama", root / "llama_v321", seed=5, vocab_size=321)
    qwen3 = save_tiny_model("qwen3", root / "qwen3", seed=6)
    return [
        ("default_gguf", _args(None)),
        ("default_none", _args(None, quantization="none")),
        ("default_gguf_gloo", _args(None, disable_custom_all_reduce=True)),
        ("qwen2_kv1", _args(qwen2_rep)),
        ("qwen2_gguf_unaligned", _args(gguf_path)),
        ("llama_untied_uneven_vocab", _args(llama)),
        ("qwen3_qk_norm", _args(qwen3)),
        ("qwen2_kv1_dummy", _args(qwen2_rep, load_format="dummy")),
    ]


@pytest.fixture(scope="module")
def tp_results(scenarios):
    ref = {name: drive_runner(args, 0, PROMPTS, DECODE_STEPS) for name, args in scenarios}
    ranks = run_ranks(run_scenarios, 2, scenarios, PROMPTS, DECODE_STEPS, timeout=600)
    return ref, ranks


@pytest.mark.parametrize(
    "name",
    [
        "default_gguf",
        "default_none",
        "default_gguf_gloo",
        "qwen2_kv1",
        "qwen2_gguf_unaligned",
        "llama_untied_uneven_vocab",
        "qwen3_qk_norm",
        "qwen2_kv1_dummy",
    ],
)
def test_tp2_logits_and_tokens_equal_tp1(tp_results, name):
    ref, ranks = tp_results
    for rank in ranks:
        got = rank[name]
        assert got["tokens"] == ref[name]["tokens"]
        for step, (a, b) in enumerate(zip(got["logits"], ref[name]["logits"], strict=True)):
            # the row-parallel sums run in another order (all-reduce of two partial sums); the
            # longest reduction: SmolLM2's MLP (1536), the tiny models' (160)
            k = 1536 if name.startswith("default") else 160
            assert_reordered_close(torch.from_numpy(a), torch.from_numpy(b), k, what=f"{name} step {step}")


def test_unaligned_row_parallel_shard_is_dequantized_aligned_one_stays_blocks(tp_results):
    ref, ranks = tp_results
    q8_0 = 8
    # intermediate 32 at tp=2: columns 0..16 / 16..32 cut the Q8_0 blocks of 32, so each rank
    # gets its part dequantized (a plain float32 weight, no qweight)
    assert ref["qwen2_gguf_unaligned"]["down_proj_qtypes"] == [q8_0]
    assert [r["qwen2_gguf_unaligned"]["down_proj_qtypes"] for r in ranks] == [None, None]
    # the default model's down_proj (1536 -> 768 + 768) keeps its Q4_1 blocks
    assert [r["default_gguf"]["down_proj_qtypes"] for r in ranks] == [
        ref["default_gguf"]["down_proj_qtypes"]
    ] * 2


def test_tp2_ranks_hold_half_the_sharded_weights_and_agree_on_the_pool(tp_results):
    ref, ranks = tp_results
    for name in ("default_gguf", "default_none"):
        full = ref[name]["sharded_bytes"]
        parts = [r[name]["sharded_bytes"] for r in ranks]
        assert all(0.4 * full <= p <= 0.6 * full for p in parts), (name, full, parts)
        assert abs(sum(parts) - full) <= 0.03 * full, (name, full, parts)
    # 3 KV heads over 2 ranks: 2 and 1 local heads, one pool size
    assert [r["default_gguf"]["kv_heads"] for r in ranks] == [2, 1]
    assert [r["qwen2_kv1"]["kv_heads"] for r in ranks] == [1, 1]
    for name in ref:
        assert ranks[0][name]["kv_tokens"] == ranks[1][name]["kv_tokens"] == ref[name]["kv_tokens"]


def test_single_rank_model_is_not_transformed(tmp_path):
    """tp size 1: no hooks, no vocab sharding, full shapes (the tp=1 path is today's)."""
    from srt.configs.model_config import ModelConfig
    from srt.model_loader import get_model

    path = save_tiny_model("qwen2", tmp_path / "m", num_key_value_heads=1)
    model_config = ModelConfig.from_server_args(_args(path).resolve())
    model = get_model(model_config, tp=TPInfo())
    assert all(not m._forward_hooks for m in model.modules())
    assert model.model.embed_tokens.tp is None and model.logits_processor.tp is None
    assert model.model.layers[0].self_attn.qkv_proj.weight.shape == ((4 + 2) * 16, 64)


def test_gguf_shard_reader_slices_blocks_and_falls_back_to_float32(tmp_path):
    """A Q4_K_M Llama: every rank tensor equals the whole tensor's slice; down_proj (512 columns,
    cut at 256) keeps its Q6_K blocks, o_proj (cut at 128, inside a 256-block) is dequantized."""
    from gguf import dequantize
    from transformers import LlamaConfig

    from srt.layers.quantized_weight import GGUFTensor
    from srt.model_loader.gguf import gguf_weights_iterator
    from srt.model_loader.shard_reader import sharded_gguf_iterator
    from tests.helpers.gguf_models import write_llama_gguf

    path = str(tmp_path / "q4km.gguf")
    write_llama_gguf(
        path, hidden=256, intermediate=512, layers=1, heads=4, kv_heads=2, vocab=64, fast_random=True
    )
    config = LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, tie_word_embeddings=False,
    )  # fmt: skip
    keep = frozenset({12, 14})  # Q4_K, Q6_K

    def as_float(t):
        if isinstance(t, GGUFTensor):
            return torch.from_numpy(dequantize(t.data.numpy(), t.qtype))
        return t

    full = {n: as_float(t) for n, t in gguf_weights_iterator(path, config, keep)}
    for rank in (0, 1):
        model = get_model_class("LlamaForCausalLM")(config, torch.float32)
        plan = shard_model(model, TPInfo(rank, 2))
        got = dict(sharded_gguf_iterator(path, config, keep, plan))
        assert set(got) == set(full)
        for name, t in got.items():
            s = plan.lookup(name)
            want = full[name] if s is None else full[name].narrow(s.dim, s.start, s.size)
            assert torch.equal(as_float(t), want), name
        assert isinstance(got["model.layers.0.mlp.down_proj.weight"], GGUFTensor)
        assert got["model.layers.0.mlp.down_proj.weight"].shape == (256, 256)
        assert not isinstance(got["model.layers.0.self_attn.o_proj.weight"], GGUFTensor)
        assert got["model.layers.0.self_attn.o_proj.weight"].shape == (256, 128)
        assert isinstance(got["model.layers.0.self_attn.q_proj.weight"], GGUFTensor)  # whole rows

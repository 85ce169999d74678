"""The launch census (benchmarks/gpu/census.py) and the kernel budgets of a decode layer on the
CUDA code path, counted on CPU.

Budgets per decoder layer, one decode step (batch 1 and 8):

    dense Llama / Qwen2     12   (measured 10: norm, qkv, rope, KV store, attention, o_proj,
                                  add+norm, gate_up, silu_and_mul, down; SGLang's layer is about 9)
    Qwen3 (q/k norm)        12   (measured 12: the two head norms in place)
    Gemma 2                 12   (measured 12: four norms, GeGLU)
    Gemma 3 (q/k norm)      14   (measured 14)
    MoE, top-2 of 8, bs 1   MOE_BUDGET  (the experts run one after another: 5 kernels per expert
                                  touched plus routing; plus one host sync for the expert counts)

A failure lists every op of the layer, so a regression says what it added.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.gpu.census import STEP, LaunchCensus, census_decode_step, census_runner, launches

DENSE_BUDGET = {"llama": 12, "qwen2": 12, "qwen3": 12, "gemma2": 12, "gemma3": 14}
MOE_BUDGET = {"mixtral": 28, "qwen2_moe": 33}  # batch 1, top-2 experts touched
SHAPE = dict(num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    from tests.helpers.tiny_gemma import save_tiny_gemma
    from tests.helpers.tiny_models import save_tiny_model
    from tests.helpers.tiny_moe import save_tiny_moe

    root = tmp_path_factory.mktemp("census")
    dense = dict(SHAPE, hidden_size=256, head_dim=64)
    return {
        "llama": save_tiny_model("llama", root / "llama", num_hidden_layers=3, **dense),
        "qwen2": save_tiny_model("qwen2", root / "qwen2", **dict(SHAPE, hidden_size=256)),
        "qwen3": save_tiny_model("qwen3", root / "qwen3", **dense),
        "gemma2": save_tiny_gemma("gemma2", root / "gemma2", **dense),
        "gemma3": save_tiny_gemma("gemma3", root / "gemma3", **dense),
        "mixtral": save_tiny_moe("mixtral", root / "mixtral", hidden=256, **SHAPE),
        "qwen2_moe": save_tiny_moe("qwen2_moe", root / "qwen2_moe", hidden=256, **SHAPE),
    }


def _layers(census: LaunchCensus) -> dict[str, list[str]]:
    layers = {k: v for k, v in census.per_layer().items() if k != STEP}
    assert layers, "no decoder layer ran under the census"
    return layers


def _within(layers: dict[str, list[str]], budget: int, what: str) -> None:
    over = {k: v for k, v in layers.items() if len(v) > budget}
    assert not over, f"{what}: over the budget of {budget} kernels per layer: " + "; ".join(
        f"{k}: {len(v)} = {' '.join(v)}" for k, v in over.items()
    )


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("kind", list(DENSE_BUDGET))
def test_dense_layer_within_budget_without_host_sync(paths, kind, batch):
    census = census_decode_step(census_runner(paths[kind]), batch)
    layers = _layers(census)
    _within(layers, DENSE_BUDGET[kind], kind)
    assert not [s for s in census.syncs if s[0] != STEP], f"host syncs inside layers: {census.syncs}"
    for ops in layers.values():  # the fused path was taken, not a silent fallback
        fused = {op for op in ops if op.startswith("flashinfer.")}
        assert {"flashinfer.rope", "flashinfer.decode.run"} <= fused, ops
        assert any("and_mul" in op for op in fused) and any("rmsnorm" in op for op in fused), ops
        assert ops.count("index_put_") == 1, f"K and V not stored in one copy: {ops}"


def test_llama_layer_is_the_ten_kernels_it_should_be(paths):
    census = census_decode_step(census_runner(paths["llama"]), 1)
    later = _layers(census)["layer1"]
    assert later == [
        "flashinfer.fused_add_rmsnorm",
        "linear",
        "flashinfer.rope",
        "index_put_",
        "flashinfer.decode.run",
        "linear",
        "flashinfer.fused_add_rmsnorm",
        "linear",
        "flashinfer.silu_and_mul",
        "linear",
    ]


@pytest.mark.parametrize("kind", list(MOE_BUDGET))
def test_moe_layer_within_budget(paths, kind):
    census = census_decode_step(census_runner(paths[kind]), 1)
    _within(_layers(census), MOE_BUDGET[kind], kind)
    # the eager MoE path reads the expert counts back, once per layer; CUDA graphs run the dense
    # reference instead, which has none. (Reads at the step level are of the plan's host arrays.)
    in_layers = sorted(s for s in census.syncs if s[0] != STEP)
    assert in_layers == [(layer, "tolist") for layer in sorted(_layers(census))]


def test_census_counts_data_ops_not_views():
    x = torch.randn(4, 6)
    with LaunchCensus() as c:
        v = x.view(2, 12).t()[0]  # views: nothing launched
        _ = x.split(3, dim=1)
        y = x + 1  # one kernel
        y.add_(1)  # in place: one kernel
        torch.empty(3)  # an allocation: none
        z = y.sum().item()  # a reduction, then a host sync
        _ = x[0].tolist()
    assert [name for _, name in c.kernels] == ["add", "add_", "sum"]
    assert [name for _, name in c.syncs] == ["item", "tolist"]
    assert isinstance(z, float) and v.shape == (2,)


def test_a_stand_in_is_one_kernel_whatever_it_computes():
    c, x = LaunchCensus(), torch.ones(3)
    fused = c.recorded("flashinfer.rmsnorm", lambda x: (x.float() * 2).to(x.dtype) + x)
    with c:
        fused(x)
    assert c.kernels == [(STEP, "flashinfer.rmsnorm")]


def test_launches_reads_the_op_schema():
    aten = torch.ops.aten
    assert not launches(aten.view.default) and not launches(aten.transpose.int)
    assert not launches(aten.empty.memory_format)
    assert launches(aten.mm.default) and launches(aten.index_put_.default) and launches(aten.copy_.default)

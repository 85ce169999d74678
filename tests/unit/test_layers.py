"""Shared layers against transformers' reference implementations and brute-force math."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

import srt.layers.linear_backend as linear_mod
from srt.configs.backends import resolve_linear_backend
from srt.configs.device import onednn_linear_available
from srt.kernels import cpu as cpu_kernels
from srt.layers.activation import SiluAndMul
from srt.layers.forward_batch import ForwardBatch, ForwardMode
from srt.layers.layernorm import RMSNorm
from srt.layers.linear import Linear, MergedColumnLinear, QKVLinear
from srt.layers.linear_backend import create_linear_backend
from srt.layers.logits_processor import LogitsProcessor
from srt.layers.radix_attention import RadixAttention
from srt.layers.rotary_embedding import RotaryEmbedding, compute_inv_freq, get_rope, rope_parameters
from srt.model_loader.weight_utils import weight_bytes
from srt.utils.errors import UnsupportedModelError, WeightLoadError
from tests.helpers.isa import cpu_isa, isa_available, isa_params, skip_reason
from tests.helpers.tolerance import EPS32, assert_reordered_close

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _llama_config(**kw) -> LlamaConfig:
    base = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    base.update(kw)
    return LlamaConfig(**base)


# ---------------------------------------------------------------- rope
@pytest.mark.parametrize(
    "scaling",
    [None, {"rope_type": "linear", "factor": 4.0}, LLAMA3_SCALING],
    ids=["default", "linear", "llama3"],
)
def test_inv_freq_matches_transformers_rope_init(scaling):
    config = _llama_config(rope_theta=500000.0, rope_scaling=scaling)
    if scaling is None:
        ref, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        ref, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
    theta, parsed = rope_parameters(config)
    assert theta == 500000.0
    ours = compute_inv_freq(32, theta, parsed)
    # the same formula on both sides, torch's pow and division: within a few ulps, not bit for bit
    torch.testing.assert_close(ours, ref, rtol=4 * EPS32, atol=0)


def test_llama3_scaling_changes_low_frequencies_only():
    plain = compute_inv_freq(32, 500000.0)
    scaled = compute_inv_freq(32, 500000.0, LLAMA3_SCALING)
    assert torch.equal(scaled[0], plain[0])  # highest frequency untouched
    torch.testing.assert_close(scaled[-1], plain[-1] / 8.0)  # lowest divided by factor
    medium = (scaled != plain) & (scaled != plain / 8.0)
    assert medium.any()  # the smooth band is exercised


def test_unsupported_rope_type_raises():
    with pytest.raises(UnsupportedModelError, match="mrope"):
        compute_inv_freq(32, 10000.0, {"rope_type": "mrope", "factor": 2.0})


@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING], ids=["default", "llama3"])
def test_rotary_matches_transformers(scaling):
    config = _llama_config(rope_theta=10000.0, rope_scaling=scaling)
    head_dim, num_tokens = 32, 11
    positions = torch.tensor([0, 1, 2, 7, 63, 64, 100, 500, 999, 3, 3])
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(num_tokens, 4 * head_dim, generator=gen)
    k = torch.randn(num_tokens, 2 * head_dim, generator=gen)

    ref_rope = LlamaRotaryEmbedding(config)
    cos, sin = ref_rope(q, positions[None])
    q_ref, k_ref = apply_rotary_pos_emb(
        q.view(1, num_tokens, 4, head_dim).transpose(1, 2),
        k.view(1, num_tokens, 2, head_dim).transpose(1, 2),
        cos,
        sin,
    )
    rope = get_rope(head_dim, config)
    q_out, k_out = rope(positions, q, k)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    # a rotation is a sum of two products per element (a reduction of length 2)
    assert_reordered_close(q_out.view(num_tokens, 4, head_dim), q_ref[0].transpose(0, 1), 2)
    assert_reordered_close(k_out.view(num_tokens, 2, head_dim), k_ref[0].transpose(0, 1), 2)


def test_rotary_accepts_strided_views_and_keeps_dtype():
    rope = RotaryEmbedding(16, 64, 10000.0)
    qkv = torch.randn(5, 16 * 4, dtype=torch.bfloat16)
    q, k, _ = qkv.split([32, 16, 16], dim=-1)
    q0 = q.clone()
    positions = torch.arange(5)
    q_ref, k_ref = rope(positions, q.clone(), k.clone())
    # the torch path (3-D heads) rounds where the native one does: the same bits
    q3, k3 = rope(positions, q.view(5, 2, 16), k.view(5, 1, 16))
    assert torch.equal(q3.view(5, 32), q_ref) and torch.equal(k3.view(5, 16), k_ref)
    q_out, k_out = rope(positions, q, k)  # 2-D bf16 rows: rotated in place, views and all
    assert q_out.dtype == torch.bfloat16 and q_out.data_ptr() == q.data_ptr()
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    # position 0 is the identity rotation
    assert torch.equal(q_out[0], q0[0])


# ---------------------------------------------------------------- norm / activation / linear
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_transformers(dtype):
    ref = LlamaRMSNorm(64, eps=1e-5).to(dtype)
    ours = RMSNorm(64, eps=1e-5, dtype=dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(64))
        ours.weight.copy_(ref.weight)
    x = torch.randn(7, 64).to(dtype) * 3
    # values up to ~10: a reduction of 64 squares and a product, rounded once more in bf16
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(ours(x), ref(x), rtol=4 * eps if dtype == torch.float32 else eps, atol=1e-6)


def test_rmsnorm_with_residual_adds_in_place():
    norm = RMSNorm(8)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(8) + 0.5)
    x, residual = torch.randn(3, 8), torch.randn(3, 8)
    expected_sum = x + residual
    out, new_residual = norm.forward_with_residual(x, residual)
    assert new_residual is residual
    torch.testing.assert_close(residual, expected_sum)
    torch.testing.assert_close(out, norm(expected_sum))


def test_silu_and_mul():
    x = torch.randn(4, 10)
    torch.testing.assert_close(SiluAndMul()(x), F.silu(x[:, :5]) * x[:, 5:])


def test_qkv_linear_shards_and_forward():
    hidden, d, h, hkv = 16, 4, 4, 2
    layer = QKVLinear(hidden, d, h, hkv, bias=True)
    parts = {
        s: (torch.randn(n * d, hidden), torch.randn(n * d)) for s, n in (("q", h), ("k", hkv), ("v", hkv))
    }
    for shard in ("v", "q", "k"):  # any order
        layer.load_shard("weight", parts[shard][0], shard)
        layer.load_shard("bias", parts[shard][1], shard)
    x = torch.randn(3, hidden)
    q, k, v = layer.split(layer(x))
    for out, shard in ((q, "q"), (k, "k"), (v, "v")):
        torch.testing.assert_close(out, F.linear(x, *parts[shard]))
    assert layer.weight.is_contiguous() and layer.weight.shape == (h * d + 2 * hkv * d, hidden)
    with pytest.raises(WeightLoadError, match="shape"):
        layer.load_shard("weight", torch.randn(h * d + 1, hidden), "q")
    with pytest.raises(WeightLoadError, match="shard"):
        layer.load_shard("weight", parts["q"][0], "x")


def test_merged_column_linear_gate_up():
    layer = MergedColumnLinear(8, [6, 6])
    gate, up = torch.randn(6, 8), torch.randn(6, 8)
    layer.load_shard("weight", up, 1)
    layer.load_shard("weight", gate, 0)
    x = torch.randn(5, 8)
    torch.testing.assert_close(SiluAndMul()(layer(x)), F.silu(x @ gate.T) * (x @ up.T))


def test_linear_has_no_grad_and_no_bias_by_default():
    layer = Linear(4, 3)
    assert layer.bias is None and not layer.weight.requires_grad


@pytest.mark.skipif(not onednn_linear_available(), reason="oneDNN linear not usable here")
def test_onednn_linear_backend_matches_f_linear(monkeypatch):
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(
        linear_mod.torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(1) or real(*a)
    )
    gen = torch.Generator().manual_seed(3)
    w, b = torch.randn(40, 24, generator=gen), torch.randn(40, generator=gen)
    backend = create_linear_backend("onednn")
    assert backend.name == "onednn"
    for shape in [(7, 24), (2, 3, 24), (5, 24)]:  # more rows than the small-batch kernel takes
        x = torch.randn(*shape, generator=gen)
        for bias in (None, b):
            got = backend.apply(x, w, bias)
            assert got.shape == (*shape[:-1], 40)
            torch.testing.assert_close(got, F.linear(x, w, bias), atol=1e-5, rtol=1e-5)
    assert len(calls) == 6
    calls.clear()
    backend = create_linear_backend("torch")
    x = torch.randn(7, 24, generator=gen)
    assert torch.equal(backend.apply(x, w, b), F.linear(x, w, b)) and not calls
    x64 = x.double()  # other dtypes always take F.linear
    backend = create_linear_backend("onednn")
    assert torch.equal(backend.apply(x64, w.double()), F.linear(x64, w.double())) and not calls


def _prepared_qkv_layer(backend, gen: torch.Generator) -> tuple[QKVLinear, torch.Tensor]:
    """A QKVLinear of random weights and bias on ``backend``, after ``prepare_weights``, and a copy
    of its plain weight taken before."""
    layer = QKVLinear(48, 8, 4, 2, bias=True, linear_backend=backend)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen))
        layer.bias.copy_(torch.randn(layer.bias.shape, generator=gen))
    plain = layer.weight.detach().clone()
    layer.prepare_weights()
    return layer, plain


@pytest.mark.skipif(not onednn_linear_available(), reason="oneDNN linear not usable here")
@pytest.mark.parametrize("native", [True, False])
def test_onednn_prepacked_and_small_batch_paths_match_f_linear(monkeypatch, native):
    """After ``prepare_weights`` the layer keeps its plain weight and a packed copy; every batch
    size (the small-batch kernel at <= SMALL_BATCH_ROWS rows, oneDNN on the packed copy above,
    or oneDNN only without native kernels) gives F.linear's result, and autograd still works."""
    if native and not cpu_kernels.load(build_if_missing=True):
        pytest.skip(f"native CPU kernels unavailable: {cpu_kernels.kernel_status()}")
    if not native:
        monkeypatch.setattr(linear_mod.cpu_kernels, "native_available", lambda: False)
    small, packed_calls = [], []
    real_small = torch.ops.srt_cpu.small_batch_linear if native else None
    real_dnn = torch.ops.mkldnn._linear_pointwise
    if native:
        monkeypatch.setattr(
            linear_mod.torch.ops.srt_cpu, "small_batch_linear", lambda *a: small.append(1) or real_small(*a)
        )
    monkeypatch.setattr(
        linear_mod.torch.ops.mkldnn,
        "_linear_pointwise",
        lambda x, w, *a: packed_calls.append(w.is_mkldnn) or real_dnn(x, w, *a),
    )
    gen = torch.Generator().manual_seed(4)
    backend = create_linear_backend("onednn")
    layer, plain = _prepared_qkv_layer(backend, gen)
    assert layer.packed_weight is not None and layer.packed_weight.is_mkldnn
    assert torch.equal(layer.packed_weight.to_dense(), plain) and torch.equal(layer.weight, plain)
    with torch.inference_mode():
        for m in (1, 3, 4, 5, 32, 100):
            x = torch.randn(m, 48, generator=gen)
            torch.testing.assert_close(layer(x), F.linear(x, plain, layer.bias), atol=1e-5, rtol=1e-5)
    assert len(small) == (3 if native else 0)
    assert packed_calls == [True] * (3 if native else 6)
    x = torch.randn(3, 48, generator=gen, requires_grad=True)
    y = backend.apply(x, layer.weight, None, layer.packed_weight)  # autograd: F.linear
    y.sum().backward()
    torch.testing.assert_close(x.grad, plain.sum(0).expand(3, 48), atol=1e-5, rtol=1e-5)
    assert create_linear_backend("torch").pack_weight(plain) is None


@pytest.mark.parametrize(
    "m,k,n", [(1, 576, 960), (2, 37, 5), (3, 1536, 64), (4, 8, 3), (7, 100, 33), (0, 16, 4)]
)
def test_small_batch_linear_kernel_matches_f_linear(m, k, n):
    if not cpu_kernels.load(build_if_missing=True):
        pytest.skip(f"native CPU kernels unavailable: {cpu_kernels.kernel_status()}")
    gen = torch.Generator().manual_seed(m * 1000 + k)
    x = torch.randn(m, k + 5, generator=gen)[:, 2 : k + 2]  # strided rows
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    for bias in (None, b):
        got = torch.ops.srt_cpu.small_batch_linear(x, w, bias)
        torch.testing.assert_close(got, F.linear(x, w, bias), atol=1e-4, rtol=1e-5)
    with pytest.raises(RuntimeError, match="columns"):
        torch.ops.srt_cpu.small_batch_linear(x, torch.randn(n, k + 1))


def test_resolve_linear_backend(monkeypatch):
    import srt.configs.cpu_features as cpu_features

    ok = onednn_linear_available()
    for avx2 in (True, False):
        monkeypatch.setattr(cpu_features, "cpu_has_avx2_fma", lambda v=avx2: v)
        want = "native" if avx2 else ("onednn" if ok else "torch")
        assert resolve_linear_backend("auto", "cpu", "float32") == want
        assert resolve_linear_backend("auto", "cpu", "bfloat16") == ("native" if avx2 else "torch")
        assert resolve_linear_backend("auto", "cpu", "float16") == "torch"
        assert resolve_linear_backend("auto", "cuda", "float32") == "torch"
        assert resolve_linear_backend("native", "cpu", "float32") == "native"
        assert resolve_linear_backend("native", "cpu", "bfloat16") == "native"
    assert resolve_linear_backend("torch", "cpu", "float32") == "torch"
    with pytest.raises(ValueError, match="--linear-backend"):
        resolve_linear_backend("onednn", "cuda", "bfloat16")
    with pytest.raises(ValueError, match="--linear-backend onednn"):
        resolve_linear_backend("onednn", "cpu", "bfloat16")
    with pytest.raises(ValueError, match="--linear-backend native"):
        resolve_linear_backend("native", "cpu", "float16")
    with pytest.raises(ValueError, match="unknown linear backend"):
        resolve_linear_backend("mkl", "cpu", "float32")
    with pytest.raises(ValueError):
        create_linear_backend("auto")


# ---------------------------------------------------------------- native packed linear
def _native_or_skip() -> None:
    if not cpu_kernels.load(build_if_missing=True):
        pytest.skip(f"native CPU kernels unavailable: {cpu_kernels.kernel_status()}")


@pytest.mark.parametrize(
    "n,k", [(960, 576), (576, 1536), (5, 3), (25, 300), (47, 513), (1, 1), (24, 0), (48, 256), (49, 129)]
)
@pytest.mark.parametrize("nr", [24, 48])
@pytest.mark.parametrize("isa", isa_params())
def test_packed_linear_kernel_matches_a_float64_reference(isa, n, k, nr):
    """Panels of 24 and 48 columns; every row count (the 4- and 8-row tiles and their tails, x in
    128-row blocks past 256 rows), panels cut by N % nr, K blocks (the depths by row count) cut by
    K, strided rows, with and without bias; each kernel (scalar, AVX2, AVX-512 on 48-wide panels)
    gives the scalar kernel's bits (same FMA order), and a row gives the same bits alone or in any
    batch."""
    _native_or_skip()
    if isa == "avx512" and nr == 24:
        pytest.skip(
            "the AVX-512 tile runs panels of 48 only (refused on 24: test_packed_linear_avx512_needs_48)"
        )
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    packed = torch.ops.srt_cpu.pack_linear_weight(w, nr)
    assert packed.shape == ((n + nr - 1) // nr, k, nr)
    for m in (0, 1, 2, 3, 4, 5, 7, 8, 9, 17, 32, 33, 40) + ((300,) if n * k < 200_000 else ()):
        x = torch.randn(m, k + 5, generator=gen)[:, 2 : k + 2]  # strided rows
        for bias in (None, b):
            want = x.double() @ w.double().t() + (0 if bias is None else bias.double())
            out = torch.ops.srt_cpu.packed_linear(x, packed, n, bias, isa)
            # float32 rounding of a k-term sum of N(0, k) size: ~1e-5 * sqrt(k) at most, as a rule
            torch.testing.assert_close(out.double(), want, atol=1e-5 * (k + 16) ** 0.5, rtol=1e-5)
            assert torch.equal(out, torch.ops.srt_cpu.packed_linear(x, packed, n, bias, "scalar"))
        if m > 1:
            full = torch.ops.srt_cpu.packed_linear(x, packed, n, b, isa)
            alone = torch.ops.srt_cpu.packed_linear(x[m - 1 :], packed, n, b, isa)
            assert torch.equal(full[m - 1 :], alone)
    with pytest.raises(RuntimeError, match="columns"):
        torch.ops.srt_cpu.packed_linear(torch.randn(2, k + 1), packed, n, None, isa)
    with pytest.raises(RuntimeError, match="panels"):
        torch.ops.srt_cpu.packed_linear(torch.randn(2, k), packed, n + nr, None, isa)


def test_packed_linear_weight_layout():
    """The default panel width follows the ISA the ops run (48, the AVX-512 tile's, else 24: the
    lowered runs take the 24 branch on any CPU); either width runs through the default kernel; a
    width other than 24 / 48 or an unknown ISA name is a clear error."""
    _native_or_skip()
    w, x = torch.randn(30, 16), torch.randn(3, 16)
    default = torch.ops.srt_cpu.pack_linear_weight(w)
    assert default.shape[2] == (48 if cpu_isa() == "avx512" else 24)
    for nr in (24, 48):
        packed = torch.ops.srt_cpu.pack_linear_weight(w, nr)
        torch.testing.assert_close(torch.ops.srt_cpu.packed_linear(x, packed, 30, None), F.linear(x, w))
    with pytest.raises(RuntimeError, match="24 or 48"):
        torch.ops.srt_cpu.pack_linear_weight(w, 32)
    with pytest.raises(RuntimeError, match="isa must be"):
        torch.ops.srt_cpu.packed_linear(x, default, 30, None, "sse")


@pytest.mark.skipif(not isa_available("avx512"), reason=skip_reason("avx512"))
def test_packed_linear_avx512_needs_48():
    _native_or_skip()
    p24 = torch.ops.srt_cpu.pack_linear_weight(torch.randn(30, 16), 24)
    with pytest.raises(RuntimeError, match="panels of 48"):
        torch.ops.srt_cpu.packed_linear(torch.randn(3, 16), p24, 30, None, "avx512")


@pytest.mark.parametrize("native", [True, False])
def test_native_linear_backend_layer_paths(monkeypatch, caplog, native):
    """After ``prepare_weights`` a layer of the ``native`` backend keeps the panels alone (its plain
    weight released to a ``meta`` tensor of the same shape and dtype); every batch size gives
    F.linear's result through the packed kernel, other dtypes go through float32, autograd is
    refused with a clear error; without native kernels the backend runs as ``onednn`` (or
    ``torch``), says so and keeps the plain weight (autograd works there)."""
    if native:
        _native_or_skip()
    else:
        monkeypatch.setattr(linear_mod.cpu_kernels, "native_available", lambda: False)
    calls = []
    if native:
        real = torch.ops.srt_cpu.packed_linear
        monkeypatch.setattr(
            linear_mod.torch.ops.srt_cpu, "packed_linear", lambda *a: calls.append(1) or real(*a)
        )
    with caplog.at_level("WARNING", logger="srt.layers.linear_backend"):
        backend = create_linear_backend("native")
    fallback = "onednn" if onednn_linear_available() else "torch"
    assert backend.name == ("native" if native else fallback)
    assert native or "native kernels are unavailable" in caplog.text
    gen = torch.Generator().manual_seed(5)
    layer, plain = _prepared_qkv_layer(backend, gen)
    if native:
        nr = layer.packed_weight.shape[2]
        assert nr in (24, 48) and layer.packed_weight.shape == ((plain.shape[0] + nr - 1) // nr, 48, nr)
        assert (
            layer.weight.is_meta and layer.weight.shape == plain.shape and layer.weight.dtype == plain.dtype
        )
        assert weight_bytes(layer) == layer.packed_weight.nbytes + layer.bias.nbytes  # held once
        layer.prepare_weights()  # again: nothing to pack, nothing lost
        assert layer.packed_weight is not None
    else:
        assert torch.equal(layer.weight, plain)
    with torch.inference_mode():
        for m in (1, 3, 4, 5, 32, 100):
            x = torch.randn(2, m, 48, generator=gen)
            torch.testing.assert_close(layer(x), F.linear(x, plain, layer.bias), atol=1e-5, rtol=1e-5)
        x64 = torch.randn(3, 48, generator=gen, dtype=torch.float64)
        y64 = layer(x64) if native else backend.apply(x64, plain.double(), layer.bias.double())
        assert y64.dtype == torch.float64
        torch.testing.assert_close(
            y64, F.linear(x64, plain.double(), layer.bias.double()), atol=1e-4, rtol=1e-4
        )
    assert len(calls) == (7 if native else 0)
    x = torch.randn(3, 48, generator=gen, requires_grad=True)
    if native:
        with pytest.raises(RuntimeError, match="plain weight was released"):
            layer(x)
    else:
        layer(x).sum().backward()
        torch.testing.assert_close(x.grad, plain.sum(0).expand(3, 48), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- radix attention
def test_radix_attention_delegates_to_backend():
    calls = []

    class Backend:
        def forward(self, q, k, v, layer, fb, save_kv_cache=True):
            calls.append((layer, save_kv_cache))
            return q * 2

    attn = RadixAttention(num_heads=4, head_dim=8, scaling=0.25, num_kv_heads=2, layer_id=3)
    fb = ForwardBatch.build(ForwardMode.EXTEND, [1, 2], [0], [0], [2], [1, 2])
    fb.attn_backend = Backend()
    q = torch.randn(2, 32)
    out = attn(q, torch.randn(2, 16), torch.randn(2, 16), fb)
    assert torch.equal(out, q * 2)
    assert calls == [(attn, True)]
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scaling, attn.layer_id) == (
        4,
        2,
        8,
        0.25,
        3,
    )
    with pytest.raises(ValueError):
        RadixAttention(num_heads=3, head_dim=8, scaling=1.0, num_kv_heads=2, layer_id=0)


# ---------------------------------------------------------------- logits processor
VOCAB, HIDDEN = 50, 16


class _Head(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN), requires_grad=False)


def _batch(mode, prefix_lens, extend_lens, **kw) -> ForwardBatch:
    total = sum(extend_lens)
    ids = torch.randint(0, VOCAB, (total,), generator=torch.Generator().manual_seed(total)).tolist()
    return ForwardBatch.build(
        mode, ids, list(range(len(extend_lens))), prefix_lens, extend_lens, list(range(total)), **kw
    )


def test_logits_only_for_last_token_of_each_segment():
    head, lp = _Head(), LogitsProcessor(VOCAB)
    fb = _batch(ForwardMode.MIXED, [0, 3, 9, 4], [5, 2, 1, 1], num_extend_seqs=2)
    hidden = torch.randn(fb.num_tokens, HIDDEN)
    out = lp(hidden, head, fb)
    rows = [4, 6, 7, 8]
    assert out.next_token_logits.dtype == torch.float32
    torch.testing.assert_close(out.next_token_logits, hidden[rows] @ head.weight.T)
    assert out.input_token_logprobs is None

    fb = _batch(ForwardMode.DECODE, [3, 7], [1, 1])
    hidden = torch.randn(2, HIDDEN)
    torch.testing.assert_close(lp(hidden, head, fb).next_token_logits, hidden @ head.weight.T)


def test_logits_processor_does_not_compute_full_logits(monkeypatch):
    head, lp = _Head(), LogitsProcessor(VOCAB)
    shapes = []
    real_linear = F.linear

    def spy(x, w, b=None):
        shapes.append(tuple(x.shape))
        return real_linear(x, w, b)

    # the processor's default backend (TORCH_LINEAR) calls F.linear
    monkeypatch.setattr(F, "linear", spy)
    fb = _batch(ForwardMode.EXTEND, [0, 0], [30, 20])
    lp(torch.randn(50, HIDDEN), head, fb)
    assert shapes == [(2, HIDDEN)]


def _brute_logprobs(hidden, weight):
    return torch.log_softmax((hidden @ weight.T).float(), dim=-1)


def test_prompt_logprobs_match_brute_force():
    head, lp = _Head(), LogitsProcessor(VOCAB)
    # seq0: whole prompt from 0; seq1: from position 3; seq2: not requested;
    # seq3: chunk continuing a prefix of 4 with the next chunk's first token known; seq4: decode
    prefix, ext = [0, 0, 0, 4, 6], [6, 7, 3, 4, 1]
    starts, next_ids, tops = [0, 3, 10**9, 0, 10**9], [-1, -1, -1, 17, -1], [2, 0, 0, 3, 0]
    fb = _batch(
        ForwardMode.MIXED,
        prefix,
        ext,
        num_extend_seqs=4,
        return_logprob=True,
        extend_logprob_start_lens_cpu=starts,
        extend_logprob_next_token_ids_cpu=next_ids,
        top_logprobs_nums=tops,
    )
    hidden = torch.randn(fb.num_tokens, HIDDEN)
    out = lp(hidden, head, fb)
    full = _brute_logprobs(hidden, head.weight)
    ids = fb.input_ids.tolist()
    tok, top = out.input_token_logprobs, out.input_top_logprobs
    assert len(tok) == len(top) == 5

    # seq0 rows 0..5: None for position 0, then token j scored by row j-1
    assert tok[0][0] is None and len(tok[0]) == 6
    torch.testing.assert_close(torch.tensor(tok[0][1:]), full[torch.arange(5), torch.tensor(ids[1:6])])
    assert top[0][0] is None and len(top[0]) == 6
    for j in range(1, 6):
        vals, idx = full[j - 1].topk(2)
        assert [t for t, _ in top[0][j]] == idx.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in top[0][j]]), vals)

    # seq1 rows 6..12: positions 3..6 scored by rows 8..11
    assert len(tok[1]) == 4 and top[1] == []
    torch.testing.assert_close(torch.tensor(tok[1]), full[torch.arange(8, 12), torch.tensor(ids[9:13])])

    assert tok[2] == [] and top[2] == [] and tok[4] == []

    # seq3 rows 16..19 hold positions 4..7: tokens 5..7 in-batch, then the next chunk's token 17
    assert len(tok[3]) == 4
    expected = full[torch.arange(16, 20), torch.tensor(ids[17:20] + [17])]
    torch.testing.assert_close(torch.tensor(tok[3]), expected)
    assert len(top[3]) == 4 and all(len(t) == 3 for t in top[3])


@pytest.mark.parametrize("start", [0, 1, 4, 6, 7, 10])
@pytest.mark.parametrize("cut", [1, 4, 6, 7, 10])
def test_prompt_logprobs_over_chunks_and_cached_prefix(monkeypatch, start, cut):
    """Prompt of 11 tokens, logprobs from ``start``: an optional cached prefix (at most
    start - 1 tokens, the caller's rule) then two chunks split at ``cut``; the concatenated
    lists hold exactly one entry per position start..10, each the brute-force logprob."""
    monkeypatch.setattr("srt.layers.logits_processor.LOGPROB_CHUNK_ROWS", 3)  # row chunking too
    head, lp = _Head(), LogitsProcessor(VOCAB)
    ids = torch.randint(0, VOCAB, (11,), generator=torch.Generator().manual_seed(5)).tolist()
    # stand-in model: the hidden state of a token depends only on its id and position
    table = torch.randn(VOCAB, 11, HIDDEN, generator=torch.Generator().manual_seed(6))
    full = _brute_logprobs(table[torch.tensor(ids), torch.arange(11)], head.weight)
    expected = ([None] if start == 0 else []) + [full[t - 1, ids[t]].item() for t in range(max(start, 1), 11)]

    def run(prefix: int, end: int) -> list:
        chunk = ids[prefix:end]
        next_id = ids[end] if end < len(ids) else -1
        fb = ForwardBatch.build(
            ForwardMode.EXTEND, chunk, [0], [prefix], [len(chunk)], list(range(len(chunk))),
            return_logprob=True, extend_logprob_start_lens_cpu=[start],
            extend_logprob_next_token_ids_cpu=[next_id], top_logprobs_nums=[2],
        )  # fmt: skip
        out = lp(table[torch.tensor(chunk), fb.positions], head, fb)
        assert len(out.input_top_logprobs[0]) == len(out.input_token_logprobs[0])
        return out.input_token_logprobs[0]

    for prefix in sorted({0, max(start - 1, 0)}):
        if prefix >= cut:
            continue
        got = run(prefix, cut) + run(cut, 11)
        assert len(got) == len(expected), (prefix, got)
        assert (got[0] is None) == (expected[0] is None)
        torch.testing.assert_close(
            torch.tensor([g for g in got if g is not None]),
            torch.tensor([e for e in expected if e is not None]),
        )


def test_idle_batch_gives_empty_logits():
    fb = _batch(ForwardMode.IDLE, [], [], num_extend_seqs=0)
    out = LogitsProcessor(VOCAB)(torch.empty(0, HIDDEN), _Head(), fb)
    assert out.next_token_logits.shape == (0, VOCAB)

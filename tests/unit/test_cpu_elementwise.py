"""The native fused element-wise ops (elementwise.cpp) against their pure-torch references, on
strided row views like the ones a fused projection's output gives, sizes that are not a multiple
of any vector width, and through the layers that use them (and their fallback)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from srt.kernels import cpu as cpu_kernels
from srt.kernels.cpu import elementwise
from srt.layers.activation import SiluAndMul
from srt.layers.layernorm import RMSNorm
from srt.layers.rotary_embedding import RotaryEmbedding


@pytest.fixture(scope="module")
def native():
    if not cpu_kernels.load(build_if_missing=True):
        pytest.skip(f"native CPU kernels unavailable: {cpu_kernels.kernel_status()}")
    return True


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("rows,d", [(1, 8), (3, 37), (33, 1536), (0, 16), (129, 100)])
def test_silu_and_mul_matches_reference(native, rows, d):
    wide = torch.randn(rows, 2 * d + 24, generator=_gen(rows + d)) * 6  # exp saturates both ways
    x = wide[:, 7 : 7 + 2 * d]  # strided rows, like a view of a fused output
    got = torch.ops.srt_cpu.silu_and_mul(x)
    want = F.silu(x[:, :d]) * x[:, d:]
    assert got.shape == (rows, d) and got.is_contiguous()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_silu_and_mul_extremes(native):
    """Gates far past exp's range on both sides (e^-g saturates to 0 or overflows)."""
    x = torch.tensor([[-1e4, -1000.0, -88.5, -20.0, 0.0, 30.0, 90.0, 1000.0, 1e4, 2.0] + [1.5] * 10])
    got = torch.ops.srt_cpu.silu_and_mul(x)
    want = F.silu(x[:, :10]) * x[:, 10:]
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows,h", [(1, 576), (5, 33), (64, 576), (0, 8)])
def test_add_rms_norm_matches_reference(native, rows, h):
    gen = _gen(h)
    x = torch.randn(rows, h + 3, generator=gen)[:, 1 : h + 1]
    residual = torch.randn(rows, h, generator=gen)
    weight = torch.randn(h, generator=gen)
    res_ref = residual.clone()
    want = elementwise.add_rms_norm_ref(x, res_ref, weight, 1e-5)
    got = torch.ops.srt_cpu.add_rms_norm_(x, residual, weight, 1e-5)
    torch.testing.assert_close(residual, res_ref, atol=1e-6, rtol=1e-6)  # residual updated in place
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 128), (2, 1, 6)])
def test_rotary_in_place_matches_reference(native, heads, kv_heads, head_dim):
    rope = RotaryEmbedding(head_dim, 4096, 10000.0)
    gen = _gen(heads * head_dim)
    T = 21
    qkv = torch.randn(T, (heads + 2 * kv_heads) * head_dim, generator=gen)
    positions = torch.randint(0, 4096, (T,), generator=gen)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q_ref, k_ref = q.clone(), k.clone()
    elementwise.rotary_neox_ref(q_ref, k_ref, positions, rope.cos_sin_cache, head_dim)
    before_v = qkv[:, (heads + kv_heads) * head_dim :].clone()
    torch.ops.srt_cpu.rotary_neox_(q, k, positions, rope.cos_sin_cache, head_dim)
    torch.testing.assert_close(q, q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], before_v)  # v untouched
    with pytest.raises(RuntimeError, match="position"):
        torch.ops.srt_cpu.rotary_neox_(q, k, torch.full((T,), 4096), rope.cos_sin_cache, head_dim)


def test_layers_native_and_fallback_agree(native, monkeypatch):
    """The layers give the same results through the native ops and through the pure-torch
    path that runs when the extension is unavailable."""
    gen = _gen(5)
    hidden, d = 48, 40
    norm = RMSNorm(hidden, 1e-6)
    norm.weight.data.copy_(torch.rand(hidden, generator=gen) + 0.5)
    rope = RotaryEmbedding(16, 512, 10000.0)
    x = torch.randn(7, hidden, generator=gen)
    res = torch.randn(7, hidden, generator=gen)
    gate_up = torch.randn(7, 2 * d, generator=gen)
    qk = torch.randn(7, 5 * 16, generator=gen)
    pos = torch.arange(7) * 11

    def run():
        r = res.clone()
        normed, r = norm.forward_with_residual(x, r)
        qk2 = qk.clone()
        q, k = rope(pos, qk2[:, :48], qk2[:, 48:])
        return normed, r, SiluAndMul()(gate_up), q.clone(), k.clone()

    native_out = run()
    monkeypatch.setattr(elementwise, "native_available", lambda: False)
    fallback_out = run()
    for a, b in zip(native_out, fallback_out):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


BF16_EPS = 2.0**-7  # bf16's machine epsilon: one ulp of x is at most this times |x|


def _assert_bf16_like_torch(got: torch.Tensor, want: torch.Tensor, ref64: torch.Tensor, rounds: int) -> None:
    """A bf16 op against torch's separate bf16 ops (``want``: the rounding points srt copies) and a
    float64 reference of the exact math (``ref64``). The native op computes in float32 where torch's
    vectorized kernels do too, so a float32 reassociation may flip a rounding: a few elements at
    most, by 2 bf16 ulps at most (a flipped rounding before a product), the rest bit for bit. Against float64, ``rounds`` roundings of half an
    ulp each (counted as whole ones), relative to the magnitudes involved."""
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    if got.numel() == 0:
        return
    g, w = got.double(), want.double()
    ulp = BF16_EPS * torch.maximum(w.abs(), g.abs())
    assert bool(((g - w).abs() <= 2 * ulp).all()), float(((g - w).abs() / ulp.clamp_min(1e-30)).max())
    assert float((got != want).float().mean()) <= 0.02, float((got != want).float().mean())
    tol = rounds * BF16_EPS * ref64.abs().clamp_min(1e-30) + 1e-6
    assert bool(((g - ref64).abs() <= tol).all()), float(((g - ref64).abs() / tol).max())


@pytest.mark.parametrize("rows,d", [(1, 8), (3, 37), (33, 1536), (0, 16)])
def test_bf16_silu_and_mul(native, rows, d):
    wide = (torch.randn(rows, 2 * d + 24, generator=_gen(rows + d)) * 4).bfloat16()
    x = wide[:, 7 : 7 + 2 * d]
    got = torch.ops.srt_cpu.silu_and_mul(x)
    want = F.silu(x[:, :d]) * x[:, d:]  # silu rounded, then the product: transformers' bf16 MLP
    g, u = x[:, :d].double(), x[:, d:].double()
    _assert_bf16_like_torch(got, want, g * torch.sigmoid(g) * u, rounds=3)
    assert elementwise.supports(x) and torch.equal(SiluAndMul()(x), got)


@pytest.mark.parametrize("rows,h", [(1, 576), (5, 33), (64, 1536), (0, 8)])
def test_bf16_add_rms_norm(native, rows, h):
    gen = _gen(h + 1)
    x = torch.randn(rows, h + 3, generator=gen).bfloat16()[:, 1 : h + 1]
    residual = torch.randn(rows, h, generator=gen).bfloat16()
    weight = (torch.rand(h, generator=gen) + 0.5).bfloat16()
    res_ref = residual.clone()
    want = elementwise.add_rms_norm_ref(x, res_ref, weight, 1e-5)
    s64 = residual.double() + x.double()
    ref64 = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
    got = torch.ops.srt_cpu.add_rms_norm_(x, residual, weight, 1e-5)
    assert torch.equal(residual, res_ref)  # the residual sum rounded once, as residual.add_(x)
    _assert_bf16_like_torch(got, want, ref64, rounds=4)
    norm = RMSNorm(h, 1e-5, dtype=torch.bfloat16)
    norm.weight.data.copy_(weight)
    r2 = res_ref.clone()
    normed, _ = norm.forward_with_residual(torch.zeros_like(x), r2)
    _assert_bf16_like_torch(normed, norm.forward(res_ref), ref64, rounds=4)  # the layer: native too


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 128), (2, 1, 6)])
def test_bf16_rotary_in_place(native, heads, kv_heads, head_dim):
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, dtype=torch.bfloat16)
    gen = _gen(heads * head_dim + 1)
    T = 21
    qkv = torch.randn(T, (heads + 2 * kv_heads) * head_dim, generator=gen).bfloat16()
    positions = torch.randint(0, 4096, (T,), generator=gen)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q_ref, k_ref = q.clone(), k.clone()
    elementwise.rotary_neox_ref(q_ref, k_ref, positions, rope.cos_sin_cache, head_dim)
    q64, k64 = q.double(), k.double()
    elementwise.rotary_neox_ref(q64, k64, positions, rope.cos_sin_cache.double(), head_dim)
    before_v = qkv[:, (heads + kv_heads) * head_dim :].clone()
    torch.ops.srt_cpu.rotary_neox_(q, k, positions, rope.cos_sin_cache, head_dim)
    # each product rounded, then the sum: bit for bit wherever the sum does not cancel
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    # against float64: 3 roundings of products of magnitude |x| (cancellation makes it absolute)
    for got, ref, x in ((q, q64, q_ref), (k, k64, k_ref)):
        assert bool(((got.double() - ref).abs() <= 3 * BF16_EPS * (x.double().abs().max() + 1)).all())
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], before_v)
    with pytest.raises(RuntimeError, match="of q's dtype"):
        torch.ops.srt_cpu.rotary_neox_(q, k, positions, rope.cos_sin_cache.half(), head_dim)


@pytest.mark.parametrize("heads,head_dim,rows", [(16, 80, 37), (2, 16, 5), (3, 6, 1)])
def test_bf16_rotary_with_a_float32_table_is_the_vision_rope(native, heads, head_dim, rows):
    """bf16 q, k and a float32 table: transformers' ``apply_rotary_pos_emb_vision`` (float32 math on
    the widened rows, rounded once), q and k strided views of a qkv output."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb_vision

    gen = _gen(heads + head_dim)
    freqs = torch.randn(rows, head_dim // 2, generator=gen) * 8
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    table = torch.cat((cos[:, : head_dim // 2], sin[:, : head_dim // 2]), dim=-1)
    qkv = (torch.randn(rows, 3 * heads * head_dim, generator=gen) * 3).bfloat16()
    q, k, v = qkv.split(heads * head_dim, dim=-1)
    want_q, want_k = apply_rotary_pos_emb_vision(
        q.view(rows, heads, head_dim), k.view(rows, heads, head_dim), cos, sin
    )
    q_ref, k_ref = q.clone(), k.clone()
    elementwise.rotary_neox_ref(q_ref, k_ref, torch.arange(rows), table, head_dim)
    assert torch.equal(q_ref.view_as(want_q), want_q) and torch.equal(k_ref.view_as(want_k), want_k)
    v_before = v.clone()
    elementwise.rotary_neox_(q, k, torch.arange(rows), table, head_dim)
    for got, want in ((q.view_as(want_q), want_q), (k.view_as(want_k), want_k)):
        # a fused multiply-add may flip a rounding: one ulp of the largest term at most, rarely
        g, w = got.double(), want.double()
        scale = q_ref.double().abs().max() * 2
        assert bool(((g - w).abs() <= BF16_EPS * torch.maximum(w.abs(), scale * 2**-9)).all())
        assert float((got != want).float().mean()) <= 0.02
    assert torch.equal(v, v_before)


@pytest.mark.parametrize("rows,n", [(1, 8), (3, 37), (33, 5120), (0, 16), (2, 0)])
def test_quick_gelu_matches_reference(native, rows, n):
    wide = torch.randn(rows, n + 9, generator=_gen(rows + n)) * 6
    x = wide[:, 4 : 4 + n]
    got = torch.ops.srt_cpu.quick_gelu(x)
    x64 = x.double()
    assert got.shape == (rows, n) and got.is_contiguous()
    torch.testing.assert_close(got.double(), x64 * torch.sigmoid(1.702 * x64), atol=1e-5, rtol=1e-5)
    ext = torch.tensor([[-1e4, -200.0, -52.0, -0.0, 0.0, 1e-30, 3.0, 60.0, 1e4, float("inf"), float("-inf")]])
    got = torch.ops.srt_cpu.quick_gelu(ext)
    want = elementwise.quick_gelu_ref(ext.double())
    assert torch.isfinite(got[:, :9]).all()
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-6, equal_nan=True)
    assert torch.isnan(torch.ops.srt_cpu.quick_gelu(torch.tensor([[float("nan")]]))).all()


@pytest.mark.parametrize("rows,n", [(1, 8), (3, 37), (33, 5120), (0, 16)])
def test_bf16_quick_gelu(native, rows, n):
    from transformers.activations import QuickGELUActivation

    x = (torch.randn(rows, n + 9, generator=_gen(rows * n + 1)) * 4).bfloat16()[:, 4 : 4 + n]
    got = torch.ops.srt_cpu.quick_gelu(x)
    want = QuickGELUActivation()(x)  # 1.702 x rounded, its sigmoid rounded, the product rounded
    # float64 from the rounded 1.702 x (its rounding, which sigmoid amplifies by |a| (1 - s), is
    # transformers' too): then the sigmoid's and the product's roundings
    ref64 = x.double() * torch.sigmoid((1.702 * x).double())
    _assert_bf16_like_torch(got, want, ref64, rounds=3)
    assert torch.equal(elementwise.quick_gelu(x), got)
    x3 = x.contiguous().view(rows, 1, n)
    assert torch.equal(elementwise.quick_gelu(x3), got.view(rows, 1, n))  # any leading dims


def test_bf16_and_float32_do_not_mix(native):
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="as the other inputs"):
        torch.ops.srt_cpu.add_rms_norm_(x, torch.randn(2, 8).bfloat16(), torch.ones(8), 1e-6)
    assert not elementwise.supports(x, x.bfloat16())
    assert not elementwise.supports(x.half())


@pytest.mark.parametrize("vocab,width", [(70, 3), (64, 2), (100, 2), (49152, 1536)])
def test_apply_token_bitmask_matches_reference(native, vocab, width):
    """Every kind of word (all allowed, none, mixed), rows in any order, a mask narrower than
    the vocabulary (the tokens past it are disallowed), strided logits rows."""
    from srt.constrained.bitmask import apply_bitmask_

    gen = _gen(vocab)
    wide = torch.randn(5, vocab + 9, generator=gen)
    mask = torch.randint(-(2**31), 2**31 - 1, (3, width), generator=gen, dtype=torch.int64).to(torch.int32)
    mask[0, 0] = -1
    mask[1, : width // 2] = 0
    rows = torch.tensor([4, 0, 2])
    got = wide[:, 3 : 3 + vocab].clone()
    want = got.clone()
    view = wide[:, 3 : 3 + vocab]  # strided rows: the op must write through the view
    torch.ops.srt_cpu.apply_token_bitmask_(view, rows, mask)
    apply_bitmask_(want, rows, mask)
    assert torch.equal(view, want)
    elementwise.apply_token_bitmask_(got, rows, mask)  # the dispatching wrapper
    assert torch.equal(got, want)


def test_apply_token_bitmask_rejects_bad_rows(native):
    with pytest.raises(RuntimeError, match="outside"):
        torch.ops.srt_cpu.apply_token_bitmask_(
            torch.zeros(2, 32), torch.tensor([2]), torch.zeros(1, 1, dtype=torch.int32)
        )

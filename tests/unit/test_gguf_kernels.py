"""GGUF quantized kernels (srt.kernels.cpu.gguf): bit-exact dequantization against gguf.quants,
quantized linear layers against the float32 matmul of the dequantized weight (every native path:
M = 1..4 in-register dots, 5..12 buffered rows, >= 13 the tile GEMM), the pure-numpy fallback,
and the error messages. The native tests skip when the extension is not built."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from srt.kernels.cpu import gguf
from tests.helpers.gguf_models import SCALE_FIELDS
from tests.helpers.gguf_models import random_code_blocks as random_blocks
from tests.helpers.threads import with_threads

NATIVE = gguf.native_qtypes()
SIMPLE = [2, 3, 8]  # Q4_0, Q4_1, Q8_0
# the K-quant kernels come with their own tests; here only once they are built
QTYPES = SIMPLE + ([12, 13, 14] if 12 in NATIVE else [])
needs_native = pytest.mark.skipif(not {2, 3, 8} <= NATIVE, reason="native gguf kernels not built")


# byte offsets of the fp16 scale fields in a block (the rest is random codes)
def cols_for(qtype: int) -> int:
    """A row length that spans several column chunks of the buffered and GEMM paths."""
    return 768 if gguf.block_info(qtype)[0] == 32 else 1024


def assert_close_to_matmul(
    out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """Within float32 summation error: |out - x w^T| <= 1e-5 * (|x| |w|^T) (+ bias rounding)."""
    ref = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    if bias is not None:
        ref = ref + bias.double()
        scale = scale + bias.double().abs()
    err = (out.double() - ref).abs()
    assert (err <= 1e-5 * scale + 1e-30).all(), (
        f"max relative error {(err / scale.clamp_min(1e-30)).max():.3g}"
    )


# ---------------------------------------------------------------- always (reference path)


def test_block_info_and_names():
    assert gguf.block_info(2) == (32, 18)
    assert gguf.block_info(3) == (32, 20)
    assert gguf.block_info(8) == (32, 34)
    assert gguf.block_info(12) == (256, 144)
    assert gguf.block_info(14) == (256, 210)
    assert gguf.QTYPE_NAMES[3] == "Q4_1"
    with pytest.raises(ValueError, match="unknown ggml quantization type"):
        gguf.block_info(999)


@pytest.mark.parametrize("qtype", [2, 3, 8, 12, 13, 14])
def test_reference_linear(qtype):
    k = cols_for(qtype)
    data = random_blocks(5, k, qtype)
    w = gguf.dequantize_ref(data, qtype, k)
    assert w.shape == (5, k) and w.dtype == torch.float32 and torch.isfinite(w).all()
    x = torch.randn(3, k)
    bias = torch.randn(5)
    torch.testing.assert_close(gguf.quant_linear_ref(x, data, qtype, bias), F.linear(x, w, bias))


def test_reference_errors():
    data = random_blocks(2, 64, 3)
    with pytest.raises(ValueError, match="not a multiple of 32"):
        gguf.dequantize_ref(data, 3, 48)
    with pytest.raises(ValueError, match="bytes"):
        gguf.dequantize_ref(data, 3, 128)
    with pytest.raises(ValueError, match="float32"):
        gguf.quant_linear_ref(torch.randn(1, 64, dtype=torch.float64), data, 3)


def test_fallback_matches_native_when_unavailable(monkeypatch):
    """Without native types the public functions take the numpy reference (same results)."""
    data = random_blocks(9, 256, 3)
    x = torch.randn(4, 256)
    native_out = gguf.quant_linear(x, data, 3)
    native_w = gguf.dequantize(data, 3, 256)
    monkeypatch.setattr(gguf, "native_qtypes", lambda: frozenset())
    w = gguf.dequantize(data, 3, 256)
    assert torch.equal(w, gguf.dequantize_ref(data, 3, 256))
    assert torch.equal(w, native_w)
    out = gguf.quant_linear(x, data, 3)
    torch.testing.assert_close(out, native_out, rtol=1e-5, atol=1e-5)
    assert_close_to_matmul(out, x, w, None)


# ---------------------------------------------------------------- native


@needs_native
def test_native_qtypes():
    assert {2, 3, 8} <= NATIVE
    assert NATIVE == frozenset(torch.ops.srt_cpu.gguf_qtypes())


@needs_native
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_dequantize_bit_exact(qtype, rows):
    k = cols_for(qtype)
    data = random_blocks(rows, k, qtype, seed=rows)
    got = torch.ops.srt_cpu.gguf_dequantize(data, qtype, k)
    ref = gguf.dequantize_ref(data, qtype, k)
    assert got.shape == (rows, k) and got.dtype == torch.float32
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))


@needs_native
@pytest.mark.parametrize("qtype", SIMPLE)
def test_dequantize_bit_exact_any_finite_scale(qtype):
    """Scales of any finite fp16 value (subnormal to 65504, both signs): the products round as in
    numpy (no fused multiply-add)."""
    k, rows = 256, 64
    data = random_blocks(rows, k, qtype).numpy().copy()
    bs, ts = gguf.block_info(qtype)
    blocks = data.reshape(rows, k // bs, ts)
    rng = np.random.default_rng(1)
    for off in SCALE_FIELDS[qtype]:
        bits = rng.integers(0, 0x7C00, size=blocks.shape[:2], dtype=np.uint16)  # finite magnitudes
        bits |= rng.integers(0, 2, size=bits.shape, dtype=np.uint16) << 15
        blocks[:, :, off : off + 2] = bits[..., None].view(np.uint8)
    data = torch.from_numpy(data)
    ref = gguf.dequantize_ref(data, qtype, k)
    got = torch.ops.srt_cpu.gguf_dequantize(data, qtype, k)
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))


@needs_native
@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_row_sets(qtype):
    """One row [bpr] -> [cols]; rows picked by index_select (the embedding lookup)."""
    k = cols_for(qtype)
    data = random_blocks(11, k, qtype)
    ref = gguf.dequantize_ref(data, qtype, k)
    assert torch.equal(gguf.dequantize(data[3], qtype, k), ref[3])
    ids = torch.tensor([5, 0, 5, 10])
    assert torch.equal(gguf.dequantize(data.index_select(0, ids), qtype, k), ref[ids])


@needs_native
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("m", [1, 4, 7, 12, 16, 20, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_dequantized_matmul(qtype, m, with_bias):
    k = cols_for(qtype)
    n = 67  # not a multiple of any tile
    data = random_blocks(n, k, qtype, seed=m)
    w = gguf.dequantize_ref(data, qtype, k)
    x = torch.randn(m, k)
    bias = torch.randn(n) if with_bias else None
    out = torch.ops.srt_cpu.gguf_linear(x, data, qtype, bias)
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert_close_to_matmul(out, x, w, bias)


@needs_native
@pytest.mark.parametrize("m", [1, 7, 64])
def test_linear_strided_rows_and_batch_dims(m):
    """x rows with a stride (a slice of a wider tensor) give the same bits as contiguous rows;
    quant_linear takes [..., K]."""
    k, n = 576, 45
    data = random_blocks(n, k, 3)
    wide = torch.randn(m, k + 40)
    x = wide[:, 8 : 8 + k]
    assert x.stride(0) == k + 40
    out = torch.ops.srt_cpu.gguf_linear(x, data, 3, None)
    assert torch.equal(out, torch.ops.srt_cpu.gguf_linear(x.contiguous(), data, 3, None))
    x3 = x.contiguous().reshape(1, m, k)
    assert torch.equal(gguf.quant_linear(x3, data, 3), out.reshape(1, m, n))
    xt = x.contiguous().T.contiguous().T  # column-major: the wrapper copies it
    assert torch.equal(gguf.quant_linear(xt, data, 3), out)


@needs_native
@pytest.mark.parametrize("qtype", SIMPLE)
@pytest.mark.parametrize("m", [1, 7, 64])
def test_linear_independent_of_thread_count(qtype, m):
    k = 768
    data = random_blocks(301, k, qtype)
    x = torch.randn(m, k)
    one, two = with_threads(lambda: torch.ops.srt_cpu.gguf_linear(x, data, qtype, None))
    assert torch.equal(one, two)


@needs_native
def test_linear_empty():
    data = random_blocks(5, 64, 8)
    assert torch.ops.srt_cpu.gguf_linear(torch.randn(0, 64), data, 8, None).shape == (0, 5)


@needs_native
def test_native_errors():
    data = random_blocks(4, 64, 3)
    x = torch.randn(2, 64)
    op = torch.ops.srt_cpu.gguf_linear
    with pytest.raises(RuntimeError, match="x must be a float32"):
        op(x.double(), data, 3, None)
    with pytest.raises(RuntimeError, match="data must be a uint8"):
        op(x, data.to(torch.int8), 3, None)
    with pytest.raises(RuntimeError, match="take 20 bytes, data rows have 40"):
        op(torch.randn(2, 32), data, 3, None)  # K = 32 needs 20-byte rows
    with pytest.raises(RuntimeError, match="multiple of the block size"):
        op(torch.randn(2, 48), data, 3, None)
    with pytest.raises(RuntimeError, match="has no native kernel"):
        op(x, data, 6, None)  # Q5_0
    with pytest.raises(RuntimeError, match="bias must be"):
        op(x, data, 3, torch.randn(3))
    with pytest.raises(RuntimeError, match="last dim must be contiguous"):
        op(torch.randn(64, 2).T, data, 3, None)
    with pytest.raises(RuntimeError, match="has no native kernel"):
        torch.ops.srt_cpu.gguf_dequantize(data, 99, 64)
    with pytest.raises(RuntimeError, match="must be contiguous"):
        torch.ops.srt_cpu.gguf_dequantize(random_blocks(4, 128, 3)[:, :40], 3, 64)
    with pytest.raises(ValueError, match="unknown ggml quantization type"):
        gguf.quant_linear(x, data, 999)


# ---------------------------------------------------------------- the x8 layout (gguf_x8.h)
needs_x8 = pytest.mark.skipif(set(SIMPLE) - gguf.x8_qtypes(), reason="x8 ops not built")


@needs_x8
@pytest.mark.parametrize("qtype", SIMPLE)
@pytest.mark.parametrize("n", [1, 8, 13, 67])
def test_x8_pack_matches_reference_and_unpacks(qtype, n):
    k = 96
    data = random_blocks(n, k, qtype, seed=n)
    packed = gguf.pack_x8(data, qtype)
    assert packed.shape == ((n + 7) // 8, 8 * data.shape[1])
    assert torch.equal(packed, gguf.pack_x8_ref(data, qtype))
    assert torch.equal(gguf.unpack_x8(packed, qtype, n, k), data)
    ids = torch.tensor([n - 1, 0, n // 2, n - 1])
    assert torch.equal(gguf.unpack_x8(packed, qtype, n, k, ids), data[ids])
    # same bytes as the file's, but for the zero rows padding the last group
    assert packed.numel() - data.numel() == ((n + 7) // 8 * 8 - n) * data.shape[1]


@needs_native
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("n", [1, 7, 8, 23, 24, 25, 49, 67])
@pytest.mark.parametrize("nr", [0, 24, 48])
def test_float32_panels_equal_the_packed_dequantized_weight(qtype, n, nr):
    """The one-pass panels (the float32 copies of GGUF weights) equal pack_linear_weight of the
    dequantized rows, bit for bit, from the rows and from their x8 groups, at every tail of rows."""
    k = cols_for(qtype)
    data = random_blocks(n, k, qtype, seed=n)
    want = torch.ops.srt_cpu.pack_linear_weight(gguf.dequantize(data, qtype, k), nr)
    got = torch.ops.srt_cpu.gguf_float32_panels(data, qtype, n, k, False, nr)
    assert got.shape == want.shape and torch.equal(got, want)
    if nr == 0:
        assert torch.equal(gguf.float32_panels(data, qtype, n, k, False), want)
    if qtype in gguf.x8_qtypes():
        packed = gguf.pack_x8(data, qtype)
        assert torch.equal(torch.ops.srt_cpu.gguf_float32_panels(packed, qtype, n, k, True, nr), want)


@needs_native
def test_float32_panels_refuse_what_does_not_fit():
    data = random_blocks(9, 64, 3)
    with pytest.raises(RuntimeError, match="expected 8 rows"):
        torch.ops.srt_cpu.gguf_float32_panels(data, 3, 8, 64, False, 0)
    with pytest.raises(RuntimeError, match="panel width must be 24 or 48"):
        torch.ops.srt_cpu.gguf_float32_panels(data, 3, 9, 64, False, 16)
    with pytest.raises(RuntimeError, match="pack into"):
        torch.ops.srt_cpu.gguf_float32_panels(data, 3, 9, 64, True, 0)  # rows, not x8 groups
    with pytest.raises(RuntimeError, match="rows of 96 weights take"):
        torch.ops.srt_cpu.gguf_float32_panels(data, 3, 9, 96, False, 0)


def test_x8_reference_layout():
    """The documented layout, spelled out for one Q4_1 block: fields side by side, codes interleaved."""
    data = torch.arange(2 * 20, dtype=torch.uint8).view(2, 20)  # rows 0, 1: d, m, 16 code bytes
    rec = gguf.pack_x8_ref(data, 3)[0]
    assert rec.numel() == 160
    assert rec[0:4].tolist() == [0, 1, 20, 21] and rec[4:16].eq(0).all()  # d of rows 0, 1
    assert rec[16:20].tolist() == [2, 3, 22, 23]  # m of rows 0, 1
    assert rec[32:34].tolist() == [4, 24] and rec[40:42].tolist() == [5, 25]  # code byte j at 32 + 8 j + r


@needs_x8
@pytest.mark.parametrize("qtype", SIMPLE)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 12, 13, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_x8_linear_matches_dequantized_matmul(qtype, m, with_bias):
    k, n = cols_for(qtype), 67
    data = random_blocks(n, k, qtype, seed=m + 100)
    packed = gguf.pack_x8(data, qtype)
    w = gguf.dequantize_ref(data, qtype, k)
    x = torch.randn(m, k)
    bias = torch.randn(n) if with_bias else None
    out = gguf.quant_linear_x8(x, packed, qtype, n, bias)
    assert out.shape == (m, n)
    assert_close_to_matmul(out, x, w, bias)
    if m >= 13:  # both GEMMs: the same dequantized weights, each sum in k order: the same bits
        assert torch.equal(out, torch.ops.srt_cpu.gguf_linear(x, data, qtype, bias))


@needs_x8
@pytest.mark.parametrize("qtype", SIMPLE)
@pytest.mark.parametrize("m", [1, 3, 7, 64])
def test_x8_linear_independent_of_thread_count(qtype, m):
    k, n = 768, 301
    packed = gguf.pack_x8(random_blocks(n, k, qtype), qtype)
    x = torch.randn(m, k)
    one, two = with_threads(lambda: gguf.quant_linear_x8(x, packed, qtype, n))
    assert torch.equal(one, two)


@needs_x8
@pytest.mark.parametrize("qtype", SIMPLE)
def test_x8_gives_the_same_bits_on_every_isa(qtype, tmp_path):
    """Where the CPU has AVX-512, decode rows (M < 13) take two x8 groups per vector and the GEMM
    (M >= 13) 12-row tiles of 16 lanes; per lane the operations are those of the AVX2 code, so
    SRT_CPU_ISA=avx2 gives the same bits (an odd group count exercises the single-group tail,
    M = 40 and 300 a short last tile). Where the 24-bit path takes the decode rows (Q4_0, Q4_1 with
    VNNI and VBMI; tests of its own in test_gguf_x8_a24_kernels.py), the AVX-512 side runs in a child
    with that path off, so the float32 lanes it replaces stay covered."""
    from tests.helpers.isa import isa_available, ops_under_isa, skip_reason

    if not isa_available("avx512"):
        pytest.skip(skip_reason("avx512"))
    k, n = cols_for(qtype), 8 * 9 + 3
    packed = gguf.pack_x8(random_blocks(n, k, qtype, seed=qtype), qtype)
    ms = (1, 3, 5, 6, 7, 9, 12, 13, 40, 300)
    xs = [torch.randn(m, k, generator=torch.Generator().manual_seed(m)) for m in ms]
    calls = [[x, packed, qtype, n] for x in xs]
    there = ops_under_isa("avx2", "gguf_linear_x8", calls, tmp_path)
    if qtype in gguf.x8_a24_qtypes():
        here = ops_under_isa("avx512", "gguf_linear_x8", calls, tmp_path, env={"SRT_GGUF_X8_A24_M": "0"})
    else:
        here = [gguf.quant_linear_x8(x, packed, qtype, n) for x in xs]
    for m, ours, avx2 in zip(ms, here, there):
        assert torch.equal(ours, avx2), m


@needs_x8
def test_x8_errors():
    data = random_blocks(9, 64, 3)
    packed = gguf.pack_x8(data, 3)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="no x8 layout"):
        torch.ops.srt_cpu.gguf_pack_x8(random_blocks(4, 256, 12), 12)
    with pytest.raises(RuntimeError, match=r"17 rows of 64 weights pack into \[3, 320\], got \[2, 320\]"):
        gguf.quant_linear_x8(x, packed, 3, 17)
    with pytest.raises(RuntimeError, match="outside"):
        gguf.unpack_x8(packed, 3, 9, 64, torch.tensor([9]))
    with pytest.raises(RuntimeError, match="bias must be"):
        gguf.quant_linear_x8(x, packed, 3, 9, torch.randn(8))

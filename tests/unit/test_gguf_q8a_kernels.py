"""GGUF matmuls on int8-quantized activations (srt.kernels.cpu.gguf quant_linear_q8a; native op
gguf_linear_q8a, row functions gguf_q8act_rows.h).

The activation quantization must equal ``quantize_activations_ref`` bit for bit (scalar and AVX2
functions); the op must equal the float64 reference formula ``quant_linear_q8a_ref`` within
float32 summation error relative to the sum of the terms' magnitudes, whatever the thread count
and instruction set; on activations that lie on the int8 grid it must reproduce the float32
``gguf_linear`` (the formulas against gguf.quants' dequantization); on Gaussian activations it
must differ from it by the expected rounding error of the activations and no more. The native
tests skip when the extension is not built."""

from __future__ import annotations

import pytest
import torch

from srt.kernels.cpu import _op_registered, gguf
from tests.helpers.gguf_models import random_code_blocks
from tests.helpers.isa import cpu_isa
from tests.helpers.threads import with_threads

QTYPES = [3, 8, 2, 12, 14, 13]  # Q4_1, Q8_0, Q4_0 (the default model's), Q4_K, Q6_K, Q5_K
NATIVE_Q8A = gguf.q8a_qtypes()
needs_native = pytest.mark.skipif(
    not (_op_registered("gguf_linear_q8a") and NATIVE_Q8A), reason="native gguf_linear_q8a not built"
)


def cols(qtype: int, blocks: int) -> int:
    return blocks * gguf.block_info(qtype)[0]


def activations(m: int, k: int, seed: int) -> torch.Tensor:
    """Gaussian rows with some special blocks: all zero, tiny (d rounds to 0), huge, and one of
    exact halves (round half to even)."""
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[0, :32] = 0.0
    if k >= 128:
        x[-1, 32:64] = 1e-44  # subnormal: d = amax / 127 is 0
        x[-1, 64:96] *= 3e4
        # amax 127 -> d = 1: the codes of +-2.5 are +-2 (half to even)
        signs = (torch.arange(32, dtype=torch.float32) - 15.5).sign()
        x[-1, 96:128] = torch.cat([torch.tensor([127.0]), torch.full((31,), 2.5)]) * signs
    return x


def assert_close_to_terms(
    y: torch.Tensor, x: torch.Tensor, data: torch.Tensor, qtype: int, bias=None
) -> None:
    """|y - reference| <= 1e-5 * (sum of the terms' magnitudes) (+ the bias's rounding)."""
    ref = gguf._q8a_dot64(x, data, qtype)
    mag = gguf._q8a_dot64(x, data, qtype, absolute=True)
    if bias is not None:
        ref = ref + bias.double()
        mag = mag + bias.double().abs()
    err = (y.double() - ref).abs()
    assert bool((err <= 1e-5 * mag + 1e-30).all()), (
        f"max relative error {(err / mag.clamp_min(1e-30)).max():.3g}"
    )


# ---------------------------------------------------------------- reference (always)


def test_quantize_activations_ref_format():
    x = torch.zeros(2, 64)
    x[0, :32] = torch.linspace(-3, 5, 32)
    x[1, 32:] = torch.tensor([127.0] + [2.5, -2.5, 3.5, -3.5, 0.5, -0.5, 1.5] * 4 + [0.0, 0.0, 0.0])
    q, d, s = gguf.quantize_activations_ref(x)
    assert q.dtype == torch.int8 and q.shape == (2, 64) and d.shape == s.shape == (2, 2)
    assert d[0, 0] == torch.tensor(5.0) / 127 and d[0, 1] == 0 and d[1, 0] == 0 and d[1, 1] == 1.0
    assert int(q[0, :32].max()) == 127 and (q[0, 32:] == 0).all() and (q[1, :32] == 0).all()
    # d = 1: the codes are x rounded half to even
    assert q[1, 32:40].tolist() == [127, 2, -2, 4, -4, 0, 0, 2]
    torch.testing.assert_close(s.double(), x.double().reshape(2, 2, 32).sum(-1), rtol=1e-6, atol=1e-6)
    assert (q.abs() <= 127).all()


@pytest.mark.parametrize("qtype", QTYPES)
def test_reference_lossless_on_the_int8_grid(qtype):
    """x = integer codes (each block reaching +-127) times a power of two quantizes exactly (s
    exact too), so the int8 formula must give the float matmul of gguf.quants' weights."""
    k = cols(qtype, 2 if qtype >= 12 else 6)
    gen = torch.Generator().manual_seed(qtype)
    codes = torch.randint(-127, 128, (5, k), generator=gen).float()
    codes[:, ::32] = 127.0
    x = codes * 2.0**-7
    q, d, _ = gguf.quantize_activations_ref(x)
    assert torch.equal(q.float(), codes) and (d == 2.0**-7).all()
    data = random_code_blocks(6, k, qtype, seed=1)
    w = gguf.dequantize_ref(data, qtype, k)
    y = gguf.quant_linear_q8a_ref(x, data, qtype)
    scale = x.abs().double() @ w.abs().double().T
    assert bool(((y.double() - x.double() @ w.double().T).abs() <= 1e-6 * scale).all())


def test_reference_errors_and_fallback(monkeypatch):
    with pytest.raises(ValueError, match="float32"):
        gguf.quant_linear_q8a_ref(torch.randn(1, 64, dtype=torch.float64), random_code_blocks(2, 64, 3), 3)
    with pytest.raises(ValueError, match="not a multiple of 32"):
        gguf.quant_linear_q8a_ref(torch.randn(1, 48), random_code_blocks(2, 64, 3), 3)
    with pytest.raises(ValueError, match="float32"):
        gguf.quantize_activations_ref(torch.randn(2, 40))
    # without native kernels the public function is the reference
    monkeypatch.setattr(gguf, "native_qtypes", lambda: frozenset())
    data = random_code_blocks(3, 64, 3)
    x = torch.randn(2, 2, 64)
    assert torch.equal(gguf.quant_linear_q8a(x, data, 3), gguf.quant_linear_q8a_ref(x, data, 3))
    assert gguf.quant_linear_q8a(x, data, 3).shape == (2, 2, 3)


# ---------------------------------------------------------------- native


@needs_native
def test_q8a_qtypes():
    assert NATIVE_Q8A == frozenset(QTYPES)
    assert NATIVE_Q8A == frozenset(torch.ops.srt_cpu.gguf_q8a_qtypes())


@needs_native
@pytest.mark.parametrize("qtype", QTYPES)
def test_quantization_bit_exact_each_isa(qtype):
    k = cols(qtype, 3 if qtype >= 12 else 9)
    x = activations(7, k, seed=qtype)
    q_ref, d_ref, s_ref = gguf.quantize_activations_ref(x)
    data = random_code_blocks(5, k, qtype)
    for scalar in (True, False):
        q, d, s, _ = torch.ops.srt_cpu.gguf_q8a_debug(x, data, qtype, scalar)
        assert torch.equal(q, q_ref)
        assert torch.equal(d.view(torch.int32), d_ref.view(torch.int32))
        assert torch.equal(s.view(torch.int32), s_ref.view(torch.int32))


@needs_native
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("m", [1, 3, 6, 7, 64])
def test_matches_reference_each_isa(qtype, m):
    """The op (this CPU's functions) and both ISAs' row functions against the float64 formula;
    N = 37 leaves a tail of single weight rows; M = 1, 3, 6, 7 leave every tail of activation
    rows the tiles take (2 or 4 at a time)."""
    blocks = {1: (3, 18), 3: (1, 2), 6: (2, 12), 7: (6, 48), 64: (2, 9)}[m]  # (K-quants, simple types)
    k = cols(qtype, blocks[0] if qtype >= 12 else blocks[1])
    data = random_code_blocks(37, k, qtype, seed=m)
    x = activations(m, k, seed=m)
    y = torch.ops.srt_cpu.gguf_linear_q8a(x, data, qtype)
    assert y.shape == (m, 37) and y.dtype == torch.float32
    assert_close_to_terms(y, x, data, qtype)
    _, _, _, y_scalar = torch.ops.srt_cpu.gguf_q8a_debug(x, data, qtype, True)
    _, _, _, y_vec = torch.ops.srt_cpu.gguf_q8a_debug(x, data, qtype, False)
    assert_close_to_terms(y_scalar, x, data, qtype)
    assert_close_to_terms(y_vec, x, data, qtype)
    # the op runs the row functions of the ISA the ops run (the scalar ones under SRT_CPU_ISA=scalar)
    assert torch.equal(y, y_scalar if cpu_isa() == "scalar" else y_vec)


@needs_native
@pytest.mark.parametrize("qtype", QTYPES)
def test_bias_strided_rows_and_batch_dims(qtype):
    k = cols(qtype, 2 if qtype >= 12 else 12)
    data = random_code_blocks(9, k, qtype)
    bias = torch.randn(9)
    wide = activations(5, k + 40, seed=2)
    x = wide[:, 8 : 8 + k]
    y = torch.ops.srt_cpu.gguf_linear_q8a(x, data, qtype, bias)
    assert_close_to_terms(y, x, data, qtype, bias)
    assert torch.equal(y, torch.ops.srt_cpu.gguf_linear_q8a(x.contiguous(), data, qtype, bias))
    assert torch.equal(y, torch.ops.srt_cpu.gguf_linear_q8a(x, data, qtype) + bias)
    x3 = x.contiguous().reshape(1, 5, k)
    assert torch.equal(gguf.quant_linear_q8a(x3, data, qtype, bias), y.reshape(1, 5, 9))


@needs_native
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("m", [1, 7])
def test_independent_of_thread_count(qtype, m):
    k = cols(qtype, 3 if qtype >= 12 else 24)
    data = random_code_blocks(301, k, qtype)
    x = torch.randn(m, k)
    one, two = with_threads(lambda: torch.ops.srt_cpu.gguf_linear_q8a(x, data, qtype))
    assert torch.equal(one, two)


@needs_native
@pytest.mark.parametrize("qtype", QTYPES)
def test_zero_activations(qtype):
    k = cols(qtype, 2 if qtype >= 12 else 4)
    data = random_code_blocks(6, k, qtype)
    bias = torch.randn(6)
    assert torch.equal(
        torch.ops.srt_cpu.gguf_linear_q8a(torch.zeros(3, k), data, qtype, bias), bias.expand(3, 6)
    )


@needs_native
@pytest.mark.parametrize("qtype", QTYPES)
def test_lossless_on_the_int8_grid_matches_float_path(qtype):
    """Activations on the int8 grid: the int8 op equals the float32 gguf_linear (float32
    summation error), an end-to-end check of the formulas against gguf.quants' weights."""
    k = cols(qtype, 4 if qtype >= 12 else 24)
    gen = torch.Generator().manual_seed(qtype)
    codes = torch.randint(-127, 128, (6, k), generator=gen).float()
    codes[:, 5::32] = -127.0
    x = codes * 2.0**-9
    data = random_code_blocks(41, k, qtype, seed=2)
    w = gguf.dequantize_ref(data, qtype, k)
    y8 = torch.ops.srt_cpu.gguf_linear_q8a(x, data, qtype)
    yf = torch.ops.srt_cpu.gguf_linear(x, data, qtype)
    scale = x.abs().double() @ w.abs().double().T
    assert bool(((y8.double() - yf.double()).abs() <= 2e-5 * scale).all())


@needs_native
@pytest.mark.parametrize("qtype", QTYPES)
def test_quantization_error_against_float_path(qtype):
    """Gaussian activations: the int8 result differs from the float32 one by the activations'
    rounding e = x - d q (|e| <= d / 2, d = max|block| / 127): exactly sum_j v_j e_j, v the part
    of the weight that multiplies the codes (w minus the block minimum, which takes the exact s).
    Relative to the output (Frobenius) that is about 2.07 / (127 sqrt 12) = 4.7e-3 (2.07: the
    expected maximum of 32 Gaussians); per output within 6 standard deviations sqrt(sum_j v_j^2
    e_j^2). A scale 1/127 off would give about 9e-3, the float path itself (no quantization) 0."""
    k = cols(qtype, 4 if qtype >= 12 else 18)
    data = random_code_blocks(64, k, qtype, seed=5)
    w = gguf.dequantize_ref(data, qtype, k).double()
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(7))
    y8 = torch.ops.srt_cpu.gguf_linear_q8a(x, data, qtype).double()
    yf = torch.ops.srt_cpu.gguf_linear(x, data, qtype).double()
    rel = float((y8 - yf).norm() / yf.norm())
    assert 3e-3 < rel < 8e-3, rel
    q, d, _ = gguf.quantize_activations_ref(x)
    e = x.double() - (q.double().reshape(16, -1, 32) * d.double()[..., None]).reshape(16, k)
    codes, scales, _ = gguf._codes_and_scales(data, qtype, k)
    v = (
        torch.from_numpy(codes).double().reshape(64, scales.shape[1], -1)
        * torch.from_numpy(scales).double()[..., None]
    )
    sigma = ((e**2) @ (v.reshape(64, k) ** 2).T).sqrt()
    float_error = 2e-5 * (x.double().abs() @ w.abs().T)
    assert bool(((y8 - yf).abs() <= 6 * sigma + float_error).all())


@needs_native
def test_empty_and_errors():
    data = random_code_blocks(4, 64, 3)
    op = torch.ops.srt_cpu.gguf_linear_q8a
    assert op(torch.randn(0, 64), data, 3).shape == (0, 4)
    assert op(torch.randn(2, 64), data[:0], 3).shape == (2, 0)
    with pytest.raises(RuntimeError, match="x must be a float32"):
        op(torch.randn(2, 64, dtype=torch.float64), data, 3)
    with pytest.raises(RuntimeError, match="take 20 bytes, data rows have 40"):
        op(torch.randn(2, 32), data, 3)
    with pytest.raises(RuntimeError, match="multiple of the block size"):
        op(torch.randn(2, 48), data, 3)
    with pytest.raises(RuntimeError, match="bias must be"):
        op(torch.randn(2, 64), data, 3, torch.randn(3))
    with pytest.raises(RuntimeError, match="last dim must be contiguous"):
        op(torch.randn(64, 2).T, data, 3)
    # a type without an int8 path goes to gguf_linear (which has no Q5_0 kernel either)
    with pytest.raises(RuntimeError, match="gguf_linear: ggml type 6 has no native kernel"):
        op(torch.randn(2, 64), data, 6)


@needs_native
def test_wrapper_uses_native():
    data = random_code_blocks(7, 96, 3)
    x = torch.randn(2, 96)
    assert torch.equal(gguf.quant_linear_q8a(x, data, 3), torch.ops.srt_cpu.gguf_linear_q8a(x, data, 3))
    assert torch.equal(gguf.quant_linear_q8a(x.T.contiguous().T, data, 3), gguf.quant_linear_q8a(x, data, 3))


@needs_native
@pytest.mark.parametrize("qtype", QTYPES)
def test_which_matmuls_take_int8_and_the_gemm_path(qtype):
    """``q8a_takes`` (one rule for the Python layers, the decode stack and the experts): nothing
    without int8 activations, up to int8_max_rows rows always, more only for a type with an int8
    GEMM faster than the float32 one (on AVX-512 VNNI CPUs Q4_K from 16 rows, Q6_K from 128). The
    GEMM keeps the op's contract at row counts that leave tails of weight rows (N = 37) and of
    activation rows."""
    rows = gguf.q8a_gemm_rows(qtype)
    assert rows in ((0, 128) if qtype == 14 else (0, 16))
    if cpu_isa() != "avx512" or qtype not in (12, 14):
        assert rows == 0
    if rows:
        assert gguf.q8a_takes(qtype, rows, 8) and not gguf.q8a_takes(qtype, rows - 1, 8)
    assert not gguf.q8a_takes(qtype, 1, 0)
    assert gguf.q8a_takes(qtype, 8, 8)
    assert gguf.q8a_takes(qtype, 15, 8) is False
    assert gguf.q8a_takes(qtype, 200, 8) == (rows > 0)
    k = cols(qtype, 3 if qtype >= 12 else 24)
    data = random_code_blocks(37, k, qtype, seed=11)
    x = activations(21, k, seed=11)
    y = torch.ops.srt_cpu.gguf_linear_q8a(x, data, qtype)
    assert_close_to_terms(y, x, data, qtype)
    rows_alone = torch.cat([torch.ops.srt_cpu.gguf_linear_q8a(x[i : i + 1], data, qtype) for i in range(21)])
    assert_close_to_terms(rows_alone, x, data, qtype)

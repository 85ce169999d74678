"""gguf_linear's register tiles (QuantRowOps::dot_tile, srt/kernels/cpu/gguf_kquant_rows.h): on
AVX-512 CPUs the path for Q4_K and Q6_K from 3 rows (2 without AVX-512 VNNI) up to the GEMM's 28.

Each weight is dequantized in registers (Q4_K: a lookup in its sub-block's table of the 16 values
(d sc) q - (dmin m); Q6_K: (d sc) (q - 32)) and multiplied with float32 activations, 16 lanes
accumulating over the whole row. So every output must equal the float64 product of the
dequantized weights within float32 summation error, and every row's sums must not depend on the
other rows of the call (x is packed in groups of up to 8 rows, the weights in tiles of 3 rows: a
wrong table, nibble or group offset would break one or the other). Skipped where the CPU (or
SRT_CPU_ISA) is below AVX-512."""

from __future__ import annotations

import pytest
import torch

from srt.kernels.cpu import gguf
from tests.helpers.gguf_models import random_code_blocks
from tests.helpers.isa import cpu_isa
from tests.helpers.threads import with_threads

QTYPES = [12, 14]  # Q4_K, Q6_K
FIRST = 3 if gguf.a24_qtypes() else 2  # below: gguf_linear_a24 (AVX-512 VNNI) or dot_rows
GEMM = 28  # from here on the dequantized-tile GEMM
needs_tiles = pytest.mark.skipif(cpu_isa() != "avx512", reason="the register tiles need the AVX-512 kernels")
linear = torch.ops.srt_cpu.gguf_linear if cpu_isa() is not None else None


def check_float32_error(y: torch.Tensor, x: torch.Tensor, data: torch.Tensor, qtype: int, bias=None) -> None:
    k = x.shape[1]
    w = gguf.dequantize_ref(data, qtype, k).double()
    ref = x.double() @ w.T
    bound = x.double().abs() @ w.abs().T
    if bias is not None:
        ref = ref + bias.double()
        bound = bound + bias.double().abs()
    err = (y.double() - ref).abs()
    # k / 16 float32 additions per lane, then the lanes' reduction and the bias; a misread code or
    # scale is off by a sizeable fraction of the bound
    tol = 2.0**-24 * (k / 16 + 8)
    assert bool((err <= tol * bound + 1e-30).all()), f"max error / bound {(err / bound).max():.3g}"


@needs_tiles
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("m", [FIRST, 5, 8, 9, 12, 17, GEMM - 1])
def test_within_float32_error_of_float64(qtype, m):
    k = 1280
    data = random_code_blocks(25, k, qtype, seed=m)  # 25 rows: tiles of 3 and a last one of 1
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    x[:, 7] *= 40.0  # an outlier column
    check_float32_error(linear(x, data, qtype), x, data, qtype)


@needs_tiles
@pytest.mark.parametrize("qtype", QTYPES)
def test_rows_independent_of_the_batch_and_the_threads(qtype):
    """Row i of a call of m rows equals row i of a call of GEMM - 1 rows, for every m the tiles
    take: the same bits whatever the groups of x (8 + 8 + 5 ... or 5 alone), the tile widths and
    the thread count."""
    k = 512
    data = random_code_blocks(301, k, qtype, seed=2)  # enough rows for both threads
    x = torch.randn(GEMM - 1, k, generator=torch.Generator().manual_seed(3))
    full = linear(x, data, qtype)
    check_float32_error(full, x, data, qtype)
    for m in range(FIRST, GEMM - 1):
        assert torch.equal(linear(x[:m], data, qtype), full[:m]), m
    for y in with_threads(lambda: linear(x[:11], data, qtype)):
        assert torch.equal(y, full[:11])
    # past the limit the GEMM: the same sums within rounding
    x28 = torch.cat([x, x[:1]])
    y28 = linear(x28, data, qtype)
    check_float32_error(y28, x28, data, qtype)


@needs_tiles
@pytest.mark.parametrize("qtype", QTYPES)
def test_bias_and_strided_rows(qtype):
    k = 768
    data = random_code_blocks(13, k, qtype, seed=5)
    bias = torch.randn(13)
    wide = torch.randn(6, k + 40, generator=torch.Generator().manual_seed(6))
    x = wide[:, 8 : 8 + k]
    y = linear(x, data, qtype, bias)
    check_float32_error(y, x, data, qtype, bias)
    assert torch.equal(y, linear(x.contiguous(), data, qtype, bias))
    assert torch.equal(y, linear(x, data, qtype) + bias)


@needs_tiles
@pytest.mark.parametrize("qtype", QTYPES)
def test_zeros_and_non_finite_rows(qtype):
    k = 512
    data = random_code_blocks(9, k, qtype, seed=8)
    bias = torch.randn(9)
    assert torch.equal(linear(torch.zeros(4, k), data, qtype, bias), bias.expand(4, 9))
    x = torch.randn(5, k)
    x[1, 300] = float("nan")
    y = linear(x, data, qtype)
    assert bool(y[1].isnan().all())
    keep = torch.tensor([0, 2, 3, 4])
    check_float32_error(y[keep], x[keep], data, qtype)

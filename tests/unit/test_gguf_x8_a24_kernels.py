"""Q4_0 and Q4_1 weights in the x8 layout against float32 activations through 24-bit integer dot
products (native op gguf_linear_x8_a24, srt/kernels/cpu/gguf_x8_a24.cpp): gguf_linear_x8's path for
decode batches (1-12 rows, up to its GEMM) on CPUs with AVX-512 VNNI and VBMI: the decode of W4A16
checkpoints and of the default model.

The numerics are gguf_linear_a24's, so the bound is too (tests/helpers/a24_checks.py): every
output within a few 2^-24 of sum_j |w_j| max|x over j's block| of the float64 product of the
dequantized weights. A wrong byte permutation, a nibble taken from the wrong half or a lost plane
would be far off. The tests skip where the CPU (or SRT_CPU_ISA) lacks the instructions; one checks
that the path is there exactly when /proc/cpuinfo says so."""

from __future__ import annotations

import pytest
import torch

from srt.kernels.cpu import _op_registered, gguf
from tests.helpers.a24_checks import activations, check_24_bit_error, check_taken_below
from tests.helpers.gguf_models import random_code_blocks
from tests.helpers.isa import cpu_isa, cpuinfo_flags
from tests.helpers.threads import with_threads

QTYPES = [2, 3]  # Q4_0, Q4_1
X8_A24 = gguf.x8_a24_qtypes()
A24_ROWS = 13  # gguf_linear_x8 takes the path below this many rows (x8_a24_rows), then its GEMM
needs_path = pytest.mark.skipif(not X8_A24, reason="the x8 24-bit path needs AVX-512 VNNI and VBMI")


def packed(n: int, k: int, qtype: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = random_code_blocks(n, k, qtype, seed=seed)
    return data, gguf.pack_x8(data, qtype)


def x8_a24(x, pk, qtype, n, bias=None):
    return torch.ops.srt_cpu.gguf_linear_x8_a24(x, pk, qtype, n, bias)


def test_available_exactly_with_vnni_and_vbmi():
    if cpu_isa() is None or not _op_registered("gguf_linear_x8_a24"):
        pytest.skip("native CPU kernels unavailable")
    wanted = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512vbmi"}
    there = cpu_isa() == "avx512" and wanted <= cpuinfo_flags()
    assert X8_A24 == (frozenset(QTYPES) if there else frozenset())
    if not there:
        with pytest.raises(RuntimeError, match="VBMI"):
            x8_a24(torch.zeros(1, 64), packed(8, 64, 2, 0)[1], 2, 8)


@needs_path
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7])
def test_within_float32_error_of_float64(qtype, m):
    """1-4 rows are one tile each, 5 and 7 a tile of 4 and one of 1 or 3; 67 weight rows are 9
    groups, the last one alone."""
    k, n = 1024, 67
    data, pk = packed(n, k, qtype, seed=m)
    x = activations(m, k, seed=m)
    check_24_bit_error(x8_a24(x, pk, qtype, n), x, data, qtype)


@needs_path
@pytest.mark.parametrize("qtype", QTYPES)
def test_gguf_linear_x8_takes_it_below_its_row_limit(qtype):
    """1 to 12 rows; from 13 rows on the GEMM on dequantized tiles (float32 products): the same sums
    within rounding, not the same bits."""
    k, n = 512, 40
    data, pk = packed(n, k, qtype, seed=3)
    x = activations(20, k, seed=4)
    check_taken_below(
        lambda xm: gguf.quant_linear_x8(xm, pk, qtype, n),
        lambda xm: x8_a24(xm, pk, qtype, n),
        x,
        data,
        qtype,
        below=(1, 2, 5, 8, A24_ROWS - 1),
        above=(A24_ROWS, 20),
    )


@needs_path
@pytest.mark.parametrize("qtype", QTYPES)
def test_bias_strided_rows_and_row_tails(qtype):
    k, n = 768, 13  # two groups, the second with 5 rows of zeros
    data, pk = packed(n, k, qtype, seed=5)
    bias = torch.randn(n)
    wide = activations(6, k + 40, seed=6)
    x = wide[:, 8 : 8 + k]
    y = x8_a24(x, pk, qtype, n, bias)
    check_24_bit_error(y, x, data, qtype, bias)
    assert torch.equal(y, x8_a24(x.contiguous(), pk, qtype, n, bias))
    assert torch.equal(y, x8_a24(x, pk, qtype, n) + bias)
    # each row's sums do not depend on the other rows of the call (tiles of 4)
    assert torch.equal(y[5:], x8_a24(x[5:], pk, qtype, n, bias))


@needs_path
@pytest.mark.parametrize("qtype", QTYPES)
def test_independent_of_thread_count(qtype):
    _, pk = packed(301, 512, qtype, seed=7)
    x = torch.randn(2, 512)
    one, two = with_threads(lambda: x8_a24(x, pk, qtype, 301))
    assert torch.equal(one, two)


@needs_path
@pytest.mark.parametrize("qtype", QTYPES)
def test_zeros_and_non_finite_blocks(qtype):
    k, n = 512, 9
    data, pk = packed(n, k, qtype, seed=8)
    bias = torch.randn(n)
    assert torch.equal(x8_a24(torch.zeros(2, k), pk, qtype, n, bias), bias.expand(2, n))
    x = torch.randn(3, k)
    x[0, 300] = float("inf")
    x[2, 7] = float("nan")
    y = x8_a24(x, pk, qtype, n)
    assert bool(y[0].isnan().all()) and bool(y[2].isnan().all())
    check_24_bit_error(y[1:2], x[1:2], data, qtype)


@needs_path
def test_extreme_codes_do_not_overflow():
    """Every nibble 0 (weight -8 d, Q4_0's largest magnitude) against a block of equal activations
    at the top of V's range: |sum (n - 8) V| = 32 * 8 * 127 * 2^16, just below 2^31."""
    k, n = 64, 8
    data, pk = packed(n, k, 2, seed=9)
    blocks = data.view(n, k // 32, 18)
    blocks[:, :, 2:] = 0  # nibbles 0
    pk = gguf.pack_x8(data, 2)
    x = torch.full((1, k), 3.0)
    check_24_bit_error(x8_a24(x, pk, 2, n), x, data, 2)
    check_24_bit_error(x8_a24(-x, pk, 2, n), -x, data, 2)


@needs_path
def test_errors():
    _, pk = packed(9, 64, 3, seed=0)
    with pytest.raises(RuntimeError, match="needs Q4_0 or Q4_1"):
        x8_a24(torch.zeros(1, 64), gguf.pack_x8(random_code_blocks(9, 64, 8), 8), 8, 9)
    with pytest.raises(RuntimeError, match=r"pack into \[3, 320\]"):
        x8_a24(torch.zeros(1, 64), pk, 3, 17)
    with pytest.raises(RuntimeError, match="bias"):
        x8_a24(torch.zeros(1, 64), pk, 3, 9, torch.zeros(3))
    with pytest.raises(RuntimeError, match="float32"):
        x8_a24(torch.zeros(1, 64, dtype=torch.float64), pk, 3, 9)
    assert x8_a24(torch.zeros(0, 64), pk, 3, 9).shape == (0, 9)

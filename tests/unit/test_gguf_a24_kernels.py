"""GGUF matmuls on float32 activations through 24-bit integer dot products (native op
gguf_linear_a24, srt/kernels/cpu/gguf_a24.cpp; gguf_linear's path for 1-2 rows of Q4_K and Q6_K
on CPUs with AVX-512 VNNI).

Each block of 32 activations becomes 24-bit fixed point (x ~ u V, |V| <= 127 * 2^16), so every
output must equal the float64 product of the dequantized weights within a few 2^-24 of
sum_j |w_j| max|x over j's block|: the error float32 summation itself allows. Dropping or
misplacing one of V's three bytes would be off by 2^-16 of that or more. Non-finite blocks give
NaN, as the float32 paths do. The tests skip where the CPU (or SRT_CPU_ISA) lacks AVX-512 VNNI;
one checks that the op is there exactly when /proc/cpuinfo says so."""

from __future__ import annotations

import pytest
import torch

from srt.kernels.cpu import _op_registered, gguf
from tests.helpers.a24_checks import activations, check_24_bit_error, check_taken_below
from tests.helpers.gguf_models import random_code_blocks
from tests.helpers.isa import cpu_isa, cpuinfo_flags
from tests.helpers.threads import with_threads

QTYPES = [12, 14]  # Q4_K, Q6_K
A24 = gguf.a24_qtypes()
A24_ROWS = 3  # gguf_linear takes the path below this many rows (gguf_a24_rows)
needs_a24 = pytest.mark.skipif(not A24, reason="gguf_linear_a24 needs the native kernels and AVX-512 VNNI")


def test_available_exactly_with_avx512_vnni():
    if cpu_isa() is None or not _op_registered("gguf_linear_a24"):
        pytest.skip("native CPU kernels unavailable")
    vnni = cpu_isa() == "avx512" and {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= cpuinfo_flags()
    assert A24 == (frozenset(QTYPES) if vnni else frozenset())
    if not vnni:
        with pytest.raises(RuntimeError, match="AVX-512 VNNI"):
            torch.ops.srt_cpu.gguf_linear_a24(torch.zeros(1, 256), random_code_blocks(2, 256, 12), 12)


@needs_a24
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7])
def test_within_float32_error_of_float64(qtype, m):
    k = 1024
    data = random_code_blocks(37, k, qtype, seed=m)
    x = activations(m, k, seed=m)
    y = torch.ops.srt_cpu.gguf_linear_a24(x, data, qtype)
    check_24_bit_error(y, x, data, qtype)


@needs_a24
@pytest.mark.parametrize("qtype", QTYPES)
def test_gguf_linear_takes_it_below_its_row_limit(qtype):
    """1 and 2 rows; from 3 rows on gguf_linear's register tiles (float32 products of the
    dequantized weights) are as fast or faster: the same sums within rounding, not the same bits."""
    limit = A24_ROWS
    k = 512
    data = random_code_blocks(21, k, qtype, seed=3)
    x = activations(8, k, seed=4)
    check_taken_below(
        lambda xm: torch.ops.srt_cpu.gguf_linear(xm, data, qtype),
        lambda xm: torch.ops.srt_cpu.gguf_linear_a24(xm, data, qtype),
        x,
        data,
        qtype,
        below=range(1, limit),
        above=(limit, 8),
    )


@needs_a24
@pytest.mark.parametrize("qtype", QTYPES)
def test_bias_strided_rows_and_row_tails(qtype):
    k = 768
    data = random_code_blocks(13, k, qtype, seed=5)  # 13: three 4-row groups and one single row
    bias = torch.randn(13)
    wide = activations(6, k + 40, seed=6)
    x = wide[:, 8 : 8 + k]
    y = torch.ops.srt_cpu.gguf_linear_a24(x, data, qtype, bias)
    check_24_bit_error(y, x, data, qtype, bias)
    assert torch.equal(y, torch.ops.srt_cpu.gguf_linear_a24(x.contiguous(), data, qtype, bias))
    assert torch.equal(y, torch.ops.srt_cpu.gguf_linear_a24(x, data, qtype) + bias)
    # each row's sums do not depend on the other rows of the call (tiles of 4)
    assert torch.equal(y[5:], torch.ops.srt_cpu.gguf_linear_a24(x[5:], data, qtype, bias))


@needs_a24
@pytest.mark.parametrize("qtype", QTYPES)
def test_independent_of_thread_count(qtype):
    data = random_code_blocks(301, 512, qtype, seed=7)
    x = torch.randn(3, 512)
    one, two = with_threads(lambda: torch.ops.srt_cpu.gguf_linear_a24(x, data, qtype))
    assert torch.equal(one, two)


@needs_a24
@pytest.mark.parametrize("qtype", QTYPES)
def test_zeros_and_non_finite_blocks(qtype):
    k = 512
    data = random_code_blocks(9, k, qtype, seed=8)
    bias = torch.randn(9)
    assert torch.equal(
        torch.ops.srt_cpu.gguf_linear_a24(torch.zeros(2, k), data, qtype, bias), bias.expand(2, 9)
    )
    x = torch.randn(3, k)
    x[0, 300] = float("inf")
    x[2, 7] = float("nan")
    y = torch.ops.srt_cpu.gguf_linear_a24(x, data, qtype)
    assert bool(y[0].isnan().all()) and bool(y[2].isnan().all())
    check_24_bit_error(y[1:2], x[1:2], data, qtype)


@needs_a24
def test_errors():
    a24 = torch.ops.srt_cpu.gguf_linear_a24
    q4k = random_code_blocks(4, 512, 12)
    with pytest.raises(RuntimeError, match="no 24-bit activation path"):
        a24(torch.zeros(1, 32), random_code_blocks(4, 32, 3), 3)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        a24(torch.zeros(1, 128), q4k, 12)
    with pytest.raises(RuntimeError, match="take 288 bytes"):
        a24(torch.zeros(1, 512), random_code_blocks(4, 512, 14), 12)
    with pytest.raises(RuntimeError, match="bias"):
        a24(torch.zeros(1, 512), q4k, 12, torch.zeros(3))
    with pytest.raises(RuntimeError, match="float32"):
        a24(torch.zeros(1, 512, dtype=torch.float64), q4k, 12)
    assert a24(torch.zeros(0, 512), q4k, 12).shape == (0, 4)

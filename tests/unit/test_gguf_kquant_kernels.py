"""The native K-quant row functions (gguf_kquant.cpp / gguf_kquant_rows.h: Q4_K, Q5_K, Q6_K).

Dequantization must equal gguf.quants' numpy reference bit for bit (random blocks, finite fp16
scales including zeros, negatives and subnormals); the quantized matmul must equal the matmul of
the dequantized weights within float32 summation error. Both the AVX2 functions (what the
gguf_dequantize / gguf_linear ops dispatch to on this CPU, and gguf_kquant_debug with scalar=False)
and the portable scalar ones (gguf_kquant_debug with scalar=True) are checked.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from srt.kernels import cpu as cpu_kernels

gguf_quants = pytest.importorskip("gguf.quants")

Q4_K, Q5_K, Q6_K = 12, 13, 14
TYPE_SIZE = {Q4_K: 144, Q5_K: 176, Q6_K: 210}
FP16_FIELDS = {Q4_K: (0, 2), Q5_K: (0, 2), Q6_K: (208,)}  # byte offsets of d (and dmin)
QTYPES = [Q4_K, Q5_K, Q6_K]


@pytest.fixture(scope="module")
def native():
    cpu_kernels.load()
    if not (cpu_kernels._op_registered("gguf_linear") and cpu_kernels._op_registered("gguf_kquant_debug")):
        pytest.skip(f"native GGUF kernels unavailable: {cpu_kernels.kernel_status()}")
    return True


def random_blocks(qtype: int, rows: int, cols: int, seed: int) -> np.ndarray:
    """uint8 [rows, cols / 256 * type_size]: random bytes, the fp16 scale fields finite."""
    rng = np.random.default_rng(seed)
    nb = cols // 256
    raw = rng.integers(0, 256, size=(rows, nb, TYPE_SIZE[qtype]), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        n = rows * nb
        scale = rng.uniform(1e-3, 1e-1, size=n) * rng.choice([-1.0, 1.0], size=n)
        special = rng.random(n)
        scale[special < 0.05] = 0.0
        scale[(special >= 0.05) & (special < 0.10)] = 3e-6  # fp16 subnormal
        scale[(special >= 0.10) & (special < 0.12)] = -65504.0  # the largest fp16
        raw[:, :, off : off + 2] = scale.astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
    return raw.reshape(rows, -1)


def reference(raw: np.ndarray, qtype: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf_quants.dequantize(raw, qtype)))


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape
    same = got.view(torch.int32) == want.view(torch.int32)
    assert bool(same.all()), (
        f"{int((~same).sum())} of {same.numel()} weights differ, first at {(~same).nonzero()[0]}"
    )


def assert_matmul_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y = x @ w.T within float32 summation error: relative to sum |x| |w| per output."""
    want = x.double() @ w.double().T
    scale = x.abs().double() @ w.abs().double().T
    err = (y.double() - want).abs()
    assert bool((err <= 1e-5 * scale + 1e-30).all()), f"max relative error {float((err / scale).max()):.3g}"
    # and against the float32 matmul torch computes
    err32 = (y.double() - (x @ w.T).double()).abs()
    assert bool((err32 <= 1e-5 * scale + 1e-30).all())


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("rows,cols", [(1, 256), (5, 256), (1, 4096), (7, 4096), (3, 11008)])
def test_dequantize_bit_exact(native, qtype, rows, cols):
    raw = random_blocks(qtype, rows, cols, seed=qtype * 1000 + rows * 7 + cols)
    want = reference(raw, qtype)
    data = torch.from_numpy(raw)
    assert_same_bits(torch.ops.srt_cpu.gguf_dequantize(data, qtype, cols), want)  # this CPU's ISA
    x = torch.zeros(1, cols)
    for scalar in (True, False):
        w, _ = torch.ops.srt_cpu.gguf_kquant_debug(data, qtype, x, scalar)
        assert_same_bits(w, want)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("m", [1, 7, 64, 300])
def test_linear_matches_float_matmul(native, qtype, m):
    n, k = 24, 4096
    raw = random_blocks(qtype, n, k, seed=qtype + m)
    w = reference(raw, qtype)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    y = torch.ops.srt_cpu.gguf_linear(x, torch.from_numpy(raw), qtype)
    assert y.shape == (m, n)
    assert_matmul_close(y, x, w)


@pytest.mark.parametrize("qtype", QTYPES)
def test_linear_strided_activations_and_bias(native, qtype):
    """Rows of x with a stride other than K (ldx), and a bias."""
    n, k = 9, 2304
    raw = random_blocks(qtype, n, k, seed=qtype)
    w = reference(raw, qtype)
    gen = torch.Generator().manual_seed(qtype)
    x = torch.randn(5, k + 40, generator=gen)[:, 8 : 8 + k]
    bias = torch.randn(n, generator=gen)
    y = torch.ops.srt_cpu.gguf_linear(x, torch.from_numpy(raw), qtype, bias)
    assert_matmul_close(y - bias, x, w)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("scalar", [True, False])
@pytest.mark.parametrize("m", [1, 2, 7])  # dot_rows with 1, 2, 4 + 3 activation rows
def test_dot_rows_each_isa(native, qtype, scalar, m):
    n, k = 13, 11008
    raw = random_blocks(qtype, n, k, seed=3 * qtype + m)
    w = reference(raw, qtype)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
    got_w, y = torch.ops.srt_cpu.gguf_kquant_debug(torch.from_numpy(raw), qtype, x, scalar)
    assert_same_bits(got_w, w)
    assert_matmul_close(y, x, w)


def test_kquant_types_listed(native):
    assert {Q4_K, Q5_K, Q6_K} <= set(torch.ops.srt_cpu.gguf_qtypes())


def test_prefill_row_groups_give_the_same_bits(native, tmp_path):
    """A prefill's x goes through the dequantized-tile GEMM in groups of rows that stay in the
    last-level cache (SRT_GGUF_GEMM_X_MIB): 300 rows of K = 4096 are one group by default and five
    (64 rows each, the last 44) under a 1 MiB budget; every output's sum is the same either way."""
    from tests.helpers.isa import cpu_isa, op_under_isa

    n, k, m = 100, 4096, 300
    raw = random_blocks(Q4_K, n, k, seed=11)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(5))
    here = torch.ops.srt_cpu.gguf_linear(x, torch.from_numpy(raw), Q4_K)
    args = [x, torch.from_numpy(raw), Q4_K]
    grouped = op_under_isa(cpu_isa(), "gguf_linear", args, tmp_path, {"SRT_GGUF_GEMM_X_MIB": "1"})
    assert_same_bits(grouped, here)
    assert_matmul_close(here, x, reference(raw, Q4_K))


@pytest.mark.parametrize("qtype", [Q4_K, Q6_K])
def test_prefill_tiles_give_the_same_bits_on_every_isa(native, qtype, tmp_path):
    """The dequantized-tile GEMM (M >= 13) takes a 12 x 16 AVX-512 tile where the CPU has it and
    the 6 x 16 AVX2 one otherwise: every sum runs over k in the same order with the same FMAs, so
    SRT_CPU_ISA=avx2 must give the very same bits (16-row panels and an 8-row tail)."""
    from tests.helpers.isa import isa_available, ops_under_isa, skip_reason

    if not isa_available("avx512"):
        pytest.skip(skip_reason("avx512"))
    n, k = 100, 512
    w = torch.from_numpy(random_blocks(qtype, n, k, seed=qtype + 7))
    xs = [torch.randn(m, k, generator=torch.Generator().manual_seed(m)) for m in (40, 300)]
    there = ops_under_isa("avx2", "gguf_linear", [[x, w, qtype] for x in xs], tmp_path)
    for x, avx2 in zip(xs, there):
        here = torch.ops.srt_cpu.gguf_linear(x, w, qtype)
        assert_same_bits(here, avx2)
        assert_matmul_close(here, x, reference(w.numpy(), qtype))

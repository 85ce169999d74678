"""srt's FP8 linear (srt/kernels/cpu/fp8_linear.cpp): float8_e4m3 codes kept in one byte, widened
to bf16 panels in cache, and the native backend's FP8 layers.

The kernel's contract is bf16_linear's on the codes in bf16 (every e4m3 value is exact in bf16): the
same bits on every path (``scalar``, ``avx2``, ``avx512`` widening to float32 in registers,
``avx512_bf16`` on ``vdpbf16ps``) at tails of rows (1-70: one tile taking several panels at once,
several tiles taking one), columns (not multiples of the 32-column panel) and k (past the blocks
widened at a time), with and without bias, both activation dtypes; the widening itself (AVX512-VBMI
byte lookups on the default path, a table one code at a time on the lowered ones) is checked on
all 254 finite codes. tests/unit/test_isa_lowering.py runs this file under ``SRT_CPU_ISA=avx2`` and
``scalar`` too.
"""

from __future__ import annotations

import pytest
import torch

from srt.kernels import cpu as cpu_kernels
from srt.layers.linear import Linear
from srt.layers.linear_backend import create_linear_backend
from srt.layers.quantized_weight import BlockScaledCodes, ScaledRows, expand_block_scale
from tests.helpers.isa import intel_cpu

PATHS = ("", "scalar", "avx2", "avx512", "avx512_bf16")
SHAPES = [(1, 64, 32), (2, 62, 200), (4, 130, 33), (8, 512, 100), (9, 256, 129), (70, 600, 65), (3, 2, 5)]
FINITE = [c for c in range(256) if c & 0x7F != 0x7F]  # every e4m3 code but the two NaNs


@pytest.fixture(scope="module", autouse=True)
def _native():
    if not (cpu_kernels.load(build_if_missing=True) and hasattr(torch.ops.srt_cpu, "fp8_linear")):
        pytest.skip(f"native CPU kernels unavailable: {cpu_kernels.kernel_status()}")


def _fp8_default_path(x_dtype, rows: int) -> str:
    """The bf16_linear path that fp8_linear's default takes: bf16_linear's own default, but never
    brgemm (fp8_linear has none): where bf16_linear takes brgemm, the vdpbf16ps tiles, or the
    widened weights from 8 rows on Intel's cores (vdpbf16ps at half the FMA's rate)."""
    ops = torch.ops.srt_cpu
    path = ops.bf16_linear_path(rows, x_dtype == torch.bfloat16)
    if path != "brgemm":
        return path
    return "avx512_bf16" if rows < 8 or not intel_cpu() else ops.bf16_linear_path(rows, False)


def _run(op, x, packed, n, bias, path):
    try:
        return op(x, packed, n, bias, path)
    except RuntimeError as e:
        if "is not available on this CPU" in str(e):
            pytest.skip(str(e).splitlines()[0])
        raise


def _codes(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    bits = torch.tensor(FINITE, dtype=torch.uint8)[torch.randint(len(FINITE), (n, k), generator=g)]
    return bits.view(torch.float8_e4m3fn)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=["x_bf16", "x_f32"])
@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("path", PATHS)
def test_same_bits_as_bf16_linear_on_the_codes_and_within_float32_sums_of_the_reference(
    path, m, k, n, x_dtype, with_bias
):
    if path == "avx512_bf16" and x_dtype == torch.float32:
        pytest.skip("bf16 dot products take bf16 activations")
    ops = torch.ops.srt_cpu
    codes = _codes(n, k, seed=m * 1000 + k + n)
    g = torch.Generator().manual_seed(m + k)
    x = torch.randn(m, k, generator=g).to(x_dtype)
    bias = torch.randn(n, generator=g) if with_bias else None
    y = _run(ops.fp8_linear, x, ops.pack_fp8_weight(codes), n, bias, path)
    # the bf16 linear's default picks brgemm for many bf16 rows on AMX: compare with its tiles
    same_path = path or _fp8_default_path(x_dtype, m)
    want = _run(ops.bf16_linear, x, ops.pack_bf16_weight(codes.to(torch.bfloat16)), n, bias, same_path)
    assert y.dtype == x_dtype and torch.equal(y, want)
    ref = x.double() @ codes.double().T + (0 if bias is None else bias.double())
    mag = x.double().abs() @ codes.double().abs().T + (0 if bias is None else bias.double().abs())
    tol = 1e-5 * mag + (2.0**-8 * ref.abs() if x_dtype == torch.bfloat16 else 0) + 1e-30
    assert bool(((y.double() - ref).abs() <= tol).all())


@pytest.mark.parametrize("path", PATHS)
def test_every_finite_code_widens_exactly(path):
    """One-hot rows of x pick each code out: the output is the code's value, exactly."""
    codes = torch.tensor([FINITE, FINITE[::-1]], dtype=torch.uint8).view(torch.float8_e4m3fn)
    k = codes.shape[1]
    x = torch.eye(k, dtype=torch.bfloat16)  # every code is exact in bf16
    y = _run(torch.ops.srt_cpu.fp8_linear, x, torch.ops.srt_cpu.pack_fp8_weight(codes), 2, None, path)
    assert torch.equal(y.float(), codes.float().T)


def test_pack_layout_and_errors():
    ops = torch.ops.srt_cpu
    codes = _codes(33, 8, seed=5)
    packed = ops.pack_fp8_weight(codes)
    assert packed.shape == (2, 4, 64) and packed.dtype == torch.uint8
    bits = codes.view(torch.uint8)
    for n, k in [(0, 0), (5, 3), (31, 6), (32, 1), (32, 7), (17, 4)]:
        i = 2 * (n % 32) + k % 2  # natural index in the pair row; stored at 16 l + 8 h + t
        assert packed[n // 32, k // 2, 16 * ((i % 32) // 8) + 8 * (i // 32) + i % 8] == bits[n, k]
    assert packed[1].count_nonzero() <= 4 * 2  # the padding past column 32: zeros
    nan = codes.clone()
    nan.view(torch.uint8)[3, 3] = 0xFF
    with pytest.raises(RuntimeError, match="NaN"):
        ops.pack_fp8_weight(nan)
    with pytest.raises(RuntimeError, match="K must be even"):
        ops.pack_fp8_weight(_codes(4, 7, seed=1))
    with pytest.raises(RuntimeError, match="float8_e4m3fn"):
        ops.pack_fp8_weight(codes.float())
    x = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match="isa must be"):
        ops.fp8_linear(x, packed, 33, None, "brgemm")
    with pytest.raises(RuntimeError, match="x has 6 columns"):
        ops.fp8_linear(torch.randn(3, 6), packed, 33, None, "")
    with pytest.raises(RuntimeError, match="does not match"):
        ops.fp8_linear(x, packed, 70, None, "")
    with pytest.raises(RuntimeError, match="must come from pack_fp8_weight"):
        ops.fp8_linear(x, packed.float(), 33, None, "")
    assert ops.fp8_linear(torch.randn(0, 8), packed, 33, None, "").shape == (0, 33)


def test_a_native_layer_keeps_fp8_codes_in_one_byte_where_the_cpu_widens_them_on_vectors():
    """``Linear`` takes an FP8 checkpoint's scaled rows: its codes in one byte where ``fp8_fast()``
    (else in its weight's dtype, two bytes), the outputs scaled per row either way, the same bits;
    plain rows loaded beside the codes widen them back to the weight's dtype."""
    g = torch.Generator().manual_seed(2)
    codes, scale = _codes(40, 48, seed=9), torch.rand(40, generator=g) + 0.5
    bias = torch.randn(40, generator=g)
    x = torch.randn(5, 48, generator=g)
    backend = create_linear_backend("native", weight_dtype=torch.bfloat16)
    layer = Linear(48, 40, bias=True, linear_backend=backend)
    layer.load_quantized(ScaledRows(codes.float(), scale))
    layer.bias.data.copy_(bias)
    layer.prepare_weights()
    one_byte = bool(torch.ops.srt_cpu.fp8_fast())
    assert layer.packed_weight.dtype == (torch.uint8 if one_byte else torch.bfloat16)
    assert layer.packed_weight.element_size() * layer.packed_weight.numel() == 64 * 48 * (
        1 if one_byte else 2
    )
    with torch.inference_mode():
        y = layer(x)
    want = torch.ops.srt_cpu.bf16_linear(
        x, torch.ops.srt_cpu.pack_bf16_weight(codes.to(torch.bfloat16)), 40, None
    )
    assert torch.equal(y, want * scale + bias)

    mixed = Linear(48, 40, linear_backend=backend)
    mixed._load_rows(0, ScaledRows(codes[:32].float(), scale[:32]), "w")
    mixed._load_rows(32, codes[32:].float() * 0.25, "w")  # plain rows: the codes widen first
    assert mixed.weight.dtype == torch.bfloat16
    mixed.prepare_weights()
    with torch.inference_mode():
        y = mixed(x)
    full = codes.float() * torch.cat([scale[:32], torch.full((8,), 0.25)]).unsqueeze(1)
    torch.testing.assert_close(y, x @ full.T, rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------- block-scaled codes
BLOCK_SHAPES = [
    (1, 256, 64, (32, 128)),
    (5, 300, 96, (64, 64)),
    (12, 130, 40, (32, 2)),
    (70, 512, 128, (128, 128)),
]


def _block_data(n: int, k: int, block: tuple[int, int], seed: int):
    g = torch.Generator().manual_seed(seed)
    grid = (-(-n // block[0]), -(-k // block[1]))
    return _codes(n, k, seed), torch.rand(grid, generator=g) * 0.01 + 1e-4


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=["x_bf16", "x_f32"])
@pytest.mark.parametrize("m,k,n,block", BLOCK_SHAPES)
@pytest.mark.parametrize("path", PATHS)
def test_block_scaled_codes_widen_to_the_bf16_weights_transformers_dequantizes_to(
    path, m, k, n, block, x_dtype
):
    """Each weight widens to bf16(code x its block's scale), the product in float32 and rounded to
    nearest even (transformers' dequantization to a bf16 model): the same bits as bf16_linear on those
    weights, whether the CPU's bf16 conversion (AVX512-BF16) or a table one code at a time rounds."""
    if path == "avx512_bf16" and x_dtype == torch.float32:
        pytest.skip("bf16 dot products take bf16 activations")
    ops = torch.ops.srt_cpu
    codes, scale = _block_data(n, k, block, seed=m + n)
    weights = (codes.float() * expand_block_scale(scale, block, (n, k))).to(torch.bfloat16)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(x_dtype)
    bias = torch.randn(n)
    packed = ops.pack_fp8_weight(codes, scale, *block)
    assert packed.shape == (-(-n // 32), k // 2 * 64 + -(-(4 + 4 * scale.shape[1]) // 64) * 64)
    y = _run(ops.fp8_linear, x, packed, n, bias, path)
    same_path = path or _fp8_default_path(x_dtype, m)
    assert torch.equal(y, _run(ops.bf16_linear, x, ops.pack_bf16_weight(weights), n, bias, same_path))


def test_block_scale_errors():
    ops = torch.ops.srt_cpu
    codes, scale = _block_data(64, 64, (32, 32), seed=1)
    with pytest.raises(RuntimeError, match="multiple of 32 rows and an even number of columns"):
        ops.pack_fp8_weight(codes, scale, 16, 32)
    with pytest.raises(RuntimeError, match="multiple of 32 rows and an even number of columns"):
        ops.pack_fp8_weight(codes, scale, 32, 31)
    with pytest.raises(RuntimeError, match=r"block_scale must be float32 \[2, 2\]"):
        ops.pack_fp8_weight(codes, scale[:1], 32, 32)
    packed = ops.pack_fp8_weight(codes, scale, 32, 32)
    with pytest.raises(RuntimeError, match="does not match the block-scaled packed weight"):
        ops.fp8_linear(torch.randn(2, 62), packed, 64, None, "")


def test_a_native_layer_keeps_block_scaled_codes_where_the_cpu_widens_them_and_dequantizes_elsewhere():
    """q / k / v shards of block-scaled codes in one fused layer: one byte a code and the scale grid
    where ``fp8_fast_blocks()``, else their values in the weight's dtype; the same outputs."""
    from srt.layers.linear import QKVLinear

    backend = create_linear_backend("native")
    layer = QKVLinear(64, 32, 2, 1, dtype=torch.bfloat16, linear_backend=backend)  # q 64 rows, k 32, v 32
    parts = {
        s: _block_data(r, 64, (32, 32), seed=i) for i, (s, r) in enumerate([("q", 64), ("k", 32), ("v", 32)])
    }
    for s, (codes, scale) in parts.items():
        layer.load_shard("weight", BlockScaledCodes(codes, scale, (32, 32)), s)
    kept = bool(torch.ops.srt_cpu.fp8_fast_blocks())
    assert (layer.fp8_block == (32, 32)) == kept and (layer.weight.dtype == torch.float8_e4m3fn) == kept
    layer.prepare_weights()
    assert layer.packed_weight.dtype == (torch.uint8 if kept else torch.bfloat16)
    x = torch.randn(3, 64).bfloat16()
    with torch.inference_mode():
        y = layer(x)
    full = torch.cat([BlockScaledCodes(c, s, (32, 32)).value() for c, s in parts.values()]).to(torch.bfloat16)
    assert torch.equal(
        y, torch.ops.srt_cpu.bf16_linear(x, torch.ops.srt_cpu.pack_bf16_weight(full), 128, None)
    )


def test_fused_checkpoint_tensors_split_with_their_scales():
    """Phi-3's fused qkv / gate_up tensors cut into parts: FP8 codes keep their scales (a row's, or
    the block rows'); block-scaled parts that do not start a block of rows come as their values."""
    from srt.models.phi3 import split_rows

    codes, scale = _block_data(96, 64, (32, 32), seed=3)
    whole = BlockScaledCodes(codes, scale, (32, 32))
    part = split_rows(whole, 32, 64)
    assert isinstance(part, BlockScaledCodes) and part.scale.shape == (2, 2)
    assert torch.equal(part.value(), whole.value()[32:96])
    coarse = BlockScaledCodes(codes, scale[:2], (64, 32))
    assert torch.equal(split_rows(coarse, 32, 64), coarse.value()[32:96])  # starts mid-block
    rows = ScaledRows(codes.float(), torch.rand(96))
    assert torch.equal(split_rows(rows, 10, 20).value(), rows.value()[10:30])

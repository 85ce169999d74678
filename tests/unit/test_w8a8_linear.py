"""W8A8 matmuls on the int8 kernel (native op gguf_linear_w8a8, w8a8_linear.cpp): Q8_0 rows of one
scale each times activations quantized to int8 per row.

The per-row codes and scales must be srt/layers/linear.py's ``fake_quant_rows`` (a full int8
range, -128 included), and the op must equal the exact formula ``float(sum q w) * (sa * dw)`` (the
integer sums in int64 here, the products in float64) within float32 rounding, on the vector path
and the scalar loops, whatever the row counts (tiles of 4 x 4, chunks of 64 activation rows, an
odd number of blocks), in both weight layouts: VNNI groups of 4 rows and AMX panels of 64 rows
(w8a8_amx.cpp: brgemm on AMX-INT8 tiles where the CPU has them, scalar loops elsewhere), which give
the same outputs bit for bit. A bf16 x (a W8A8 checkpoint served in bf16) gives the outputs of its
float32 widening rounded to bf16. A W8A8 layer moves to it only when every block of each row has the row's
scale; served end to end it is tested in tests/integration/test_compressed_tensors.py."""

from __future__ import annotations

import os

import pytest
import torch

from srt.configs import cpu_features
from srt.kernels.cpu import _op_registered, native_available
from srt.kernels.cpu import w8a8 as w8a8_kernels
from srt.layers.linear import Linear, fake_quant_rows
from srt.layers.quantized_weight import GGUFTensor
from srt.model_loader import quantized_checkpoint
from tests.helpers.threads import with_threads

needs_native = pytest.mark.skipif(
    not (native_available() and _op_registered("gguf_linear_w8a8")),
    reason="native gguf_linear_w8a8 not built",
)


def q8_0_rows(
    n: int, k: int, seed: int, uniform: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random int8 codes [n, k] (the whole range), float16 row scales [n, 1], and the Q8_0 bytes
    (every block with its row's scale, or with ``uniform`` False one block changed)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = (torch.rand(n, 1, generator=gen) * 0.02 + 1e-3).half()
    nb = k // 32
    d = scale.expand(n, nb).contiguous()
    if not uniform:
        d[0, -1] = d[0, -1] * 2
    data = torch.cat([d.view(torch.uint8).view(n, nb, 2), codes.view(torch.uint8).view(n, nb, 32)], 2)
    return codes, scale.float(), data.reshape(n, -1).contiguous()


LAYOUTS = ["groups", "amx"]


def w8a8(
    x: torch.Tensor, data: torch.Tensor, bias: torch.Tensor | None, isa: str, layout: str = "groups"
) -> torch.Tensor:
    """The op on Q8_0 rows, packed for it first."""
    return torch.ops.srt_cpu.gguf_linear_w8a8(
        x, torch.ops.srt_cpu.gguf_pack_w8a8(data, layout), data.shape[0], bias, isa
    )


def exact(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    sa = x.abs().amax(1, keepdim=True) / 127.5
    sa = torch.where(sa == 0, torch.finfo(torch.float32).eps, sa)
    q = torch.round(x / sa).clamp(-128, 127)
    dots = q.to(torch.int64) @ codes.to(torch.int64).t()
    out = dots.double() * (sa.double() * scale.double().t())
    return out if bias is None else out + bias.double()


@needs_native
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("isa", ["", "scalar"])
@pytest.mark.parametrize(
    "m,n,k",
    # past 4096 columns (64 pairs) batches of more than 4 rows take K in blocks: 8224 = 2 blocks + 32
    [
        (1, 8, 32),
        (1, 37, 96),
        (3, 17, 160),
        (4, 4, 64),
        (9, 33, 1056),
        (70, 13, 224),
        (9, 21, 8224),
        (5, 3, 4160),
        (40, 70, 96),  # AMX panels: two of 64 rows, two brgemm blocks of 32 activation rows
    ],
)
def test_w8a8_op_equals_the_exact_formula(layout, isa, m, n, k):
    codes, scale, data = q8_0_rows(n, k, seed=m * 1000 + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    x[0, 1] = -50.0  # its row's largest magnitude, negative: code -128
    if m > 1:
        x[1] = 0.0  # a row of zeros: scale eps, codes 0
    bias = torch.randn(n)
    want = exact(x, codes, scale, bias)
    for b in (bias, None):
        got = w8a8(x, data, b, isa, layout).double()
        ref = want if b is not None else want - bias.double()
        tol = 4e-7 * (ref.abs() + (exact(x.abs(), codes.abs(), scale, None)))  # float32 rounding of the terms
        assert ((got - ref).abs() <= tol + 1e-30).all(), (got - ref).abs().max()


@needs_native
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("k", [512, 8224])  # 8224: K blocks in the batch, none for a row alone
def test_w8a8_op_does_not_depend_on_the_thread_count_the_batch_or_the_layout(layout, k):
    codes, scale, data = q8_0_rows(41, k, seed=3)
    x = torch.randn(67, k, generator=torch.Generator().manual_seed(4))
    one, two = with_threads(lambda: w8a8(x, data, None, "", layout))
    alone = torch.cat([w8a8(x[i : i + 1], data, None, "", layout) for i in range(67)])
    assert torch.equal(one, two) and torch.equal(one, alone)
    assert torch.equal(one, w8a8(x, data, None, "scalar", layout))
    assert torch.equal(one, w8a8(x, data, None, "", "groups"))


@needs_native
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("isa", ["", "scalar"])
@pytest.mark.parametrize("m,n,k", [(1, 37, 96), (3, 17, 160), (9, 130, 1056), (70, 13, 224), (40, 70, 8224)])
def test_bf16_rows_give_their_float32_widenings_outputs_rounded_to_bf16(layout, isa, m, n, k):
    """The codes of a bf16 row are those of its exact float32 widening, and each output is the float32
    output rounded to bf16 (the bias bf16 or float32), at row and column tails and on strided rows."""
    _, _, data = q8_0_rows(n, k, seed=m + n)
    x = torch.randn(2 * m, k, generator=torch.Generator().manual_seed(k)).bfloat16()[::2]
    bias = torch.randn(n).bfloat16()
    want = w8a8(x.float().contiguous(), data, bias.float(), isa, layout)
    for b in (bias, bias.float()):
        got = w8a8(x, data, b, isa, layout)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want.bfloat16())
    assert torch.equal(w8a8(x, data, None, isa, layout), w8a8(x.float(), data, None, isa, layout).bfloat16())
    with pytest.raises(RuntimeError, match="float32 or bf16"):
        w8a8(x.half(), data, None, isa, layout)


@needs_native
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n,k", [(8, 64), (13, 96), (1, 32), (6, 4128), (130, 96)])
def test_the_packed_rows_hold_the_codes_and_scales(layout, n, k):
    codes, scale, data = q8_0_rows(n, k, seed=n)
    packed = torch.ops.srt_cpu.gguf_pack_w8a8(data, layout)
    # the codes and a float32 scale a row (groups of 4 rows, panels of 64)
    if layout == "groups":
        assert packed.numel() == -(-n // 4) * (16 + -(-k // 64) * 256)
    else:
        assert packed.numel() == -(-n // 64) * (256 + 64 * k)
    got_codes, got_scale = w8a8_kernels.unpack_w8a8(packed, n, k)
    assert torch.equal(got_codes, codes) and torch.equal(got_scale, scale.reshape(-1))


@needs_native
def test_w8a8_op_refuses_bad_arguments():
    _, _, data = q8_0_rows(4, 64, seed=0)
    packed = torch.ops.srt_cpu.gguf_pack_w8a8(data)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.srt_cpu.gguf_linear_w8a8(torch.randn(2, 48), packed, 4, None, "")
    with pytest.raises(RuntimeError, match="packed must be"):
        torch.ops.srt_cpu.gguf_linear_w8a8(torch.randn(2, 128), packed, 4, None, "")
    with pytest.raises(RuntimeError, match="multiple of 34"):
        torch.ops.srt_cpu.gguf_pack_w8a8(data[:, :40].contiguous())
    with pytest.raises(RuntimeError, match="layout must be"):
        torch.ops.srt_cpu.gguf_pack_w8a8(data, "tiles")


@needs_native
def test_amx_tiles_are_taken_exactly_where_the_cpu_has_them(monkeypatch):
    """The AMX panels' brgemm runs where CPUID has AMX-INT8 (a CPU without it runs their scalar
    loops, which the tests above compare), and the loader packs panels only there and only when
    the bf16 probe (AMX tiles in a child process) passed."""
    flags = cpu_features.cpu_flags()
    has_amx = {"amx_int8", "amx_tile"} <= flags and cpu_features.cpu_isa_cap() in (None, "avx512")
    capped = bool(os.environ.get("ONEDNN_MAX_CPU_ISA"))
    assert w8a8_kernels.w8a8_amx() == (has_amx and not capped)
    monkeypatch.setattr(quantized_checkpoint, "probe_bf16", lambda device: False)
    assert quantized_checkpoint.int8_layout() == "groups"
    monkeypatch.setattr(quantized_checkpoint, "probe_bf16", lambda device: True)
    assert quantized_checkpoint.int8_layout() == ("amx" if w8a8_kernels.w8a8_amx() else "groups")


@needs_native
@pytest.mark.skipif(
    not w8a8_kernels.w8a8_fast(), reason="no AVX-512 VNNI: W8A8 layers keep the float32 kernels"
)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("uniform", [True, False])
def test_a_w8a8_layer_moves_to_the_int8_kernel_only_with_one_scale_a_row(layout, uniform):
    codes, scale, data = q8_0_rows(48, 128, seed=5, uniform=uniform)
    layer = Linear(128, 48)
    layer.load_quantized(GGUFTensor(8, 48, 128, data))
    layer.prepare_weights()
    layer.token_quant = "int8"
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        before = layer(x)  # per-token fake quantization, then the float32 kernel
        assert layer.qweight.use_token_int8(layout) == uniform
        after = layer(x)
    float_path = fake_quant_rows(x, "int8") @ layer.qweight.dequantize().t()
    torch.testing.assert_close(before, float_path, rtol=1e-5, atol=1e-5)
    if uniform:
        torch.testing.assert_close(after.double(), exact(x, codes, scale, None), rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(before, after)

"""srt's bf16 linear (srt/kernels/cpu/bf16_linear.cpp) and the native backend's bf16 weights.

Every path the CPU runs (``scalar``, ``avx2``, ``avx512`` widening the weights in registers;
``avx512_bf16`` on ``vdpbf16ps``; ``brgemm`` through ATen's CPUBlas) against a float64 reference,
at tails of rows (1-70, past the 8-row tile and the 64-row brgemm block; 260-300, past brgemm's
chunks of rows), columns (not multiples of the 32-column panel) and k (2 to 3400, past the 1024-k
blocks that several tiles of rows share and the blocks brgemm splits a long k into, and 0); bf16
and float32 activations; with and without bias. The paths a CPU lacks are skipped with the kernel's own reason (tests/unit/test_isa_lowering.py runs this file
again under ``SRT_CPU_ISA=avx2`` and ``scalar``).

Bounds. Products of bf16 values are exact in float32, so the only error of a float32 result is the
float32 summation: ``|y - ref| <= 1e-5 * (|x| |w|^T + |bias|)`` per output. A bf16 result is
that sum rounded to bf16 (half an ulp, 2^-9 relative), so ``|y - ref| <= 2^-8 |ref|`` plus the same
summation term.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from srt.configs import cpu_features
from srt.kernels import cpu as cpu_kernels
from srt.layers.linear import Linear
from srt.layers.linear_backend import NativeLinear, create_linear_backend
from srt.layers.onednn_linear import onednn_bf16_available
from srt.layers.vocab_embedding import VocabEmbedding
from tests.helpers.isa import intel_cpu

PATHS = ("scalar", "avx2", "avx512", "avx512_bf16", "brgemm")
SHAPES = [
    (1, 64, 32),
    (3, 62, 70),
    (8, 128, 33),
    (9, 256, 100),
    (17, 576, 96),
    (70, 1024, 65),
    (20, 2500, 70),
    (5, 4200, 40),  # avx2: the first two rows, then a tile of 3, k in blocks (2,048 + 2,048 + 104)
    (300, 3200, 70),  # brgemm: two chunks of rows (256 + 44), k whole
    (260, 3400, 40),  # brgemm: k in two blocks (3,200 + 200) summed in float32, chunks of 256 + 4 rows
    (2, 2, 5),
    (4, 0, 3),
]


@pytest.fixture(scope="module", autouse=True)
def _native():
    if not (cpu_kernels.load(build_if_missing=True) and hasattr(torch.ops.srt_cpu, "bf16_linear")):
        pytest.skip(f"native CPU kernels unavailable: {cpu_kernels.kernel_status()}")


def _run(x, packed, n, bias, path):
    """bf16_linear on ``path``, or a skip with the kernel's reason when this CPU lacks it."""
    try:
        return torch.ops.srt_cpu.bf16_linear(x, packed, n, bias, path)
    except RuntimeError as e:
        if "is not available on this CPU" in str(e):
            pytest.skip(str(e).splitlines()[0])
        raise


def _data(m: int, k: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(m, k, generator=g),
        torch.randn(n, k, generator=g).bfloat16(),
        torch.randn(n, generator=g),
    )


def _assert_within_bound(y, x, w, bias) -> None:
    ref = x.double() @ w.double().T
    mag = x.double().abs() @ w.double().abs().T
    if bias is not None:
        ref, mag = ref + bias.double(), mag + bias.double().abs()
    tol = 1e-5 * mag + 1e-30
    if y.dtype == torch.bfloat16:
        tol = tol + 2.0**-8 * ref.abs()
    err = (y.double() - ref).abs()
    assert bool((err <= tol).all()), f"max error / bound {float((err / tol).max()):.3g}"


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=["x_bf16", "x_f32"])
@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("path", PATHS)
def test_every_path_matches_a_float64_reference(path, m, k, n, x_dtype, with_bias):
    if path in ("avx512_bf16", "brgemm") and x_dtype == torch.float32:
        pytest.skip("bf16 dot products take bf16 activations (float32 ones widen the weights instead)")
    x, w, bias = _data(m, k, n, seed=m * 1000 + k + n)
    x = x.to(x_dtype)
    bias = bias if with_bias else None
    y = _run(x, torch.ops.srt_cpu.pack_bf16_weight(w), n, bias, path)
    assert y.shape == (m, n) and y.dtype == x_dtype
    _assert_within_bound(y, x, w, bias)


@pytest.mark.parametrize("path", ["scalar", "avx2", "avx512", "avx512_bf16"])
def test_a_row_does_not_depend_on_its_batch_on_the_tile_paths(path):
    """Every output is one float32 chain over k in pair order: the same bits for a row alone, in
    any batch, at any position of its register tile, whether the batch takes k in blocks or not."""
    x, w, bias = _data(19, 2100, 70, seed=3)
    x = x.bfloat16()
    packed = torch.ops.srt_cpu.pack_bf16_weight(w)
    full = _run(x, packed, 70, bias, path)
    for lo, hi in [(0, 1), (5, 6), (3, 11), (8, 19), (2, 4), (10, 17)]:
        assert torch.equal(_run(x[lo:hi], packed, 70, bias, path), full[lo:hi]), (lo, hi)


def test_pack_layout_is_vnni_pairs_of_32_columns():
    w = torch.randn(33, 8).bfloat16()
    packed = torch.ops.srt_cpu.pack_bf16_weight(w)
    assert packed.shape == (2, 4, 32, 2) and packed.dtype == torch.bfloat16 and packed.is_contiguous()
    for n, k in [(0, 0), (5, 3), (31, 6), (32, 1), (32, 7)]:
        assert packed[n // 32, k // 2, n % 32, k % 2] == w[n, k]
    assert packed[1, :, 1:].eq(0).all()  # n padding
    with pytest.raises(RuntimeError, match="K must be even"):
        torch.ops.srt_cpu.pack_bf16_weight(torch.randn(4, 7))
    w32 = torch.randn(5, 8)
    assert torch.equal(
        torch.ops.srt_cpu.pack_bf16_weight(w32), torch.ops.srt_cpu.pack_bf16_weight(w32.bfloat16())
    )


def test_path_choice():
    """brgemm from bf16_brgemm_rows() rows where the CPU has AMX (never without: the vdpbf16ps tiles
    beat it there), the vdpbf16ps tiles below that or without AMX -- but from 8 rows on Intel cores
    without AMX, where vdpbf16ps issues at half the FMA's rate, the widened weights --, widened
    weights without bf16 units and for float32 activations."""
    ops = torch.ops.srt_cpu
    rows = ops.bf16_brgemm_rows()
    bf16_units = ops.bf16_linear_path(1, True) == "avx512_bf16"
    widened = ops.bf16_linear_path(1, False)
    assert widened in ("avx512", "avx2", "scalar")
    assert rows >= 1 and (rows < 2**62) == ("amx_bf16" in cpu_features.cpu_flags())
    for m in (1, 7, 8, 64, 512):
        tiles = "avx512_bf16" if m < 8 or not intel_cpu() else widened
        want = ("brgemm" if m >= rows else tiles) if bf16_units else widened
        assert ops.bf16_linear_path(m, True) == want, m
        assert ops.bf16_linear_path(m, False) == widened


def test_errors():
    ops = torch.ops.srt_cpu
    w = torch.randn(40, 16).bfloat16()
    packed = ops.pack_bf16_weight(w)
    x = torch.randn(3, 16).bfloat16()
    with pytest.raises(RuntimeError, match="isa must be"):
        ops.bf16_linear(x, packed, 40, None, "sse")
    with pytest.raises(RuntimeError, match="takes a bf16 x"):
        _run(x.float(), packed, 40, None, "avx512_bf16")
    with pytest.raises(RuntimeError, match="x has 15 columns"):
        ops.bf16_linear(torch.randn(3, 15).bfloat16(), packed, 40, None, "")
    with pytest.raises(RuntimeError, match="x has 18 columns"):
        ops.bf16_linear(torch.randn(3, 18).bfloat16(), packed, 40, None, "")
    with pytest.raises(RuntimeError, match="does not match"):
        ops.bf16_linear(x, packed, 70, None, "")
    with pytest.raises(RuntimeError, match="must come from pack_bf16_weight"):
        ops.bf16_linear(x, packed.float(), 40, None, "")
    with pytest.raises(RuntimeError, match="bias must have 40"):
        ops.bf16_linear(x, packed, 40, torch.zeros(39), "")
    with pytest.raises(RuntimeError, match="bf16 or float32"):
        ops.pack_bf16_weight(torch.randn(4, 4).half())
    assert ops.bf16_linear(torch.randn(0, 16).bfloat16(), packed, 40, None, "").shape == (0, 40)


# ---------------------------------------------------------------- the native backend
def _packed_layer(backend, n_in: int, n_out: int, dtype: torch.dtype, seed: int):
    """A ``Linear`` with a bias on ``backend``, random bf16-valued weights, packed; and its plain weight."""
    layer = Linear(n_in, n_out, bias=True, dtype=dtype, linear_backend=backend)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n_out, n_in, generator=g).bfloat16())
        layer.bias.copy_(torch.randn(n_out, generator=g))
    plain = layer.weight.detach().clone()
    layer.prepare_weights()
    return layer, plain


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_native_backend_packs_bf16_weights_and_releases_the_plain_ones(weight_dtype):
    """A bf16 model's weights (or float32 ones with ``weight_dtype=bf16``: a bf16 checkpoint served
    with float32 activations) go into bf16 panels; the layer keeps those alone and computes in its
    input's dtype."""
    backend = create_linear_backend(
        "native", weight_dtype=torch.bfloat16 if weight_dtype == torch.float32 else None
    )
    assert isinstance(backend, NativeLinear)
    layer, plain = _packed_layer(backend, 48, 40, weight_dtype, seed=1)
    g = torch.Generator().manual_seed(1)
    assert layer.packed_weight.dtype == torch.bfloat16 and layer.weight.is_meta
    with torch.inference_mode():
        for m in (1, 5, 40):
            x = torch.randn(m, 48, generator=g).to(weight_dtype)
            y = layer(x)
            assert y.dtype == weight_dtype
            _assert_within_bound(y, x, plain, layer.bias)
    assert create_linear_backend("native").pack_weight(torch.randn(4, 4).half()) is None
    assert (
        create_linear_backend("native").pack_weight(torch.randn(4, 5).bfloat16()) is None
    )  # odd k: F.linear


def test_tied_embedding_reads_its_rows_from_the_bf16_head():
    emb = VocabEmbedding(70, 34, dtype=torch.bfloat16)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(70, 34))
    plain = emb.weight.detach().clone()
    emb.read_rows_from(torch.ops.srt_cpu.pack_bf16_weight(plain))
    ids = torch.tensor([[0, 31, 32, 69], [5, 5, 64, 1]])
    assert torch.equal(emb._lookup(ids), F.embedding(ids, plain))
    other = VocabEmbedding(70, 34, dtype=torch.bfloat16)
    with torch.no_grad():  # not left uninitialized: freed memory may hold plain's very rows
        other.weight.copy_(plain.roll(1, 0))
    with pytest.raises(ValueError, match="does not hold"):
        other.read_rows_from(torch.ops.srt_cpu.pack_bf16_weight(plain))


# ---------------------------------------------------------------- gate/up with SiLU in one pass
@pytest.mark.parametrize(
    "m,k,d,with_bias",
    [
        (300, 256, 96, False),  # brgemm (where the CPU takes it): chunks of 256 + 44 rows, 3 unit panels
        (70, 3400, 64, True),  # k split into blocks summed in float32, a bias on gate and up
        (65, 128, 32, True),  # one 64-row block and a row
        (5, 128, 64, False),  # under the brgemm rows: the two ops
        (40, 64, 48, True),  # d not a multiple of the 32-column panel: the two ops
        (0, 64, 32, False),
    ],
)
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=["x_bf16", "x_f32"])
def test_gate_up_with_silu_is_silu_and_mul_of_the_linear(m, k, d, with_bias, x_dtype):
    """``bf16_linear_silu_mul`` gives the bits of ``silu_and_mul(bf16_linear(...))``: fused (the
    brgemm path, each gate panel's float32 sums rounded as the separate ops round the stored output)
    or not; and the separate ops are near silu(gate) * up in float64."""
    x, w, bias = _data(m, k, 2 * d, seed=m + k + d)
    x, bias = x.to(x_dtype), (bias.bfloat16() if with_bias else None)
    packed = torch.ops.srt_cpu.pack_bf16_weight(w)
    ops = torch.ops.srt_cpu
    want = ops.silu_and_mul(ops.bf16_linear(x, packed, 2 * d, bias, ""))
    got = ops.bf16_linear_silu_mul(x, packed, 2 * d, bias)
    assert got.shape == (m, d) and got.dtype == x_dtype
    assert torch.equal(got, want)
    ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
    ref = F.silu(ref[:, :d]) * ref[:, d:]
    if m:  # each of gate and up within 2^-8 of its magnitude, silu and the product rounded to bf16
        assert float((got.double() - ref).abs().max()) <= 2.0**-6 * float(ref.abs().max())


def test_llama_mlp_takes_the_fused_gate_up():
    """A bf16 MLP on the native backend gives the same bits through the one-pass gate/up as through
    the layer and the activation, whole or in row chunks."""
    from srt.models import llama

    backend = create_linear_backend("native")
    mlp = llama.LlamaMLP(64, 96, False, torch.bfloat16, backend)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for lin in (mlp.gate_up_proj, mlp.down_proj):
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=g).bfloat16() * 0.1)
            lin.prepare_weights()
    x = torch.randn(600, 64, generator=g).bfloat16()
    with torch.inference_mode():
        fused = mlp(x)
        assert mlp.gate_up_proj.silu_and_mul(x) is not None
        separate = mlp.down_proj(mlp.act_fn(mlp.gate_up_proj(x)))
        old = llama.MLP_CHUNK_BYTES
        try:
            llama.MLP_CHUNK_BYTES = 256 * 192 * 2  # chunks of 256 rows
            chunked = mlp(x)
        finally:
            llama.MLP_CHUNK_BYTES = old
    assert torch.equal(fused, separate) and torch.equal(chunked, separate)


# ---------------------------------------------------------------- oneDNN copies for prefill rows
def _copy_layer(monkeypatch, choice: str, amx: bool = True, memory_ok: bool = True):
    """A bf16 layer on ``NativeLinear(prefill_copy=choice)``, packed, with the AMX and memory checks
    answered as given (oneDNN's bf16 matmul runs on any CPU with AVX-512; only the choice to copy
    depends on AMX). Where oneDNN has no bf16 (AVX2-only CPUs) the copy is a stand-in, the plain
    weight: the choice table runs on every CPU."""
    from srt.layers import linear_backend as lb

    monkeypatch.setattr(lb, "amx_bf16_tiles", lambda: amx)
    if not onednn_bf16_available():
        monkeypatch.setattr(lb, "_reorder_for_prefill", lambda w: w.clone())
    monkeypatch.setattr(lb, "_memory_left_after", lambda nbytes: memory_ok)
    backend = create_linear_backend("native", prefill_copy=choice)
    layer, plain = _packed_layer(backend, 96, 2 * 48, torch.bfloat16, seed=7)
    return backend, layer, plain


def test_prefill_copy_runs_prefill_rows_on_onednn_and_decode_rows_on_srt(monkeypatch):
    from srt.layers.linear_backend import ONEDNN_PREFILL_ROWS

    if not onednn_bf16_available():
        pytest.skip("torch's oneDNN has no bf16 matmul on this CPU (it needs AVX-512 or AVX-NE-CONVERT)")
    backend, layer, plain = _copy_layer(monkeypatch, "on")
    copy = layer.packed_weight.onednn_copy
    assert backend.prefill_copies == 1 and backend.prefill_copy_bytes == plain.numel() * 2
    assert "1 layers" in backend.load_summary()
    g = torch.Generator().manual_seed(8)
    with torch.inference_mode():
        for m in (1, ONEDNN_PREFILL_ROWS - 1, ONEDNN_PREFILL_ROWS, 300):
            x = torch.randn(m, 96, generator=g).bfloat16()
            y = layer(x)
            if m >= ONEDNN_PREFILL_ROWS:
                want = torch.ops.mkldnn._linear_pointwise(x, copy, layer.bias, "none", [], "")
                assert layer.silu_and_mul(x) is None  # oneDNN's matmul, then the activation
            else:
                want = torch.ops.srt_cpu.bf16_linear(x, layer.packed_weight, 96, layer.bias, "")
                assert layer.silu_and_mul(x) is not None
            assert torch.equal(y, want)
            _assert_within_bound(y, x, plain, layer.bias)
            assert torch.equal(
                layer(x.float()),
                torch.ops.srt_cpu.bf16_linear(x.float(), layer.packed_weight, 96, layer.bias, ""),
            )


@pytest.mark.parametrize(
    "choice,amx,memory_ok,copied,skipped",
    [
        ("auto", True, True, 1, 0),
        ("auto", True, False, 0, 1),  # under half of the memory would stay available
        ("on", True, False, 1, 0),
        ("off", True, True, 0, 0),
        ("on", False, True, 0, 0),  # no AMX tiles: srt's kernels beat oneDNN at every row count
    ],
)
def test_prefill_copy_choice(monkeypatch, choice, amx, memory_ok, copied, skipped):
    backend, layer, _ = _copy_layer(monkeypatch, choice, amx, memory_ok)
    assert (getattr(layer.packed_weight, "onednn_copy", None) is not None) == bool(copied)
    assert (backend.prefill_copies, backend.prefill_copies_skipped) == (copied, skipped)
    summary = backend.load_summary()
    assert (summary is None) == (copied + skipped == 0)
    if skipped:
        assert "1 layers without one" in summary
    # a float32 weight stored in bf16 (float32 activations) never gets one
    f32 = NativeLinear(torch.bfloat16, prefill_copy=choice)
    assert getattr(f32.pack_weight(torch.randn(32, 64)), "onednn_copy", None) is None
    with pytest.raises(ValueError, match="prefill_copy"):
        NativeLinear(prefill_copy="sometimes")


@pytest.mark.parametrize(
    "limit,usage,want",
    [
        (None, None, True),  # no cgroup limit: the machine's memory, plenty free
        (8 << 30, 3 << 30, True),  # 5 GiB of an 8 GiB limit free, 1 GiB copied: 4 >= 4
        (8 << 30, 4 << 30, False),  # 4 GiB free, 1 GiB copied: under half of the limit
    ],
)
def test_prefill_copy_memory_rule_reads_the_cgroup(monkeypatch, limit, usage, want):
    """``auto``'s rule counts a container's cgroup limit, not the host's memory that /proc shows."""
    import types

    from srt.layers import linear_backend as lb

    host = types.SimpleNamespace(total=256 << 30, available=200 << 30)
    monkeypatch.setattr("psutil.virtual_memory", lambda: host)
    monkeypatch.setattr(lb, "read_cgroup_memory", lambda: (limit, usage))
    assert lb._memory_left_after(1 << 30) is want

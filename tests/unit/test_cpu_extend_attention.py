"""torch.ops.srt_cpu.extend_attention (extend_attention.cpp) against a per-sequence SDPA reference
with an explicit prefix-aligned causal mask: GQA ratios 1, 3 and 8, head dims 64 and 128, prefixes
and new tokens from 1 to 600 mixed in one batch, strided K/V views, each instruction set (skipped
above the one the CPU runs); bf16 inputs on the AVX512-BF16 kernel (vdpbf16ps) against float64
with windows and soft-caps, and which kernel ``isa=""`` picks for them; and FusedCPUAttnBackend taking it for EXTEND and MIXED batches
(paged pools, cached prefixes) with the torch-native backend as the oracle."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from srt.configs.cpu_features import cpu_bf16_units
from srt.kernels import cpu as cpu_kernels
from srt.layers.attention.fused_cpu import FusedCPUAttnBackend
from srt.layers.forward_batch import ForwardMode
from tests.helpers.isa import cpu_isa, isa_params
from tests.unit.test_torch_native_attention import make_case, run_backend


@pytest.fixture(scope="module")
def native():
    if cpu_isa() is None or not hasattr(torch.ops.srt_cpu, "extend_attention"):
        pytest.skip(f"native CPU kernels unavailable: {cpu_kernels.kernel_status()}")


def reference(q, k, v, q_starts, kv_starts, extend_lens, seq_lens, scale):
    out = torch.zeros_like(q)
    g = q.shape[1] // k.shape[1]
    for qs, ks, e, s in zip(q_starts, kv_starts, extend_lens, seq_lens, strict=True):
        if e == 0:
            continue
        qr = q[qs : qs + e].transpose(0, 1).double()
        kr = k[ks : ks + s].repeat_interleave(g, 1).transpose(0, 1).double()
        vr = v[ks : ks + s].repeat_interleave(g, 1).transpose(0, 1).double()
        mask = torch.ones(e, s, dtype=torch.bool).tril(s - e)
        o = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask, scale=scale)
        out[qs : qs + e] = o.transpose(0, 1).float()
    return out


def make_batch(prefixes, extends, heads, kv_heads, d, seed, strided=False):
    g = torch.Generator().manual_seed(seed)
    T, N = sum(extends), sum(p + e for p, e in zip(prefixes, extends, strict=True))
    q = torch.randn(T, heads, d, generator=g)
    if strided:  # k and v as views into one wider row (what a fused qkv projection gives)
        kv = torch.randn(N, 2 * kv_heads + 1, d, generator=g)
        k, v = kv[:, :kv_heads], kv[:, kv_heads + 1 :]
    else:
        k, v = torch.randn(N, kv_heads, d, generator=g), torch.randn(N, kv_heads, d, generator=g)
    q_starts, kv_starts, qs, ks = [], [], 0, 0
    for p, e in zip(prefixes, extends, strict=True):
        q_starts.append(qs)
        kv_starts.append(ks)
        qs, ks = qs + e, ks + p + e
    seq_lens = [p + e for p, e in zip(prefixes, extends, strict=True)]
    return q, k, v, q_starts, kv_starts, list(extends), seq_lens


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("isa", isa_params())
def test_matches_reference(native, isa, heads, kv_heads, d):
    prefixes = [0, 0, 37, 5, 300, 0]
    extends = [1, 70, 1, 130, 17, 600]
    batch = make_batch(prefixes, extends, heads, kv_heads, d, seed=heads + d, strided=d == 64)
    scale = d**-0.5
    want = reference(*batch, scale)
    desc = [torch.tensor(x, dtype=torch.int64) for x in batch[3:]]
    got = torch.ops.srt_cpu.extend_attention(*batch[:3], *desc, scale, isa)
    assert got.shape == batch[0].shape and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)


def test_rejects_bad_input(native):
    q, k, v = torch.zeros(4, 2, 64), torch.zeros(4, 1, 64), torch.zeros(4, 1, 64)
    ok = [torch.tensor([0]), torch.tensor([0]), torch.tensor([4]), torch.tensor([4])]
    with pytest.raises(RuntimeError, match="outside"):
        torch.ops.srt_cpu.extend_attention(q, k, v, ok[0], ok[1], ok[2], torch.tensor([5]), 1.0)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        torch.ops.srt_cpu.extend_attention(q[..., :32], k[..., :32], v[..., :32], *ok, 1.0)
    with pytest.raises(RuntimeError, match="isa must be"):
        torch.ops.srt_cpu.extend_attention(q, k, v, *ok, 1.0, "neon")


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(
    "mode,prefixes,extends",
    [
        (ForwardMode.EXTEND, [0, 0, 0], [9, 1, 140]),  # no prefix: the k/v rows in hand
        (ForwardMode.EXTEND, [5, 0, 40], [9, 12, 1]),  # prefixes: gathered from the pool
        (ForwardMode.MIXED, [0, 20, 8, 31, 0], [13, 5, 1, 1, 1]),
    ],
)
def test_backend_takes_it_and_matches_torch_native(native, monkeypatch, page_size, mode, prefixes, extends):
    calls = []
    op = torch.ops.srt_cpu.extend_attention

    def counting(*args):
        calls.append(args[0].shape[0])
        return op(*args)

    make = lambda: make_case(mode, prefixes, extends, page_size, heads=6, kv_heads=2, head_dim=64, seed=5)  # noqa: E731
    case = make()
    backend = FusedCPUAttnBackend(None)
    monkeypatch.setattr(torch.ops.srt_cpu, "extend_attention", counting, raising=False)
    case.fb.attn_backend = backend
    backend.init_forward_metadata(case.fb)
    out = backend.forward(case.q, case.k, case.v, case.layer, case.fb)
    assert calls == [backend.forward_metadata.num_extend_tokens]  # one call for every extend sequence
    torch.testing.assert_close(out, run_backend(make()), rtol=1e-4, atol=2e-5)


# ---------------------------------------------------------------------- bf16 on vdpbf16ps
def _bf16_dot_cpu() -> tuple[bool, str]:
    """Whether the AVX512-BF16 kernel runs here (the AVX-512 path on a CPU with vdpbf16ps), and
    whether ``isa=""`` picks it for bf16 inputs (not on Intel's cores, whose vdpbf16ps runs at half
    the FMA's rate: "widened" there)."""
    units = cpu_bf16_units()
    if units is None or cpu_isa() != "avx512":
        return False, "widened"
    with open("/proc/cpuinfo") as f:
        intel = "GenuineIntel" in f.read()
    return True, "widened" if intel else "dot"


@pytest.fixture(scope="module")
def bf16_dot(native):
    runs, _ = _bf16_dot_cpu()
    if not runs:
        pytest.skip(
            "the AVX512-BF16 extend kernel needs vdpbf16ps (AVX512-BF16) and the avx512 ISA (not lowered)"
        )


@pytest.mark.parametrize("heads,kv_heads,d", [(4, 4, 64), (9, 3, 128), (8, 1, 64)])
@pytest.mark.parametrize("window,cap", [(-1, 0.0), (50, 0.0), (-1, 5.0), (7, 2.0)])
@pytest.mark.parametrize("q_scale", [1.0, 3.0])
def test_bf16_dot_matches_reference(bf16_dot, heads, kv_heads, d, window, cap, q_scale):
    """bf16 q, K, V: scores and P @ V on vdpbf16ps (P rounded to bf16, as torch's flash attention
    and transformers' eager attention round it) against float64 on the same bf16 values: every
    output within 6e-3 (under the bf16 rounding of outputs of this size, up to 7.8e-3) and the mean
    error within 4e-4 (a bias, not noise). Sequences of 1 to 600 new tokens behind prefixes of 0 to
    300, key blocks' tails (odd counts) included; sharper scores with q_scale 3."""
    prefixes = [0, 0, 37, 5, 300, 0]
    extends = [1, 70, 1, 130, 17, 600]
    batch = make_batch(prefixes, extends, heads, kv_heads, d, seed=heads + d, strided=d == 64)
    q, k, v = (x.bfloat16() for x in batch[:3])
    q = (q.float() * q_scale).bfloat16()
    scale = d**-0.5
    want = window_cap_reference(q.double(), k.double(), v.double(), *batch[3:], scale, window, cap)
    desc = [torch.tensor(x, dtype=torch.int64) for x in batch[3:]]
    got = torch.ops.srt_cpu.extend_attention(q, k, v, *desc, scale, "avx512_bf16", window, cap)
    assert got.dtype == torch.float32 and got.shape == q.shape
    err = (got.double() - want).abs()
    assert err.max().item() < 6e-3, err.max().item()
    assert err.mean().item() < 4e-4, err.mean().item()


def window_cap_reference(q, k, v, q_starts, kv_starts, extend_lens, seq_lens, scale, window, cap):
    """float64 attention per sequence with the prefix-aligned causal mask, a sliding window (key t
    seen by query j iff prefix + j - window <= t <= prefix + j; -1: none) and a soft-cap."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    g = q.shape[1] // k.shape[1]
    for qs, ks, e, s in zip(q_starts, kv_starts, extend_lens, seq_lens, strict=True):
        qr = q[qs : qs + e].transpose(0, 1)
        kr = k[ks : ks + s].repeat_interleave(g, 1).transpose(0, 1)
        vr = v[ks : ks + s].repeat_interleave(g, 1).transpose(0, 1)
        scores = qr @ kr.transpose(1, 2) * scale
        if cap > 0:
            scores = cap * torch.tanh(scores / cap)
        j = torch.arange(e).view(-1, 1) + (s - e)
        t = torch.arange(s).view(1, -1)
        seen = (t <= j) & ((t >= j - window) if window >= 0 else True)
        p = scores.masked_fill(~seen, float("-inf")).softmax(-1)
        out[qs : qs + e] = (p @ vr).transpose(0, 1)
    return out


def test_bf16_default_path_and_refusals(native):
    """``isa=""`` on bf16 inputs: the AVX512-BF16 kernel where vdpbf16ps is fast, else the float32
    kernel on the widened values (the same bits as passing them widened); "avx512_bf16" refuses
    float32 inputs, and CPUs without it."""
    runs, default = _bf16_dot_cpu()
    batch = make_batch([0, 9], [70, 5], 6, 2, 64, seed=3)
    q, k, v = (x.bfloat16() for x in batch[:3])
    desc = [torch.tensor(x, dtype=torch.int64) for x in batch[3:]]
    got = torch.ops.srt_cpu.extend_attention(q, k, v, *desc, 0.125)
    widened = torch.ops.srt_cpu.extend_attention(q.float(), k.float(), v.float(), *desc, 0.125)
    if default == "dot":
        assert torch.equal(got, torch.ops.srt_cpu.extend_attention(q, k, v, *desc, 0.125, "avx512_bf16"))
        assert not torch.equal(got, widened)
    else:
        assert torch.equal(got, widened)
    if runs:
        with pytest.raises(RuntimeError, match="takes bf16 q, k and v"):
            torch.ops.srt_cpu.extend_attention(q.float(), k, v, *desc, 0.125, "avx512_bf16")
    else:
        with pytest.raises(RuntimeError, match="not available"):
            torch.ops.srt_cpu.extend_attention(q, k, v, *desc, 0.125, "avx512_bf16")

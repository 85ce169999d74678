"""torch.ops.srt_cpu.extend_attention (extend_attention.cpp) against a per-sequence SDPA reference
with an explicit prefix-aligned causal mask: GQA ratios 1, 3 and 8, head dims 64 and 128, prefixes
and new tokens from 1 to 600 mixed in one batch, strided K/V views, each instruction set (skipped
above the one the CPU runs); and FusedCPUAttnBackend taking it for EXTEND and MIXED batches
(paged pools, cached prefixes) with the torch-native backend as the oracle."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

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

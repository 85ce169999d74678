"""Sliding-window attention and logit soft-capping on the CPU backends.

The oracle is a naive loop over every query (its own key range ``max(0, p - window_left) .. p``,
scores ``cap * tanh(scale q.k / cap)``, softmax, float64), independent of torch_native's
``visible_keys``/``math_attention`` (srt/layers/attention/window_cap.py). torch_native is checked against it; fused_cpu's native
kernels against both (decode and extend, with and without cached prefix, windows shorter and
longer than the sequences, window 0, GQA, head dims 64 and 128, page sizes 1 and 16, mixed
lengths); the native kernels must not read the keys before a window at all (they are NaN there);
the fallbacks of fused_cpu (no native kernels, a head dim or dtype the extend kernel refuses) must
still honour both features; the native decode stack of Llama-family models must equal the
layer-by-layer path on a Mistral with a sliding window.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from srt.kernels import cpu as cpu_kernels
from srt.kernels.cpu.reference import paged_decode_attention_ref
from srt.layers.attention import fused_cpu
from srt.layers.attention.fused_cpu import FusedCPUAttnBackend
from srt.layers.forward_batch import ForwardMode
from tests.unit.test_torch_native_attention import Case, FakeLayer, make_case, run_backend


@dataclasses.dataclass
class WindowCapLayer(FakeLayer):
    sliding_window_size: int = -1
    logit_cap: float = 0.0


BATCHES = {
    "decode": (ForwardMode.DECODE, [1, 30, 0, 17, 64, 300], [1] * 6),
    "extend": (ForwardMode.EXTEND, [0, 0, 0], [7, 70, 16]),
    "extend_prefix": (ForwardMode.EXTEND, [5, 0, 90, 16], [9, 12, 1, 40]),
    "mixed": (ForwardMode.MIXED, [0, 20, 8, 131, 0], [13, 5, 1, 1, 1]),
}
WINDOWS_CAPS = [(-1, 0.0), (-1, 3.0), (0, 0.0), (5, 0.0), (5, 2.5), (40, 0.0), (1000, 1.5)]


def make(batch: str, window: int, cap: float, page_size: int = 16, heads=6, kv_heads=2, head_dim=64, seed=7):
    mode, prefixes, extends = BATCHES[batch]
    case = make_case(mode, prefixes, extends, page_size, heads, kv_heads, head_dim, seed=seed)
    case.layer = WindowCapLayer(**dataclasses.asdict(case.layer), sliding_window_size=window, logit_cap=cap)
    return case


def naive(case: Case) -> torch.Tensor:
    """One query at a time: its window of keys, capped scores, softmax (float64)."""
    fb, layer = case.fb, case.layer
    h, h_kv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    window, cap = layer.sliding_window_size, layer.logit_cap
    rows = []
    for i in range(fb.batch_size):
        e, s = fb.extend_seq_lens_cpu[i], fb.seq_lens_cpu[i]
        start = int(fb.extend_start_loc[i])
        for j in range(e):
            pos = s - e + j
            lo = max(0, pos - window) if window >= 0 else 0
            k = case.full_k[i][lo : pos + 1].double().repeat_interleave(h // h_kv, dim=1)
            v = case.full_v[i][lo : pos + 1].double().repeat_interleave(h // h_kv, dim=1)
            q = case.q[start + j].view(h, d).double()
            scores = torch.einsum("hd,khd->hk", q, k) * layer.scaling
            if cap > 0:
                scores = torch.tanh(scores / cap) * cap
            rows.append(torch.einsum("hk,khd->hd", scores.softmax(-1), v).reshape(h * d))
    return torch.stack(rows).float()


def run_fused(case: Case) -> torch.Tensor:
    backend = FusedCPUAttnBackend(None)
    case.fb.attn_backend = backend
    backend.init_forward_metadata(case.fb)
    return backend.forward(case.q, case.k, case.v, case.layer, case.fb)


@pytest.fixture(scope="module")
def native():
    if not cpu_kernels.load(build_if_missing=True):
        pytest.skip(f"native CPU kernels unavailable: {cpu_kernels.kernel_status()}")
    return True


def _no_fallback(*args, **kwargs):
    raise AssertionError("the native kernels should have run, not torch_native's path")


# ---------------------------------------------------------------------- torch_native vs the loop
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("window,cap", WINDOWS_CAPS)
@pytest.mark.parametrize("batch", list(BATCHES))
def test_torch_native_matches_per_query_loop(batch, window, cap, page_size):
    case = make(batch, window, cap, page_size, head_dim=16)
    out = run_backend(case)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, naive(case), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------- fused_cpu's native kernels
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(6, 2, 64), (8, 1, 128), (4, 4, 128)])
@pytest.mark.parametrize("window,cap", WINDOWS_CAPS)
@pytest.mark.parametrize("batch", list(BATCHES))
def test_fused_native_matches_torch_native(
    native, monkeypatch, batch, window, cap, heads, kv_heads, head_dim, page_size
):
    monkeypatch.setattr(fused_cpu, "sdpa_extend", _no_fallback)
    monkeypatch.setattr(fused_cpu, "sdpa_decode", _no_fallback)
    case, twin = (make(batch, window, cap, page_size, heads, kv_heads, head_dim) for _ in range(2))
    out = run_fused(case)
    assert out.shape == case.q.shape and torch.isfinite(out).all()
    torch.testing.assert_close(out, run_backend(twin), rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(out, naive(case), rtol=1e-4, atol=2e-5)


def _isas() -> list[str]:
    if not cpu_kernels.native_available():
        return ["scalar"]
    order = ["scalar", "avx2", "avx512"]
    return order[: order.index(torch.ops.srt_cpu.cpu_isa()) + 1]


@pytest.mark.parametrize("split_len", [0, 64])
@pytest.mark.parametrize("window,cap", [(0, 0.0), (50, 0.0), (50, 4.0), (3000, 2.0)])
def test_decode_kernel_skips_keys_before_the_window(native, window, cap, split_len):
    """Keys before the window are NaN: a kernel that read (and masked) them would return NaN."""
    g = torch.Generator().manual_seed(3)
    lens = [2000, 700, 1, 40]
    S, h_kv, d, h = sum(lens) + 16, 2, 64, 6
    k, v = torch.randn(S, h_kv, d, generator=g), torch.randn(S, h_kv, d, generator=g)
    r2t = torch.full((len(lens) + 1, 2048), S - 1, dtype=torch.int64)
    slots = torch.randperm(sum(lens), generator=g)
    poisoned_k, poisoned_v = k.clone(), v.clone()
    start = 0
    for i, n in enumerate(lens):
        row = slots[start : start + n]
        r2t[i + 1, :n] = row
        first = max(0, n - 1 - window)
        poisoned_k[row[:first]] = float("nan")
        poisoned_v[row[:first]] = float("nan")
        start += n
    rows, seq_lens = torch.arange(1, len(lens) + 1), torch.tensor(lens)
    q = torch.randn(len(lens), h, d, generator=g)
    want = paged_decode_attention_ref(q, k, v, r2t, rows, seq_lens, 0.2, window, cap)
    for isa in _isas():
        out = torch.ops.srt_cpu.paged_decode_attention(
            q,
            poisoned_k,
            poisoned_v,
            r2t,
            rows,
            seq_lens,
            0.2,
            split_len,
            isa,
            window_left=window,
            logit_cap=cap,
        )
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5, msg=lambda m, isa=isa: f"{isa}: {m}")
    # the Python entry point takes the same arguments, native or not
    torch.testing.assert_close(
        cpu_kernels.paged_decode_attention(
            q, k, v, r2t, rows, seq_lens, 0.2, window_left=window, logit_cap=cap
        ),
        want,
        rtol=1e-5,
        atol=1e-5,
    )


def test_extend_kernel_skips_blocks_before_the_window(native):
    """A long cached prefix under a small window: the 64-key chunks before the first query's window
    are NaN and must never be read."""
    g = torch.Generator().manual_seed(5)
    h, h_kv, d, window, cap = 8, 2, 128, 30, 5.0
    seqs = [(1000, 20), (0, 150), (64, 1)]  # (prefix, new tokens)
    n_kv, n_q = sum(p + e for p, e in seqs), sum(e for _, e in seqs)
    k, v, q = (torch.randn(n, hh, d, generator=g) for n, hh in ((n_kv, h_kv), (n_kv, h_kv), (n_q, h)))
    qs, ks, es, ss = [], [], [], []
    kk, vv = k.clone(), v.clone()
    q0 = k0 = 0
    for p, e in seqs:
        qs.append(q0), ks.append(k0), es.append(e), ss.append(p + e)
        dead = max(0, p - window) // 64 * 64  # keys in chunks wholly before row 0's window
        kk[k0 : k0 + dead] = float("nan")
        vv[k0 : k0 + dead] = float("nan")
        q0, k0 = q0 + e, k0 + p + e
    desc = [torch.tensor(x, dtype=torch.int64) for x in (qs, ks, es, ss)]
    twin = make_case(ForwardMode.EXTEND, [p for p, _ in seqs], [e for _, e in seqs], 1, h, h_kv, d)
    twin.q = q.reshape(n_q, h * d)
    twin.full_k = [k[k0 : k0 + s] for k0, s in zip(ks, ss)]
    twin.full_v = [v[k0 : k0 + s] for k0, s in zip(ks, ss)]
    twin.layer = WindowCapLayer(h, h_kv, d, 0.1, 1, window, cap)
    want = naive(twin).view(n_q, h, d)
    for isa in _isas():
        out = torch.ops.srt_cpu.extend_attention(
            q, kk, vv, *desc, 0.1, isa, window_left=window, logit_cap=cap
        )
        torch.testing.assert_close(out, want, rtol=1e-4, atol=2e-5, msg=lambda m, isa=isa: f"{isa}: {m}")


# ---------------------------------------------------------------------- fused_cpu's fallbacks
@pytest.mark.parametrize("batch", ["decode", "mixed", "extend_prefix"])
def test_fallback_without_native_kernels_is_torch_native(monkeypatch, batch):
    monkeypatch.setattr(cpu_kernels, "native_available", lambda: False)
    case, twin = (make(batch, 5, 2.5, 16) for _ in range(2))
    out = run_fused(case)
    assert torch.equal(out, run_backend(twin))
    torch.testing.assert_close(out, naive(case), rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("batch", ["extend_prefix", "mixed"])
def test_head_dim_the_extend_kernel_refuses(native, batch):
    """Head dim 16: extend through torch_native's math path, decode through the native kernel."""
    case, twin = (make(batch, 5, 2.5, 1, head_dim=16) for _ in range(2))
    out = run_fused(case)
    torch.testing.assert_close(out, run_backend(twin), rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(out, naive(case), rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("batch", ["decode", "mixed"])
def test_bfloat16_activations(native, batch):
    case, twin = (make(batch, 5, 2.5, 16) for _ in range(2))
    for c in (case, twin):
        c.q, c.k, c.v = (t.to(torch.bfloat16) for t in (c.q, c.k, c.v))
    out = run_fused(case)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), run_backend(twin).float(), rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------------- the native decode stack
def _decode_logits(runner, lens: list[int], seed: int) -> torch.Tensor:
    from srt.layers.forward_batch import ForwardBatch
    from tests.unit.test_native_decode_layers import _fill

    rows, loc = _fill(runner, lens, seed)
    ids = [(37 * i + 11) % runner.model_config.vocab_size for i in range(len(lens))]
    fb = ForwardBatch.build(ForwardMode.DECODE, ids, rows, lens, [1] * len(lens), loc, runner.device)
    return runner.forward(fb).next_token_logits.clone()


def test_native_decode_stack_honours_window_and_cap(native, tmp_path):
    """Mistral with ``sliding_window`` 8 (window_left 7) through LlamaModel: the one-call native
    stack equals the layer-by-layer path bit for bit, and the window changes exactly the
    sequences longer than it (against the same weights without a window)."""
    from tests.helpers.tiny_models import save_tiny_model
    from tests.unit.test_native_decode_layers import _decode_both_ways, _runner

    windowed = _runner(
        save_tiny_model("mistral", tmp_path / "w", seed=1, sliding_window=8), linear_backend="native"
    )
    plain = _runner(save_tiny_model("mistral", tmp_path / "p", seed=1), linear_backend="native")
    layers = windowed.model.model.layers
    assert [layer.self_attn.attn.sliding_window_size for layer in layers] == [7] * len(layers)
    assert windowed.model.model.native_decode is not None and plain.model.model.native_decode is not None
    _decode_both_ways(windowed, [1, 5, 300, 17], seed=3)
    lens = [300, 5, 7, 8]  # the decoded token is the (len + 1)-th: the window of 8 covers 5 and 7 + 1
    got, free = _decode_logits(windowed, lens, seed=4), _decode_logits(plain, lens, seed=4)
    assert not torch.allclose(got[0], free[0]) and not torch.allclose(got[3], free[3])
    assert torch.equal(got[1:3], free[1:3])
    for i, layer in enumerate(layers):  # soft-capping on every other layer, then rebuild the stack
        layer.self_attn.attn.logit_cap = 0.5 if i % 2 else 0.0
    assert windowed.model.enable_native_decode().startswith("native decode layers on")
    _decode_both_ways(windowed, [1, 5, 300, 17], seed=5)

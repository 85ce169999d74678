"""TorchNativeAttnBackend vs a naive per-sequence reference on random tensors.

Each case lays sequences out in a KV pool with shuffled (non-contiguous) pages, fills every
unused slot with NaN (so any read of a slot the backend should not touch poisons the output),
writes random K/V for the cached prefixes, then runs one layer of attention for the new tokens.
"""

from __future__ import annotations

import math
import random
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from srt.layers.attention import torch_native
from srt.layers.attention.registry import (
    UnknownAttentionBackendError,
    available_attention_backends,
    create_attention_backend,
)
from srt.layers.attention.torch_native import TorchNativeAttnBackend
from srt.layers.forward_batch import ForwardBatch, ForwardMode
from srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool


@dataclass
class FakeLayer:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    layer_id: int = 0


@dataclass
class Case:
    fb: ForwardBatch
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    full_k: list[torch.Tensor]  # per sequence [seq_len, H_kv, D]
    full_v: list[torch.Tensor]
    layer: FakeLayer


def _slots_for(num_tokens: int, page_size: int, free_pages: list[int]) -> list[int]:
    pages = [free_pages.pop() for _ in range(math.ceil(num_tokens / page_size))]
    return [pages[t // page_size] * page_size + t % page_size for t in range(num_tokens)]


def make_case(
    mode: ForwardMode,
    prefix_lens: list[int],
    extend_lens: list[int],
    page_size: int,
    heads: int = 6,
    kv_heads: int = 2,
    head_dim: int = 16,
    layer_id: int = 1,
    seed: int = 0,
) -> Case:
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    bs = len(prefix_lens)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pool_pages = sum(math.ceil(s / page_size) for s in seq_lens) + 7  # the last page stays unused
    pool = MHATokenToKVPool(pool_pages * page_size, page_size, torch.float32, kv_heads, head_dim, 3, "cpu")
    for buf in pool.k_buffer + pool.v_buffer:
        buf[page_size:] = float("nan")
    req_pool = ReqToTokenPool(bs + 3, max(seq_lens) + 5, "cpu")
    # stale entries past seq_len point at a NaN slot: a backend must never read them
    req_pool.req_to_token.fill_(pool_pages * page_size + page_size - 1)
    free_pages = list(range(1, pool_pages))  # page 0 is the padding page
    rng.shuffle(free_pages)
    rows = req_pool.alloc(bs + 3)[3:]  # rows 0..2 stay unused: indices need not start at 0
    rng.shuffle(rows)

    full_k, full_v, out_loc = [], [], []
    for i in range(bs):
        slots = _slots_for(seq_lens[i], page_size, free_pages)
        req_pool.req_to_token[rows[i], : seq_lens[i]] = torch.tensor(slots)
        full_k.append(torch.randn(seq_lens[i], kv_heads, head_dim, generator=g))
        full_v.append(torch.randn(seq_lens[i], kv_heads, head_dim, generator=g))
        p = prefix_lens[i]
        if p:
            loc = torch.tensor(slots[:p])
            pool.set_kv_buffer(layer_id, loc, full_k[i][:p], full_v[i][:p])
        out_loc.extend(slots[p:])

    k = torch.cat([fk[p:] for fk, p in zip(full_k, prefix_lens)]).reshape(-1, kv_heads * head_dim)
    v = torch.cat([fv[p:] for fv, p in zip(full_v, prefix_lens)]).reshape(-1, kv_heads * head_dim)
    q = torch.randn(k.shape[0], heads * head_dim, generator=g)
    num_extend = sum(1 for e in extend_lens if e > 1) if mode == ForwardMode.MIXED else None
    kw = {"num_extend_seqs": num_extend} if num_extend is not None else {}
    fb = ForwardBatch.build(mode, [0] * k.shape[0], rows, prefix_lens, extend_lens, out_loc, **kw)
    fb.req_to_token_pool = req_pool
    fb.token_to_kv_pool = pool
    layer = FakeLayer(heads, kv_heads, head_dim, head_dim**-0.5 * 1.3, layer_id)
    return Case(fb, q, k, v, full_k, full_v, layer)


def reference(case: Case) -> torch.Tensor:
    """Naive attention, one sequence at a time, repeated KV heads, explicit bottom-right causal mask."""
    fb, layer = case.fb, case.layer
    h, h_kv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    outs = []
    for i in range(fb.batch_size):
        e, s = fb.extend_seq_lens_cpu[i], fb.seq_lens_cpu[i]
        start = fb.extend_start_loc[i].item()
        q = case.q[start : start + e].view(e, h, d).double()
        kk = case.full_k[i].double().repeat_interleave(h // h_kv, dim=1)
        vv = case.full_v[i].double().repeat_interleave(h // h_kv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, kk) * layer.scaling
        allowed = torch.arange(s)[None, :] <= (s - e + torch.arange(e))[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv).reshape(e, h * d))
    return torch.cat(outs).float()


def run_backend(case: Case) -> torch.Tensor:
    backend = TorchNativeAttnBackend(None)
    case.fb.attn_backend = backend
    backend.init_forward_metadata(case.fb)
    return backend.forward(case.q, case.k, case.v, case.layer, case.fb)


def check(case: Case) -> None:
    out = run_backend(case)
    assert out.shape == case.q.shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, reference(case), rtol=1e-4, atol=1e-5)
    # the new tokens' K/V were written at out_cache_loc of this layer (and no other layer)
    pool, loc = case.fb.token_to_kv_pool, case.fb.out_cache_loc
    kv = case.layer.num_kv_heads, case.layer.head_dim
    torch.testing.assert_close(pool.k_buffer[case.layer.layer_id][loc], case.k.view(-1, *kv))
    torch.testing.assert_close(pool.v_buffer[case.layer.layer_id][loc], case.v.view(-1, *kv))
    assert torch.isnan(pool.k_buffer[0][loc]).all()


PAGE_SIZES = [1, 16]


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_extend_from_scratch(page_size):
    check(make_case(ForwardMode.EXTEND, [0, 0, 0, 0], [7, 33, 1, 20], page_size))


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_extend_on_cached_prefix(page_size):
    check(make_case(ForwardMode.EXTEND, [5, 0, 40, 16, 3], [9, 12, 1, 17, 30], page_size, seed=1))


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_extend_equal_shapes_are_batched(page_size):
    case = make_case(ForwardMode.EXTEND, [4, 4, 4, 0, 0, 10], [6, 6, 6, 8, 8, 6], page_size, seed=2)
    check(case)
    runs = case.fb.attn_backend.forward_metadata.extend_runs
    assert [(r.n, r.extend_len, r.seq_len) for r in runs] == [(3, 6, 10), (2, 8, 8), (1, 6, 16)]


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_decode(page_size):
    case = make_case(ForwardMode.DECODE, [1, 30, 0, 17, 64], [1, 1, 1, 1, 1], page_size, seed=3)
    check(case)
    md = case.fb.attn_backend.forward_metadata
    # small batch: one chunk, one padded [bs, max_len] gather index built once per batch,
    # sequences ordered by length
    (chunk,) = md.decode_chunks
    assert chunk.slots.numel() == 5 * 65 and chunk.mask.shape == (5, 1, 1, 65)
    assert chunk.index.tolist() == [2, 0, 3, 1, 4]


def test_decode_equal_lengths_needs_no_mask():
    case = make_case(ForwardMode.DECODE, [12, 12, 12], [1, 1, 1], 16, seed=4)
    check(case)
    (chunk,) = case.fb.attn_backend.forward_metadata.decode_chunks
    assert chunk.mask is None and chunk.index is None  # already in length order: plain slices


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_decode_in_chunks_by_length(page_size, monkeypatch):
    # a gather budget of 40 rows: sequences are sorted by length and cut into chunks
    head_num, head_dim = 2, 16  # make_case's pool (kv_heads, head_dim)
    monkeypatch.setattr(torch_native, "DECODE_CHUNK_BYTES", 40 * 2 * head_num * head_dim * 4)
    prefixes = [30, 3, 9, 2, 17, 8, 25, 4, 4]
    case = make_case(ForwardMode.DECODE, prefixes, [1] * len(prefixes), page_size, seed=7)
    check(case)
    chunks = case.fb.attn_backend.forward_metadata.decode_chunks
    seen = []
    for c in chunks:
        idx = list(range(c.start, c.start + c.n)) if c.index is None else c.index.tolist()
        lens = [prefixes[i] + 1 for i in idx]
        assert c.max_len == max(lens) and (c.n == 1 or c.n * c.max_len <= 40)
        seen += lens
    assert seen == sorted(p + 1 for p in prefixes) and len(chunks) > 2


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_mixed(page_size):
    # extend sequences first (one on a cached prefix), then decoding sequences
    case = make_case(ForwardMode.MIXED, [0, 20, 8, 31, 0], [13, 5, 1, 1, 1], page_size, seed=5)
    assert case.fb.num_extend_seqs == 2
    check(case)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 1), (6, 3)])
def test_head_layouts(heads, kv_heads):
    check(make_case(ForwardMode.EXTEND, [3, 0], [5, 9], 1, heads=heads, kv_heads=kv_heads, seed=6))
    check(make_case(ForwardMode.DECODE, [3, 9], [1, 1], 16, heads=heads, kv_heads=kv_heads, seed=7))


def _sub_batch(case: Case, mode: ForwardMode, seqs: range) -> Case:
    """The same sequences, tensors and pools as ``case``, restricted to ``seqs``, in ``mode``."""
    fb = case.fb
    starts = fb.extend_start_loc.tolist()
    tok = slice(starts[seqs.start], starts[seqs.stop - 1] + fb.extend_seq_lens_cpu[seqs.stop - 1])
    sub = ForwardBatch.build(
        mode,
        fb.input_ids[tok].tolist(),
        fb.req_pool_indices[seqs.start : seqs.stop].tolist(),
        fb.extend_prefix_lens_cpu[seqs.start : seqs.stop],
        fb.extend_seq_lens_cpu[seqs.start : seqs.stop],
        fb.out_cache_loc[tok],
    )
    sub.req_to_token_pool, sub.token_to_kv_pool = fb.req_to_token_pool, fb.token_to_kv_pool
    return Case(sub, case.q[tok], case.k[tok], case.v[tok], case.full_k, case.full_v, case.layer)


def test_mixed_equals_split_batches():
    """A MIXED batch computes the same per-token outputs as its EXTEND and DECODE halves alone."""
    mixed = make_case(ForwardMode.MIXED, [0, 6, 22, 9], [11, 4, 1, 1], 16, seed=8)
    out_mixed = run_backend(mixed)
    out_ext = run_backend(_sub_batch(mixed, ForwardMode.EXTEND, range(0, 2)))
    out_dec = run_backend(_sub_batch(mixed, ForwardMode.DECODE, range(2, 4)))
    torch.testing.assert_close(out_mixed, torch.cat([out_ext, out_dec]), rtol=0, atol=0)


def test_one_backend_across_batches_and_inference_mode():
    """The gather workspace is reused when it fits and re-made when it must be; results stay right."""
    backend = TorchNativeAttnBackend(None)
    big = make_case(ForwardMode.DECODE, [60, 61, 62, 63], [1, 1, 1, 1], 16, seed=10)
    small = make_case(ForwardMode.MIXED, [0, 2], [3, 1], 1, seed=11)
    big2 = make_case(ForwardMode.DECODE, [50, 40, 62, 63], [1, 1, 1, 1], 16, seed=12)
    ptrs = []
    for case, inference in [(big, False), (big2, False), (small, True), (big, True), (big2, False)]:
        case.fb.attn_backend = backend
        with torch.inference_mode(inference):
            backend.init_forward_metadata(case.fb)
            out = backend.forward(case.q, case.k, case.v, case.layer, case.fb)
        torch.testing.assert_close(out, reference(case), rtol=1e-4, atol=1e-5)
        ptrs.append(backend.workspace._buffers[0].data_ptr())
    assert ptrs[0] == ptrs[1]  # same size class: reused
    assert ptrs[2] != ptrs[1]  # much smaller batch: re-made


def test_forward_without_metadata_raises():
    case = make_case(ForwardMode.DECODE, [3], [1], 1)
    with pytest.raises(RuntimeError, match="init_forward_metadata"):
        TorchNativeAttnBackend(None).forward(case.q, case.k, case.v, case.layer, case.fb)


def test_registry_creates_torch_native_and_never_imports_flashinfer():
    assert {"torch_native", "flashinfer"} <= set(available_attention_backends())
    backend = create_attention_backend("torch_native", None)
    assert isinstance(backend, TorchNativeAttnBackend)
    with pytest.raises(UnknownAttentionBackendError, match="torch_native"):
        create_attention_backend("nope", None)
    # in a fresh interpreter: other tests of this session may have imported flashinfer on purpose
    code = (
        "import sys\n"
        "from srt.layers.attention.registry import create_attention_backend\n"
        "create_attention_backend('torch_native', None)\n"
        "create_attention_backend('fused_cpu', None)\n"
        "assert 'flashinfer' not in sys.modules, 'flashinfer was imported'\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]

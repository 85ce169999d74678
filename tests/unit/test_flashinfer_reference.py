"""srt's torch reference of FlashInfer's paged attention (srt/layers/attention/paged_reference.py)
against FlashInfer's own shipped pure-torch reference (``flashinfer/trace/templates/attention.py``,
private API: it ignores ``kv_last_page_len``, so it applies to full pages only, returns bf16 and
an lse in log2 units), and against per-sequence SDPA where pages are partly filled."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from srt.layers.attention.paged_reference import paged_attention_reference, paged_decode_reference
from tests.unit.test_flashinfer_backend import real_flashinfer  # noqa: F401 (fixture)


@pytest.fixture(scope="module")
def fi_reference(real_flashinfer):  # noqa: F811
    try:
        from flashinfer.trace.templates import attention
    except ImportError as e:
        pytest.skip(f"flashinfer {real_flashinfer.__version__} ships no trace reference ({e})")
    for name in ("_gqa_paged_decode_reference", "_gqa_paged_prefill_reference"):
        if not hasattr(attention, name):
            pytest.skip(f"flashinfer {real_flashinfer.__version__} has no {name}")
    return attention


def _random_paged(
    kv_lens: list[int],
    qo_lens: list[int],
    page_size: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    seed: int,
):
    """A shuffled paged cache and FlashInfer's index arrays for sequences of ``kv_lens`` tokens."""
    g = torch.Generator().manual_seed(seed)
    num_pages = [math.ceil(n / page_size) for n in kv_lens]
    total = sum(num_pages) + 3
    k_cache = torch.randn(total, page_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(total, page_size, kv_heads, head_dim, generator=g)
    perm = torch.randperm(total, generator=g)[: sum(num_pages)]
    kv_indptr = torch.tensor([0] + num_pages).cumsum(0).to(torch.int32)
    qo_indptr = torch.tensor([0] + qo_lens).cumsum(0).to(torch.int32)
    last = torch.tensor([n - (p - 1) * page_size for n, p in zip(kv_lens, num_pages)], dtype=torch.int32)
    q = torch.randn(sum(qo_lens), heads, head_dim, generator=g)
    return q, k_cache, v_cache, qo_indptr, kv_indptr, perm.to(torch.int32), last


# (kv_lens, qo_lens); with page size 16 every kv_len is a multiple of 16 (full pages)
SHAPES = {1: ([7, 1, 30, 12], [3, 1, 30, 5]), 16: ([16, 48, 32], [16, 5, 1])}


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_prefill_matches_flashinfer_reference(fi_reference, page_size, heads, kv_heads):
    kv_lens, qo_lens = SHAPES[page_size]
    q, kc, vc, qo, kvp, idx, last = _random_paged(kv_lens, qo_lens, page_size, heads, kv_heads, 64, seed=1)
    scale = 0.11
    out, lse = paged_attention_reference(q, kc, vc, qo, kvp, idx, last, causal=True, sm_scale=scale)
    ref_out, ref_lse = fi_reference._gqa_paged_prefill_reference(q, kc, vc, qo, kvp, idx, scale)
    torch.testing.assert_close(out.to(torch.bfloat16), ref_out, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)  # both log2 units


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_decode_matches_flashinfer_reference(fi_reference, page_size, heads, kv_heads):
    kv_lens = SHAPES[page_size][0]
    q, kc, vc, _, kvp, idx, last = _random_paged(
        kv_lens, [1] * len(kv_lens), page_size, heads, kv_heads, 128, 2
    )
    out, lse = paged_decode_reference(q, kc, vc, kvp, idx, last, sm_scale=128**-0.5)
    ref_out, ref_lse = fi_reference._gqa_paged_decode_reference(q, kc, vc, kvp, idx, 128**-0.5)
    torch.testing.assert_close(out.to(torch.bfloat16), ref_out, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (8, 1)])
def test_partial_pages_match_sdpa(heads, kv_heads):
    """Partial last pages (FlashInfer's reference cannot check them): per-sequence SDPA with a
    bottom-right causal mask and ``enable_gqa`` (query head h reads KV head h // group)."""
    kv_lens, qo_lens, page_size = [20, 1, 33, 16], [4, 1, 33, 1], 16
    q, kc, vc, qo, kvp, idx, last = _random_paged(kv_lens, qo_lens, page_size, heads, kv_heads, 64, seed=3)
    out, lse = paged_attention_reference(q, kc, vc, qo, kvp, idx, last, causal=True)
    for i, (n, m) in enumerate(zip(kv_lens, qo_lens)):
        pages = idx[kvp[i] : kvp[i + 1]].long()
        k = kc[pages].flatten(0, 1)[:n].transpose(0, 1)
        v = vc[pages].flatten(0, 1)[:n].transpose(0, 1)
        qi = q[qo[i] : qo[i + 1]].transpose(0, 1)
        mask = torch.ones(m, n, dtype=torch.bool).tril(n - m)
        ref = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(out[qo[i] : qo[i + 1]], ref, rtol=1e-5, atol=1e-5)
        scores = torch.einsum("hqd,hkd->hqk", qi, k.repeat_interleave(heads // kv_heads, 0)) / 8.0
        ref_lse = scores.masked_fill(~mask, -math.inf).logsumexp(-1).T / math.log(2.0)
        torch.testing.assert_close(lse[qo[i] : qo[i + 1]], ref_lse, rtol=1e-5, atol=1e-5)


def test_rows_past_the_last_page_len_are_never_read():
    q, kc, vc, qo, kvp, idx, last = _random_paged([20, 5], [3, 1], 16, 4, 2, 64, seed=4)
    out, _ = paged_attention_reference(q, kc, vc, qo, kvp, idx, last, causal=True)
    for i, n in enumerate([20, 5]):  # poison the unused rows of each last page
        kc[idx[kvp[i + 1] - 1].long(), (n - 1) % 16 + 1 :] = float("nan")
    again, _ = paged_attention_reference(q, kc, vc, qo, kvp, idx, last, causal=True)
    assert torch.equal(out, again)


def test_bad_metadata_raises():
    q, kc, vc, qo, kvp, idx, last = _random_paged([4], [4], 16, 4, 2, 64, seed=5)
    with pytest.raises(ValueError, match="kv_len"):
        paged_attention_reference(q, kc, vc, qo, kvp, idx, last - 1, causal=True)  # qo_len 4 > kv_len 3

"""srt page table -> FlashInfer index arrays (srt/layers/attention/flashinfer_metadata.py):
hand-worked tables, the layout invariants on random paged batches, and FlashInfer's own
``get_seq_lens`` reading the arrays back."""

from __future__ import annotations

import pytest
import torch

from srt.layers.attention.flashinfer_metadata import (
    build_paged_kv_metadata,
    check_page_aligned,
    kv_lens,
    paged_view,
)
from srt.layers.forward_batch import ForwardMode
from tests.unit.test_flashinfer_backend import BATCHES, real_flashinfer  # noqa: F401 (fixture)
from tests.unit.test_torch_native_attention import Case, make_case


def _table(rows: list[list[int]], width: int = 40) -> torch.Tensor:
    r2t = torch.full((len(rows) + 1, width), 999, dtype=torch.int64)
    for i, slots in enumerate(rows):
        r2t[i + 1, : len(slots)] = torch.tensor(slots)
    return r2t


def test_page_size_16_by_hand():
    # row 1: 20 tokens on pages 3 then 7; row 2: 16 tokens on page 5 (exactly full)
    r2t = _table([list(range(48, 64)) + list(range(112, 116)), list(range(80, 96))])
    md = build_paged_kv_metadata(r2t, torch.tensor([1, 2]), [20, 16], [4, 16], 16)
    assert md.qo_indptr.tolist() == [0, 4, 20]
    assert md.kv_indptr.tolist() == [0, 2, 3]
    assert md.kv_indices.tolist() == [3, 7, 5]
    assert md.kv_last_page_len.tolist() == [4, 16]
    assert kv_lens(md).tolist() == [20, 16] and md.batch_size == 2 and md.num_qo_tokens == 20


def test_page_size_1_indices_are_the_slots():
    r2t = _table([[9, 4, 7], [2], [5, 6]])
    md = build_paged_kv_metadata(r2t, torch.tensor([3, 1, 2]), [2, 3, 1], None, 1)
    assert md.qo_indptr.tolist() == [0, 1, 2, 3]  # decode: one query each
    assert md.kv_indptr.tolist() == [0, 2, 5, 6]
    assert md.kv_indices.tolist() == [5, 6, 9, 4, 7, 2]
    assert md.kv_last_page_len.tolist() == [1, 1, 1]


def test_dtypes_and_devices():
    r2t = _table([list(range(16, 26))])
    md = build_paged_kv_metadata(r2t, torch.tensor([1]), [10], [3], 16)
    for t in (md.qo_indptr, md.kv_indptr, md.kv_indices, md.kv_last_page_len):
        assert t.dtype == torch.int32 and t.device.type == "cpu" and t.is_contiguous()


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_every_token_is_found_where_flashinfer_looks(batch, page_size):
    mode, prefixes, extends = BATCHES[batch]
    case: Case = make_case(mode, prefixes, extends, page_size, seed=13)
    fb = case.fb
    r2t = fb.req_to_token_pool.req_to_token
    check_page_aligned(r2t, fb.req_pool_indices, fb.seq_lens_cpu, page_size)
    md = build_paged_kv_metadata(
        r2t,
        fb.req_pool_indices,
        fb.seq_lens_cpu,
        None if mode.is_decode() else fb.extend_seq_lens_cpu,
        page_size,
    )
    assert kv_lens(md).tolist() == fb.seq_lens_cpu
    assert md.qo_indptr.diff().tolist() == (
        [1] * fb.batch_size if mode.is_decode() else fb.extend_seq_lens_cpu
    )
    # token t of sequence i: page kv_indices[kv_indptr[i] + t // P], row t % P == its slot
    pool = fb.token_to_kv_pool.k_buffer[case.layer.layer_id]
    pages = paged_view(pool, page_size)
    for i, row in enumerate(fb.req_pool_indices.tolist()):
        s = fb.seq_lens_cpu[i]
        t = torch.arange(s)
        page = md.kv_indices[md.kv_indptr[i] + t // page_size].long()
        assert torch.equal(page * page_size + t % page_size, r2t[row, :s])
        torch.testing.assert_close(
            pages[page, t % page_size], pool[r2t[row, :s]], rtol=0, atol=0, equal_nan=True
        )


def test_paged_view_is_zero_copy_nhd():
    buf = torch.randn(16 * 5 + 3, 2, 8)  # a trailing partial page is dropped
    pages = paged_view(buf, 16)
    assert pages.shape == (5, 16, 2, 8) and pages.data_ptr() == buf.data_ptr()
    assert torch.equal(pages[3, 7], buf[3 * 16 + 7])


def test_inconsistent_batches_raise():
    r2t = _table([list(range(16, 26))])
    with pytest.raises(ValueError, match="extend_len"):
        build_paged_kv_metadata(r2t, torch.tensor([1]), [10], [11], 16)
    with pytest.raises(ValueError, match="req_pool_indices"):
        build_paged_kv_metadata(r2t, torch.tensor([1, 1]), [10], [1], 16)
    bad = _table([[16, 17, 40, 41]])  # page changes in the middle of a page
    with pytest.raises(ValueError, match="page by page"):
        check_page_aligned(bad, torch.tensor([1]), [4], 4)
    check_page_aligned(bad, torch.tensor([1]), [4], 2)


@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_reads_the_same_lengths(real_flashinfer, page_size):  # noqa: F811
    case = make_case(ForwardMode.MIXED, [0, 20, 8, 31, 0], [13, 5, 1, 1, 1], page_size, seed=2)
    fb = case.fb
    md = build_paged_kv_metadata(
        fb.req_to_token_pool.req_to_token,
        fb.req_pool_indices,
        fb.seq_lens_cpu,
        fb.extend_seq_lens_cpu,
        page_size,
    )
    got = real_flashinfer.page.get_seq_lens(md.kv_indptr, md.kv_last_page_len, page_size)
    assert got.tolist() == fb.seq_lens_cpu

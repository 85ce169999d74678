"""srt's page table -> FlashInfer's paged-KV index arrays (pure torch; runs on any device).

srt keeps one row of KV slots per request (``req_to_token[row, pos]``) over a flat pool of
``[slots, H_kv, D]`` buffers handed out page by page (``P`` = page size). FlashInfer reads the
same pool as ``[pages, P, H_kv, D]`` (NHD, ``paged_view``) through four int32 arrays::

    qo_indptr        [bs + 1]  CPU   query rows of sequence i: qo_indptr[i] .. qo_indptr[i+1]-1
    kv_indptr        [bs + 1]  CPU   pages of sequence i: kv_indices[kv_indptr[i] : kv_indptr[i+1]]
    kv_indices       [sum n_i] dev   page ids (slot // P), sequence by sequence, in token order
    kv_last_page_len [bs]      CPU   tokens used in sequence i's last page, in 1 .. P

    n_i = ceil(s_i / P)                       s_i = seq_lens[i] (cached prefix + new tokens)
    kv_len_i = (n_i - 1) * P + kv_last_page_len[i] == s_i
    token t of sequence i: page kv_indices[kv_indptr[i] + t // P], row t % P

``indptr`` and ``last_page_len`` stay on the CPU (FlashInfer's ``plan`` reads them there; on the
GPU they would force a sync); ``kv_indices`` is gathered on ``req_to_token``'s device.

Page-table invariant this relies on (srt's allocator keeps it; ``check_page_aligned`` tests it):
the slot of token ``t`` is ``page * P + t % P`` for a page owned by the request, so the slots of
positions ``0, P, 2P, ...`` name every page of the sequence. With ``P == 1`` the page ids are the
slots themselves and every last page holds 1 token.

Decode batches have one query per sequence (``qo_indptr = arange(bs + 1)``); EXTEND and MIXED
batches have ``extend_seq_lens[i]`` queries (1 for MIXED's decoding tail).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

INDEX_DTYPE = torch.int32


@dataclass(slots=True)
class PagedKVMetadata:
    """FlashInfer's index arrays for one batch (shapes and devices in the module docstring)."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    page_size: int

    @property
    def batch_size(self) -> int:
        return int(self.kv_last_page_len.numel())

    @property
    def num_qo_tokens(self) -> int:
        return int(self.qo_indptr[-1])


def _exclusive_cumsum(lengths: torch.Tensor) -> torch.Tensor:
    """``[0, l0, l0+l1, ...]`` of CPU int64 ``lengths`` as a CPU int32 tensor of ``len + 1`` entries."""
    out = torch.zeros(lengths.numel() + 1, dtype=INDEX_DTYPE)
    torch.cumsum(lengths, 0, out=out[1:])
    return out


def build_paged_kv_metadata(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: Sequence[int],
    extend_lens: Sequence[int] | None,
    page_size: int,
) -> PagedKVMetadata:
    """The index arrays of a batch of ``bs`` sequences.

    req_to_token: ``int [rows, max_context_len]`` slot table; req_pool_indices: ``int [bs]`` rows of
    the batch's sequences (on ``req_to_token``'s device or the CPU); seq_lens: ``bs`` total lengths
    (prefix + new tokens); extend_lens: ``bs`` new-token counts, or None for a DECODE batch (one
    query each); page_size: ``P``. Raises ``ValueError`` for inconsistent lengths.

    Host work is a few tensor ops on the CPU whatever the batch size (no loop over sequences)."""
    bs = len(seq_lens)
    if req_pool_indices.numel() != bs:
        raise ValueError(f"{req_pool_indices.numel()} req_pool_indices for {bs} sequences")
    seq = torch.tensor(seq_lens, dtype=torch.int64)
    ext = (
        torch.ones(bs, dtype=torch.int64)
        if extend_lens is None
        else torch.tensor(extend_lens, dtype=torch.int64)
    )
    if ext.numel() != bs:
        raise ValueError(f"{ext.numel()} extend lengths for {bs} sequences")
    bad = ((ext < 1) | (ext > seq)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise ValueError(f"sequence {i}: need 1 <= extend_len ({int(ext[i])}) <= seq_len ({int(seq[i])})")
    num_pages = torch.div(seq + (page_size - 1), page_size, rounding_mode="floor")
    last_page_len = seq - (num_pages - 1) * page_size
    kv_indptr = _exclusive_cumsum(num_pages)
    return PagedKVMetadata(
        qo_indptr=_exclusive_cumsum(ext),
        kv_indptr=kv_indptr,
        kv_indices=_gather_page_ids(req_to_token, req_pool_indices, num_pages, kv_indptr, page_size),
        kv_last_page_len=last_page_len.to(INDEX_DTYPE),
        page_size=page_size,
    )


def _gather_page_ids(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    num_pages: torch.Tensor,
    kv_indptr: torch.Tensor,
    page_size: int,
) -> torch.Tensor:
    """``int32 [sum n_i]`` on ``req_to_token``'s device: for each sequence, the page id
    (``slot // P``) of positions ``0, P, .., (n_i - 1) * P``. One gather, no host sync."""
    device = req_to_token.device
    total = int(kv_indptr[-1])  # a CPU tensor: no device sync
    n_t = num_pages.to(device, non_blocking=True)
    start_t = kv_indptr[:-1].to(torch.int64).to(device, non_blocking=True)
    rows = torch.repeat_interleave(req_pool_indices.to(device, torch.int64), n_t, output_size=total)
    page_pos = torch.arange(total, device=device) - torch.repeat_interleave(start_t, n_t, output_size=total)
    slots = req_to_token[rows, page_pos * page_size]
    return torch.div(slots, page_size, rounding_mode="floor").to(INDEX_DTYPE)


def kv_lens(md: PagedKVMetadata) -> torch.Tensor:
    """``int32 [bs]`` KV length of each sequence, as FlashInfer derives it from the arrays."""
    pages = md.kv_indptr[1:] - md.kv_indptr[:-1]
    return ((pages - 1) * md.page_size + md.kv_last_page_len).to(INDEX_DTYPE)


def paged_view(buf: torch.Tensor, page_size: int) -> torch.Tensor:
    """A pool buffer ``[slots, H_kv, D]`` seen as FlashInfer's NHD pages ``[slots // P, P, H_kv, D]``
    (zero-copy; slot ``s`` is page ``s // P``, row ``s % P``; a trailing partial page is dropped)."""
    pages = buf.shape[0] // page_size
    return buf[: pages * page_size].view(pages, page_size, *buf.shape[1:])


def check_page_aligned(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: Sequence[int], page_size: int
) -> None:
    """Raise ``ValueError`` unless every sequence's slots follow the page invariant of the module
    docstring (slot of token t == page * P + t % P, one page per P consecutive tokens). A check
    for tests and debug runs: it syncs and reads every slot."""
    rows = req_pool_indices.tolist()
    for i, (row, s) in enumerate(zip(rows, seq_lens)):
        slots = req_to_token[row, :s].to("cpu", torch.int64)
        pos = torch.arange(s)
        first = slots[pos - pos % page_size]  # the slot opening each token's page
        if not torch.equal(slots, first + pos % page_size) or bool((first % page_size).any()):
            raise ValueError(f"sequence {i} (row {row}): slots are not laid out page by page (P={page_size})")

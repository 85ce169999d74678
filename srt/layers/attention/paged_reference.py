"""A pure-torch reference of FlashInfer's batched paged attention, read from FlashInfer's metadata.

It consumes exactly what FlashInfer's ``plan()``/``run()`` receive (the index arrays of
``flashinfer_metadata``), so a test can stand it in for the CUDA kernel and check that srt hands
FlashInfer the right page table. Semantics it reproduces, per sequence ``i``::

    pages   = kv_indices[kv_indptr[i] : kv_indptr[i+1]]
    kv_len  = (len(pages) - 1) * P + kv_last_page_len[i]          (partial last page honoured)
    K, V    = k_cache[pages].flatten(0, 1)[:kv_len]                NHD cache [pages, P, H_kv, D]
    queries = q[qo_indptr[i] : qo_indptr[i+1]]                     qo_len <= kv_len
    causal: query row j sees keys 0 .. j + kv_len - qo_len          (mask aligned bottom-right)
    window_left >= 0: query row j sees keys >= j + kv_len - qo_len - window_left only (causal or not)
    query head h reads KV head h // (H / H_kv)
    scores scaled by sm_scale (default 1 / sqrt(D)); logits_soft_cap > 0: scaled scores s become
    cap * tanh(s / cap) before the mask; softmax in float32

The log-sum-exp it returns is in log2 units, as FlashInfer's ``return_lse`` gives it. A slow,
per-sequence loop: for tests only.
"""

from __future__ import annotations

import math

import torch


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    *,
    causal: bool,
    sm_scale: float | None = None,
    window_left: int = -1,
    logits_soft_cap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched prefill over a paged cache, as ``BatchPrefillWithPagedKVCacheWrapper`` computes it.

    q ``[total_q, H, D]``; k_cache/v_cache ``[pages, P, H_kv, D]``; index arrays as in the module
    docstring (any integer dtype and device); ``window_left`` / ``logits_soft_cap`` as ``plan``
    takes them (-1 / 0: off). Returns ``(out [total_q, H, D] in q's dtype, lse [total_q, H]
    float32, log2 units)``."""
    total_q, h, d = q.shape
    _, page_size, h_kv, _ = k_cache.shape
    if h % h_kv:
        raise ValueError(f"{h} query heads are not a multiple of {h_kv} KV heads")
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    qo, kv_ptr = qo_indptr.tolist(), kv_indptr.tolist()
    last, indices = kv_last_page_len.tolist(), kv_indices.to(q.device, torch.int64)
    out = q.new_zeros(total_q, h, d)
    lse = torch.full((total_q, h), -math.inf, dtype=torch.float32, device=q.device)
    for i in range(len(last)):
        pages = indices[kv_ptr[i] : kv_ptr[i + 1]]
        kv_len = (pages.numel() - 1) * page_size + last[i]
        qo_len = qo[i + 1] - qo[i]
        if qo_len == 0:
            continue
        if not 0 < last[i] <= page_size or qo_len > kv_len:
            raise ValueError(f"sequence {i}: last page len {last[i]}, qo_len {qo_len}, kv_len {kv_len}")
        k = k_cache[pages].flatten(0, 1)[:kv_len].float().repeat_interleave(h // h_kv, dim=1)
        v = v_cache[pages].flatten(0, 1)[:kv_len].float().repeat_interleave(h // h_kv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[qo[i] : qo[i + 1]].float(), k) * scale
        if logits_soft_cap > 0:
            scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
        allowed = _allowed(qo_len, kv_len, causal, window_left, q.device)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, -math.inf)
        seq_lse = torch.logsumexp(scores, dim=-1)  # [H, qo_len]
        probs = torch.exp(scores - seq_lse[..., None])
        out[qo[i] : qo[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
        lse[qo[i] : qo[i + 1]] = (seq_lse / math.log(2.0)).T
    return out, lse


def _allowed(
    qo_len: int, kv_len: int, causal: bool, window_left: int, device: torch.device
) -> torch.Tensor | None:
    """bool ``[qo_len, kv_len]``: query row j (at position j + kv_len - qo_len) may see key t; None
    when every key is visible."""
    if not causal and window_left < 0:
        return None
    pos = torch.arange(qo_len, device=device)[:, None] + (kv_len - qo_len)
    key = torch.arange(kv_len, device=device)[None, :]
    allowed = key <= pos if causal else torch.ones(qo_len, kv_len, dtype=torch.bool, device=device)
    if window_left >= 0:
        allowed = allowed & (key >= pos - window_left)
    return allowed


def paged_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    *,
    sm_scale: float | None = None,
    window_left: int = -1,
    logits_soft_cap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched decode, as ``BatchDecodeWithPagedKVCacheWrapper`` computes it: q ``[bs, H, D]``, one
    query per sequence attending to all ``kv_len`` keys (no causal mask; with ``window_left`` >= 0
    the last ``window_left + 1`` only). Returns ``(out [bs, H, D], lse [bs, H] float32, log2 units)``."""
    qo_indptr = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    return paged_attention_reference(
        q,
        k_cache,
        v_cache,
        qo_indptr,
        kv_indptr,
        kv_indices,
        kv_last_page_len,
        causal=False,
        sm_scale=sm_scale,
        window_left=window_left,
        logits_soft_cap=logits_soft_cap,
    )

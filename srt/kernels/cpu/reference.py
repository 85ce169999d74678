"""Pure-torch paged decode attention: the oracle the native op is tested against, and the fallback.

Clarity over speed: per sequence, gather its K/V rows through the page table, repeat each KV head
for the G = H // H_kv query heads of its group, softmax, weighted sum; float32 throughout (a
float16 / bfloat16 KV cache is upcast after the gather).
"""

from __future__ import annotations

import torch

_INDEX_DTYPES = (torch.int64, torch.int32)


def _check(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens) -> None:
    if q.dim() != 3 or q.dtype != torch.float32:
        raise ValueError(f"q must be float32 [bs, H, D], got {q.dtype} {tuple(q.shape)}")
    if k_buffer.dim() != 3 or v_buffer.shape != k_buffer.shape or v_buffer.dtype != k_buffer.dtype:
        raise ValueError(
            f"k_buffer/v_buffer must be [S, H_kv, D] of one dtype, got {k_buffer.dtype} {tuple(k_buffer.shape)}"
            f" and {v_buffer.dtype} {tuple(v_buffer.shape)}"
        )
    if k_buffer.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"k_buffer must be float32, float16 or bfloat16, got {k_buffer.dtype}")
    if k_buffer.shape[2] != q.shape[2] or q.shape[1] % k_buffer.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} does not fit k_buffer {tuple(k_buffer.shape)} (D, H % H_kv)")
    bs = q.shape[0]
    if req_to_token.dim() != 2 or req_to_token.dtype not in _INDEX_DTYPES:
        raise ValueError(f"req_to_token must be int64/int32 [R, max_ctx], got {req_to_token.dtype}")
    for name, t in (("req_pool_indices", req_pool_indices), ("seq_lens", seq_lens)):
        if t.shape != (bs,) or t.dtype not in _INDEX_DTYPES:
            raise ValueError(f"{name} must be int64/int32 [{bs}], got {t.dtype} {tuple(t.shape)}")


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window_left: int = -1,
    logit_cap: float = 0.0,
) -> torch.Tensor:
    """Same contract as ``srt.kernels.cpu.paged_decode_attention``: q [bs, H, D] float32,
    k_buffer / v_buffer [S, H_kv, D], req_to_token [R, max_ctx], req_pool_indices [bs],
    seq_lens [bs] -> [bs, H, D] float32 (zeros for a sequence of length 0). With ``window_left``
    >= 0 a sequence of length n attends to its keys ``max(0, n - 1 - window_left) .. n - 1`` only;
    ``logit_cap`` > 0 soft-caps the scaled scores (``cap * tanh(s / cap)``)."""
    _check(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens)
    bs, h, d = q.shape
    group = h // k_buffer.shape[1]
    out = torch.zeros(bs, h, d, dtype=torch.float32)
    for i, (row, n) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        if n == 0:
            continue
        first = max(0, n - 1 - window_left) if window_left >= 0 else 0
        slots = req_to_token[row, first:n].long()
        k = k_buffer[slots].float().repeat_interleave(group, dim=1)  # [n, H, D]
        v = v_buffer[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[i], k) * scale  # [H, n]
        if logit_cap > 0:
            scores = torch.tanh(scores / logit_cap) * logit_cap
        out[i] = torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), v)
    return out

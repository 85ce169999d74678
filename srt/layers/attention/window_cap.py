"""The reference attention of layers with a sliding window or logit soft-capping (Gemma 2/3,
Mistral, Phi-3), which SDPA cannot express: explicit scores, the cap, a mask of the keys each
query may see, softmax. torch_native takes it for such layers; the native kernels and FlashInfer
are tested against it.

A layer's ``sliding_window_size`` (``window_left``) lets a query at position p see keys
``p - window_left .. p`` (-1: every earlier key); ``logit_cap`` c > 0 maps each score s to
``c * tanh(s / c)`` before the softmax.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from srt.layers.forward_batch import AttentionLayer


def has_window_or_cap(layer: AttentionLayer) -> bool:
    """Whether the layer attends through a sliding window or soft-caps its scores."""
    return getattr(layer, "sliding_window_size", -1) >= 0 or getattr(layer, "logit_cap", 0.0) > 0


def visible_keys(query_pos: torch.Tensor, num_keys: int, window_left: int) -> torch.Tensor:
    """bool ``[len(query_pos), num_keys]``: key position j is visible to a query at position p when
    j <= p and (no window, or j >= p - window_left)."""
    key_pos = torch.arange(num_keys, device=query_pos.device)[None, :]
    visible = key_pos <= query_pos[:, None]
    if window_left >= 0:
        visible &= key_pos >= query_pos[:, None] - window_left
    return visible


def math_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, layer: AttentionLayer
) -> torch.Tensor:
    """The reference attention for windowed and soft-capped layers: q ``[n, H, e, D]``, k/v
    ``[n, H_kv, s, D]``, ``visible`` bool broadcastable to ``[n, H, e, s]`` -> ``[n, H, e, D]``.

    scores = q k^T * scaling (float32) -> logit_cap * tanh(scores / logit_cap) when capped ->
    invisible keys -inf -> softmax -> weighted sum of v (in q's dtype)."""
    group = layer.num_heads // layer.num_kv_heads
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * layer.scaling
    cap = getattr(layer, "logit_cap", 0.0)
    if cap > 0:
        scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)

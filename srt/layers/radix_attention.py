"""RadixAttention: the model-side attention layer; the math lives in the attention backend.

The layer only carries its shape (``num_heads``, ``num_kv_heads``, ``head_dim``, ``scaling``,
``layer_id``) and its per-layer features (``sliding_window_size``, ``logit_cap``) and hands q/k/v to ``forward_batch.attn_backend``, which writes k/v into the KV
pool and attends over each sequence's cached prefix plus its new tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from srt.layers.forward_batch import ForwardBatch


class RadixAttention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scaling: float,
        num_kv_heads: int,
        layer_id: int,
        sliding_window_size: int = -1,
        logit_cap: float = 0.0,
    ) -> None:
        """``sliding_window_size``: a query at position p sees keys at p - sliding_window_size .. p
        (HF's ``sliding_window`` - 1; -1 = no window); ``logit_cap``: attention scores become
        ``logit_cap * tanh(score / logit_cap)`` before the softmax (0 = off)."""
        super().__init__()
        if sliding_window_size < -1:
            raise ValueError(f"sliding_window_size must be >= -1, got {sliding_window_size}")
        if logit_cap < 0:
            raise ValueError(f"logit_cap must be >= 0, got {logit_cap}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.num_kv_heads = num_kv_heads
        self.layer_id = layer_id
        self.sliding_window_size = sliding_window_size
        self.logit_cap = float(logit_cap)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """q ``[T, H*D]``, k/v ``[T, H_kv*D]`` (rows may be strided views) -> ``[T, H*D]``."""
        backend = forward_batch.attn_backend
        if backend is None:
            raise RuntimeError("forward_batch.attn_backend is not set (the ModelRunner sets it)")
        return backend.forward(q, k, v, self, forward_batch, save_kv_cache)

    def extra_repr(self) -> str:
        return (
            f"layer_id={self.layer_id}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, scaling={self.scaling:.4g}"
            + (f", window_left={self.sliding_window_size}" if self.sliding_window_size >= 0 else "")
            + (f", logit_cap={self.logit_cap:g}" if self.logit_cap else "")
        )

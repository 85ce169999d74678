"""Attention inside an image both ways (Gemma 3): the image's tokens see each other, the rest of
the sequence stays causal.

A bidirectional image (``ImageRun.bidirectional``, srt/multimodal/req_images.py) is never cut by
a prefill chunk, so the step's ``image_spans`` hold each such image's rows that this extend
computes in one piece (a cached prefix may end inside an image: its rows there are earlier keys,
visible anyway). For an extend sequence with ``e`` new tokens over ``s`` keys (prefix ``p = s - e``)
and a block of its new tokens ``lo .. hi`` (local indices), a query ``j`` sees key ``t`` when::

    (t <= p + j  or  (lo <= j < hi and p + lo <= t < p + hi))  and  t >= p + j - window_left

transformers' mask for Gemma 3: OR(causal, same image) on every layer, AND the sliding window on
the sliding layers. The attention itself is window_cap.py's ``math_attention`` over that mask,
one sequence at a time; sequences without such a block keep the backend's own path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from srt.layers.attention.window_cap import math_attention, visible_keys

if TYPE_CHECKING:
    from srt.layers.forward_batch import AttentionLayer

# extend sequence index -> its blocks' (lo, hi) local query indices
ImageBlocks = dict[int, list[tuple[int, int]]]


def image_blocks(spans: Sequence[Any] | None, extend_lens: Sequence[int]) -> ImageBlocks:
    """The bidirectional blocks of the step's ``image_spans`` (``row``, ``n``, ``image``) per
    extend sequence (``extend_lens``: their new tokens, in batch order)."""
    blocks: ImageBlocks = {}
    if not spans:
        return blocks
    starts, row = [], 0
    for e in extend_lens:
        starts.append(row)
        row += e
    seq = 0
    for span in sorted(spans, key=lambda s: s.row):
        if not span.image.bidirectional or span.n < 2:
            continue
        while seq + 1 < len(starts) and starts[seq + 1] <= span.row:
            seq += 1
        lo = span.row - starts[seq]
        blocks.setdefault(seq, []).append((lo, lo + span.n))
    return blocks


def block_visible(
    extend_len: int, seq_len: int, blocks: Sequence[tuple[int, int]], window_left: int, device: Any
) -> torch.Tensor:
    """bool ``[extend_len, seq_len]``: the keys each new token sees (module docstring)."""
    prefix = seq_len - extend_len
    query_pos = torch.arange(prefix, seq_len, device=device)
    visible = visible_keys(query_pos, seq_len, -1)
    for lo, hi in blocks:
        visible[lo:hi, prefix + lo : prefix + hi] = True
    if window_left >= 0:
        key_pos = torch.arange(seq_len, device=device)[None, :]
        visible &= key_pos >= query_pos[:, None] - window_left
    return visible


def attend_with_blocks(
    q3: torch.Tensor,
    kx: torch.Tensor,
    vx: torch.Tensor,
    runs: Sequence[Any],
    blocks: ImageBlocks,
    layer: AttentionLayer,
    out: torch.Tensor,
) -> None:
    """The extend sequences that hold a block, into ``out`` (q3 ``[T, H, D]``, kx/vx the extend
    keys, each sequence's in order, prefix first; ``runs``: torch_native's ``ExtendRun``s)."""
    h, d = layer.num_heads, layer.head_dim
    window = int(getattr(layer, "sliding_window_size", -1))
    seq = 0
    for run in runs:
        e, s = run.extend_len, run.seq_len
        for i in range(run.n):
            if seq + i in blocks:
                qe, ks = run.q_start + i * e, run.kv_start + i * s
                qr = q3[qe : qe + e].transpose(0, 1).unsqueeze(0)
                kr = kx[ks : ks + s].transpose(0, 1).unsqueeze(0)
                vr = vx[ks : ks + s].transpose(0, 1).unsqueeze(0)
                visible = block_visible(e, s, blocks[seq + i], window, q3.device)
                o = math_attention(qr, kr, vr, visible, layer)
                out[qe : qe + e] = o.squeeze(0).transpose(0, 1).reshape(e, h, d)
        seq += run.n

"""Qwen2-VL's multimodal rotary positions (M-RoPE) of a prompt with images.

Each token gets three positions (time, height, width); the rotary frequencies are split into
three sections (``mrope_section``), each rotated by one of them. A text token has the same
value in all three rows, one more than the largest position before it, so a text-only prompt
gets plain 1-D positions. An image of ``t x h x w`` merged patches (its placeholder span) starts
at ``s`` = one past the largest position before it and gets, for merged patch ``(i, j, k)``:
``(s + i, s + j, s + k)``. The text after an image continues from its largest position + 1,
so the positions fall behind the sequence index by the rows an image saves; ``delta`` (the last
position + 1 - the prompt's length, <= 0) shifts every generated token by that amount.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def mrope_positions(
    length: int, spans: Sequence[tuple[int, int, tuple[int, int, int]]], merge: int
) -> tuple[np.ndarray, int]:
    """``int32 [3, length]`` positions and the delta, for a prompt of ``length`` tokens whose
    images occupy ``spans``: ``(offset, count, (t, h, w) in patches)`` in prompt order, with
    ``count == t * (h // merge) * (w // merge)``."""
    out = np.empty((3, length), dtype=np.int64)
    cursor = 0  # next sequence index to fill
    nxt = 0  # the position the next text token takes
    for offset, count, (t, h, w) in spans:
        gh, gw = h // merge, w // merge
        if count != t * gh * gw:
            raise ValueError(f"an image span of {count} tokens for a {t}x{gh}x{gw} merged grid")
        out[:, cursor:offset] = np.arange(nxt, nxt + offset - cursor)
        nxt += offset - cursor
        ti, hi, wi = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        out[0, offset : offset + count] = nxt + ti.reshape(-1)
        out[1, offset : offset + count] = nxt + hi.reshape(-1)
        out[2, offset : offset + count] = nxt + wi.reshape(-1)
        nxt += max(t, gh, gw)
        cursor = offset + count
    out[:, cursor:] = np.arange(nxt, nxt + length - cursor)
    last = int(out.max()) if length else -1
    return out.astype(np.int32), last + 1 - length

"""Multimodal rotary embedding (Qwen2-VL's M-RoPE): three position rows, one per frequency section.

The rotary frequencies ``0 .. rotary_dim/2`` are cut into ``mrope_section`` (e.g. [16, 24, 24]
of 64): the first section rotates by the time position, the second by the height, the third by
the width (srt/multimodal/mrope.py gives each token its three positions). A text token has the
same value in all three rows, which is the plain rope, so 1-D positions (every DECODE step, every
text-only request) take `RotaryEmbedding`'s own paths, native kernels included; ``[3, T]``
positions (an extend holding an image) take the torch path here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from srt.layers.rope_scaling import parse_rope
from srt.layers.rotary_embedding import RotaryEmbedding


class MRotaryEmbedding(RotaryEmbedding):
    def __init__(self, head_dim: int, config: Any, sections: Sequence[int]) -> None:
        """``config``: the decoder's config without the M-RoPE keys (a plain rope);
        ``sections``: ``mrope_section``, summing to ``rotary_dim / 2``."""
        spec = parse_rope(config, head_dim)
        super().__init__(head_dim, spec.max_position_embeddings, spec.base, spec=spec)
        half = self.rotary_dim // 2
        if sum(sections) != half or len(sections) != 3:
            raise ValueError(f"mrope_section {list(sections)} must be 3 sections summing to {half}")
        rows = torch.repeat_interleave(torch.arange(3), torch.tensor(list(sections)))
        self.register_buffer("section_rows", rows.repeat(2), persistent=False)  # per table column

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions ``[T]`` (the plain rope) or ``[3, T]``; q/k as `RotaryEmbedding.forward`."""
        if positions.dim() == 1:
            return super().forward(positions, q, k)
        n = positions.shape[1]
        rows = self.cos_sin_cache.index_select(0, positions.reshape(-1)).view(3, n, -1)
        index = self.section_rows.view(1, 1, -1).expand(1, n, -1)
        cos_sin = rows.gather(0, index)[0]  # [T, rotary_dim]: column c from row section_rows[c]
        if cos_sin.dtype != q.dtype:
            cos_sin = cos_sin.to(q.dtype)
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)
        return self._rotate_heads(q, cos, sin), self._rotate_heads(k, cos, sin)

"""Rotary position embedding (HF "rotate half" / NeoX layout), positions-based.

A ``cos_sin_cache [max_position, rotary_dim]`` (float32: cos of the ``rotary_dim/2``
frequencies, then sin) is built once; each call gathers the rows of ``positions`` and
rotates every head of q and k:

    x = [x1 | x2] (halves of the rotary dims);  out = [x1*cos - x2*sin | x2*cos + x1*sin]

Frequencies: ``inv_freq[i] = base^(-2i/rotary_dim)``, rescaled by the config's rope scaling:
``linear`` (divide by factor) or ``llama3`` (Llama 3.1: low frequencies divided by factor,
high ones kept, a smooth blend in between).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from srt.kernels.cpu import elementwise

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(config) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, scaling dict or None)`` from a transformers config (v4 ``rope_theta`` +
    ``rope_scaling`` or v5 ``rope_parameters``)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = params
    else:
        theta = float(getattr(config, "rope_theta", 10000.0))
        scaling = getattr(config, "rope_scaling", None) or None
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type == "default":
            scaling = None
    return theta, scaling


def compute_inv_freq(rotary_dim: int, base: float, scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """float32 ``[rotary_dim // 2]`` inverse frequencies, scaled per ``scaling``."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    if scaling is None:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_context_len = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise NotImplementedError(
        f"rope scaling type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
    )


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        scaling: dict[str, Any] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = head_dim
        self.max_position = max_position
        inv_freq = compute_inv_freq(self.rotary_dim, base, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [max_position, rotary_dim]
        self.register_buffer("cos_sin_cache", cache.to(dtype), persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x [T, n, D]; cos/sin [T, 1, D/2]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions ``[T]`` int64; q ``[T, H*D]`` (or ``[T, H, D]``), k ``[T, H_kv*D]`` ->
        rotated (q, k) of the input shapes and dtype: for 2-D float32 CPU inputs the inputs
        themselves, rotated in place by the native op; otherwise new contiguous tensors."""
        num_tokens = positions.shape[0]
        if q.dim() == 2 and elementwise.supports(q, k, self.cos_sin_cache):
            elementwise.rotary_neox_(q, k, positions, self.cos_sin_cache, self.head_dim)
            return q, k
        cos_sin = self.cos_sin_cache.index_select(0, positions)
        if cos_sin.dtype != q.dtype:
            cos_sin = cos_sin.to(q.dtype)
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)
        q_rot = self._rotate(q.view(num_tokens, -1, self.head_dim), cos, sin)
        k_rot = self._rotate(k.view(num_tokens, -1, self.head_dim), cos, sin)
        return q_rot.view(q.shape), k_rot.view(k.shape)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_position={self.max_position}"


def get_rope(head_dim: int, config, dtype: torch.dtype = torch.float32) -> RotaryEmbedding:
    """The rope of a transformers config (theta, scaling, ``max_position_embeddings``)."""
    base, scaling = rope_parameters(config)
    return RotaryEmbedding(head_dim, int(config.max_position_embeddings), base, scaling, dtype)

"""Rotary position embedding (HF "rotate half" / NeoX layout), positions-based.

A ``cos_sin_cache [max_position, rotary_dim]`` (float32: cos of the ``rotary_dim/2``
frequencies, then sin, both times the rope's attention factor) is built once
(``srt/layers/rope_scaling.py``: rope types, scaling, per-position long-context choice); each
call gathers the rows of ``positions`` and rotates every head of q and k:

    x = [x1 | x2 | x_pass] (x1, x2: halves of the first rotary_dim dims; x_pass: the rest)
    out = [x1*cos - x2*sin | x2*cos + x1*sin | x_pass]

``rotary_dim < head_dim`` is partial rotary (``partial_rotary_factor``, e.g. Phi-4-mini's 0.75).

Paths: on CUDA (``fused`` bound by the model runner) FlashInfer's cos/sin-cache rope rotates q and
k in place in one kernel (every rope type: they differ only in the table; partial rotary too) where
it takes the inputs (``fused_kernels.FusedKernels.rope_``); full rotary on 2-D float32 CPU inputs, or bf16 ones with a bf16 table (a bf16 model's),
rotates in place with the native op (``elementwise.rotary_neox_``); everything else (partial rotary, other dtypes, 3-D inputs) takes
the torch path, which is also the reference.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from srt.kernels.cpu import elementwise
from srt.layers.fused_kernels import FusedKernels
from srt.layers.rope_scaling import (
    SUPPORTED_ROPE_TYPES,
    RopeSpec,
    check_rope_keys,
    cos_sin_table,
    parse_rope,
    rope_type_of,
    static_inv_freq,
)

__all__ = [
    "SUPPORTED_ROPE_TYPES",
    "RotaryEmbedding",
    "compute_inv_freq",
    "get_rope",
    "limit_positions",
    "parse_rope",
    "rope_parameters",
]


def rope_parameters(config) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, scaling dict or None)`` from a transformers config (v4 ``rope_theta`` +
    ``rope_scaling`` or v5 ``rope_parameters``); None for the default rope."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = params
    else:
        theta = float(getattr(config, "rope_theta", 10000.0))
        scaling = getattr(config, "rope_scaling", None) or None
    if rope_type_of(scaling) == "default":
        scaling = None
    return theta, scaling


def compute_inv_freq(rotary_dim: int, base: float, scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """float32 ``[rotary_dim // 2]`` inverse frequencies of a position-independent rope type
    (default, linear, llama3, yarn); raises ``UnsupportedModelError`` for others."""
    rope_type = rope_type_of(scaling)
    kept = dict(scaling or {})
    check_rope_keys(kept, rope_type)
    spec = RopeSpec(base, rotary_dim, rotary_dim, rope_type, kept)
    return static_inv_freq(spec)[0]


class RotaryEmbedding(nn.Module):
    fused: FusedKernels | None = None

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        scaling: dict[str, Any] | None = None,
        dtype: torch.dtype = torch.float32,
        rotary_dim: int | None = None,
        spec: RopeSpec | None = None,
    ) -> None:
        """``spec`` (from ``parse_rope``) takes precedence over ``base`` / ``scaling`` /
        ``rotary_dim``; without it the rope is built from those (a default-type dict: no scaling)."""
        super().__init__()
        if spec is None:
            rope_type = rope_type_of(scaling)
            kept = dict(scaling or {})
            check_rope_keys(kept, rope_type)
            spec = RopeSpec(base, head_dim, rotary_dim or head_dim, rope_type, kept, max_position)
        self.head_dim = head_dim
        self.rotary_dim = spec.rotary_dim
        self.max_position = max_position
        self.rope_type = spec.rope_type
        cache = cos_sin_table(spec, max_position)  # [max_position, rotary_dim]
        self.register_buffer("cos_sin_cache", cache.to(dtype), persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x [T, n, rotary_dim]; cos/sin [T, 1, rotary_dim/2]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def _rotate_heads(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        heads = x.reshape(num_tokens, -1, self.head_dim)
        if self.rotary_dim == self.head_dim:
            return self._rotate(heads, cos, sin).view(x.shape)
        rot, rest = heads.split([self.rotary_dim, self.head_dim - self.rotary_dim], dim=-1)
        return torch.cat((self._rotate(rot, cos, sin), rest), dim=-1).view(x.shape)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions ``[T]`` int64; q ``[T, H*D]`` (or ``[T, H, D]``), k ``[T, H_kv*D]`` ->
        rotated (q, k) of the input shapes and dtype: for full rotary on 2-D float32 or bf16 CPU inputs
        the inputs themselves, rotated in place by the native op, and on CUDA by FlashInfer's;
        otherwise new contiguous tensors."""
        if self.fused is not None and self.fused.rope_(positions, q, k, self.head_dim, self.cos_sin_cache):
            return q, k
        full = self.rotary_dim == self.head_dim
        if full and q.dim() == 2 and elementwise.supports(q, k):
            table = self.table(q.dtype)
            elementwise.rotary_neox_(q, k, positions, table, self.head_dim)
            return q, k
        cos_sin = self.cos_sin_cache.index_select(0, positions)
        if cos_sin.dtype != q.dtype:
            cos_sin = cos_sin.to(q.dtype)
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)
        return self._rotate_heads(q, cos, sin), self._rotate_heads(k, cos, sin)

    def table(self, dtype: torch.dtype) -> torch.Tensor:
        """``cos_sin_cache`` in ``dtype`` (what the torch path casts the gathered rows to): a bf16
        model's native rope takes a bf16 copy, made once per table."""
        cache = self.cos_sin_cache
        if cache.dtype == dtype:
            return cache
        held = getattr(self, "_table_copy", None)
        if held is None or held[0] is not cache or held[1].dtype != dtype:
            held = (cache, cache.to(dtype))
            self._table_copy = held
        return held[1]

    def extra_repr(self) -> str:
        partial = f", rotary_dim={self.rotary_dim}" if self.rotary_dim != self.head_dim else ""
        return f"head_dim={self.head_dim}{partial}, max_position={self.max_position}, type={self.rope_type}"


def get_rope(head_dim: int, config, dtype: torch.dtype = torch.float32) -> RotaryEmbedding:
    """The rope of a transformers config (theta, partial rotary, scaling,
    ``max_position_embeddings``); raises ``UnsupportedModelError`` / ``ConfigError`` for rope
    settings srt cannot honour (``rope_scaling.parse_rope``)."""
    spec = parse_rope(config, head_dim)
    return RotaryEmbedding(head_dim, spec.max_position_embeddings, spec.base, dtype=dtype, spec=spec)


def limit_positions(model: nn.Module, max_positions: int) -> int:
    """Cut every rope table of ``model`` to its first ``max_positions`` rows (no request reaches
    a position past its KV rows: the pool and the context length bound them), before anything
    captures the tables (native decode layers, CUDA graphs). Returns the bytes freed: a
    Llama-3.1-8B config's 131,072 positions take 64 MiB in float32, a 4,096-token pool needs 2."""
    freed = 0
    for module in model.modules():
        if isinstance(module, RotaryEmbedding) and module.max_position > max_positions:
            old = module.cos_sin_cache
            module.cos_sin_cache = old[:max_positions].clone()
            module.max_position = max_positions
            freed += old.numel() * old.element_size() - module.cos_sin_cache.numel() * old.element_size()
    return freed

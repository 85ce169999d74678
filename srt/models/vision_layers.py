"""srt's versions of the vision towers' costly small layers, swapped into transformers' towers when
a VLM is built. Each keeps the module's parameters (names, shapes, dtypes), so checkpoints load as
they are, and computes what transformers' module computes up to float32 summation order:

* `PatchConv`: a ``Conv2d`` / ``Conv3d`` whose kernel equals its stride (the patch embedding of
  CLIP, SigLIP, Qwen2-VL) as one matmul over the flattened patches. torch's CPU convolution took
  104 ms for Qwen2-VL's 1,024 patches of a 448x448 image, the matmul 2 ms.
* `QuickGelu`: ``x * sigmoid(1.702 x)`` (CLIP's and Qwen2-VL's MLP activation) in one pass
  (srt.kernels.cpu.elementwise.quick_gelu) rather than three bf16 ops over the MLP's widest rows.
* `RopeVisionAttention`: Qwen2-VL's and Qwen2.5-VL's tower attention: the 2-D rope applied in place
  to q and k within the qkv projection's output (``rotary_neox_`` with a float32 table: float32
  math on the bf16 rows, rounded once, as transformers' ``apply_rotary_pos_emb_vision``), then SDPA
  per image (or per window) as transformers' ``sdpa`` path, then the output projection.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from srt.kernels.cpu.elementwise import quick_gelu, rotary_neox_


class PatchConv(nn.Module):
    """A convolution with ``stride == kernel_size`` (no padding, dilation or groups) as a matmul:
    input ``[B, C, *spatial]`` -> ``[B, out, *spatial // kernel]``, the trailing remainder of
    each spatial size dropped, as the convolution drops it."""

    def __init__(self, conv: nn.Conv2d | nn.Conv3d) -> None:
        super().__init__()
        self.weight = conv.weight
        self.bias = conv.bias
        self.kernel = tuple(int(k) for k in conv.kernel_size)

    @staticmethod
    def takes(module: nn.Module) -> bool:
        if type(module) not in (nn.Conv2d, nn.Conv3d):
            return False
        n = len(module.kernel_size)
        return (
            tuple(module.stride) == tuple(module.kernel_size)
            and module.padding in ((0,) * n, "valid")
            and tuple(module.dilation) == (1,) * n
            and module.groups == 1
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = len(self.kernel)
        b, c = x.shape[0], x.shape[1]
        grid = [s // k for s, k in zip(x.shape[2:], self.kernel)]
        x = x[(slice(None), slice(None), *(slice(0, g * k) for g, k in zip(grid, self.kernel)))]
        x = x.reshape(b, c, *(v for g, k in zip(grid, self.kernel) for v in (g, k)))
        order = [0, *(2 + 2 * i for i in range(n)), 1, *(3 + 2 * i for i in range(n))]
        patches = x.permute(order).reshape(-1, c * math.prod(self.kernel))
        out_channels = self.weight.shape[0]
        out = F.linear(patches.to(self.weight.dtype), self.weight.reshape(out_channels, -1), self.bias)
        return out.view(b, *grid, out_channels).movedim(-1, 1)


class QuickGelu(nn.Module):
    """transformers' ``QuickGELUActivation`` in one pass."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quick_gelu(x)


def _rope_table(cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor | None:
    """``[T, head_dim]`` float32 ``[cos | sin]`` of the rotated halves, from transformers' ``[T,
    head_dim]`` cos and sin of ``cat(freqs, freqs)``; None if their halves differ (some other rope)."""
    half = head_dim // 2
    if cos.dim() != 2 or cos.shape[-1] != head_dim or sin.shape != cos.shape:
        return None
    if not (torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:])):
        return None
    return torch.cat((cos[:, :half], sin[:, :half]), dim=-1).float().contiguous()


class _RopeTables:
    """The table and positions of a tower call's cos and sin, made once for all of its blocks
    (every block of the call is handed the same two tensors)."""

    def __init__(self) -> None:
        self._key: tuple[torch.Tensor, torch.Tensor] | None = None
        self._entry: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)

    def get(self, cos: torch.Tensor, sin: torch.Tensor, head_dim: int):
        """(``_rope_table``'s table or None, ``arange`` of the rows)."""
        if self._key is None or cos is not self._key[0] or sin is not self._key[1]:
            table = _rope_table(cos, sin, head_dim)
            positions = None if table is None else torch.arange(cos.shape[0], device=cos.device)
            self._key, self._entry = (cos, sin), (table, positions)
        return self._entry


class RopeVisionAttention(nn.Module):
    """Qwen2-VL's ``VisionAttention`` / Qwen2.5-VL's ``Qwen2_5_VLVisionAttention`` (the same
    forward), on the module's own ``qkv`` and ``proj``; ``tables`` is shared by the tower's
    attention modules."""

    def __init__(self, attn: nn.Module, reference: Any, tables: _RopeTables) -> None:
        super().__init__()
        self.qkv = attn.qkv
        self.proj = attn.proj
        self.num_heads = int(attn.num_heads)
        self.head_dim = int(attn.head_dim)
        self.scaling = float(attn.scaling)
        self._reference = reference  # transformers' rope function, for a table this cannot take
        self._tables = tables

    def forward(
        self,
        hidden_states: torch.Tensor,
        cu_seqlens: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        t, h, d = hidden_states.shape[0], self.num_heads, self.head_dim
        qkv = self.qkv(hidden_states)  # [T, 3 h d]: q, k, v, each heads x head_dim
        if position_embeddings is None:  # transformers 4's blocks may pass the angles alone
            emb = torch.cat((kwargs["rotary_pos_emb"],) * 2, dim=-1)
            position_embeddings = (emb.cos(), emb.sin())
        cos, sin = position_embeddings
        table, positions = self._tables.get(cos, sin, d)
        if table is not None:
            rotary_neox_(qkv[:, : h * d], qkv[:, h * d : 2 * h * d], positions, table, d)
            q, k, v = qkv.view(t, 3, h, d).permute(1, 2, 0, 3).unbind(0)  # each [h, T, d]
        else:
            q, k, v = qkv.view(t, 3, h, d).permute(1, 0, 2, 3).unbind(0)
            q, k = self._reference(q, k, cos, sin)
            q, k, v = (x.transpose(0, 1) for x in (q, k, v))
        bounds = cu_seqlens.tolist()
        outs = [
            F.scaled_dot_product_attention(
                q[None, :, s:e], k[None, :, s:e], v[None, :, s:e], scale=self.scaling
            )[0]
            for s, e in zip(bounds[:-1], bounds[1:])
            if e > s
        ]
        out = torch.cat(outs, dim=1) if len(outs) != 1 else outs[0]  # [h, T, d]
        return self.proj(out.transpose(0, 1).reshape(t, h * d))


def _swap(tower: nn.Module, make: Any) -> None:
    """Replace every child ``c`` of the tower's modules for which ``make(c)`` gives a module."""
    for module in list(tower.modules()):
        for name, child in list(module.named_children()):
            new = make(child)
            if new is not None:
                setattr(module, name, new)


def use_fast_tower_layers(tower: nn.Module) -> nn.Module:
    """``tower`` with its patch convolutions and quick-GELU activations replaced (see the module
    docstring); any tower: the layers it lacks are left alone."""
    from transformers.activations import QuickGELUActivation

    def make(child: nn.Module) -> nn.Module | None:
        if PatchConv.takes(child):
            return PatchConv(child)
        return QuickGelu() if type(child) is QuickGELUActivation else None

    _swap(tower, make)
    return tower


def use_rope_vision_attention(tower: nn.Module, attention_cls: type | None, reference: Any) -> nn.Module:
    """``tower`` with each ``attention_cls`` (Qwen2-VL's or Qwen2.5-VL's vision attention)
    replaced by `RopeVisionAttention`; ``reference`` is that model's ``apply_rotary_pos_emb_vision``.
    Either None (a transformers release that names them otherwise): the tower as it is."""
    if attention_cls is None or reference is None:
        return tower
    tables = _RopeTables()
    _swap(tower, lambda c: RopeVisionAttention(c, reference, tables) if type(c) is attention_cls else None)
    return tower

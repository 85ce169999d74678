"""Fused element-wise ops of a decoder layer: the native ops (elementwise.cpp) when the
extension is loaded, their pure-torch references otherwise (same contracts).

    silu_and_mul(x [T, 2d]) -> [T, d]                       silu(x[:, :d]) * x[:, d:]
    quick_gelu(x [T, n]) -> [T, n]                          x * sigmoid(1.702 x) (CLIP's and
        Qwen2-VL's vision towers; in bf16 as transformers' module rounds it: 1.702 x, its sigmoid,
        the product)
    add_rms_norm_(x [T, h], residual [T, h], weight [h], eps) -> [T, h]
        residual += x (in place), returns residual * rsqrt(mean(residual^2, -1) + eps) * weight
    rotary_neox_(q [T, Hq*D], k [T, Hk*D], positions [T] int64, cos_sin [P, D], head_dim)
        rotates every head of q and k in place ("rotate half"): with [cos | sin] = cos_sin[pos],
        [x1 | x2] -> [x1*cos - x2*sin | x2*cos + x1*sin]; bf16 q and k take a bf16 table (each
        product rounded, as a bf16 decoder computes) or a float32 one (float32 math, each result
        rounded once, as transformers computes a vision tower's rope)
    apply_token_bitmask_(logits [B, V], rows [n] int64, bitmask [n, W] int32)
        constrained decoding: -inf at every token a row's bitmask disallows (in place; the
        reference is srt.constrained.bitmask.apply_bitmask_, the same results bit for bit)

Inputs are float32 CPU tensors, or bf16 ones (all of a call's, the norm's weight and the rope
table included: a bf16 model's), whose rows may be strided (views of a fused projection's output)
with a contiguous last dim; ``supports(*tensors)`` says whether a call qualifies for the native
path. bf16 computes in float32 and rounds to bf16 where the references' separate bf16 ops do
(transformers' bf16 modules: silu rounded before the product; the residual sum, the normalised
rows and each rope product rounded). The native results differ from the references by float32
reassociation only (and, in bf16, where that flips a rounding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from srt.constrained.bitmask import apply_bitmask_
from srt.kernels.cpu import native_available

__all__ = [
    "add_rms_norm_",
    "apply_token_bitmask_",
    "quick_gelu",
    "rotary_neox_",
    "silu_and_mul",
    "supports",
]


_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def supports(*tensors: torch.Tensor) -> bool:
    """The native path can take these: the extension is loaded and each is a 2-D CPU tensor with
    a contiguous last dim, all float32 or all bf16."""
    if not native_available() or tensors[0].dtype not in _NATIVE_DTYPES:
        return False
    dtype = tensors[0].dtype
    for t in tensors:  # a plain loop: this runs several times per layer
        if t.dtype != dtype or t.device.type != "cpu" or t.dim() != 2 or t.stride(-1) != 1:
            return False
    return True


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def quick_gelu_ref(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    residual.add_(x)
    if residual.dtype == torch.float32:
        return F.rms_norm(residual, (residual.shape[-1],), weight, eps)
    xf = residual.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(residual.dtype)


def rotary_neox_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, head_dim: int
) -> None:
    cos, sin = cos_sin.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D/2]
    for x in (q, k):
        x3 = x.view(x.shape[0], -1, head_dim)
        x1, x2 = x3.chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        x3.copy_(rotated)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if supports(x):
        return torch.ops.srt_cpu.silu_and_mul(x)
    return silu_and_mul_ref(x)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 2 and supports(x):
        return torch.ops.srt_cpu.quick_gelu(x)
    if x.dim() > 2 and x.is_contiguous() and supports(x.view(-1, x.shape[-1])):
        return torch.ops.srt_cpu.quick_gelu(x.view(-1, x.shape[-1])).view(x.shape)
    return quick_gelu_ref(x)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if supports(x, residual) and weight.dtype == x.dtype and weight.is_contiguous():
        return torch.ops.srt_cpu.add_rms_norm_(x, residual, weight, eps)
    return add_rms_norm_ref(x, residual, weight, eps)


def rotary_neox_(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, head_dim: int
) -> None:
    table_ok = supports(q, k, cos_sin) or (
        q.dtype == torch.bfloat16 and cos_sin.dtype == torch.float32 and supports(q, k) and supports(cos_sin)
    )
    if table_ok and positions.dtype == torch.int64:
        torch.ops.srt_cpu.rotary_neox_(q, k, positions.contiguous(), cos_sin, head_dim)
        return
    rotary_neox_ref(q, k, positions, cos_sin, head_dim)


def apply_token_bitmask_(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    if (
        supports(logits)
        and logits.dtype == torch.float32
        and rows.dtype == torch.int64
        and bitmask.dtype == torch.int32
    ):
        torch.ops.srt_cpu.apply_token_bitmask_(logits, rows.contiguous(), bitmask.contiguous())
        return
    apply_bitmask_(logits, rows, bitmask)

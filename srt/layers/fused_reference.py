"""Torch references of the FlashInfer ops ``fused_kernels`` binds, with FlashInfer's signatures.

What each kernel computes, written out (float32 inside, one rounding to the input dtype at the
end, as the kernels do), so that CPU tests can stand them in for FlashInfer
(``FusedKernels(reference_ops())``) and GPU tests can hold the real kernels to them. The in-place
ops write their inputs as FlashInfer's do.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def _normed(x: torch.Tensor, weight: torch.Tensor, eps: float, bias: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (weight.float() + bias)).to(x.dtype)


def rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):  # noqa: A002 - FlashInfer's names
    result = _normed(input, weight, eps, 0.0)
    return result if out is None else out.copy_(result)


def gemma_rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):  # noqa: A002
    result = _normed(input, weight, eps, 1.0)
    return result if out is None else out.copy_(result)


def _fused_add(input, residual, weight, eps, bias) -> None:  # noqa: A002
    total = input.float() + residual.float()
    residual.copy_(total)
    input.copy_(_normed(total, weight, eps, bias))  # normalises the float32 sum, as the kernel


def fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):  # noqa: A002
    _fused_add(input, residual, weight, eps, 0.0)


def gemma_fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):  # noqa: A002
    _fused_add(input, residual, weight, eps, 1.0)


def silu_and_mul(input, out=None, enable_pdl=None):  # noqa: A002
    d = input.shape[-1] // 2
    result = (F.silu(input[..., :d].float()) * input[..., d:].float()).to(input.dtype)
    return result if out is None else out.copy_(result)


def gelu_tanh_and_mul(input, out=None, enable_pdl=None):  # noqa: A002
    d = input.shape[-1] // 2
    result = (F.gelu(input[..., :d].float(), approximate="tanh") * input[..., d:].float()).to(input.dtype)
    return result if out is None else out.copy_(result)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, is_neox: bool) -> None:
    rot = x[..., :rotary_dim].float()
    if is_neox:
        x1, x2 = rot.chunk(2, dim=-1)
        x[..., :rotary_dim] = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        x[..., :rotary_dim] = out.to(x.dtype)


def apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cos_sin_cache, is_neox=True):
    rotary_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache.index_select(0, positions.long()).unsqueeze(1).chunk(2, dim=-1)
    for x in (query, key):
        _rotate(x.view(x.shape[0], -1, head_size), cos, sin, rotary_dim, is_neox)


def reference_ops() -> dict[str, Callable]:
    """``fused_kernels.FLASHINFER_OPS``'s names -> these references."""
    return {
        "rmsnorm": rmsnorm,
        "fused_add_rmsnorm": fused_add_rmsnorm,
        "gemma_rmsnorm": gemma_rmsnorm,
        "gemma_fused_add_rmsnorm": gemma_fused_add_rmsnorm,
        "silu_and_mul": silu_and_mul,
        "gelu_tanh_and_mul": gelu_tanh_and_mul,
        "rope": apply_rope_with_cos_sin_cache_inplace,
    }

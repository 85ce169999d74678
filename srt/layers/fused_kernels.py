"""Fused CUDA kernels behind srt's layer classes: FlashInfer's norm, activation and rope ops.

On CUDA a decode layer written in plain torch launches dozens of small kernels (an RMSNorm alone
is six elementwise ops and a residual add); FlashInfer ships each of those steps as one kernel.
The layer classes keep their torch code (the CPU path and the numerical reference) and hold a
``fused: FusedKernels | None`` that the model runner binds on CUDA (``bind_fused_kernels``)::

    RMSNorm / GemmaRMSNorm          rmsnorm, fused_add_rmsnorm (residual += x; x = norm(residual))
                                    and the Gemma variants (scale by 1 + weight)
    SiluAndMul / GeluTanhAndMul     silu_and_mul, gelu_tanh_and_mul
    RotaryEmbedding                 apply_rope_with_cos_sin_cache_inplace (q and k in place, from
                                    the layer's float32 cos/sin table: every srt rope type)

Each method returns None when the kernel cannot take the inputs (dtype other than bf16/fp16, a
layout the kernel does not read, a head size its rope does not build for) and the layer then
runs its torch code for that call, so a model mixes both per layer and per call, never wrongly.

The kernels compute in float32 and round once; the torch code rounds where HF does (a Llama
norm rounds before the weight multiply). Outputs agree to bf16 rounding, so greedy tokens agree
up to near-ties.

The FlashInfer functions are looked up by name (``FLASHINFER_OPS``) when the first op runs; a
test passes its own table (``ops``) of functions with the same signatures, as the attention
backend takes a wrapper factory.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping

import torch
from torch import nn

FUSED_DTYPES = (torch.bfloat16, torch.float16)
ROPE_HEAD_DIMS = (64, 128, 256, 512)  # FlashInfer's cos/sin-cache rope kernel's head sizes

# srt's name -> (flashinfer module, function)
FLASHINFER_OPS: dict[str, tuple[str, str]] = {
    "rmsnorm": ("flashinfer.norm", "rmsnorm"),
    "fused_add_rmsnorm": ("flashinfer.norm", "fused_add_rmsnorm"),
    "gemma_rmsnorm": ("flashinfer.norm", "gemma_rmsnorm"),
    "gemma_fused_add_rmsnorm": ("flashinfer.norm", "gemma_fused_add_rmsnorm"),
    "silu_and_mul": ("flashinfer.activation", "silu_and_mul"),
    "gelu_tanh_and_mul": ("flashinfer.activation", "gelu_tanh_and_mul"),
    "rope": ("flashinfer.rope", "apply_rope_with_cos_sin_cache_inplace"),
}
ACTIVATIONS = {"silu": "silu_and_mul", "gelu_tanh": "gelu_tanh_and_mul"}


def flashinfer_ops() -> dict[str, Callable]:
    """The FlashInfer functions of ``FLASHINFER_OPS``, imported now."""
    return {
        name: getattr(importlib.import_module(module), func)
        for name, (module, func) in FLASHINFER_OPS.items()
    }


def _rows_ok(x: torch.Tensor) -> bool:
    return x.dtype in FUSED_DTYPES and x.dim() >= 1 and x.stride(-1) == 1


class FusedKernels:
    """The fused ops a layer may hand a call to; see the module docstring."""

    def __init__(self, ops: Mapping[str, Callable] | None = None) -> None:
        self._ops: Mapping[str, Callable] | None = ops

    @property
    def ops(self) -> Mapping[str, Callable]:
        if self._ops is None:
            self._ops = flashinfer_ops()
        return self._ops

    def norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False, in_place: bool = False
    ) -> torch.Tensor | None:
        """``norm(x) * weight`` (Gemma: ``* (1 + weight)``) of x ``[T, d]`` or ``[T, heads, d]``
        (rows may be strided) -> a new contiguous tensor, or x itself with ``in_place`` (the
        kernel reads each row before writing it); None if the kernel cannot take x."""
        if not (_rows_ok(x) and x.dim() in (2, 3) and weight.dtype == x.dtype and weight.is_contiguous()):
            return None
        out = x if in_place else torch.empty(x.shape, dtype=x.dtype, device=x.device)
        self.ops["gemma_rmsnorm" if gemma else "rmsnorm"](x, weight, eps, out=out)
        return out

    def add_norm_(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """In place: ``residual += x``, then ``x = norm(residual) * weight``; returns ``(x,
        residual)``, or None (nothing written) if the kernel cannot take them. Both ``[T, d]``."""
        if not (_rows_ok(x) and x.dim() == 2 and residual.dim() == 2 and residual.stride(-1) == 1):
            return None
        if residual.dtype != x.dtype or weight.dtype != x.dtype or residual.shape != x.shape:
            return None
        self.ops["gemma_fused_add_rmsnorm" if gemma else "fused_add_rmsnorm"](x, residual, weight, eps)
        return x, residual

    def act_and_mul(self, x: torch.Tensor, act: str) -> torch.Tensor | None:
        """``act(x[..., :d]) * x[..., d:]`` for contiguous x ``[..., 2d]`` (act ``silu`` or
        ``gelu_tanh``) -> ``[..., d]``; None if the kernel cannot take x."""
        if not (_rows_ok(x) and x.is_contiguous() and (x.shape[-1] * x.element_size()) % 16 == 0):
            return None
        return self.ops[ACTIVATIONS[act]](x)

    def rope_(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        head_dim: int,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Neox rope of q ``[T, H*D]`` and k ``[T, H_kv*D]`` (strided rows allowed, e.g. views of
        the fused qkv output) in place from ``cos_sin_cache [positions, rotary_dim]`` (float32:
        cos then sin); the first ``rotary_dim`` dims of each head rotate. Returns ``(q, k)``, or
        None (nothing written) if the kernel cannot take them."""
        if not (_rows_ok(q) and _rows_ok(k) and q.dim() == 2 and k.dim() == 2 and q.dtype == k.dtype):
            return None
        rotary_dim = cos_sin_cache.shape[-1]
        vec = max(16 // q.element_size(), head_dim // 32)  # elements one thread rotates
        if head_dim not in ROPE_HEAD_DIMS or rotary_dim % (2 * vec) or rotary_dim > head_dim:
            return None
        if cos_sin_cache.dtype != torch.float32 or not cos_sin_cache.is_contiguous():
            return None
        if positions.dtype not in (torch.int32, torch.int64) or not positions.is_contiguous():
            return None
        self.ops["rope"](positions, q, k, head_dim, cos_sin_cache, is_neox=True)
        return q, k


def fused_layers(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that can hand calls to fused kernels (a ``fused`` attribute)."""
    return [m for m in model.modules() if hasattr(m, "fused") and not isinstance(m, FusedKernels)]


def bind_fused_kernels(model: nn.Module, kernels: FusedKernels | None) -> int:
    """Give every such module of ``model`` ``kernels`` (None: their torch code); returns how many."""
    layers = fused_layers(model)
    for m in layers:
        m.fused = kernels
    return len(layers)


def fused_kernels_off_reason(device: torch.device, dtype: torch.dtype, disabled: bool) -> str | None:
    """Why a model on ``device`` in ``dtype`` runs its torch code rather than the fused kernels,
    or None when it takes them (CUDA, bf16/fp16, flashinfer importable, not disabled)."""
    if disabled:
        return "--disable-fused-kernels"
    if device.type != "cuda":
        return f"device {device.type} (fused kernels are CUDA only)"
    if dtype not in FUSED_DTYPES:
        return f"dtype {str(dtype).removeprefix('torch.')} (the kernels take bfloat16 and float16)"
    try:
        flashinfer_ops()
    except (ImportError, AttributeError) as e:
        return f"flashinfer's fused ops do not import ({e})"
    return None

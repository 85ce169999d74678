"""RMSNorm, optionally fused with the residual add of a pre-norm transformer block.

Numerics follow HF Llama: normalize in float32, cast back to the input dtype, then scale
by the weight. A subclass with ``gemma`` set scales by ``1 + weight`` instead (Gemma's; its own
torch code in ``_norm`` and ``_add_norm``); the fused kernels take both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from srt.kernels.cpu import elementwise
from srt.layers.fused_kernels import FusedKernels
from srt.layers.parameter import empty_param


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim (size ``hidden_size``); one
    FlashInfer kernel on CUDA (``fused``, bound by the model runner), else the torch code."""

    fused: FusedKernels | None = None
    gemma = False  # the scale is 1 + weight (Gemma)

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = empty_param(hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[..., hidden_size]`` -> same shape and dtype."""
        if self.fused is not None:
            out = self.fused.norm(x, self.weight, self.eps, self.gemma)
            if out is not None:
                return out
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        """The torch code (the CPU path and the reference)."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def norm_heads(self, x: torch.Tensor) -> torch.Tensor:
        """Each head of x ``[T, heads, head_dim]`` (q or k, a view of the qkv output) normalised:
        in place on CUDA, so q and k stay views of that output (the KV pool then stores K and V
        in one copy); else a new tensor."""
        if self.fused is not None:
            out = self.fused.norm(x, self.weight, self.eps, self.gemma, in_place=True)
            if out is not None:
                return out
        return self.forward(x)

    def forward_with_residual(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual += x`` (in place; the caller owns ``residual``, and ``x``, which may hold
        the result), then ``(norm(residual), residual)``; one native pass for float32 or bf16 CPU
        rows, one FlashInfer kernel on CUDA."""
        if self.fused is not None:
            done = self.fused.add_norm_(x, residual, self.weight, self.eps, self.gemma)
            if done is not None:
                return done
        return self._add_norm(x, residual)

    def _add_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward_with_residual`` without the fused kernel."""
        if elementwise.supports(x, residual):  # add_rms_norm_ checks the weight itself
            return elementwise.add_rms_norm_(x, residual, self.weight, self.eps), residual
        residual.add_(x)
        return self.forward(residual), residual

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"

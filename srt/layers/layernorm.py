"""RMSNorm, optionally fused with the residual add of a pre-norm transformer block.

Numerics follow HF Llama: normalize in float32, cast back to the input dtype, then scale
by the weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from srt.kernels.cpu import elementwise
from srt.layers.parameter import empty_param


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim (size ``hidden_size``)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = empty_param(hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[..., hidden_size]`` -> same shape and dtype."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward_with_residual(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual += x`` (in place; the caller owns ``residual``), then
        ``(norm(residual), residual)``; one native pass for float32 or bf16 CPU rows."""
        if elementwise.supports(x, residual):  # add_rms_norm_ checks the weight itself
            return elementwise.add_rms_norm_(x, residual, self.weight, self.eps), residual
        residual.add_(x)
        return self.forward(residual), residual

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"

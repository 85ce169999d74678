"""Activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from srt.kernels.cpu import elementwise


class SiluAndMul(nn.Module):
    """``silu(x[..., :d]) * x[..., d:]`` for x ``[..., 2d]`` (the fused gate/up output) -> ``[..., d]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if elementwise.supports(x):  # one pass, native (float32 or bf16 CPU)
            return elementwise.silu_and_mul(x)
        d = x.shape[-1] // 2
        out = F.silu(x[..., :d])
        return out.mul_(x[..., d:])


class GeluTanhAndMul(nn.Module):
    """``gelu_tanh(x[..., :d]) * x[..., d:]`` for x ``[..., 2d]`` -> ``[..., d]`` (GeGLU; HF's
    ``gelu_pytorch_tanh``: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        out = F.gelu(x[..., :d], approximate="tanh")
        return out.mul_(x[..., d:])

"""Activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from srt.kernels.cpu import elementwise
from srt.layers.fused_kernels import FusedKernels


class SiluAndMul(nn.Module):
    """``silu(x[..., :d]) * x[..., d:]`` for x ``[..., 2d]`` (the fused gate/up output) -> ``[..., d]``;
    one FlashInfer kernel on CUDA (``fused``), one native pass on CPU, else the torch code."""

    fused: FusedKernels | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None and (out := self.fused.act_and_mul(x, "silu")) is not None:
            return out
        if elementwise.supports(x):  # one pass, native (float32 or bf16 CPU)
            return elementwise.silu_and_mul(x)
        d = x.shape[-1] // 2
        out = F.silu(x[..., :d])
        return out.mul_(x[..., d:])


class GeluTanhAndMul(nn.Module):
    """``gelu_tanh(x[..., :d]) * x[..., d:]`` for x ``[..., 2d]`` -> ``[..., d]`` (GeGLU; HF's
    ``gelu_pytorch_tanh``: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``); one FlashInfer
    kernel on CUDA (``fused``)."""

    fused: FusedKernels | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None and (out := self.fused.act_and_mul(x, "gelu_tanh")) is not None:
            return out
        d = x.shape[-1] // 2
        out = F.gelu(x[..., :d], approximate="tanh")
        return out.mul_(x[..., d:])

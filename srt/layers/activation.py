"""Activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from srt.kernels.cpu import elementwise


class SiluAndMul(nn.Module):
    """``silu(x[..., :d]) * x[..., d:]`` for x ``[..., 2d]`` (the fused gate/up output) -> ``[..., d]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if elementwise.supports(x):  # one pass, native (float32 CPU)
            return elementwise.silu_and_mul(x)
        d = x.shape[-1] // 2
        out = F.silu(x[..., :d])
        return out.mul_(x[..., d:])

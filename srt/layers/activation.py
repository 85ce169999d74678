"""Activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """``silu(x[..., :d]) * x[..., d:]`` for x ``[..., 2d]`` (the fused gate/up output) -> ``[..., d]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        out = F.silu(x[..., :d])
        return out.mul_(x[..., d:])

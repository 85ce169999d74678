"""The pure-torch parts of the mixture-of-experts blocks (``srt/layers/moe.py``): the router's
top-k, and ``dense_moe_reference``, every expert on every token weighted by the full routing
matrix: the reference the grouped path is tested against, and the path taken while a CUDA graph
is captured (the grouped one reads per-expert counts on the host)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from srt.kernels.cpu import elementwise
from srt.layers.linear import fake_quant_rows

__all__ = ["dense_moe_reference", "route_topk"]


def route_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights float32 [T, k], expert ids int64 [T, k])``: softmax over the experts in float32,
    the ``top_k`` largest, renormalised to sum 1 when ``renormalize``."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    if elementwise.supports(h):
        return elementwise.silu_and_mul(h)
    d = h.shape[-1] // 2
    return F.silu(h[..., :d]) * h[..., d:]


def dense_moe_reference(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    token_quant: str | None = None,
) -> torch.Tensor:
    """Every expert on every token: ``sum_e routing[:, e] * down_e(silu(gate_e x) * up_e x)`` with
    ``routing [T, E]`` the top-k ``weights`` scattered at ``ids`` (zeros elsewhere). ``gate_up
    [E, 2I, H]``, ``down [E, H, I]`` float. ``token_quant``: both matmuls' inputs quantized per
    token first (``fake_quant_rows``)."""
    quant = (lambda t: fake_quant_rows(t, token_quant)) if token_quant else (lambda t: t)  # noqa: E731
    routing = torch.zeros(x.shape[0], gate_up.shape[0], dtype=torch.float32, device=x.device)
    routing.scatter_(1, ids, weights.to(torch.float32))
    out = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float32, device=x.device)
    x = quant(x)
    for e in range(gate_up.shape[0]):
        y = F.linear(quant(_silu_and_mul(F.linear(x, gate_up[e]))), down[e])
        out += routing[:, e : e + 1] * y.float()
    return out.to(x.dtype)

"""Parameters of srt's layers: created uninitialized, filled by a checked copy.

``empty_param`` allocates without running an init kernel (pages stay untouched until loading
writes them) and without gradients. ``copy_weight`` is the one copy every ``load_weights`` and
``load_shard`` uses: it checks the shapes agree (``WeightLoadError`` otherwise) and converts
dtype/device on the way. Both sit below the layers and the loader, so neither depends on the
other.
"""

from __future__ import annotations

import torch
from torch import nn

from srt.utils.errors import WeightLoadError


def empty_param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    """An uninitialized, non-trainable parameter."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def released_param(param: torch.Tensor) -> nn.Parameter:
    """A parameter with ``param``'s shape and dtype and no memory (on the ``meta`` device): what a
    layer keeps of a weight it only needs in another form."""
    return nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"), requires_grad=False)


def copy_weight(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    """``param.copy_(loaded)`` (dtype/device converted) after checking the shapes agree."""
    if param.shape != loaded.shape:
        raise WeightLoadError(
            f"weight {name}: checkpoint shape {tuple(loaded.shape)} != model shape {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(loaded)

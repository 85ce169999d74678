"""The interface of linear backends (``LinearBackend``) and the plain one (``TorchLinear``);
srt/layers/linear_backend.py says which backends exist and how one is chosen.

Contract of ``apply(x, weight, bias)``: x ``[..., in]``, weight ``[out, in]`` (F.linear's
layout), bias ``[out]`` or None -> ``[..., out]`` in x's dtype, equal to ``F.linear(x, weight,
bias)`` up to float rounding. This is the seam where quantized weight formats plug in: a backend
that owns its own weight layout and ``apply``.

Weights may be prepacked once, after loading: ``pack_weight(weight)`` returns a second form
of the weight for the backend's own use (or None), which the layer keeps beside its plain weight
and passes back to ``apply`` as ``packed``; a backend that needs the packed form alone
(``packed_only``) has the layer release the plain one (a ``meta`` tensor keeps its shape and dtype).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import Tensor


class LinearBackend(ABC):
    """The matmul of linear layers; see the module docstring for the contract of ``apply``."""

    name: str
    # apply() needs nothing but the packed weight once pack_weight() made one: the layer then
    # releases its plain weight (srt/layers/linear.py)
    packed_only: bool = False

    @abstractmethod
    def apply(
        self, x: Tensor, weight: Tensor, bias: Tensor | None = None, packed: Tensor | None = None
    ) -> Tensor:
        """x ``[..., in]``, weight ``[out, in]``, bias ``[out]`` -> ``[..., out]``; ``packed`` is
        what ``pack_weight(weight)`` returned, if anything."""

    def pack_weight(self, weight: torch.Tensor, prefill: bool = True) -> torch.Tensor | None:
        """A prepacked copy of a loaded ``weight [out, in]`` for ``apply`` (called once per weight
        after loading), or None: the default has no packed form. ``prefill=False``: the layer never
        sees a prompt's rows (the LM head: one row a sequence)."""
        return None

    def apply_silu_mul(
        self, x: Tensor, weight: Tensor, bias: Tensor | None = None, packed: Tensor | None = None
    ) -> Tensor | None:
        """``silu_and_mul(apply(x, weight, bias, packed))`` for a gate/up weight (gate rows first)
        in one pass, ``[..., out / 2]``, the same values; None where the backend has no such pass
        (the default): apply, then the activation."""
        return None

    def for_many_rows(self, dtype: torch.dtype) -> LinearBackend:
        """The backend for layers of ``dtype`` that only ever see hundreds of rows or more (a
        vision tower's: every patch of an image at once): this one, unless another is faster
        there."""
        return self

    def load_summary(self) -> str | None:
        """One line on what packing the loaded weights made, for the load log; None: nothing to say."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class TorchLinear(LinearBackend):
    """``F.linear``."""

    name = "torch"

    def apply(
        self, x: Tensor, weight: Tensor, bias: Tensor | None = None, packed: Tensor | None = None
    ) -> Tensor:
        return F.linear(x, weight, bias)


TORCH_LINEAR = TorchLinear()


def check_packed_only_input(x: Tensor, kernel: str) -> None:
    """A layer of a ``packed_only`` backend released its plain weight: refuse what its packed form
    cannot run (a non-CPU input, or autograd), naming ``kernel``."""
    if x.device.type != "cpu" or (torch.is_grad_enabled() and x.requires_grad):
        raise RuntimeError(
            f"a linear layer packed for {kernel} runs CPU inference only (its plain weight was "
            f"released); got a {x.device.type} input{' that requires grad' * x.requires_grad}. "
            "Build the model with another linear backend for this."
        )

"""Linear backends: how a linear layer (and the LM head) runs its matmul.

A ``LinearBackend`` is chosen once per process from ``ServerArgs.linear_backend`` (resolved by
``ServerArgs.resolve``; see ``srt/configs/backends.py``), built by the ModelRunner with
``create_linear_backend(name)`` and handed to the model's constructor, which gives it to every
``Linear`` and to the ``LogitsProcessor`` (the LM head). A model built without one (tests,
tools) uses ``TORCH_LINEAR``.

Contract of ``apply(x, weight, bias)``: x ``[..., in]``, weight ``[out, in]`` (F.linear's
layout), bias ``[out]`` or None -> ``[..., out]`` in x's dtype, equal to ``F.linear(x, weight,
bias)`` up to float rounding. This is the seam where quantized weight formats plug in: a backend
that owns its own weight layout and ``apply``.

* ``torch``: ``F.linear`` everywhere (MKL sgemm on CPU): outputs bitwise those of a plain PyTorch
  model on the same machine; always the choice on CUDA.
* ``onednn`` (what ``auto`` picks on CPU float32 when oneDNN is present and passes its
  self-check): oneDNN's matmul (``torch.ops.mkldnn._linear_pointwise``) for CPU float32 inputs
  outside autograd, ``F.linear`` for everything else. Its float32 accumulation order differs
  from MKL's, so logits move by about 1e-4 against a reference computed with MKL; greedy tokens
  stay equal except at near-ties. docs/benchmarks.md has the measured speed-up.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F

from srt.configs.device import onednn_linear_available


class LinearBackend(ABC):
    """The matmul of linear layers; see the module docstring for the contract of ``apply``."""

    name: str

    @abstractmethod
    def apply(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x ``[..., in]``, weight ``[out, in]``, bias ``[out]`` -> ``[..., out]``."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class TorchLinear(LinearBackend):
    """``F.linear``."""

    name = "torch"

    def apply(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)


class OneDNNLinear(LinearBackend):
    """oneDNN's linear for CPU float32 inputs outside autograd, ``F.linear`` otherwise."""

    name = "onednn"

    def apply(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if (
            x.dtype == torch.float32
            and x.device.type == "cpu"
            and weight.dtype == torch.float32
            and x.numel() > 0
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        ):
            x2 = x.reshape(-1, x.shape[-1])
            out = torch.ops.mkldnn._linear_pointwise(x2, weight, bias, "none", [], "")
            return out.view(*x.shape[:-1], weight.shape[0])
        return F.linear(x, weight, bias)


TORCH_LINEAR = TorchLinear()


def create_linear_backend(name: str) -> LinearBackend:
    """The backend of a resolved ``--linear-backend`` (``torch`` or ``onednn``).

    Raises ``ValueError`` for any other name (``auto`` included: resolve it first) and for
    ``onednn`` where oneDNN's linear is not usable."""
    if name == "torch":
        return TORCH_LINEAR
    if name == "onednn":
        if not onednn_linear_available():
            raise ValueError(
                "linear backend 'onednn' is not usable here (oneDNN missing or failed its self-check)"
            )
        return OneDNNLinear()
    raise ValueError(f"create_linear_backend takes a resolved name ('torch' or 'onednn'), got {name!r}")

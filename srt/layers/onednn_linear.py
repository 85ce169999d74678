"""oneDNN's matmul on weights prepacked in its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``,
an opaque ``torch._mkldnn`` tensor: the reorder oneDNN would otherwise redo on every call).

* ``OneDNNLinear`` (``--linear-backend onednn``, what ``auto`` picks on CPU float32 machines
  without srt's native kernels when oneDNN passes its self-check): float32 CPU inputs outside
  autograd; small batches (at most ``SMALL_BATCH_ROWS`` rows, decode with a few sequences) on
  ``torch.ops.srt_cpu.small_batch_linear`` over the plain weight when srt's native kernels are
  loaded (a matrix-vector product is bound by memory bandwidth, where oneDNN's blocked GEMM falls
  short), the rest on the packed weight; ``F.linear`` for everything else. It keeps the float32
  weights twice (plain and packed; the memory accounting counts both). Its float32 accumulation
  order differs from MKL's, so logits move by about 1e-4 against a reference computed with MKL;
  greedy tokens stay equal except at near-ties.
* ``OneDNNBf16Linear``: bf16 weights in the blocked layout alone, for layers that only ever see
  hundreds of rows (a vision tower's) on a CPU with AMX tiles (``amx_bf16_tiles``), where oneDNN's
  matmul on its own layout beats srt's brgemm path and ``F.linear`` (which reorders the plain
  weight on every call).
* ``ONEDNN_PREFILL_ROWS``: from how many rows the native backend's bf16 prefill copies (the same
  blocked layout, srt/layers/linear_backend.py) take a matmul.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor

from srt.kernels import cpu as cpu_kernels
from srt.layers.linear_base import LinearBackend, check_packed_only_input


def _cpu_float32_inference(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A float32 CPU input and weight outside autograd: what the packed kernels take (the rest
    goes to ``F.linear``)."""
    return (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and weight.dtype == torch.float32
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    )


# the batch size oneDNN is told to expect when it picks a packed layout (any batch size works
# with the result; this one suits decode batches)
PACK_BATCH_HINT = 32
# inputs with at most this many rows take the native small-batch kernel (it beats oneDNN's
# packed GEMM up to here on the CPUs measured; docs/benchmarks.md)
SMALL_BATCH_ROWS = 4


class OneDNNLinear(LinearBackend):
    """See the module docstring: the native small-batch kernel for a few rows, oneDNN's matmul
    on the prepacked weight otherwise (CPU float32 outside autograd), ``F.linear`` for the rest."""

    name = "onednn"

    def pack_weight(self, weight: torch.Tensor, prefill: bool = True) -> torch.Tensor | None:
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            return None
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_BATCH_HINT)

    def apply(
        self, x: Tensor, weight: Tensor, bias: Tensor | None = None, packed: Tensor | None = None
    ) -> Tensor:
        if not (_cpu_float32_inference(x, weight) and x.numel() > 0):
            return F.linear(x, weight, bias)
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] <= SMALL_BATCH_ROWS and weight.is_contiguous() and cpu_kernels.native_available():
            out = torch.ops.srt_cpu.small_batch_linear(x2, weight, bias)
        else:
            w = packed if packed is not None else weight
            out = torch.ops.mkldnn._linear_pointwise(x2, w, bias, "none", [], "")
        return out.view(*x.shape[:-1], weight.shape[0])


# rows from which a bf16 layer's oneDNN copy (NativeLinear's prefill_copy) runs its matmul: oneDNN
# was 0.96x srt's brgemm path at 32 rows, 1.03-1.08x at 64, 1.19-1.24x at 128-512 (Qwen2.5-1.5B's
# layers, Intel Xeon with AMX, 2 cores)
ONEDNN_PREFILL_ROWS = 64


def onednn_bf16_available() -> bool:
    """Whether torch's oneDNN runs bf16 matmuls on this CPU: it needs AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT, and refuses a bf16 weight's reorder elsewhere (AVX2-only CPUs)."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def amx_bf16_tiles() -> bool:
    """Whether bf16 matmuls run on AMX tiles here: srt's brgemm path is on (the CPU has AMX-BF16
    and ``SRT_BF16_BRGEMM_M`` does not switch it off), torch's oneDNN runs bf16, and oneDNN is not
    capped below AMX (``ONEDNN_MAX_CPU_ISA``, which srt/configs/bf16_probe.py sets where tiles
    trap)."""
    if not (cpu_kernels.native_available() and hasattr(torch.ops.srt_cpu, "bf16_brgemm_rows")):
        return False
    if not onednn_bf16_available():
        return False
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    return torch.ops.srt_cpu.bf16_brgemm_rows() < 2**62 and (cap in ("", "ALL") or "AMX" in cap)


# the batch size oneDNN is told to expect for a bf16 layer of many rows (a tower's: an image's
# patches)
MANY_ROWS_HINT = 1024


class OneDNNBf16Linear(LinearBackend):
    """bf16 weights held in oneDNN's blocked layout alone (``packed_only``), run by its matmul:
    for layers that only ever see hundreds of rows, on a CPU with AMX tiles (module docstring).
    Other weights (not bf16, not on the CPU) stay plain and go to ``F.linear``."""

    name = "onednn_bf16"
    packed_only = True

    def pack_weight(self, weight: torch.Tensor, prefill: bool = True) -> torch.Tensor | None:
        if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2:
            return None
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), MANY_ROWS_HINT)

    def apply(
        self, x: Tensor, weight: Tensor, bias: Tensor | None = None, packed: Tensor | None = None
    ) -> Tensor:
        if packed is None:
            return F.linear(x, weight, bias)
        check_packed_only_input(x, "oneDNN's bf16 matmul")
        x2 = x.reshape(-1, x.shape[-1])
        if x2.dtype != torch.bfloat16:  # not a bf16 tower's input: the weight's values, x's dtype
            return F.linear(x, packed.to_dense().to(x.dtype), None if bias is None else bias.to(x.dtype))
        out = torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")
        return out.view(*x.shape[:-1], weight.shape[0])


ONEDNN_BF16 = OneDNNBf16Linear()

"""Linear backends: how a linear layer (and the LM head) runs its matmul.

A ``LinearBackend`` (srt/layers/linear_base.py: the contract of ``apply`` and of prepacked
weights) is chosen once per process from ``ServerArgs.linear_backend`` (resolved by
``ServerArgs.resolve``; see ``srt/configs/backends.py``), built by the ModelRunner with
``create_linear_backend(name)`` and handed to the model's constructor, which gives it to every
``Linear`` and to the ``LogitsProcessor`` (the LM head). A model built without one (tests,
tools) uses ``TORCH_LINEAR``.

* ``torch``: ``F.linear`` everywhere (MKL sgemm on CPU): outputs bitwise those of a plain PyTorch
  model on the same machine; always the choice on CUDA.
* ``native`` (what ``auto`` picks on CPU float32 where the CPU has AVX2 + FMA, AVX-512 CPUs
  included): srt's packed kernel, ``torch.ops.srt_cpu.packed_linear``
  (``srt/kernels/cpu/packed_linear.cpp``) on the weight packed once into panels of output
  columns (48 with an AVX-512 tile, 24 with an AVX2 one), one kernel for every batch size: it
  streams the weights at M = 1-4 rows, and beats oneDNN at decode batches (1.3x at M = 8-64 on
  the AMD Zen 3 measured, AVX2; 1.4-1.6x at M = 4-64 on the Intel Emerald Rapids measured,
  AVX-512) while matching it at prefill sizes. Every output is one FMA chain over k in order,
  seeded with the bias, so results do not depend on the batch a row came in (batch invariance),
  on the thread count or on the ISA; against MKL the logits move by about 1e-4, as with oneDNN.
  It needs the packed form alone (``packed_only``), so a float32 model is held once.
* ``onednn`` (what ``auto`` picks on other CPU float32 machines when oneDNN is present and passes
  its self-check): oneDNN's matmul on prepacked float32 weights (srt/layers/onednn_linear.py).
  docs/benchmarks.md has the measured speed-ups.

On a CPU with AMX tiles the ``native`` backend may keep a second form of each bf16 weight
(``prefill_copy``): oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``), which
its matmul runs 1.08-1.24x faster than srt's brgemm path from ``ONEDNN_PREFILL_ROWS`` rows on
(prefill; Qwen2.5-1.5B's layers on an Intel Xeon with AMX, 2 cores), at the cost of the weights'
size again in memory. Below that (decode) srt's kernels stay faster or equal. ``auto`` makes the
copy while the memory left available afterwards stays at least half of the machine's (of its
cgroup limit in a container). Layers that
only ever see hundreds of rows (a vision tower's) hold bf16 weights in that layout alone
(``for_many_rows``: ``OneDNNBf16Linear``).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from srt.configs.device import onednn_linear_available
from srt.kernels import cpu as cpu_kernels
from srt.layers.linear_base import TORCH_LINEAR, LinearBackend, check_packed_only_input
from srt.layers.onednn_linear import (
    ONEDNN_BF16,
    ONEDNN_PREFILL_ROWS,
    OneDNNLinear,
    amx_bf16_tiles,
)
from srt.mem_cache.pool_size import cpu_process_memory, read_cgroup_memory

__all__ = [
    "ONEDNN_PREFILL_ROWS",
    "TORCH_LINEAR",
    "LinearBackend",
    "NativeLinear",
    "OneDNNLinear",
    "amx_bf16_tiles",
    "create_linear_backend",
]

logger = logging.getLogger(__name__)


PREFILL_COPY_CHOICES = ("auto", "on", "off")


def _memory_left_after(nbytes: int) -> bool:
    """Whether ``nbytes`` more leave at least half of the memory available: the machine's, or the
    process's memory cgroup's where it has a limit (a container sees the host's in /proc/meminfo)."""
    import psutil

    mem = psutil.virtual_memory()
    limit, usage = read_cgroup_memory()
    total = mem.total if limit is None else min(mem.total, limit)
    available = cpu_process_memory(mem.available, 0, limit, usage)  # capped by the cgroup's room
    return available - nbytes >= total // 2


class NativeLinear(LinearBackend):
    """srt's packed kernels for every CPU input of a packed weight, ``F.linear`` for weights it did
    not pack: a float32 weight in float32 panels (``torch.ops.srt_cpu.packed_linear``, one kernel for
    every batch size; other input dtypes go through float32), a bf16 weight in bf16 VNNI-pair panels
    (``torch.ops.srt_cpu.bf16_linear``: bf16 activations on the CPU's bf16 dot products or oneDNN's
    brgemm, float32 ones widening the weights in registers; the output in the input's dtype).
    ``weight_dtype=torch.bfloat16`` packs float32 weights in bf16 too (a bf16 checkpoint served with
    float32 activations on a CPU without bf16 arithmetic: half the bytes, the same values). An FP8
    checkpoint's float8_e4m3fn codes go in one byte a code (``torch.ops.srt_cpu.fp8_linear``, see
    ``stores_fp8``). The plain weight of a packed layer is released (``packed_only``): autograd through it is refused.
    ``prefill_copy`` (``auto`` / ``on`` / ``off``): on a CPU with AMX tiles, a bf16 weight's packed
    form also carries oneDNN's blocked copy (its ``onednn_copy`` attribute), which runs inputs of
    ``ONEDNN_PREFILL_ROWS`` bf16 rows or more (module docstring).
    Needs the native kernels loaded: ``create_linear_backend`` checks that."""

    name = "native"
    packed_only = True

    def __init__(self, weight_dtype: torch.dtype | None = None, prefill_copy: str = "off") -> None:
        if prefill_copy not in PREFILL_COPY_CHOICES:
            raise ValueError(f"prefill_copy must be one of {PREFILL_COPY_CHOICES}, got {prefill_copy!r}")
        self.weight_dtype = weight_dtype
        self.prefill_copy = prefill_copy
        # what the copies took: bytes, layers copied, layers left without one for lack of memory
        self.prefill_copy_bytes = 0
        self.prefill_copies = 0
        self.prefill_copies_skipped = 0

    @property
    def stores_fp8(self) -> bool:
        """Whether an FP8 checkpoint's codes stay in one byte (``torch.ops.srt_cpu.fp8_linear``
        widens them to bf16 in cache, where the CPU does that on vectors: AVX512-VBMI); else a
        ``Linear`` keeps them in its weight's dtype (bf16 storage: two bytes a code, exact)."""
        return hasattr(torch.ops.srt_cpu, "fp8_fast") and bool(torch.ops.srt_cpu.fp8_fast())

    @property
    def stores_fp8_blocks(self) -> bool:
        """Whether a block-scaled FP8 checkpoint's codes and scales stay as they are (the widening
        applies each block's scale too, rounding to bf16 on the CPU's bf16 conversion); else a
        ``Linear`` holds their values in its weight's dtype."""
        return hasattr(torch.ops.srt_cpu, "fp8_fast_blocks") and bool(torch.ops.srt_cpu.fp8_fast_blocks())

    def pack_fp8_blocks(self, codes: Tensor, scale: Tensor, block: tuple[int, int]) -> Tensor:
        """Block-scaled codes for ``fp8_linear``: each weight widens to bf16(code x its block's scale)."""
        return torch.ops.srt_cpu.pack_fp8_weight(
            codes.detach(), scale.float().contiguous(), block[0], block[1]
        )

    def for_many_rows(self, dtype: torch.dtype) -> LinearBackend:
        """bf16 on a CPU with AMX tiles: ``ONEDNN_BF16`` (oneDNN's bf16 matmul on its blocked
        layout, the weights held once); srt's kernels elsewhere (below AMX they beat oneDNN's)."""
        if dtype == torch.bfloat16 and amx_bf16_tiles():
            return ONEDNN_BF16
        return self

    def load_summary(self) -> str | None:
        if not (self.prefill_copies or self.prefill_copies_skipped):
            return None
        return (
            f"bf16 prefill copies (--bf16-prefill-copy {self.prefill_copy}): {self.prefill_copies} layers, "
            f"{self.prefill_copy_bytes / (1 << 20):.1f} MiB in oneDNN's layout for inputs of "
            f"{ONEDNN_PREFILL_ROWS} rows or more; {self.prefill_copies_skipped} layers without one "
            "(under half of the memory would have stayed available)"
        )

    def _attach_prefill_copy(self, weight: Tensor, packed: Tensor) -> None:
        """Give a bf16 weight's packed form its oneDNN copy (``onednn_copy``) where ``prefill_copy``
        asks for one: ``on`` on any CPU with AMX tiles, ``auto`` while memory allows."""
        if self.prefill_copy == "off" or weight.dtype != torch.bfloat16 or not amx_bf16_tiles():
            return
        nbytes = weight.numel() * weight.element_size()
        if self.prefill_copy == "auto" and not _memory_left_after(nbytes):
            self.prefill_copies_skipped += 1
            return
        packed.onednn_copy = _reorder_for_prefill(weight)
        self.prefill_copy_bytes += nbytes
        self.prefill_copies += 1

    def pack_weight(self, weight: torch.Tensor, prefill: bool = True) -> torch.Tensor | None:
        if weight.device.type != "cpu" or weight.dim() != 2:
            return None
        if weight.dtype == torch.float8_e4m3fn:  # an FP8 checkpoint's codes (stores_fp8)
            return torch.ops.srt_cpu.pack_fp8_weight(weight.detach()) if weight.shape[1] % 2 == 0 else None
        if weight.dtype == torch.bfloat16 or (
            weight.dtype == torch.float32 and self.weight_dtype == torch.bfloat16
        ):
            # pairs of k: an odd in_features (no model has one) keeps its plain weight and F.linear
            if weight.shape[1] % 2:
                return None
            packed = torch.ops.srt_cpu.pack_bf16_weight(weight.detach())
            if prefill:
                self._attach_prefill_copy(weight, packed)
            return packed
        if weight.dtype != torch.float32:
            return None
        return torch.ops.srt_cpu.pack_linear_weight(weight.detach())

    def apply(
        self, x: Tensor, weight: Tensor, bias: Tensor | None = None, packed: Tensor | None = None
    ) -> Tensor:
        if packed is None:
            return F.linear(x, weight, bias)
        check_packed_only_input(x, "srt's native CPU kernel")
        x2 = x.reshape(-1, x.shape[-1])
        copy = _onednn_copy(packed, x2)
        if copy is not None:
            out = torch.ops.mkldnn._linear_pointwise(x2, copy, bias, "none", [], "")
            return out.view(*x.shape[:-1], weight.shape[0])
        if packed.dtype in (torch.bfloat16, torch.uint8):
            x2 = x2 if x2.dtype in (torch.bfloat16, torch.float32) else x2.float()
            op = (
                torch.ops.srt_cpu.bf16_linear
                if packed.dtype == torch.bfloat16
                else torch.ops.srt_cpu.fp8_linear
            )
            out = op(x2, packed, weight.shape[0], bias)
        else:
            b32 = None if bias is None else bias.float().contiguous()
            out = torch.ops.srt_cpu.packed_linear(x2.float(), packed, weight.shape[0], b32)
        return out.view(*x.shape[:-1], weight.shape[0]).to(x.dtype)

    def apply_silu_mul(
        self, x: Tensor, weight: Tensor, bias: Tensor | None = None, packed: Tensor | None = None
    ) -> Tensor | None:
        """bf16 packed weights and activations: ``torch.ops.srt_cpu.bf16_linear_silu_mul`` (on the
        brgemm path each gate panel's sums meet their up panel's before they are stored)."""
        if packed is None or packed.dtype != torch.bfloat16 or x.dtype != torch.bfloat16:
            return None
        if x.device.type != "cpu" or (torch.is_grad_enabled() and x.requires_grad):
            return None
        x2 = x.reshape(-1, x.shape[-1])
        if _onednn_copy(packed, x2) is not None:
            return None  # oneDNN's matmul on the copy, then the activation
        out = torch.ops.srt_cpu.bf16_linear_silu_mul(x2, packed, weight.shape[0], bias)
        return out.view(*x.shape[:-1], weight.shape[0] // 2)


def _reorder_for_prefill(weight: Tensor) -> Tensor:
    """A bf16 weight in oneDNN's blocked layout, for inputs of ``ONEDNN_PREFILL_ROWS`` rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), ONEDNN_PREFILL_ROWS)


def _onednn_copy(packed: Tensor, x2: Tensor) -> Tensor | None:
    """The oneDNN copy of a bf16 packed weight when it should run ``x2``'s matmul: bf16 rows, at
    least ``ONEDNN_PREFILL_ROWS`` of them; else None."""
    copy = getattr(packed, "onednn_copy", None)
    if copy is None or x2.dtype != torch.bfloat16 or x2.shape[0] < ONEDNN_PREFILL_ROWS:
        return None
    return copy


def _native_or_fallback(weight_dtype: torch.dtype | None, prefill_copy: str) -> LinearBackend:
    """``NativeLinear`` when the native kernels are loaded; else, with a warning naming why, the
    ``onednn`` backend (``torch`` when oneDNN is unusable)."""
    if cpu_kernels.native_available() and hasattr(torch.ops.srt_cpu, "bf16_linear"):
        return NativeLinear(weight_dtype, prefill_copy)
    fallback = OneDNNLinear() if onednn_linear_available() else TORCH_LINEAR
    logger.warning(
        "linear backend native: the native kernels are unavailable (%s); using %s instead",
        cpu_kernels.kernel_status(),
        fallback.name,
    )
    return fallback


def create_linear_backend(
    name: str, weight_dtype: torch.dtype | None = None, prefill_copy: str = "off"
) -> LinearBackend:
    """The backend of a resolved ``--linear-backend`` (``torch``, ``onednn`` or ``native``);
    ``weight_dtype``: the native backend's storage dtype for float32 weights, ``prefill_copy``:
    its oneDNN copies of bf16 weights on AMX CPUs (``--bf16-prefill-copy``; see ``NativeLinear``).

    ``native`` without the native kernels gives the ``onednn`` (or ``torch``) backend, with a
    warning. Raises ``ValueError`` for any other name (``auto`` included: resolve it first) and for
    ``onednn`` where oneDNN's linear is not usable."""
    if name == "torch":
        return TORCH_LINEAR
    if name == "native":
        return _native_or_fallback(weight_dtype, prefill_copy)
    if name == "onednn":
        if not onednn_linear_available():
            raise ValueError(
                "linear backend 'onednn' is not usable here (oneDNN missing or failed its self-check)"
            )
        return OneDNNLinear()
    raise ValueError(
        f"create_linear_backend takes a resolved name ('torch', 'onednn' or 'native'), got {name!r}"
    )

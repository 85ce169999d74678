"""Fused CPU attention: decode through the native paged kernel, extend through torch-native SDPA.

The decode part of a DECODE or MIXED batch runs ``srt.kernels.cpu.paged_decode_attention``
(decode_attention.cpp): K/V are read in place through ``req_to_token`` (no gather into a
workspace), each K/V row is loaded once for every query head of its GQA group, and long contexts
are split across threads and merged by log-sum-exp. Extend sequences (prefill, cached prefix +
new tokens) take the torch-native path unchanged.

When the extension is not built (no compiler, a failed build, ``SRT_DISABLE_NATIVE_KERNELS=1``)
the backend is exactly ``TorchNativeAttnBackend``; one log line at start-up says which decode
path is in use and why. ``TorchNativeAttnBackend`` stays the oracle the kernel is tested against
(tests/unit/test_cpu_decode_attention.py, tests/unit/test_fused_cpu_attention.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from srt.kernels import cpu as cpu_kernels
from srt.layers.attention.torch_native import TorchNativeAttnBackend, TorchNativeMetadata

if TYPE_CHECKING:
    from srt.layers.attention.base import AttentionBackendContext, AttentionLayer

logger = logging.getLogger("srt.attention")


class FusedCPUAttnBackend(TorchNativeAttnBackend):
    """See the module docstring. The decode metadata is the decode sequences' pool rows and
    lengths (int64 ``[nd]``) and ``req_to_token``; nothing is gathered."""

    def __init__(self, model_runner: AttentionBackendContext | None = None) -> None:
        super().__init__(model_runner)
        self.native = cpu_kernels.native_available()
        if self.native:
            logger.info("fused_cpu attention: decode through %s", cpu_kernels.kernel_status())
        else:
            logger.warning(
                "fused_cpu attention: decode through torch_native's gather path, the native kernel "
                "is unavailable (%s)",
                cpu_kernels.kernel_status(),
            )
        self._req_to_token: torch.Tensor | None = None
        self._decode_rows: torch.Tensor | None = None
        self._decode_lens: torch.Tensor | None = None

    def _init_decode(
        self,
        md: TorchNativeMetadata,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: list[int],
        budget_rows: int,
    ) -> None:
        if not self.native:
            super()._init_decode(md, req_to_token, req_pool_indices, seq_lens, budget_rows)
            return
        md.num_decode_seqs = len(seq_lens)
        self._req_to_token = req_to_token
        self._decode_rows = req_pool_indices.to(device=req_to_token.device, dtype=torch.int64)
        self._decode_lens = torch.tensor(seq_lens, dtype=torch.int64, device=req_to_token.device)

    def native_decode_args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(req_to_token, req_pool_indices, seq_lens)`` of the current DECODE batch as the native
        kernel takes them (what ``srt/models/llama_native.py`` passes to its fused layers), or
        None when decode runs on the fallback path."""
        if not self.native or self._req_to_token is None:
            return None
        assert self._decode_rows is not None and self._decode_lens is not None
        return self._req_to_token, self._decode_rows, self._decode_lens

    def _decode(
        self,
        q3: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        md: TorchNativeMetadata,
        layer: AttentionLayer,
    ) -> torch.Tensor:
        """q3 ``[nd, H, D]`` (one query per decoding sequence) -> ``[nd, H, D]``."""
        if not self.native:
            return super()._decode(q3, k_buf, v_buf, md, layer)
        assert self._req_to_token is not None and self._decode_rows is not None
        assert self._decode_lens is not None
        out = cpu_kernels.paged_decode_attention(
            q3.float(),
            k_buf,
            v_buf,
            self._req_to_token,
            self._decode_rows,
            self._decode_lens,
            layer.scaling,
        )
        return out.to(q3.dtype)

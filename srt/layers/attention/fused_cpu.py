"""Fused CPU attention: native kernels for decode and for extend.

The decode part of a DECODE or MIXED batch runs ``srt.kernels.cpu.paged_decode_attention``
(decode_attention.cpp): K/V are read in place through ``req_to_token`` (no gather into a
workspace), each K/V row is loaded once for every query head of its GQA group, and long contexts
are split across threads and merged by log-sum-exp. Extend sequences (prefill, cached prefix +
new tokens) get their K/V as the torch-native path does (the rows in hand without a prefix, one
gather with one), then run ``torch.ops.srt_cpu.extend_attention`` (extend_attention.cpp: all the
batch's sequences in one call, register-tiled, causal blocks skipped) when the activations are
float32 and the head dim a multiple of 64, torch's SDPA otherwise.

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
        self._extend_native = self.native and hasattr(torch.ops.srt_cpu, "extend_attention")
        if self.native:
            logger.info(
                "fused_cpu attention: decode through %s; extend through %s",
                cpu_kernels.kernel_status(),
                "torch.ops.srt_cpu.extend_attention (float32, head dim a multiple of 64; SDPA otherwise)"
                if self._extend_native
                else "SDPA (the loaded kernels have no extend_attention)",
            )
        else:
            logger.warning(
                "fused_cpu attention: decode through torch_native's gather path and extend through "
                "SDPA, the native kernels are unavailable (%s)",
                cpu_kernels.kernel_status(),
            )
        # the extend sequences' (q_starts, kv_starts, extend_lens, seq_lens) of the current batch
        self._extend_desc: tuple[torch.Tensor, ...] | None = None
        self._req_to_token: torch.Tensor | None = None
        self._decode_rows: torch.Tensor | None = None
        self._decode_lens: torch.Tensor | None = None

    def _init_extend(
        self,
        md: TorchNativeMetadata,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: list[int],
        extend_lens: list[int],
        prefix_lens: list[int],
    ) -> None:
        super()._init_extend(md, req_to_token, req_pool_indices, seq_lens, extend_lens, prefix_lens)
        self._extend_desc = None
        if self._extend_native:
            q_starts, kv_starts = [], []
            for run in md.extend_runs:
                q_starts += [run.q_start + i * run.extend_len for i in range(run.n)]
                kv_starts += [run.kv_start + i * run.seq_len for i in range(run.n)]
            n = len(q_starts)
            lens = (q_starts, kv_starts, extend_lens[:n], seq_lens[:n])
            self._extend_desc = tuple(torch.tensor(x, dtype=torch.int64) for x in lens)

    def _extend(
        self,
        q3: torch.Tensor,
        kx: torch.Tensor,
        vx: torch.Tensor,
        md: TorchNativeMetadata,
        layer: AttentionLayer,
        out: torch.Tensor,
    ) -> None:
        desc = self._extend_desc
        if desc is None or q3.dtype != torch.float32 or kx.dtype != torch.float32 or layer.head_dim % 64:
            super()._extend(q3, kx, vx, md, layer, out)
            return
        ne_tok = md.num_extend_tokens
        out[:ne_tok] = torch.ops.srt_cpu.extend_attention(q3[:ne_tok], kx, vx, *desc, layer.scaling)

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

"""Fused CPU attention: native kernels for decode and for extend.

The decode part of a DECODE or MIXED batch runs ``srt.kernels.cpu.paged_decode_attention``
(decode_attention.cpp): K/V are read in place through ``req_to_token`` (no gather into a
workspace), each K/V row is loaded once for every query head of its GQA group, and long contexts
are split across threads and merged by log-sum-exp. Extend sequences (prefill, cached prefix +
new tokens) get their K/V as the torch-native path does (the rows in hand without a prefix, one
gather with one), then run ``torch.ops.srt_cpu.extend_attention`` (extend_attention.cpp: all the
batch's sequences in one call, register-tiled, causal blocks skipped; bf16 q, K and V on
vdpbf16ps where the CPU's is fast (AMD Zen 4 / 5: 1.6x the widened float32 kernel at a 2,048-token
prefill of Qwen2.5-1.5B's heads), other 16-bit inputs widened to float32 by the kernel) when the
head dim is a multiple of 64, torch's SDPA otherwise. On a
CPU with AMX-BF16 tiles, bf16 extends without a window or cap take torch's SDPA instead: its flash
attention's matmuls run on the tiles (oneDNN's brgemm), 5.8x the float32 kernel at a 1,280-token
prefill of 32 heads of 128 on an Intel Xeon with AMX (731 against 125 GFLOP/s).

Sliding windows and logit soft-capping (a layer's ``sliding_window_size`` / ``logit_cap``) reach
both native kernels, which skip the keys outside a window rather than masking them (a long
context under a small window reads the window only). Where the extend kernel does not apply, such
a layer takes the ``math_attention`` path of window_cap.py (``sdpa_extend`` handles it).

When the extension is not built (no compiler, a failed build, ``SRT_DISABLE_NATIVE_KERNELS=1``)
the backend computes exactly what ``TorchNativeAttnBackend`` does (it is built from the same
functions of torch_native.py, composed, not inherited); one log line at start-up says which decode
path is in use and why. ``TorchNativeAttnBackend`` stays the oracle the kernel is tested against
(tests/unit/test_cpu_decode_attention.py, tests/unit/test_fused_cpu_attention.py).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch

from srt.configs.bf16_probe import ISA_ENV
from srt.configs.cpu_features import cpu_bf16_units
from srt.kernels import cpu as cpu_kernels
from srt.layers.attention.base import AttentionBackend, save_and_read_kv
from srt.layers.attention.torch_native import (
    GatherWorkspace,
    TorchNativeMetadata,
    attend_extend_batch,
    build_metadata,
    sdpa_decode,
    sdpa_extend,
)

if TYPE_CHECKING:
    from srt.layers.attention.base import AttentionBackendContext, AttentionLayer
    from srt.layers.forward_batch import ForwardBatch

logger = logging.getLogger("srt.attention")
# activations the native extend kernel takes (bf16 on vdpbf16ps where fast; else widened to float32)
_EXTEND_DTYPES = {torch.float32, torch.bfloat16, torch.float16}


class FusedCPUAttnBackend(AttentionBackend):
    """See the module docstring. The decode metadata is the decode sequences' pool rows and
    lengths (int64 ``[nd]``) and ``req_to_token``; nothing is gathered."""

    supports_image_blocks = True  # (attend_extend_batch: torch_native's image_blocks.py pass)

    def __init__(self, model_runner: AttentionBackendContext | None = None) -> None:
        self.native = cpu_kernels.native_available()
        self._extend_native = self.native and hasattr(torch.ops.srt_cpu, "extend_attention")
        # bf16 extends on SDPA where its matmuls take AMX tiles (not where oneDNN is capped below)
        self._bf16_sdpa = cpu_bf16_units() == "amx" and not os.environ.get(ISA_ENV)
        self._log_paths()
        self.forward_metadata: TorchNativeMetadata | None = None
        self.workspace = GatherWorkspace()  # the fallback paths' gathers
        # the extend sequences' (q_starts, kv_starts, extend_lens, seq_lens) of the current batch
        self._extend_desc: tuple[torch.Tensor, ...] | None = None
        # (req_to_token, decode rows, decode lengths) of the current batch, for the native kernel
        self._decode_args: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _log_paths(self) -> None:
        if not self.native:
            logger.warning(
                "fused_cpu attention: decode through torch_native's gather path and extend through "
                "SDPA, the native kernels are unavailable (%s)",
                cpu_kernels.kernel_status(),
            )
            return
        logger.info(
            "fused_cpu attention: decode through %s; extend through %s",
            cpu_kernels.kernel_status(),
            "torch.ops.srt_cpu.extend_attention (head dim a multiple of 64; SDPA otherwise"
            + ("; bf16 on SDPA, AMX tiles)" if self._bf16_sdpa else ")")
            if self._extend_native
            else "SDPA (the loaded kernels have no extend_attention)",
        )

    # ------------------------------------------------------------------ metadata
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        md = build_metadata(fb, decode_chunks=not self.native)
        self.forward_metadata = md
        self._extend_desc = self._decode_args = None
        if md.num_extend_seqs and self._extend_native:
            self._extend_desc = extend_descriptor(md)
        if md.num_decode_seqs and self.native:
            req_to_token = fb.req_to_token_pool.req_to_token
            ne = md.num_extend_seqs
            seq_lens = md.seq_lens[ne:]
            rows = fb.req_pool_indices[ne:].to(device=req_to_token.device, dtype=torch.int64)
            lens = torch.tensor(seq_lens, dtype=torch.int64, device=req_to_token.device)
            self._decode_args = (req_to_token, rows, lens)

    def native_decode_args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(req_to_token, req_pool_indices, seq_lens)`` of the current batch's decode sequences
        as the native kernel takes them (what ``srt/models/llama_native.py`` passes to its fused
        layers), or None when decode runs on the fallback path."""
        return self._decode_args

    # ------------------------------------------------------------------ per layer
    # forward_extend / forward_decode: the signature, shapes and contract of AttentionBackend's
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        kv = (k, v, *save_and_read_kv(k, v, layer, forward_batch, save_kv_cache))
        return attend_extend_batch(q, kv, self._metadata(), layer, self.workspace, self._extend, self._decode)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        kv_buf = save_and_read_kv(k, v, layer, forward_batch, save_kv_cache)
        bs, h, d = q.shape[0], layer.num_heads, layer.head_dim
        return self._decode(q.reshape(bs, h, d), *kv_buf, self._metadata(), layer).reshape(bs, h * d)

    def _extend(self, q3, kx, vx, md: TorchNativeMetadata, layer: AttentionLayer, out: torch.Tensor) -> None:
        """The native extend kernel for head dims that are multiples of 64 (bf16 q, K and V on
        vdpbf16ps where the CPU's is fast; other 16-bit inputs widened to float32 by the kernel),
        SDPA else, and for bf16 without a window or cap on AMX CPUs."""
        desc = self._extend_desc
        window, cap = layer_window_and_cap(layer)
        amx_sdpa = self._bf16_sdpa and q3.dtype == torch.bfloat16 and window < 0 and cap == 0.0
        if desc is None or amx_sdpa or layer.head_dim % 64 or not {q3.dtype, kx.dtype} <= _EXTEND_DTYPES:
            sdpa_extend(q3, kx, vx, md, layer, out)
            return
        ne_tok = md.num_extend_tokens
        isa = ""  # the best the CPU runs
        out[:ne_tok] = torch.ops.srt_cpu.extend_attention(
            q3[:ne_tok], kx, vx, *desc, layer.scaling, isa, window, cap
        )

    def _decode(self, q3, k_buf, v_buf, md: TorchNativeMetadata, layer: AttentionLayer) -> torch.Tensor:
        """q3 ``[nd, H, D]`` (one query per decoding sequence) -> ``[nd, H, D]``: the native kernel
        reading K/V in place, or torch-native's chunked gathers without it."""
        if self._decode_args is None:
            return sdpa_decode(q3, (k_buf, v_buf), md, layer, self.workspace)
        req_to_token, rows, lens = self._decode_args
        window, cap = layer_window_and_cap(layer)
        out = cpu_kernels.paged_decode_attention(
            q3.float(),
            k_buf,
            v_buf,
            req_to_token,
            rows,
            lens,
            layer.scaling,
            window_left=window,
            logit_cap=cap,
        )
        return out.to(q3.dtype)

    def _metadata(self) -> TorchNativeMetadata:
        if self.forward_metadata is None:
            raise RuntimeError("init_forward_metadata was not called for this batch")
        return self.forward_metadata


def layer_window_and_cap(layer: AttentionLayer) -> tuple[int, float]:
    """``(window_left, logit_cap)`` of a layer as the native kernels take them (-1 / 0.0: none)."""
    return int(getattr(layer, "sliding_window_size", -1)), float(getattr(layer, "logit_cap", 0.0))


def extend_descriptor(md: TorchNativeMetadata) -> tuple[torch.Tensor, ...]:
    """``(q_starts, kv_starts, extend_lens, seq_lens)`` int64 ``[ne]`` of the extend sequences, as
    ``extend_attention`` takes them (offsets into the batch's q and the gathered extend K/V)."""
    q_starts: list[int] = []
    kv_starts: list[int] = []
    for run in md.extend_runs:
        q_starts += [run.q_start + i * run.extend_len for i in range(run.n)]
        kv_starts += [run.kv_start + i * run.seq_len for i in range(run.n)]
    n = len(q_starts)
    lens = (q_starts, kv_starts, md.extend_lens[:n], md.seq_lens[:n])
    return tuple(torch.tensor(x, dtype=torch.int64) for x in lens)

"""The attention backend interface.

A backend is created once per ModelRunner (``create_attention_backend``) and used by every
``RadixAttention`` layer of the model::

    runner.forward(forward_batch):
        attn_backend.init_forward_metadata(forward_batch)       # once per batch
        model.forward(...)                                      # per layer:
            RadixAttention.forward(q, k, v, forward_batch)
                -> forward_batch.attn_backend.forward(q, k, v, layer, forward_batch)
                   -> forward_extend (EXTEND, MIXED) / forward_decode (DECODE)

Shapes (``T`` = ``forward_batch.num_tokens``, ``H``/``H_kv`` = query/KV heads of the layer,
``D`` = head_dim):  q ``[T, H*D]``, k/v ``[T, H_kv*D]``, output ``[T, H*D]`` (q's dtype).
Token order is the batch's (sequence by sequence; in MIXED the extending sequences first,
then the decoding ones). Unless ``save_kv_cache`` is False the backend writes k/v of the
new tokens into ``forward_batch.token_to_kv_pool`` at ``forward_batch.out_cache_loc`` before
attending, so every query attends to its whole sequence (cached prefix + new tokens,
causally) through the pool.

The layer object supplies ``num_heads``, ``num_kv_heads``, ``head_dim``, ``scaling`` and
``layer_id`` (``AttentionLayer``; see ``srt/layers/radix_attention.py``).

A backend is built as ``Class(model_runner)`` (``create_attention_backend``) and may read only
what ``AttentionBackendContext`` names from the runner.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Protocol

import torch

from srt.layers.forward_batch import AttentionLayer, ForwardBatch, ForwardMode

__all__ = ["AttentionBackend", "AttentionBackendContext", "AttentionLayer", "save_and_read_kv"]


class AttentionBackendContext(Protocol):
    """What a backend may read from the ModelRunner that builds it (``ModelRunner`` satisfies it):
    the device, the model's compute dtype, the KV cache dtype and the KV page size."""

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def kv_cache_dtype(self) -> torch.dtype: ...

    @property
    def page_size(self) -> int: ...


class AttentionBackend(ABC):
    """Base class of attention backends; see the module docstring for the contract."""

    @abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Precompute everything the per-layer calls share (index tensors, masks) for this batch.

        Called once per batch, after ``forward_batch.req_to_token_pool`` and
        ``forward_batch.token_to_kv_pool`` are set and ``req_to_token`` holds the slots of every
        token up to ``seq_lens``."""

    @abstractmethod
    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """EXTEND and MIXED batches: ``[T, H*D]`` attention output."""

    @abstractmethod
    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """DECODE batches (one token per sequence): ``[bs, H*D]`` attention output."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Dispatch on ``forward_batch.forward_mode`` (MIXED goes through ``forward_extend``)."""
        mode = forward_batch.forward_mode
        if mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        if mode.is_extend():
            return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        raise ValueError(f"attention called for a batch in mode {mode.name}")

    # whether an extend honours bidirectional image blocks (``ForwardBatch.image_spans`` of images
    # marked ``bidirectional``; srt/layers/attention/image_blocks.py): a model that needs them
    # (``bidirectional_images``) refuses a backend without
    supports_image_blocks: bool = False

    # ------------------------------------------------------------------ fused decode stacks
    def native_decode_args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(req_to_token, req_pool_indices, seq_lens)`` (int64) of the current batch's decode
        sequences for a native decode stack that attends through srt's paged CPU kernel
        (``srt/models/llama_native.py``), or None when this backend offers none (the default)."""
        return None

    # ------------------------------------------------------------------ CUDA graphs (decode)
    # The graph runner calls these; a backend that supports graphs overrides all three and sets
    # ``supports_cuda_graph``. Inputs of a captured batch are padded to ``bs`` (the padding rows
    # point at a dummy slot with length 1), and nothing here may synchronise with the device.
    supports_cuda_graph: bool = False

    def init_cuda_graph_state(self, max_bs: int, max_context_len: int) -> None:
        """Allocate the fixed buffers every captured batch of up to ``max_bs`` sequences reads."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_capture_cuda_graph(
        self,
        bs: int,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens_cpu: Sequence[int],
        forward_mode: ForwardMode,
    ) -> None:
        """Before capturing batch size ``bs``: the metadata the captured forward reads, built
        from a dummy batch outside the capture, in buffers that stay fixed."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_replay_cuda_graph(
        self,
        bs: int,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens_cpu: Sequence[int],
        forward_mode: ForwardMode,
    ) -> None:
        """Before replaying batch size ``bs``: rewrite those fixed buffers for the live batch."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")


def save_and_read_kv(
    k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, forward_batch: ForwardBatch, save_kv_cache: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the new tokens' k/v ``[T, H_kv*D]`` into the pool at ``forward_batch.out_cache_loc``
    (unless ``save_kv_cache`` is False); return the layer's whole K and V buffers from the pool."""
    pool = forward_batch.token_to_kv_pool
    if save_kv_cache:
        pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
    return pool.get_kv_buffer(layer.layer_id)

"""CudaGraphRunner: DECODE batches replayed from CUDA graphs captured at start-up.

One graph per captured batch size ``capture_bs`` (``capture_batch_sizes``: 1, 2, 4, 8, then
every multiple of 8 up to ``--cuda-graph-max-bs``, which is captured too), all sharing one
memory pool and captured largest first. Every graph reads the same static inputs and writes
the same logits buffer::

    static inputs (int64, one row of ``[5, max_bs]`` each)    logits  float32 [max_bs, vocab]
        input_ids  positions  req_pool_indices  seq_lens  out_cache_loc

    replay(live DECODE batch of raw_bs sequences):
        bs = capture_bs[bisect_left(capture_bs, raw_bs)]        (raw_bs > max: eager instead)
        rows raw_bs .. bs-1 of the static inputs <- padding     (PAD_VALUES, below)
        rows 0 .. raw_bs-1                       <- the live batch's tensors (copied, never bound)
        attn_backend.init_forward_metadata_replay_cuda_graph(bs, ..., seq_lens_cpu + [1] * pad)
        graphs[bs].replay()
        -> LogitsProcessorOutput(logits[:raw_bs])               (a view: valid until the next replay)

Padding rows are sequences of length 1 at position 0 of request row ``PAD_ROW`` (whatever slot
that row names: any slot is a valid, finite read) whose new K/V goes to slot ``PAD_SLOT`` of the
KV pool's reserved padding page; that page therefore stops being all zero once a padded batch
ran, which is harmless because every backend masks padded reads. Their logits rows are never
returned, so never sampled.

What a captured forward may rely on: the tensors above and whatever the backend's hooks keep
in fixed buffers. The captured ``ForwardBatch``'s Python fields (``seq_lens_cpu``,
``extend_prefix_lens`` ...) hold the dummy batch of capture time; the model reads none of them
in DECODE. Nothing in the captured forward may synchronise with the host.

Graph memory (``reserve_bytes``, subtracted before the KV pool is sized on CUDA)::

    fixed    static inputs + logits buffer + the backend's init_cuda_graph_state buffers
             (measured as they are allocated, in the constructor)
    pool     activations of one decode of max_bs sequences, estimated as the profiled extend's
             activation peak per token x max_bs, plus that batch's logits ([max_bs, vocab] in the
             model dtype and again in float32)
    graphs   PER_GRAPH_BYTES per captured size (the driver's own memory for the graph's nodes)

The memory the capture really took (free device memory before - after) is logged beside it.

The graph class, the capture context and the stream class are injected (defaults:
``torch.cuda.CUDAGraph``, ``torch.cuda.graph``, ``torch.cuda.Stream``), so CPU tests substitute
a fake that records the captured ops and re-runs them on replay.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import torch

from srt.layers.forward_batch import ForwardBatch, ForwardMode
from srt.layers.logits_processor import LogitsProcessorOutput

if TYPE_CHECKING:
    from torch import nn

    from srt.configs.model_config import ModelConfig
    from srt.layers.attention.base import AttentionBackend
    from srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

logger = logging.getLogger(__name__)

PAD_ROW = 0  # request row the padding sequences read (one token)
PAD_SLOT = 0  # KV slot the padding sequences write: the pool's reserved padding page
# padding value of each static input row: input_ids, positions, req_pool_indices, seq_lens, out_cache_loc
PAD_VALUES = (0, 0, PAD_ROW, 1, PAD_SLOT)
PER_GRAPH_BYTES = 2 << 20  # an allowance for the driver's memory per instantiated graph


def capture_batch_sizes(max_bs: int) -> list[int]:
    """The batch sizes captured for ``max_bs``: 1, 2, 4, 8, then 16, 24, 32, ... up to
    ``max_bs``, and ``max_bs`` itself; ascending. Raises ``ValueError`` when ``max_bs < 1``."""
    if max_bs < 1:
        raise ValueError(f"the largest captured batch size must be >= 1, got {max_bs}")
    sizes = [b for b in (1, 2, 4, 8) if b <= max_bs] + list(range(16, max_bs + 1, 8))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def padded_batch_size(capture_bs: list[int], raw_bs: int) -> int | None:
    """The smallest captured size ``>= raw_bs`` (bisection over the ascending ``capture_bs``),
    or None when ``raw_bs`` exceeds them all (the batch runs eagerly)."""
    i = bisect.bisect_left(capture_bs, raw_bs)
    return capture_bs[i] if i < len(capture_bs) else None


def estimate_graph_pool_bytes(
    max_bs: int, activation_peak_bytes: int, profiled_tokens: int, vocab_size: int, dtype_bytes: int
) -> int:
    """The graphs' shared pool: one decode of ``max_bs`` sequences, i.e. ``max_bs`` tokens at the
    profiled extend's activation bytes per token (``activation_peak_bytes / profiled_tokens``),
    plus its ``[max_bs, vocab]`` logits in the model dtype and in float32 (an extend computes
    logits for one row per sequence only, so its peak does not hold them)."""
    per_token = math.ceil(activation_peak_bytes / max(profiled_tokens, 1))
    return per_token * max_bs + max_bs * vocab_size * (dtype_bytes + 4)


def cuda_graph_off_reason(
    device: torch.device, disable: bool, backend: AttentionBackend, tp_enabled: bool
) -> str | None:
    """Why DECODE batches run eagerly on this runner, or None when graphs are used."""
    if disable:
        return "--disable-cuda-graph"
    if device.type != "cuda":
        return f"device {device.type} (graphs are CUDA-only)"
    if not backend.supports_cuda_graph:
        return f"attention backend {type(backend).__name__} has no CUDA-graph hooks"
    if tp_enabled:
        return "tensor parallelism (an all-reduce inside a captured forward is not supported yet)"
    return None


class GraphRunnerContext(Protocol):
    """What the runner reads from its ModelRunner (``ModelRunner`` satisfies it); the pools are
    read at capture time, the rest from construction on."""

    model: nn.Module
    model_config: ModelConfig
    attn_backend: AttentionBackend
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: MHATokenToKVPool
    device: torch.device
    dtype: torch.dtype


class Graph(Protocol):
    """What the runner calls on a graph object (``torch.cuda.CUDAGraph`` satisfies it)."""

    def replay(self) -> None: ...

    def pool(self) -> Any: ...


GraphContext = Callable[..., AbstractContextManager]  # (graph, pool=, stream=) -> capture context


class CudaGraphRunner:
    """See the module docstring. ``max_bs``: the largest batch the buffers (and the backend's
    graph state) are sized for; ``capture(limit)`` captures the sizes up to ``limit``."""

    def __init__(
        self,
        ctx: GraphRunnerContext,
        max_bs: int,
        *,
        graph_cls: Callable[[], Graph] | None = None,
        graph_context: GraphContext | None = None,
        stream_cls: Callable[[], Any] | None = None,
    ) -> None:
        if not ctx.attn_backend.supports_cuda_graph:
            raise ValueError(
                f"attention backend {type(ctx.attn_backend).__name__} does not support CUDA graphs"
            )
        self.ctx = ctx
        self.device = torch.device(ctx.device)
        self.max_bs = max_bs
        self.all_sizes = capture_batch_sizes(max_bs)
        self.graph_cls = graph_cls or torch.cuda.CUDAGraph
        self.graph_context = graph_context or torch.cuda.graph
        self.stream_cls = stream_cls or (lambda: torch.cuda.Stream(self.device))
        allocated = self._allocated_bytes()
        self.static_inputs = torch.zeros(len(PAD_VALUES), max_bs, dtype=torch.int64, device=self.device)
        self.input_ids, self.positions, self.req_pool_indices, self.seq_lens, self.out_cache_loc = (
            self.static_inputs.unbind(0)
        )
        self._pad_column = torch.tensor(PAD_VALUES, dtype=torch.int64, device=self.device)[:, None]
        self.static_inputs.copy_(self._pad_column.expand(-1, max_bs))
        # the captured batches' fixed extend fields: 1 new token per sequence, at row i, no prefix kept
        self._ones = torch.ones(max_bs, dtype=torch.int64, device=self.device)
        self._zeros = torch.zeros(max_bs, dtype=torch.int64, device=self.device)
        self._arange = torch.arange(max_bs, dtype=torch.int64, device=self.device)
        self.logits = torch.zeros(
            max_bs, ctx.model_config.vocab_size, dtype=torch.float32, device=self.device
        )
        ctx.attn_backend.init_cuda_graph_state(max_bs, ctx.model_config.context_len)
        own = (self.static_inputs, self._pad_column, self._ones, self._zeros, self._arange, self.logits)
        # on CUDA the allocator's count, which includes the backend's graph state
        self.fixed_bytes = max(self._allocated_bytes() - allocated, sum(t.numel() * t.itemsize for t in own))
        self.capture_bs: list[int] = []
        self.graphs: dict[int, Graph] = {}
        self._batches: dict[int, ForwardBatch] = {}
        self._pool: Any = None
        self._capture_stream: Any = None
        self.capture_seconds = 0.0
        self.capture_bytes = 0
        self.reserved_bytes = 0  # what reserve_bytes last returned (0: nothing was reserved)

    # ------------------------------------------------------------------ memory
    def reserve_bytes(self, activation_peak_bytes: int, profiled_tokens: int) -> int:
        """Device memory to set aside before sizing the KV pool (see the module docstring)."""
        pool = estimate_graph_pool_bytes(
            self.max_bs,
            activation_peak_bytes,
            profiled_tokens,
            self.ctx.model_config.vocab_size,
            self.ctx.dtype.itemsize,
        )
        self.reserved_bytes = self.fixed_bytes + pool + PER_GRAPH_BYTES * len(self.all_sizes)
        return self.reserved_bytes

    def _allocated_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0

    def _free_bytes(self) -> int:
        return torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 0

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ capture
    def capture(self, limit: int | None = None) -> None:
        """(Re)capture one graph per size of ``capture_batch_sizes(max_bs)`` up to ``limit`` (the
        scheduler's running-request cap; at least size 1 is captured). Drops earlier graphs first:
        call it again whenever the model's weights are replaced. Needs the KV pools in place."""
        self.graphs.clear()
        self._batches.clear()
        self._pool = None
        sizes = [b for b in self.all_sizes if limit is None or b <= limit] or [1]
        t0, free_before = time.perf_counter(), self._free_bytes()
        self.static_inputs.copy_(self._pad_column.expand(-1, self.max_bs))
        with torch.inference_mode():
            self._warm_up_eagerly(max(sizes))
            for bs in sorted(sizes, reverse=True):  # the largest first: smaller ones reuse its pool
                self.graphs[bs] = self._capture_one(bs)
        self._synchronize()
        self.capture_bs = sorted(sizes)
        self.capture_seconds = time.perf_counter() - t0
        self.capture_bytes = max(0, free_before - self._free_bytes())
        logger.info(
            "CUDA graphs: %d decode batch sizes (%s) captured in %.1f s, %.1f MiB "
            "(fixed buffers %.1f MiB; reserved before KV sizing %.1f MiB)",
            len(sizes),
            ", ".join(map(str, self.capture_bs)),
            self.capture_seconds,
            self.capture_bytes / (1 << 20),
            self.fixed_bytes / (1 << 20),
            self.reserved_bytes / (1 << 20),
        )

    def _warm_up_eagerly(self, bs: int) -> None:
        """One eager forward of the dummy batch (the attention backend learns the layers'
        geometry; lazy kernel set-up happens outside any capture)."""
        fb = self._batch(bs)
        self.ctx.attn_backend.init_forward_metadata(fb)
        self._run(fb)

    def _capture_one(self, bs: int) -> Graph:
        fb = self._batches[bs] = self._batch(bs)
        backend = self.ctx.attn_backend
        rows = self.req_pool_indices[:bs]
        req_to_token = self.ctx.req_to_token_pool.req_to_token
        backend.init_forward_metadata_capture_cuda_graph(bs, req_to_token, rows, [1] * bs, ForwardMode.DECODE)
        self._run(fb)  # warm-up on the graph's metadata, outside the capture
        self._synchronize()
        graph = self.graph_cls()
        with self.graph_context(graph, pool=self._pool, stream=self._stream()):
            self._run(fb)
        if self._pool is None:
            self._pool = graph.pool()
        return graph

    def _stream(self) -> Any:
        if self._capture_stream is None:
            self._capture_stream = self.stream_cls()
        return self._capture_stream

    def _batch(self, bs: int) -> ForwardBatch:
        """The DECODE ForwardBatch of the first ``bs`` rows of the static buffers."""
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            extend_seq_lens=self._ones[:bs],
            extend_prefix_lens=self._zeros[:bs],
            extend_start_loc=self._arange[:bs],
            seq_lens_cpu=[1] * bs,
            extend_seq_lens_cpu=[1] * bs,
            extend_prefix_lens_cpu=[0] * bs,
        )
        fb.req_to_token_pool = self.ctx.req_to_token_pool
        fb.token_to_kv_pool = self.ctx.token_to_kv_pool
        fb.attn_backend = self.ctx.attn_backend
        return fb

    def _run(self, fb: ForwardBatch) -> None:
        """The captured work: the model on ``fb``, logits into the shared buffer."""
        out = self.ctx.model(fb.input_ids, fb.positions, fb)
        logits = out.next_token_logits
        if logits.shape != (fb.batch_size, self.logits.shape[1]):
            raise RuntimeError(
                f"model returned logits {tuple(logits.shape)}, graph buffer holds {self.logits.shape}"
            )
        self.logits[: fb.batch_size].copy_(logits)

    # ------------------------------------------------------------------ replay
    def can_run(self, forward_batch: ForwardBatch) -> bool:
        """Whether ``forward_batch`` replays a graph: DECODE, 1 .. max captured sequences, no LoRA
        adapter (the graphs hold the base model's kernels only), no M-RoPE positions (a Qwen2-VL
        image request decodes at positions the captured ``positions`` buffer does not carry)."""
        fb = forward_batch
        return (
            bool(self.capture_bs)
            and fb.forward_mode.is_decode()
            and 0 < fb.batch_size <= self.capture_bs[-1]
            and fb.lora_slots is None
            and fb.mrope_positions is None
        )

    def replay(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        """Run ``forward_batch`` (``can_run`` must hold) through the graph of the next captured
        size; ``next_token_logits`` ``[raw_bs, vocab]`` is a view valid until the next replay."""
        fb = forward_batch
        raw_bs = fb.batch_size
        bs = padded_batch_size(self.capture_bs, raw_bs)
        if bs is None or not fb.forward_mode.is_decode():
            raise ValueError(f"no captured graph for a {fb.forward_mode.name} batch of {raw_bs}")
        with torch.inference_mode():
            self._load_inputs(fb, bs)
            seq_lens_cpu = list(fb.seq_lens_cpu or fb.seq_lens.tolist()) + [1] * (bs - raw_bs)
            self.ctx.attn_backend.init_forward_metadata_replay_cuda_graph(
                bs,
                self.ctx.req_to_token_pool.req_to_token,
                self.req_pool_indices[:bs],
                seq_lens_cpu,
                ForwardMode.DECODE,
            )
            self.graphs[bs].replay()
        return LogitsProcessorOutput(next_token_logits=self.logits[:raw_bs])

    def _load_inputs(self, fb: ForwardBatch, bs: int) -> None:
        """Copy the live batch into rows ``0 .. raw_bs-1`` of the static inputs and padding into
        rows ``raw_bs .. bs-1`` (a larger batch may have left live values there)."""
        raw_bs = fb.batch_size
        if bs > raw_bs:
            self.static_inputs[:, raw_bs:bs].copy_(self._pad_column.expand(-1, bs - raw_bs))
        live = (fb.input_ids, fb.positions, fb.req_pool_indices, fb.seq_lens, fb.out_cache_loc)
        for dst, src in zip(self.static_inputs, live):
            dst[:raw_bs].copy_(src, non_blocking=True)

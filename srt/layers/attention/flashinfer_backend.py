"""FlashInfer attention (CUDA): paged decode and prefill kernels over srt's KV pool.

Per batch (``init_forward_metadata``) the page table becomes FlashInfer's index arrays
(``flashinfer_metadata.build_paged_kv_metadata``) and one wrapper per attention group is
planned, once::

    DECODE          BatchDecodeWithPagedKVCacheWrapper   (use_tensor_cores when H / H_kv > 1)
    EXTEND, MIXED   BatchPrefillWithPagedKVCacheWrapper  causal=True over the paged cache

Per layer the new tokens' K/V are written into the pool at ``out_cache_loc`` first, then the
wrapper's ``run(q [T, H, D], (k_pages, v_pages))`` reads the pool as NHD pages
``[pages, P, H_kv, D]``. One prefill call covers a cached prefix plus the new tokens because
FlashInfer aligns the causal mask bottom-right (query j of a sequence sees keys
``0 .. j + kv_len - qo_len``); MIXED's decoding tail is just sequences with one query.

``plan`` needs the layers' geometry (query/KV heads, head dim, softmax scale). Given at
construction it is planned in ``init_forward_metadata``; otherwise the first layer call of the
first forward supplies it (and plans that forward), and every later forward plans up front. All
layers must share it (a layer that differs raises ``ValueError``).

Attention groups: a layer's sliding window and logit soft-cap are plan arguments of FlashInfer
(``window_left``, ``logits_soft_cap``), so layers are grouped by ``(window_left, logit_cap)``
(``group_of``; ``PLAIN`` = (-1, 0.0), neither) and each group has its own wrapper, planned once per
batch; a layer runs its group's wrapper. A model alternating windowed and global layers (Gemma 2/3)
plans two wrappers per batch, a Mistral with a window in every layer one. The groups are given at
construction (``groups``; ``PLAIN`` alone by default when the geometry is given) or learnt like the
geometry: a layer of a group not yet known plans it on the spot in an eager forward, and every
later batch plans it up front. All wrappers share the one float workspace (they run one after
another). FlashInfer applies the cap to the scaled scores: ``cap * tanh(sm_scale * q.k / cap)``.

Wrappers are built by one injected ``wrapper_factory(kind, workspace, **ctor_kwargs)`` (kind
``"decode"`` or ``"prefill"``; ``ctor_kwargs`` are the real class's constructor keywords), so a
CPU test substitutes a recording fake; the default factory imports flashinfer lazily. One
zeroed workspace (128 MiB on CUDA) is allocated once and shared by every wrapper: they run one
after another on one stream.

CUDA graphs (decode only): ``init_cuda_graph_state`` allocates fixed device buffers; a capture
builds one ``use_cuda_graph=True`` decode wrapper per captured batch size and known group over
slices of them (a batch size's groups share the buffers: they plan the same page table) and plans
them outside the graph; a replay plans them again (``plan`` copies the new index arrays into the
fixed buffers the captured kernels read). The groups must be known at capture (the graph runner's
eager warm-up forward teaches them); a layer of an unknown group in a graph batch raises. The runner pads a replayed batch to the
captured size with rows of ``seq_len`` 1 whose slot is 0 (the pool's zero padding page).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from srt.layers.attention.base import AttentionBackend, AttentionBackendContext, AttentionLayer
from srt.layers.attention.flashinfer_metadata import (
    INDEX_DTYPE,
    PagedKVMetadata,
    build_paged_kv_metadata,
    paged_view,
)
from srt.layers.forward_batch import ForwardMode

if TYPE_CHECKING:
    from srt.layers.forward_batch import ForwardBatch

# (window_left, logit_cap) of a layer: the plan arguments that differ between layers
AttnGroup = tuple[int, float]
PLAIN: AttnGroup = (-1, 0.0)  # no sliding window, no soft-cap

WORKSPACE_BYTES = 128 << 20  # FlashInfer's float workspace on CUDA (split-KV partial results)
HOST_WORKSPACE_BYTES = 1 << 20  # on other devices only fake wrappers run (tests)


class PagedWrapper(Protocol):
    """What srt calls on a FlashInfer paged wrapper (decode or prefill)."""

    def plan(self, *args: Any, **kwargs: Any) -> None: ...

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor: ...


class WrapperFactory(Protocol):
    def __call__(self, kind: str, workspace: torch.Tensor, **ctor_kwargs: Any) -> PagedWrapper: ...


def flashinfer_wrapper_factory(kind: str, workspace: torch.Tensor, **ctor_kwargs: Any) -> PagedWrapper:
    """The real wrappers: ``kind`` "decode" -> ``BatchDecodeWithPagedKVCacheWrapper``, "prefill" ->
    ``BatchPrefillWithPagedKVCacheWrapper``, built as ``Class(workspace, **ctor_kwargs)``."""
    import flashinfer  # lazily: a CPU install never imports it

    classes = {
        "decode": flashinfer.BatchDecodeWithPagedKVCacheWrapper,
        "prefill": flashinfer.BatchPrefillWithPagedKVCacheWrapper,
    }
    return classes[kind](workspace, **ctor_kwargs)


@dataclass(frozen=True, slots=True)
class AttentionGeometry:
    """What ``plan`` needs to know of the layers: heads, head dim and softmax scale."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    sm_scale: float

    @classmethod
    def of(cls, layer: AttentionLayer) -> AttentionGeometry:
        return cls(layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.scaling)

    @property
    def use_tensor_cores(self) -> bool:
        """Tensor-core decode pays off once query heads share a KV head (GQA/MQA)."""
        return self.num_qo_heads > self.num_kv_heads


def group_of(layer: AttentionLayer) -> AttnGroup:
    """The layer's attention group: ``(sliding_window_size, logit_cap)`` (-1 / 0.0: none)."""
    return int(getattr(layer, "sliding_window_size", -1)), float(getattr(layer, "logit_cap", 0.0))


@dataclass(slots=True)
class FlashInferMetadata:
    """One batch: its index arrays and the wrapper planned for each attention group."""

    kind: str  # "decode" or "prefill"
    table: PagedKVMetadata
    wrappers: dict[AttnGroup, PagedWrapper] = field(default_factory=dict)
    graph_bs: int | None = None  # a CUDA-graph batch: its wrappers are the captured ones


@dataclass(slots=True)
class DecodeGraphState:
    """Fixed device buffers the captured decode kernels read, and a wrapper per batch size."""

    kv_indptr: torch.Tensor  # int32 [max_bs + 1]
    kv_indices: torch.Tensor  # int32 [max_bs * max_pages_per_seq]
    kv_last_page_len: torch.Tensor  # int32 [max_bs]
    wrappers: dict[int, dict[AttnGroup, PagedWrapper]] = field(default_factory=dict)  # bs -> group -> wrapper

    @property
    def max_bs(self) -> int:
        return int(self.kv_last_page_len.numel())


class FlashInferAttnBackend(AttentionBackend):
    """See the module docstring. Reads ``device``, ``dtype`` (q and output), ``kv_cache_dtype`` and
    ``page_size`` from ``model_runner``. ``groups``: the attention groups to plan for up front
    (see the module docstring)."""

    supports_cuda_graph = True

    def __init__(
        self,
        model_runner: AttentionBackendContext,
        *,
        wrapper_factory: WrapperFactory | None = None,
        geometry: AttentionGeometry | None = None,
        workspace_bytes: int | None = None,
        groups: Sequence[AttnGroup] | None = None,
    ) -> None:
        self.device = torch.device(model_runner.device)
        self.dtype = model_runner.dtype
        self.kv_cache_dtype = model_runner.kv_cache_dtype
        self.page_size = model_runner.page_size
        self.wrapper_factory: WrapperFactory = wrapper_factory or flashinfer_wrapper_factory
        self.geometry = geometry
        if groups is None:
            groups = [PLAIN] if geometry is not None else []
        self.groups: dict[AttnGroup, None] = dict.fromkeys(
            (int(w), float(c)) for w, c in groups
        )  # ordered set
        if workspace_bytes is None:
            workspace_bytes = WORKSPACE_BYTES if self.device.type == "cuda" else HOST_WORKSPACE_BYTES
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._wrappers: dict[tuple[str, AttnGroup], PagedWrapper] = {}
        self.forward_metadata: FlashInferMetadata | None = None
        self.graph_state: DecodeGraphState | None = None

    # ------------------------------------------------------------------ per batch
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Build the batch's index arrays and plan its wrapper (when the geometry is known)."""
        fb = forward_batch
        mode = fb.forward_mode
        if mode.is_idle() or fb.batch_size == 0:
            self.forward_metadata = None
            return
        if fb.req_to_token_pool is None:
            raise ValueError("forward_batch.req_to_token_pool must be set before init_forward_metadata")
        seq_lens = fb.seq_lens_cpu or fb.seq_lens.tolist()
        decode = mode.is_decode()
        extend_lens = None if decode else (fb.extend_seq_lens_cpu or fb.extend_seq_lens.tolist())
        table = build_paged_kv_metadata(
            fb.req_to_token_pool.req_to_token, fb.req_pool_indices, seq_lens, extend_lens, self.page_size
        )
        md = FlashInferMetadata("decode" if decode else "prefill", table)
        if self.geometry is not None:
            for group in self.groups:
                self._plan(md, group, self._wrapper(md.kind, group))
        self.forward_metadata = md

    def _wrapper(self, kind: str, group: AttnGroup) -> PagedWrapper:
        """The eager wrapper of ``kind`` for ``group``, built on first use."""
        wrapper = self._wrappers.get((kind, group))
        if wrapper is None:
            kwargs: dict[str, Any] = {"kv_layout": "NHD"}
            if kind == "decode":
                kwargs["use_tensor_cores"] = self._geometry().use_tensor_cores
            wrapper = self.wrapper_factory(kind, self.workspace, **kwargs)
            self._wrappers[(kind, group)] = wrapper
        return wrapper

    def _plan(self, md: FlashInferMetadata, group: AttnGroup, wrapper: PagedWrapper) -> None:
        """``wrapper.plan`` with the batch's arrays (indptr and last_page_len on the CPU) and the
        group's window and soft-cap."""
        g, t = self._geometry(), md.table
        common = {
            "window_left": group[0],
            "logits_soft_cap": group[1],
            "q_data_type": self.dtype,
            "kv_data_type": self.kv_cache_dtype,
            "o_data_type": self.dtype,
            "sm_scale": g.sm_scale,
            "non_blocking": True,
        }
        heads = (g.num_qo_heads, g.num_kv_heads, g.head_dim, self.page_size)
        if md.kind == "decode":
            wrapper.plan(t.kv_indptr, t.kv_indices, t.kv_last_page_len, *heads, **common)
        else:
            wrapper.plan(
                t.qo_indptr, t.kv_indptr, t.kv_indices, t.kv_last_page_len, *heads, causal=True, **common
            )
        md.wrappers[group] = wrapper

    def _geometry(self) -> AttentionGeometry:
        if self.geometry is None:
            raise RuntimeError("the layers' geometry is unknown: no layer has run yet and none was given")
        return self.geometry

    # ------------------------------------------------------------------ per layer
    # forward_extend / forward_decode: the signature, shapes and contract of AttentionBackend's
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        return self._forward("prefill", q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        return self._forward("decode", q, k, v, layer, forward_batch, save_kv_cache)

    def _forward(
        self,
        kind: str,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool,
    ) -> torch.Tensor:
        """q ``[T, H*D]``, k/v ``[T, H_kv*D]`` -> ``[T, H*D]`` through the planned wrapper."""
        md = self.forward_metadata
        if md is None:
            raise RuntimeError("init_forward_metadata was not called for this batch")
        if md.kind != kind:
            raise RuntimeError(f"batch planned for {md.kind}, called through forward_{kind}")
        geometry = AttentionGeometry.of(layer)
        if self.geometry is None:
            self.geometry = geometry
        elif geometry != self.geometry:
            raise ValueError(f"layer {layer.layer_id} has geometry {geometry}, planned for {self.geometry}")
        group = group_of(layer)
        wrapper = md.wrappers.get(group)
        if wrapper is None:
            wrapper = self._plan_new_group(md, group)
        pool = forward_batch.token_to_kv_pool
        if save_kv_cache:
            pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        kv = (paged_view(k_buf, self.page_size), paged_view(v_buf, self.page_size))
        num_tokens, h, d = q.shape[0], layer.num_heads, layer.head_dim
        out = wrapper.run(q.reshape(num_tokens, h, d), kv)
        return out.reshape(num_tokens, h * d)

    def _plan_new_group(self, md: FlashInferMetadata, group: AttnGroup) -> PagedWrapper:
        """A layer of a group this batch has no plan for (the first forward, or the first layer of
        its kind): plan it now and for every later batch; never inside a CUDA graph."""
        if md.graph_bs is not None:
            raise RuntimeError(
                f"attention group (window_left, logit_cap) = {group} was not known when the CUDA graph "
                f"of batch size {md.graph_bs} was captured (known: {list(self.groups)}); run an eager "
                "forward of every layer before capturing"
            )
        self.groups[group] = None
        self._plan(md, group, self._wrapper(md.kind, group))
        return md.wrappers[group]

    # ------------------------------------------------------------------ CUDA graphs (decode)
    def init_cuda_graph_state(self, max_bs: int, max_context_len: int) -> None:
        """Allocate the fixed buffers every captured decode batch (up to ``max_bs`` sequences of up
        to ``max_context_len`` tokens) reads: indptr ``[max_bs + 1]``, last_page_len ``[max_bs]``
        and indices ``[max_bs * ceil(max_context_len / P)]``, int32 on the device."""
        max_pages = (max_context_len + self.page_size - 1) // self.page_size
        zeros = lambda n: torch.zeros(n, dtype=INDEX_DTYPE, device=self.device)  # noqa: E731
        self.graph_state = DecodeGraphState(zeros(max_bs + 1), zeros(max_bs * max_pages), zeros(max_bs))

    # the graph hooks: the signatures and contract of AttentionBackend's
    def init_forward_metadata_capture_cuda_graph(
        self, bs, req_to_token, req_pool_indices, seq_lens_cpu, forward_mode
    ):
        """Before capturing batch size ``bs``: build its ``use_cuda_graph`` decode wrapper over the
        fixed buffers and plan it with this (dummy) batch, outside the capture."""
        state = self._graph_state(bs, forward_mode)
        g = self._geometry()
        state.wrappers[bs] = {
            group: self.wrapper_factory(
                "decode",
                self.workspace,
                kv_layout="NHD",
                use_tensor_cores=g.use_tensor_cores,
                use_cuda_graph=True,
                paged_kv_indptr_buffer=state.kv_indptr[: bs + 1],
                paged_kv_indices_buffer=state.kv_indices,
                paged_kv_last_page_len_buffer=state.kv_last_page_len[:bs],
            )
            for group in self.groups or [PLAIN]
        }
        self._plan_graph(bs, state.wrappers[bs], req_to_token, req_pool_indices, seq_lens_cpu)

    def init_forward_metadata_replay_cuda_graph(
        self, bs, req_to_token, req_pool_indices, seq_lens_cpu, forward_mode
    ):
        """Before replaying batch size ``bs`` (inputs already padded to ``bs``): plan its wrappers
        with the live batch, which rewrites the fixed buffers the graph reads."""
        state = self._graph_state(bs, forward_mode)
        wrappers = state.wrappers.get(bs)
        if wrappers is None:
            raise ValueError(f"no CUDA graph was captured for batch size {bs} ({sorted(state.wrappers)})")
        self._plan_graph(bs, wrappers, req_to_token, req_pool_indices, seq_lens_cpu)

    def _graph_state(self, bs: int, forward_mode: ForwardMode) -> DecodeGraphState:
        if not forward_mode.is_decode():
            raise NotImplementedError(f"CUDA graphs cover DECODE batches only, not {forward_mode.name}")
        if self.graph_state is None:
            raise RuntimeError("init_cuda_graph_state was not called")
        if not 0 < bs <= self.graph_state.max_bs:
            raise ValueError(f"batch size {bs} outside 1 .. {self.graph_state.max_bs}")
        return self.graph_state

    def _plan_graph(
        self,
        bs: int,
        wrappers: dict[AttnGroup, PagedWrapper],
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens_cpu: Sequence[int],
    ) -> None:
        table = build_paged_kv_metadata(req_to_token, req_pool_indices, seq_lens_cpu, None, self.page_size)
        if table.kv_indices.numel() > self.graph_state.kv_indices.numel():
            raise ValueError(
                f"{table.kv_indices.numel()} pages exceed the graph buffer of "
                f"{self.graph_state.kv_indices.numel()} (init_cuda_graph_state's max_context_len)"
            )
        md = FlashInferMetadata("decode", table, graph_bs=bs)
        for group, wrapper in wrappers.items():
            self._plan(md, group, wrapper)
        self.forward_metadata = md

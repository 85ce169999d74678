"""Torch-native attention: the CPU path and the oracle other backends are tested against.

Padding-free across requests: q/k/v hold only real tokens. Per batch, ``init_forward_metadata``
turns ``req_to_token`` into flat gather indices once; per layer the backend writes the new K/V
into the pool, gathers K and V once, and runs SDPA (GQA through ``enable_gqa``).

Extend part (sequences ``0 .. ne-1``; all of an EXTEND batch, the head of a MIXED one)::

    extend_kv_slots = concat_i req_to_token[req_pool_indices[i], 0 : seq_lens[i]]   # [sum_i s_i]
    sequence i: queries = its e_i new tokens, keys = its s_i tokens (prefix p_i from the pool,
                then the new ones), mask = bottom-right causal: query j sees keys 0 .. p_i + j

    Runs of consecutive sequences with the same (e_i, s_i) form one SDPA call of batch n
    (zero-copy views). No prefix -> ``is_causal``; e_i == 1 -> no mask. When no extend sequence
    has a prefix and the pool keeps q's dtype, the keys are the batch's own k/v rows (views).

Decode part (the remaining ``nd`` sequences, one query token each), in chunks::

    sequences ordered by seq_len (stable), then cut into chunks of consecutive ones whose
    padded K+V gather (n_c x L_c rows, L_c = the chunk's max seq_len) fits DECODE_CHUNK_BYTES
    (at least one sequence per chunk); per chunk, built once per batch:
      slots [n_c, L_c] = req_to_token[rows, :L_c], entries past seq_len -> slot 0 (the pool's
                         zero padding page)
      mask  [n_c, 1, 1, L_c] = position < seq_len   (None when the chunk's lengths are equal)
    per layer and chunk: K = k_buffer.index_select(0, slots.flatten()) -> [n_c, L_c, H_kv, D]
                 (once for K, once for V, into a reused workspace), then one batched SDPA.

Layers with a sliding window or logit soft-capping (``has_window_or_cap``) take ``math_attention``
instead of SDPA in both parts: explicit scores, the cap, a mask of the keys each query may see
(``visible_keys``: causal and, with a window, no further back than ``sliding_window_size``), softmax.
All K/V stay in the pool; a window only narrows what is read. Sequences holding an image seen
both ways (Gemma 3) are attended again with those blocks visible (image_blocks.py).

Chunking keeps the gathered K/V in the CPU caches between the gather and SDPA's reads, and
grouping similar lengths cuts the padding a single ``[nd, max_len]`` matrix would attend over.
A sequence's result does not depend on its chunk (masked padding adds exact zeros).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from srt.layers.attention.base import (
    AttentionBackend,
    AttentionBackendContext,
    AttentionLayer,
    save_and_read_kv,
)
from srt.layers.attention.image_blocks import ImageBlocks, attend_with_blocks, image_blocks
from srt.layers.attention.window_cap import has_window_or_cap, math_attention, visible_keys

if TYPE_CHECKING:
    from collections.abc import Callable

    from srt.layers.forward_batch import ForwardBatch

    # (q3 [T, H, D], kx, vx [extend keys, H_kv, D], metadata, layer, out [T, H, D]) -> None
    ExtendFn = Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, "TorchNativeMetadata", AttentionLayer, torch.Tensor], None
    ]
    # (q3 [nd, H, D], k_buf, v_buf, metadata, layer) -> [nd, H, D]
    DecodeFn = Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, "TorchNativeMetadata", AttentionLayer], torch.Tensor
    ]

# Budget for one decode chunk's gathered K plus V (bytes): fits comfortably in a core's L2 plus
# its share of L3 on current x86 server parts.
DECODE_CHUNK_BYTES = 4 << 20


@dataclass(slots=True)
class ExtendRun:
    """``n`` consecutive extend sequences sharing ``extend_len`` and ``seq_len``."""

    q_start: int  # first token of the run in the batch's q
    kv_start: int  # first row of the run in the gathered extend K/V
    n: int
    extend_len: int
    seq_len: int
    # None -> no mask (or is_causal when causal is True); else bool [extend_len, seq_len]
    mask: torch.Tensor | None
    causal: bool


@dataclass(slots=True)
class DecodeChunk:
    """``n`` decode sequences attended together (positions among the batch's decode part)."""

    start: int  # first position when the chunk is a contiguous range of decode sequences
    n: int
    index: torch.Tensor | None  # int64 [n] positions (None: the range start .. start + n - 1)
    max_len: int
    slots: torch.Tensor  # int64 [n * max_len] (flattened [n, max_len]; padding -> slot 0)
    mask: torch.Tensor | None  # bool [n, 1, 1, max_len] or None (all lengths == max_len)
    lens: torch.Tensor  # int64 [n]: the chunk's sequence lengths (windowed layers' masks)


@dataclass(slots=True)
class TorchNativeMetadata:
    num_extend_seqs: int = 0
    num_extend_tokens: int = 0
    extend_kv_slots: torch.Tensor | None = None  # int64 [sum of extend seqs' seq_lens]
    extend_runs: list[ExtendRun] = field(default_factory=list)
    # no extend sequence has a cached prefix: the batch's own k/v rows are all it attends to
    extend_no_prefix: bool = False
    num_decode_seqs: int = 0
    decode_chunks: list[DecodeChunk] = field(default_factory=list)
    max_gather_rows: int = 0  # max(len(extend_kv_slots), rows of a decode chunk): the workspace size
    # the batch's sequence lengths and the extend sequences' new-token counts, read once per batch
    seq_lens: list[int] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    image_blocks: ImageBlocks = field(default_factory=dict)  # bidirectional images (image_blocks.py)


# ---------------------------------------------------------------------- metadata (once per batch)
def build_metadata(fb: ForwardBatch, decode_chunks: bool = True) -> TorchNativeMetadata:
    """The batch's split into extend and decode sequences, the extend runs and (unless
    ``decode_chunks`` is False: a backend with its own decode path) the decode chunks."""
    mode = fb.forward_mode
    if mode.is_idle() or fb.batch_size == 0:
        return TorchNativeMetadata()
    if fb.req_to_token_pool is None:
        raise ValueError("forward_batch.req_to_token_pool must be set before init_forward_metadata")
    req_to_token = fb.req_to_token_pool.req_to_token
    bs = fb.batch_size
    seq_lens = fb.seq_lens_cpu or fb.seq_lens.tolist()
    ne = 0 if mode.is_decode() else fb.num_extend_seqs if mode.is_mixed() else bs
    md = TorchNativeMetadata(num_extend_seqs=ne, num_decode_seqs=bs - ne, seq_lens=seq_lens)
    if ne:
        extend_lens = md.extend_lens = fb.extend_seq_lens_cpu or fb.extend_seq_lens.tolist()
        prefix_lens = fb.extend_prefix_lens_cpu or fb.extend_prefix_lens.tolist()
        plan_extend(
            md, req_to_token, fb.req_pool_indices[:ne], seq_lens[:ne], extend_lens[:ne], prefix_lens[:ne]
        )
        md.image_blocks = image_blocks(fb.image_spans, extend_lens[:ne])
    if bs - ne and decode_chunks:
        pool = fb.token_to_kv_pool
        row_bytes = 0 if pool is None else 2 * pool.head_num * pool.head_dim * pool.dtype.itemsize
        budget = DECODE_CHUNK_BYTES // row_bytes if row_bytes else 4096
        plan_decode_chunks(md, req_to_token, fb.req_pool_indices[ne:], seq_lens[ne:], budget)
    md.max_gather_rows = max(
        0 if md.extend_kv_slots is None else md.extend_kv_slots.numel(),
        max((c.slots.numel() for c in md.decode_chunks), default=0),
    )
    return md


def plan_extend(
    md: TorchNativeMetadata,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: list[int],
    extend_lens: list[int],
    prefix_lens: list[int],
) -> None:
    """The extend sequences' gather slots and runs (see the module docstring)."""
    device = req_to_token.device
    total_kv = sum(seq_lens)
    lens_t = torch.tensor(seq_lens, dtype=torch.int64, device=device)
    starts_t = torch.cumsum(lens_t, 0) - lens_t
    rows = torch.repeat_interleave(req_pool_indices.to(device), lens_t, output_size=total_kv)
    cols = torch.arange(total_kv, device=device) - torch.repeat_interleave(
        starts_t, lens_t, output_size=total_kv
    )
    md.extend_kv_slots = req_to_token[rows, cols]
    md.num_extend_tokens = sum(extend_lens)
    md.extend_no_prefix = not any(prefix_lens)

    masks: dict[tuple[int, int], torch.Tensor] = {}
    q_start = kv_start = 0
    i = 0
    while i < len(seq_lens):
        e, s = extend_lens[i], seq_lens[i]
        if e + prefix_lens[i] != s:
            raise ValueError(f"sequence {i}: extend_len {e} + prefix_len {prefix_lens[i]} != seq_len {s}")
        n = 1
        while i + n < len(seq_lens) and extend_lens[i + n] == e and seq_lens[i + n] == s:
            n += 1
        mask = None
        causal = e > 1 and e == s
        if e > 1 and not causal:
            mask = masks.get((e, s))
            if mask is None:
                mask = masks[(e, s)] = torch.ones(e, s, dtype=torch.bool, device=device).tril(s - e)
        md.extend_runs.append(ExtendRun(q_start, kv_start, n, e, s, mask, causal))
        q_start += n * e
        kv_start += n * s
        i += n


def plan_decode_chunks(
    md: TorchNativeMetadata,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: list[int],
    budget_rows: int,
) -> None:
    """Chunks of the decode sequences (see the module docstring); ``budget_rows`` = gathered K/V
    rows per chunk."""
    device = req_to_token.device
    nd = len(seq_lens)
    order = sorted(range(nd), key=seq_lens.__getitem__)
    in_order = all(order[i] == i for i in range(nd))
    pool_rows = req_pool_indices.to(device)
    lens_t = torch.tensor(seq_lens, dtype=torch.int64, device=device)
    i = 0
    while i < nd:
        n = 1  # lengths ascend along `order`, so the last one is the chunk's max
        while i + n < nd and (n + 1) * seq_lens[order[i + n]] <= budget_rows:
            n += 1
        max_len = seq_lens[order[i + n - 1]]
        if in_order:
            index = None
            rows, lens = pool_rows[i : i + n], lens_t[i : i + n]
        else:
            index = torch.tensor(order[i : i + n], dtype=torch.int64, device=device)
            rows, lens = pool_rows[index], lens_t[index]
        slots = req_to_token[rows, :max_len]
        mask = None
        if seq_lens[order[i]] < max_len:
            valid = torch.arange(max_len, device=device)[None, :] < lens[:, None]
            slots = slots.masked_fill(~valid, 0)
            mask = valid[:, None, None, :]
        md.decode_chunks.append(DecodeChunk(i, n, index, max_len, slots.reshape(-1), mask, lens))
        i += n


# ---------------------------------------------------------------------- per layer
class GatherWorkspace:
    """``src.index_select(0, index)`` into reused buffers, one for K and one for V.

    The gathered K/V of a decode batch are large (bs x max_len x H_kv x D); a fresh tensor per
    layer would be a fresh ``mmap`` each time, whose page faults cost several times the copy
    itself on CPU. A buffer is sized for the batch's largest gather (``md.max_gather_rows``) and
    kept across layers and batches; it is re-made when too small or more than 8x too large (so one
    huge batch does not pin its memory forever). A result is valid until the next ``gather`` with
    the same ``which``."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor | None] = [None, None]

    def gather(self, src: torch.Tensor, index: torch.Tensor, which: int, max_rows: int) -> torch.Tensor:
        """``which``: 0 = K, 1 = V; ``max_rows``: the batch's largest gather (rows)."""
        row_numel = src[0].numel()
        need = index.numel() * row_numel
        batch_need = max(need, max_rows * row_numel)
        ws = self._buffers[which]
        if (
            ws is None
            or ws.dtype != src.dtype
            or ws.device != src.device
            or ws.numel() < batch_need
            or ws.numel() > 8 * batch_need
            or (ws.is_inference() and not torch.is_inference_mode_enabled())
        ):
            ws = self._buffers[which] = torch.empty(batch_need, dtype=src.dtype, device=src.device)
        out = ws[:need].view(index.numel(), *src.shape[1:])
        return torch.index_select(src, 0, index, out=out)


def attend_extend_batch(
    q: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    md: TorchNativeMetadata,
    layer: AttentionLayer,
    ws: GatherWorkspace,
    extend: ExtendFn,
    decode: DecodeFn,
) -> torch.Tensor:
    """An EXTEND or MIXED batch: ``kv`` = (the batch's k, v rows, the pool's K, V buffers). The
    extend sequences' keys are the rows in hand (no prefix, same dtype) or gathered from the pool;
    ``extend`` writes their attention into ``out[:num_extend_tokens]``, ``decode`` returns the
    decoding tail's. q ``[T, H*D]`` -> ``[T, H*D]``."""
    k, v, k_buf, v_buf = kv
    num_tokens = q.shape[0]
    h, h_kv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    q3 = q.reshape(num_tokens, h, d)
    out = q.new_empty(num_tokens, h, d)
    ne_tok = md.num_extend_tokens
    if md.num_extend_seqs:
        if md.extend_no_prefix and k_buf.dtype == q.dtype:
            # nothing cached to read: the k/v rows in hand are what the pool now holds
            kx, vx = k[:ne_tok].reshape(ne_tok, h_kv, d), v[:ne_tok].reshape(ne_tok, h_kv, d)
        else:
            kx = ws.gather(k_buf, md.extend_kv_slots, 0, md.max_gather_rows).to(q.dtype)
            vx = ws.gather(v_buf, md.extend_kv_slots, 1, md.max_gather_rows).to(q.dtype)
        extend(q3, kx, vx, md, layer, out)
        if md.image_blocks:  # their sequences again, with the image blocks visible both ways
            attend_with_blocks(q3, kx, vx, md.extend_runs, md.image_blocks, layer, out)
    if md.num_decode_seqs:
        out[ne_tok:] = decode(q3[ne_tok:], k_buf, v_buf, md, layer)
    return out.view(num_tokens, h * d)


def sdpa_extend(
    q3: torch.Tensor,
    kx: torch.Tensor,
    vx: torch.Tensor,
    md: TorchNativeMetadata,
    layer: AttentionLayer,
    out: torch.Tensor,
) -> None:
    """The extend sequences' attention into ``out[:num_extend_tokens]``: q3 ``[T, H, D]``, kx/vx
    ``[sum of extend seq_lens, H_kv, D]`` (each sequence's keys in order, prefix first)."""
    h, h_kv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    gqa = h != h_kv
    special = has_window_or_cap(layer)
    for run in md.extend_runs:
        qe, ks, n, e, s = run.q_start, run.kv_start, run.n, run.extend_len, run.seq_len
        qr = q3[qe : qe + n * e].view(n, e, h, d).transpose(1, 2)
        kr = kx[ks : ks + n * s].view(n, s, h_kv, d).transpose(1, 2)
        vr = vx[ks : ks + n * s].view(n, s, h_kv, d).transpose(1, 2)
        if special:
            query_pos = torch.arange(s - e, s, device=q3.device)
            o = math_attention(qr, kr, vr, visible_keys(query_pos, s, layer.sliding_window_size), layer)
        else:
            o = F.scaled_dot_product_attention(
                qr, kr, vr, attn_mask=run.mask, is_causal=run.causal, scale=layer.scaling, enable_gqa=gqa
            )
        out[qe : qe + n * e].view(n, e, h, d).copy_(o.transpose(1, 2))


def sdpa_decode(
    q3: torch.Tensor,
    kv_buf: tuple[torch.Tensor, torch.Tensor],
    md: TorchNativeMetadata,
    layer: AttentionLayer,
    ws: GatherWorkspace,
) -> torch.Tensor:
    """q3 ``[nd, H, D]`` (one query per decoding sequence) -> ``[nd, H, D]``, chunk by chunk
    through the gather workspace."""
    k_buf, v_buf = kv_buf
    nd, h, d = q3.shape
    h_kv = layer.num_kv_heads
    chunks = md.decode_chunks
    whole = len(chunks) == 1 and chunks[0].index is None  # one chunk, batch order
    out = None if whole else q3.new_empty(nd, h, d)
    special = has_window_or_cap(layer)
    for c in chunks:
        n, max_len = c.n, c.max_len
        qc = q3[c.start : c.start + n] if c.index is None else q3.index_select(0, c.index)
        kd = ws.gather(k_buf, c.slots, 0, md.max_gather_rows).view(n, max_len, h_kv, d).transpose(1, 2)
        vd = ws.gather(v_buf, c.slots, 1, md.max_gather_rows).view(n, max_len, h_kv, d).transpose(1, 2)
        if special:  # the query sits at position len - 1 of its sequence
            visible = visible_keys(c.lens - 1, max_len, layer.sliding_window_size)[:, None, None, :]
            o = math_attention(qc.unsqueeze(2), kd.to(q3.dtype), vd.to(q3.dtype), visible, layer).squeeze(2)
        else:
            o = F.scaled_dot_product_attention(
                qc.unsqueeze(2),
                kd.to(q3.dtype),
                vd.to(q3.dtype),
                attn_mask=c.mask,
                scale=layer.scaling,
                enable_gqa=h != h_kv,
            ).squeeze(2)
        if out is None:
            return o
        if c.index is None:
            out[c.start : c.start + n] = o
        else:
            out.index_copy_(0, c.index, o)
    assert out is not None
    return out


# ---------------------------------------------------------------------- the backend
class TorchNativeAttnBackend(AttentionBackend):
    """See the module docstring. Needs nothing from ``model_runner`` (taken for the registry's
    uniform constructor; may be None): every index tensor lives on ``req_to_token``'s device."""

    supports_image_blocks = True

    def __init__(self, model_runner: AttentionBackendContext | None = None) -> None:
        self.forward_metadata: TorchNativeMetadata | None = None
        self.workspace = GatherWorkspace()

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        self.forward_metadata = build_metadata(forward_batch)

    # forward_extend / forward_decode: the signature, shapes and contract of AttentionBackend's
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        kv = (k, v, *save_and_read_kv(k, v, layer, forward_batch, save_kv_cache))
        return attend_extend_batch(q, kv, self._metadata(), layer, self.workspace, sdpa_extend, self._decode)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        kv_buf = save_and_read_kv(k, v, layer, forward_batch, save_kv_cache)
        bs, h, d = q.shape[0], layer.num_heads, layer.head_dim
        return self._decode(q.reshape(bs, h, d), *kv_buf, self._metadata(), layer).reshape(bs, h * d)

    def _decode(self, q3, k_buf, v_buf, md: TorchNativeMetadata, layer: AttentionLayer) -> torch.Tensor:
        return sdpa_decode(q3, (k_buf, v_buf), md, layer, self.workspace)

    def _metadata(self) -> TorchNativeMetadata:
        if self.forward_metadata is None:
            raise RuntimeError("init_forward_metadata was not called for this batch")
        return self.forward_metadata

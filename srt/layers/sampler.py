"""Token sampling: penalties -> temperature -> top_k -> top_p -> min_p -> draw, vectorized over the batch.

Reproducibility contract: a sampled row's token is a pure function of its own logits, its own
parameters, its seed and its output position. The randomness comes from a counter-based hash
(`counter_uniform`: splitmix64 of (seed, position, round)), one uniform ``u`` per row and draw
round; a token is drawn by inverse CDF over the filtered, unnormalized weights
``w = exp((logit - max) / T)`` laid out in TOKEN-ID order (never a sort order): the first token
whose cumulative weight reaches ``u * sum(w)``. Every reduction on the way is exact (max), a
per-row sequential scan (cumsum) or a fixed-shape block sum, so the same request gets the same
tokens whatever else is in the batch and whichever row it occupies.

Filters (each keeps ties at its boundary, so none depends on tie order):
- top_k: keep logits ``>=`` the k-th largest logit;
- top_p: keep token i iff the mass of the tokens strictly heavier than i is below ``top_p`` of the
  (top-k filtered) total: the smallest descending prefix reaching ``top_p``, plus its ties;
- min_p: keep weights ``>= min_p * max_weight`` (``max_weight`` is 1 by construction).

Constrained rows (a grammar's token bitmask) have their disallowed logits set to -inf first.

Row groups (`SamplingBatchInfo`): greedy rows take the argmax; top-k rows (small k) work on
``torch.topk`` candidates; full-vocab rows work on ``[n, vocab]`` weights, where top_p is done by
exact rejection sampling instead of a sort: draw i from w; accept iff i is in the nucleus (one
masked sum); else every token no heavier than i is outside the nucleus too, so drop them and draw
again with the next round's uniform. Each round accepts with probability >= top_p.

Logprobs are ``log_softmax`` of the RAW logits (before penalties and temperature).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from srt.kernels.cpu.elementwise import apply_token_bitmask_
from srt.sampling.sampling_batch_info import SamplingBatchInfo

if TYPE_CHECKING:
    from srt.layers.gpu_sampling import FlashInferSampler

# full-vocab rows draw by inverse CDF in two levels: sums of blocks of this many tokens, then the
# prefix sum inside the one block holding the target (instead of a sequential [n, vocab] cumsum)
CDF_BLOCK = 128
# top_p rejection rounds before the remaining rows fall back to an exact sort (P(reaching it) is
# at most (1 - top_p) ** MAX_TOP_P_ROUNDS)
MAX_TOP_P_ROUNDS = 32

_MASK64 = (1 << 64) - 1


def _i64(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _i64(0x9E3779B97F4A7C15)
_MIX1 = _i64(0xBF58476D1CE4E5B9)
_MIX2 = _i64(0x94D049BB133111EB)


def _shr(z: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _fmix64(z: Tensor) -> Tensor:
    """splitmix64's finalizer on int64 tensors (multiplication wraps mod 2**64)."""
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def counter_uniform(seeds: Tensor, positions: Tensor, round_: int = 0) -> Tensor:
    """Uniform numbers in (0, 1), float64, elementwise: a pure function of (seed, position, round).

    ``seeds``, ``positions``: int64 tensors of one shape. ``h = fmix(fmix(seed) + (pos+1)*golden)``,
    for ``round_ > 0`` then ``h = fmix(h + round_*golden)``; ``u = (h >> 11 + 0.5) / 2**53``.
    """
    h = _fmix64(_fmix64(seeds.to(torch.int64)) + (positions.to(torch.int64) + 1) * _GOLDEN)
    if round_:
        h = _fmix64(h + _i64(round_ * 0x9E3779B97F4A7C15))
    return (_shr(h, 11).to(torch.float64) + 0.5) * (1.0 / (1 << 53))


@dataclass(slots=True)
class SampleOutput:
    """``next_token_ids [bs]`` int64; ``next_token_logprobs [bs]`` float32 (None unless requested);
    ``top_logprobs[i]``: ``(token_id, logprob)`` pairs, best first, ``top_logprobs_nums[i]`` of them
    (None unless logprobs were requested)."""

    next_token_ids: Tensor
    next_token_logprobs: Tensor | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


class _Workspace:
    """Reusable scratch for ``[n, vocab]`` intermediates.

    A fresh 50 MB tensor (256 x 49152 float32) costs more in page faults than the arithmetic done
    on it, so the sampler keeps its big buffers between steps (about 3 x bs x vocab x 4 bytes).
    """

    def __init__(self) -> None:
        self._bufs: dict[str, Tensor] = {}

    def get(self, name: str, shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> Tensor:
        numel = shape[0] * shape[1]
        buf = self._bufs.get(name)
        if (
            buf is None
            or buf.numel() < numel
            or buf.dtype != dtype
            or buf.device != device
            # inference tensors cannot be updated in place outside inference mode (and vice versa)
            or buf.is_inference() != torch.is_inference_mode_enabled()
        ):
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._bufs[name] = buf
        return buf[:numel].view(shape)

    def clear(self) -> None:
        self._bufs.clear()


class Sampler(nn.Module):
    """The sampler of a ModelRunner. Holds only reusable scratch memory (`release_buffers`).

    ``flashinfer_sampler`` (`srt.layers.gpu_sampling.create_flashinfer_sampler`): when given, the
    non-greedy rows go to FlashInfer's kernels, which give up per-seed reproducibility and batch
    invariance; None (the default) keeps the contract of this module's docstring.
    """

    def __init__(self, flashinfer_sampler: FlashInferSampler | None = None) -> None:
        super().__init__()
        self._ws = _Workspace()
        self._flashinfer = flashinfer_sampler

    def release_buffers(self) -> None:
        """Drop the cached scratch buffers (they are re-created on the next call)."""
        self._ws.clear()

    def forward(
        self,
        logits: Tensor,
        sampling_info: SamplingBatchInfo,
        return_logprob: bool = False,
        top_logprobs_nums: list[int] | None = None,
    ) -> SampleOutput:
        """Sample one token per row of ``logits [bs, vocab]`` (float32; never modified)."""
        if logits.dtype != torch.float32:
            logits = logits.float()
        info = sampling_info
        bs = logits.shape[0]
        assert bs == info.batch_size, (bs, info.batch_size)

        work = logits
        if not info.adjustments.is_empty or info.grammar_bitmask is not None:
            work = self._ws.get("work", tuple(logits.shape), torch.float32, logits.device).copy_(logits)
            info.adjustments.apply_(work)
            if info.grammar_bitmask is not None:
                apply_token_bitmask_(work, info.grammar_rows, info.grammar_bitmask)

        if info.is_all_greedy:
            next_ids = work.argmax(dim=-1)
        elif self._flashinfer is not None:
            next_ids = self._flashinfer.sample(work, info)
        else:
            next_ids = torch.empty(bs, dtype=torch.int64, device=logits.device)
            g = info.greedy_idx
            if g.numel():
                # a full-batch argmax beats copying many rows out first
                src = work.argmax(dim=-1)[g] if 2 * g.numel() >= bs else work.index_select(0, g).argmax(-1)
                next_ids[g] = src
            if info.topk_idx.numel():
                next_ids[info.topk_idx] = _sample_topk_rows(work, info.topk_idx, info)
            if info.full_idx.numel():
                next_ids[info.full_idx] = _sample_full_rows(work, info.full_idx, info, self._ws)

        if not return_logprob:
            return SampleOutput(next_token_ids=next_ids)
        return _with_logprobs(logits, next_ids, top_logprobs_nums)


def _is_all_rows(rows: Tensor, n: int) -> bool:
    return rows.numel() == n and bool((rows == torch.arange(n, device=rows.device)).all())


def _rows(x: Tensor, rows: Tensor) -> Tensor:
    """``x[rows]`` without a copy when ``rows`` is every row in order."""
    return x if _is_all_rows(rows, x.shape[0]) else x.index_select(0, rows)


def _uniform(info: SamplingBatchInfo, rows: Tensor, round_: int = 0) -> Tensor:
    return counter_uniform(info.seeds[rows], info.positions[rows], round_)


# ---------------------------------------------------------------- top-k candidate rows
def _inverse_cdf(weights: Tensor, u: Tensor) -> Tensor:
    """Column index, per row of ``weights [n, C]`` (>= 0, some > 0), of the first cumulative weight
    ``>= u * total``; never a zero-weight column since ``u > 0``."""
    cum = weights.cumsum(dim=1)
    target = (u * cum[:, -1].to(torch.float64)).to(cum.dtype).unsqueeze(1)
    return torch.searchsorted(cum, target).clamp_(max=weights.shape[1] - 1).squeeze(1)


def _sample_topk_rows(work: Tensor, rows: Tensor, info: SamplingBatchInfo) -> Tensor:
    """Rows with ``2 <= top_k <= TOPK_CANDIDATE_LIMIT``: all work on ``[n, topk_max]`` candidates."""
    vals, ids = torch.topk(_rows(work, rows), info.topk_max, dim=1)  # descending
    k = info.top_ks[rows]
    w = ((vals - vals[:, :1]) / info.temperatures[rows].unsqueeze(1)).exp_()  # w[:, 0] == 1
    w.masked_fill_(vals < vals.gather(1, (k - 1).unsqueeze(1)), 0.0)  # top_k, ties kept
    if info.need_top_p:
        top_p = info.top_ps[rows]
        cum = w.cumsum(dim=1)  # descending order: the nucleus is a prefix
        # nucleus size: 1 + number of prefix sums still below top_p * total
        m = (cum[:, :-1] < (top_p * cum[:, -1]).unsqueeze(1)).sum(dim=1) + 1
        thr = w.gather(1, (m - 1).unsqueeze(1))
        w.masked_fill_((w < thr) & (top_p < 1.0).unsqueeze(1), 0.0)
    if info.need_min_p:
        w.masked_fill_(w < info.min_ps[rows].unsqueeze(1), 0.0)
    # draw in token-id order so the result never depends on the order topk returned ties in
    ids_sorted, perm = ids.sort(dim=1)
    col = _inverse_cdf(w.gather(1, perm), _uniform(info, rows))
    return ids_sorted.gather(1, col.unsqueeze(1)).squeeze(1)


# ---------------------------------------------------------------- full-vocab rows
def _block_sums(wbuf: Tensor) -> Tensor:
    """``[n, padded / CDF_BLOCK]`` per-block sums of ``wbuf [n, padded]`` (fixed shape per row)."""
    n, padded = wbuf.shape
    return wbuf.view(n, padded // CDF_BLOCK, CDF_BLOCK).sum(dim=2)


def _block_inverse_cdf(wbuf: Tensor, u: Tensor) -> Tensor:
    """`_inverse_cdf` over ``wbuf [n, padded]`` in two levels: the block holding the target (from
    the block sums), then the column inside that block. Never picks a zero weight."""
    n, padded = wbuf.shape
    bcum = _block_sums(wbuf).cumsum(dim=1)
    target = (u * bcum[:, -1].to(torch.float64)).to(bcum.dtype).unsqueeze(1)
    blk = torch.searchsorted(bcum, target).clamp_(max=bcum.shape[1] - 1)  # [n, 1]
    before = torch.where(blk > 0, bcum.gather(1, (blk - 1).clamp(min=0)), torch.zeros_like(target))
    blocks = wbuf.view(n, padded // CDF_BLOCK, CDF_BLOCK)
    inner = blocks[torch.arange(n, device=wbuf.device), blk.squeeze(1)]  # [n, CDF_BLOCK]
    col = torch.searchsorted(inner.cumsum(dim=1), target - before)
    # rounding may leave the target just past the block's own total: take its last nonzero weight
    last_nz = CDF_BLOCK - 1 - (inner.flip(1) > 0).to(torch.int8).argmax(dim=1, keepdim=True)
    col = torch.where(col >= CDF_BLOCK, last_nz, col)
    return (blk * CDF_BLOCK + col).squeeze(1)


def _heavier_mass(wbuf: Tensor, than: Tensor, scratch: Tensor, mask: Tensor) -> Tensor:
    """Per row of ``wbuf [n, padded]``: the sum of the weights strictly greater than ``than [n]``
    (``scratch``/``mask``: buffers shaped like ``wbuf``)."""
    torch.gt(wbuf, than.unsqueeze(1), out=mask)
    torch.where(mask, wbuf, wbuf.new_zeros(()), out=scratch)
    return _block_sums(scratch).sum(dim=1)


def _sample_full_rows(work: Tensor, rows: Tensor, info: SamplingBatchInfo, ws: _Workspace) -> Tensor:
    """Rows with top_k disabled (or above the candidate limit): weights over the whole vocab."""
    vocab = work.shape[1]
    wbuf = _full_weights(work, rows, info, ws)
    w = wbuf[:, :vocab]
    p_rows = (info.top_ps[rows] < 1.0).nonzero().squeeze(1) if info.need_top_p else None
    if p_rows is not None and p_rows.numel():
        # the nucleus is decided on the top-k filtered weights, before min_p
        total = _block_sums(wbuf).sum(dim=1).index_select(0, p_rows)
    if info.need_min_p:
        w.masked_fill_(w < info.min_ps[rows].unsqueeze(1), 0.0)
    # (the clamp only matters for a row whose every logit is -inf: NaN weights)
    tokens = _block_inverse_cdf(wbuf, _uniform(info, rows)).clamp_(max=vocab - 1)
    if p_rows is None or p_rows.numel() == 0:
        return tokens
    limit = info.top_ps[rows].index_select(0, p_rows) * total  # [np]
    _top_p_by_rejection(tokens, wbuf, rows, p_rows, limit, info, ws, vocab)
    return tokens


def _full_weights(work: Tensor, rows: Tensor, info: SamplingBatchInfo, ws: _Workspace) -> Tensor:
    """``[n, padded]`` weights ``exp((logit - max) / T)`` of ``rows`` (top_k applied; max weight
    exactly 1; the padding past the vocab is 0), in the workspace."""
    n, vocab = rows.numel(), work.shape[1]
    padded = -(-vocab // CDF_BLOCK) * CDF_BLOCK
    wbuf = ws.get("w", (n, padded), torch.float32, work.device)
    if padded > vocab:
        wbuf[:, vocab:].zero_()
    w = wbuf[:, :vocab]
    if _is_all_rows(rows, work.shape[0]):
        w.copy_(work)
    elif padded == vocab:
        torch.index_select(work, 0, rows, out=wbuf)
    else:
        w.copy_(work.index_select(0, rows))
    if info.full_needs_top_k:
        k = info.top_ks[rows]
        kth = torch.topk(w, int(k.max()), dim=1).values.gather(1, (k - 1).unsqueeze(1))
        w.masked_fill_(w < kth, float("-inf"))  # top_k, ties kept
    w.sub_(w.amax(dim=1, keepdim=True)).div_(info.temperatures[rows].unsqueeze(1)).exp_()
    return wbuf


def _top_p_by_rejection(
    tokens: Tensor,
    wbuf: Tensor,
    rows: Tensor,
    p_rows: Tensor,
    limit: Tensor,
    info: SamplingBatchInfo,
    ws: _Workspace,
    vocab: int,
) -> None:
    """Redraw, in place in ``tokens``, the rows ``p_rows`` (of this group) whose draw is outside
    their nucleus (``limit``: top_p times the row's total weight). min_p cannot change the mass
    heavier than a token that passed it."""
    pending = p_rows  # rows (of this group) whose current draw is not yet accepted
    cand = _rows(wbuf, p_rows)  # their remaining candidate weights (aliases wbuf when all rows)
    scratch = ws.get("scratch", tuple(cand.shape), torch.float32, wbuf.device)
    mask = ws.get("mask", tuple(cand.shape), torch.bool, wbuf.device)
    drawn = tokens.index_select(0, p_rows)
    for round_ in range(1, MAX_TOP_P_ROUNDS + 1):
        val = cand.gather(1, drawn.unsqueeze(1)).squeeze(1)
        rejected = (_heavier_mass(cand, val, scratch, mask) >= limit).nonzero().squeeze(1)
        if rejected.numel() == 0:
            return
        pending, limit, val = pending[rejected], limit[rejected], val[rejected]
        cand = cand.index_select(0, rejected)  # a copy from here on: wbuf is never edited
        cand.masked_fill_(cand <= val.unsqueeze(1), 0.0)
        scratch, mask = scratch[: cand.shape[0]], mask[: cand.shape[0]]
        drawn = _block_inverse_cdf(cand, _uniform(info, rows[pending], round_)).clamp_(max=vocab - 1)
        tokens[pending] = drawn
    # practically unreachable: exact nucleus by sorting what is left of these rows
    val = cand.gather(1, drawn.unsqueeze(1)).squeeze(1)
    rejected = (_heavier_mass(cand, val, scratch, mask) >= limit).nonzero().squeeze(1)
    if rejected.numel():
        pending, limit = pending[rejected], limit[rejected]
        cand = cand.index_select(0, rejected)
        desc = cand.sort(dim=1, descending=True).values
        m = (desc.cumsum(dim=1)[:, :-1] < limit.unsqueeze(1)).sum(dim=1) + 1
        cand.masked_fill_(cand < desc.gather(1, (m - 1).unsqueeze(1)), 0.0)
        last = _block_inverse_cdf(cand, _uniform(info, rows[pending], MAX_TOP_P_ROUNDS + 1))
        tokens[pending] = last.clamp_(max=vocab - 1)


# ---------------------------------------------------------------- logprobs
def _with_logprobs(logits: Tensor, next_ids: Tensor, top_logprobs_nums: list[int] | None) -> SampleOutput:
    """Logprobs of the chosen tokens and the top alternatives, from the raw logits."""
    lse = torch.logsumexp(logits, dim=-1)
    chosen = logits.gather(1, next_ids.unsqueeze(1)).squeeze(1) - lse
    bs = logits.shape[0]
    top: list[list[tuple[int, float]]] = [[] for _ in range(bs)]
    max_n = max(top_logprobs_nums, default=0) if top_logprobs_nums else 0
    if max_n > 0:
        assert top_logprobs_nums is not None and len(top_logprobs_nums) == bs
        vals, ids = torch.topk(logits, min(max_n, logits.shape[1]), dim=1)
        lps = (vals - lse.unsqueeze(1)).tolist()
        id_rows = ids.tolist()
        top = [
            list(zip(id_rows[i][:n], lps[i][:n])) if n > 0 else [] for i, n in enumerate(top_logprobs_nums)
        ]
    return SampleOutput(next_token_ids=next_ids, next_token_logprobs=chosen, top_logprobs=top)

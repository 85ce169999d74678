"""Logit edits that depend on a request's tokens: penalties, logit bias, min-new-tokens masks.

Everything here is *sparse*: a batch's edits are precomputed once per step (`build_logit_adjustments`)
as flat indices ``row * vocab_size + token_id`` into the ``[bs, vocab]`` logits, and applied with a
handful of index ops (`LogitAdjustments.apply_`). Nothing allocates a ``[bs, vocab]`` buffer and
nothing loops over requests on the vocab dimension.

Definitions (applied in this order to the raw logits ``l``):

1. repetition penalty ``r`` (HF / CTRL), over the tokens of prompt + output (each distinct token
   once): ``l = l / r`` where ``l > 0``, ``l = l * r`` otherwise;
2. frequency ``f`` and presence ``p`` penalties (OpenAI), over the OUTPUT tokens with ``c`` = count
   of the token in the output: ``l -= f * c + p * (c > 0)``;
3. logit bias (OpenAI): ``l[token] += bias``;
4. min new tokens: while ``len(output_ids) < min_new_tokens``, the request's ``stop_token_ids``
   and (unless ``ignore_eos``) the model's EOS tokens get ``-inf``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from torch import Tensor

from srt.sampling.sampling_params import SamplingParams


@dataclass(slots=True)
class LogitAdjustments:
    """The edits of one batch, as flat indices into ``logits.view(-1)`` of a ``[bs, vocab]`` tensor.

    - ``repetition_idx`` ``[N]`` int64 (may repeat an index), ``repetition_penalty`` ``[N]`` float32;
    - ``additive_idx`` ``[M]`` int64 (may repeat: contributions add up), ``additive_delta`` ``[M]`` float32;
    - ``mask_idx`` ``[K]`` int64: set to ``-inf``.
    Any pair may be None (nothing of that kind in this batch).
    """

    repetition_idx: Tensor | None = None
    repetition_penalty: Tensor | None = None
    additive_idx: Tensor | None = None
    additive_delta: Tensor | None = None
    mask_idx: Tensor | None = None

    @property
    def is_empty(self) -> bool:
        return self.repetition_idx is None and self.additive_idx is None and self.mask_idx is None

    def apply_(self, logits: Tensor) -> Tensor:
        """Apply in place to contiguous float ``logits [bs, vocab]`` (the batch it was built for); returns it."""
        if self.is_empty:
            return logits
        assert logits.is_contiguous() and logits.dim() == 2
        flat = logits.view(-1)
        if self.repetition_idx is not None:
            assert self.repetition_penalty is not None
            v = flat.index_select(0, self.repetition_idx)
            p = self.repetition_penalty
            # duplicate indices compute identical values from the same original logit
            flat.index_put_((self.repetition_idx,), torch.where(v > 0, v / p, v * p))
        if self.additive_idx is not None:
            assert self.additive_delta is not None
            flat.index_add_(0, self.additive_idx, self.additive_delta)
        if self.mask_idx is not None:
            flat.index_fill_(0, self.mask_idx, float("-inf"))
        return logits


@dataclass(frozen=True, slots=True)
class BatchTokens:
    """The tokens of a batch's rows that the edits depend on (row i = request i).

    ``output_ids[i]``: generated so far; ``prompt_ids[i]``: the prompt (None: the repetition
    penalty sees the output only); ``eos_token_ids``: the model's EOS ids (masked while
    ``min_new_tokens`` is not reached). Tensors are built on ``device``."""

    output_ids: list[list[int]]
    prompt_ids: list[list[int]] | None
    vocab_size: int
    device: torch.device | str = "cpu"
    eos_token_ids: list[int] | None = None


@dataclass(slots=True)
class _RowScan:
    """What one pass over the rows finds: the rows of each penalty, and the flat bias / mask edits."""

    rep_rows: list[int] = field(default_factory=list)
    fp_rows: list[int] = field(default_factory=list)
    bias_idx: list[int] = field(default_factory=list)
    bias_val: list[float] = field(default_factory=list)
    mask_idx: list[int] = field(default_factory=list)


def build_logit_adjustments(params: list[SamplingParams], tokens: BatchTokens) -> LogitAdjustments:
    """Precompute the sparse logit edits of a batch (row i = ``params[i]``).

    Token ids outside ``[0, vocab_size)`` (e.g. an EOS id of a padded vocab) are ignored. Only rows
    that use a feature pay for it; a batch without penalties/bias/min-tokens costs one pass over
    ``params``.
    """
    scan = _scan_rows(params, tokens)
    device = tokens.device
    adj = LogitAdjustments()
    if scan.rep_rows:
        adj.repetition_idx, adj.repetition_penalty = _repetition_edits(params, scan.rep_rows, tokens)
    add_idx: list[Tensor] = []
    add_delta: list[Tensor] = []
    if scan.fp_rows:
        fp = _frequency_presence_edits(params, scan.fp_rows, tokens)
        if fp is not None:
            add_idx.append(fp[0])
            add_delta.append(fp[1])
    if scan.bias_idx:
        add_idx.append(torch.tensor(scan.bias_idx, dtype=torch.int64, device=device))
        add_delta.append(torch.tensor(scan.bias_val, dtype=torch.float32, device=device))
    if add_idx:
        adj.additive_idx = torch.cat(add_idx)
        adj.additive_delta = torch.cat(add_delta)
    if scan.mask_idx:
        adj.mask_idx = torch.tensor(scan.mask_idx, dtype=torch.int64, device=device)
    return adj


def _scan_rows(params: list[SamplingParams], tokens: BatchTokens) -> _RowScan:
    vocab_size = tokens.vocab_size
    eos = [t for t in (tokens.eos_token_ids or []) if 0 <= t < vocab_size]
    scan = _RowScan()
    for i, p in enumerate(params):
        out = tokens.output_ids[i]
        if p.repetition_penalty != 1.0:
            scan.rep_rows.append(i)
        if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and out:
            scan.fp_rows.append(i)
        if p.logit_bias:
            for tid, b in p.logit_bias_items():
                if 0 <= tid < vocab_size:
                    scan.bias_idx.append(i * vocab_size + tid)
                    scan.bias_val.append(b)
        if p.min_new_tokens > 0 and len(out) < p.min_new_tokens:
            banned = list(p.stop_token_ids or [])
            if not p.ignore_eos:
                banned += eos
            base = i * vocab_size
            scan.mask_idx.extend(base + t for t in banned if 0 <= t < vocab_size)
    return scan


def _repetition_edits(
    params: list[SamplingParams], rows: list[int], tokens: BatchTokens
) -> tuple[Tensor | None, Tensor | None]:
    """(flat indices, penalty per index) over each row's prompt + output tokens (None, None: none)."""
    prompts = tokens.prompt_ids
    seqs = [(prompts[i] if prompts is not None else []) + list(tokens.output_ids[i]) for i in rows]
    flat, which = _flat_indices(rows, seqs, tokens.vocab_size, tokens.device)
    if flat is None:
        return None, None
    penalty = torch.tensor([params[i].repetition_penalty for i in rows], dtype=torch.float32)
    return flat, penalty.to(tokens.device)[which]


def _frequency_presence_edits(
    params: list[SamplingParams], rows: list[int], tokens: BatchTokens
) -> tuple[Tensor, Tensor] | None:
    """(flat indices, additive deltas) of the frequency and presence penalties over each row's
    output tokens (each distinct token once, with its count)."""
    vocab_size, device = tokens.vocab_size, tokens.device
    flat, _ = _flat_indices(rows, [tokens.output_ids[i] for i in rows], vocab_size, device)
    if flat is None:
        return None
    uniq, counts = torch.unique(flat, return_counts=True)
    rows_of = uniq // vocab_size
    freq = torch.zeros(len(params), dtype=torch.float32, device=device)
    pres = torch.zeros(len(params), dtype=torch.float32, device=device)
    freq[rows] = torch.tensor([params[i].frequency_penalty for i in rows], device=device)
    pres[rows] = torch.tensor([params[i].presence_penalty for i in rows], device=device)
    return uniq, -(freq[rows_of] * counts.to(torch.float32) + pres[rows_of])


def _flat_indices(
    rows: list[int], seqs: list[list[int]], vocab_size: int, device: torch.device | str
) -> tuple[Tensor | None, Tensor]:
    """``row * vocab_size + token`` for every token of ``seqs[j]`` (row ``rows[j]``), dropping ids
    outside the vocab; also returns, per kept element, its position ``j`` in ``rows``."""
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
    tokens = torch.tensor(list(itertools.chain.from_iterable(seqs)), dtype=torch.int64)
    which = torch.repeat_interleave(torch.arange(len(rows), dtype=torch.int64), lengths)
    valid = (tokens >= 0) & (tokens < vocab_size)
    if not bool(valid.all()):
        tokens, which = tokens[valid], which[valid]
    if tokens.numel() == 0:
        return None, which
    row_ids = torch.tensor(rows, dtype=torch.int64)[which]
    flat = row_ids * vocab_size + tokens
    return flat.to(device), which.to(device)

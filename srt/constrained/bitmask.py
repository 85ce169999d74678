"""Token bitmasks: bit ``t % 32`` of word ``t // 32`` of a row says whether token ``t`` may be
sampled (1 = allowed), the layout llguidance and xgrammar both fill."""

from __future__ import annotations

import string

import torch
from torch import Tensor

_BITS = torch.arange(32, dtype=torch.int32)


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row for ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int) -> Tensor:
    """``[rows, bitmask_width(vocab_size)]`` int32, every token allowed."""
    return torch.full((rows, bitmask_width(vocab_size)), -1, dtype=torch.int32)


def unpack_bitmask(bitmask: Tensor, vocab_size: int) -> Tensor:
    """``[rows, vocab_size]`` bool: True where the token is allowed."""
    bits = (bitmask.unsqueeze(-1) >> _BITS.to(bitmask.device)) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask_(logits: Tensor, rows: Tensor, bitmask: Tensor) -> None:
    """``logits[rows[i], t] = -inf`` for every token ``t`` that ``bitmask[i]`` disallows (in place).

    ``logits [bs, vocab]`` float; ``rows [n]`` int64 row indices; ``bitmask [n, width]`` int32.
    Tokens past the mask's width (a vocabulary padded beyond the tokenizer's) are disallowed."""
    if rows.numel() == 0:
        return
    vocab = logits.shape[1]
    covered = min(vocab, bitmask.shape[1] * 32)
    allowed = unpack_bitmask(bitmask.to(logits.device), covered)
    sub = logits.index_select(0, rows)
    sub[:, :covered].masked_fill_(~allowed, float("-inf"))
    if covered < vocab:
        sub[:, covered:] = float("-inf")
    logits.index_copy_(0, rows, sub)


# characters that close JSON (and most grammars' nesting): a token made only of these (and spaces)
# moves an output toward its end
_CLOSING_CHARS = frozenset('"]})')
_PUNCTUATION = frozenset(string.punctuation)


def closing_token_bitmask(tokenizer, vocab_size: int, eos_token_ids: list[int]) -> Tensor:
    """``[4, width]`` int32 bitmasks of the tokens that bring an output to its end, best first:

    0. the EOS tokens;
    1. tokens of closing characters (``"``, ``]``, ``}``, ``)``, spaces) that start with ``"``
       (inside a JSON string the others are mere content: the string must close first);
    2. the other tokens of closing characters, e.g. ``]}``;
    3. tokens of ASCII punctuation only (``@``, ``.``, ``-``, ``:`` ...): the separators a regex or
       grammar moves on with, where a weak model would repeat letters or digits forever.

    See srt/managers/scheduler/grammar.py."""
    tiers = torch.zeros(4, vocab_size, dtype=torch.bool)
    texts = tokenizer.batch_decode([[i] for i in range(min(vocab_size, len(tokenizer)))])
    for i, text in enumerate(texts):
        stripped = text.replace(" ", "")
        if not stripped:
            continue
        if set(stripped) <= _CLOSING_CHARS:
            tiers[1 if stripped[0] == '"' else 2, i] = True
        elif set(stripped) <= _PUNCTUATION:
            tiers[3, i] = True
    for e in eos_token_ids:
        if 0 <= e < vocab_size:
            tiers[:, e] = False
            tiers[0, e] = True
    return pack_bitmask(tiers)


def pack_bitmask(allowed: Tensor) -> Tensor:
    """The inverse of `unpack_bitmask`: ``[rows, vocab]`` bool -> ``[rows, width]`` int32."""
    rows, vocab = allowed.shape
    width = bitmask_width(vocab)
    padded = torch.zeros(rows, width * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.to(torch.int64)
    words = (padded.view(rows, width, 32) << torch.arange(32, dtype=torch.int64)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)

"""Token embedding and LM head (weights ``[vocab, hidden]``; the head may share the embedding's)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from srt.layers.parameter import empty_param


class VocabEmbedding(nn.Module):
    """input_ids ``[T]`` (int64) -> ``[T, embedding_dim]``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = empty_param(num_embeddings, embedding_dim, dtype=dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class LMHead(nn.Module):
    """Output projection weight ``[vocab, hidden]``; applied by ``LogitsProcessor`` (through the
    model's ``LinearBackend``) only to the rows that need logits."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.weight = empty_param(vocab_size, hidden_size, dtype=dtype)

    def extra_repr(self) -> str:
        return f"{self.vocab_size}, {self.hidden_size}"

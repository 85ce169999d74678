"""Token embedding and LM head (weights ``[vocab, hidden]``; the head may share the embedding's).

Either may hold its weight as GGUF blocks (``load_quantized``, ``--quantization gguf``): the
embedding then dequantizes only the looked-up rows, and the LM head's matmul runs on the blocks
(``qweight``; see ``srt/layers/quantized_weight.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from srt.layers.parameter import empty_param
from srt.layers.quantized_weight import GGUFTensor, QuantizedWeight


class _VocabWeight(nn.Module):
    """A ``[vocab, hidden]`` weight, float32 (``weight``) or GGUF blocks (``qweight``)."""

    def __init__(self, num_rows: int, dim: int, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.weight = empty_param(num_rows, dim, dtype=dtype)
        self.qweight: QuantizedWeight | None = None

    def load_quantized(self, loaded: GGUFTensor, name: str = "weight") -> None:
        """Keep the weight as GGUF blocks; the float32 parameter becomes an empty placeholder."""
        rows, dim = self.weight.shape
        qweight = QuantizedWeight(rows, dim)
        qweight.add(0, loaded, name)
        qweight.finalize()
        self.qweight = qweight
        self.weight = empty_param(0, dim, dtype=self.weight.dtype)


class VocabEmbedding(_VocabWeight):
    """input_ids ``[T]`` (int64) -> ``[T, embedding_dim]``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim, dtype)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            return self.qweight.rows(input_ids)
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class LMHead(_VocabWeight):
    """Output projection weight ``[vocab, hidden]``; applied by ``LogitsProcessor`` (through the
    model's ``LinearBackend``, or on its GGUF blocks) only to the rows that need logits."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None) -> None:
        super().__init__(vocab_size, hidden_size, dtype)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size

    def extra_repr(self) -> str:
        return f"{self.vocab_size}, {self.hidden_size}"

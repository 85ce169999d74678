"""Token embedding and LM head (weights ``[vocab, hidden]``; the head may share the embedding's).

Either may hold its weight as GGUF blocks (``load_quantized``, ``--quantization gguf``): the
embedding then dequantizes only the looked-up rows, and the LM head's matmul runs on the blocks
(``qweight``; see ``srt/layers/quantized_weight.py``).

Tensor parallelism (``shard_vocab``, before loading): each rank holds the rows
``[vocab_start, vocab_start + rows)`` of the weight. The embedding looks up the ids in its range
(the others read row 0 and are zeroed) and all-reduces, so every rank gets every token's row;
the LM head's logits of the local rows are gathered by ``LogitsProcessor``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from srt.distributed.communication import TPInfo
from srt.layers.parameter import empty_param
from srt.layers.quantized_weight import GGUFTensor, QuantizedWeight


class _VocabWeight(nn.Module):
    """A ``[vocab, hidden]`` weight, float32 (``weight``) or GGUF blocks (``qweight``)."""

    def __init__(self, num_rows: int, dim: int, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.weight = empty_param(num_rows, dim, dtype=dtype)
        self.qweight: QuantizedWeight | None = None
        self.vocab_start = 0
        self.tp: TPInfo | None = None  # set by shard_vocab

    def shard_vocab(self, vocab_start: int, num_rows: int, tp: TPInfo) -> None:
        """Keep rows ``[vocab_start, vocab_start + num_rows)`` (re-created uninitialized)."""
        dim = self.weight.shape[1]
        self.weight = empty_param(num_rows, dim, dtype=self.weight.dtype).to(self.weight.device)
        self.vocab_start, self.tp = vocab_start, tp

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
        # a tied LM head packed by the native linear backend ([P, K, nr] panels: row n of the weight
        # is panels[n // nr, :, n % nr]); once set, the plain weight can be released
        self.packed_rows: torch.Tensor | None
        self.register_buffer("packed_rows", None, persistent=False)
        self.rows_dtype: torch.dtype | None = None  # set by store_bf16: the dtype rows come out in

    def store_bf16(self) -> None:
        """Keep a float32 table in bf16 (a bf16 checkpoint's values: exact), its looked-up rows
        widened back to float32: half the memory of the copy."""
        self.rows_dtype = self.weight.dtype
        self.weight = nn.Parameter(self.weight.detach().to(torch.bfloat16), requires_grad=False)

    def _panel_rows(self, panels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (1-D) of the weight packed in ``panels``: float32 ``[P, K, nr]`` (row n at
        ``panels[n // nr, :, n % nr]``) or bf16 VNNI pairs ``[P, K / 2, nr, 2]`` (row n at
        ``panels[n // nr, :, n % nr, :]``, flattened)."""
        nr = panels.shape[2]
        if panels.dim() == 3:
            return panels[ids // nr, :, ids % nr]
        return panels[ids // nr, :, ids % nr, :].reshape(ids.numel(), self.embedding_dim)

    def read_rows_from(self, panels: torch.Tensor) -> None:
        """Look rows up in ``panels`` (the tied LM head's packed form) from now on: they must hold
        exactly the plain weight's rows (checked), which the caller may then release."""
        rows, nr = self.weight.shape[0], panels.shape[2]
        dim = self.embedding_dim
        fits = (
            panels.shape[1] == dim if panels.dim() == 3 else panels.dim() == 4 and 2 * panels.shape[1] == dim
        )
        same = fits and panels.shape[0] * nr >= rows
        for start in range(0, rows, 8192):  # in chunks: no second full copy at load
            if not same:
                break
            ids = torch.arange(start, min(rows, start + 8192))
            got = self._panel_rows(panels, ids).to(self.weight.dtype)  # bf16 panels of float32 weights
            same = torch.equal(got, self.weight[start : start + ids.numel()])
        if not same:
            raise ValueError("the packed LM head does not hold the embedding's rows")
        self.packed_rows = panels

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            return self.qweight.rows(ids)
        if self.packed_rows is not None:
            rows = self._panel_rows(self.packed_rows, ids.reshape(-1)).to(self.weight.dtype)
            return rows.view(*ids.shape, self.embedding_dim)
        rows = F.embedding(ids, self.weight)
        return rows if self.rows_dtype is None else rows.to(self.rows_dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is not None:
            return self._parallel_forward(input_ids)
        return self._lookup(input_ids)

    def _parallel_forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Masked lookup of the local rows, then the sum over the ranks."""
        assert self.tp is not None
        rows = self.qweight.out_features if self.qweight is not None else self.weight.shape[0]
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= rows)
        local = local.masked_fill(outside, 0)
        out = self._lookup(local)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)

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

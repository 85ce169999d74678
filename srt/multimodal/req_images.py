"""The images of one request in the scheduler: prefix-cache keys, model ids, spans, M-RoPE.

The prefix cache keys a request by its token ids. An image's span holds one placeholder id
repeated, so two different images at the same place would share their KV; here each span is
keyed by the image's *pad id* instead, a negative number derived from its content hash (no
token id is negative, so a pad never matches text either)::

    origin_input_ids (the key)   ... 12 -7311 -7311 -7311 13 ...    same image: same key
    model ids (what is embedded)  ... 12  151655 151655 151655 13 ...

The model embeds the real ids and overwrites each span's rows with the image's embedding rows
(`ImageSpan`: rows ``src .. src + n`` of the image go to the step's token ``row``); an extend that
covers part of a span (chunked prefill, or a cached prefix that ends inside it) takes the rows
of that part, so one image may be split across chunks, unless the model attends within an image
both ways (``bidirectional``, Gemma 3): then a chunk ends before or after an image, never inside
(``whole_spans``; a cached prefix may still end inside one, its rows were computed whole). The
embedding is computed once, at the
first step that needs it, kept on the `ImageRun` until the step that consumes its last row, and
recomputed only if the request is retracted and prefills again.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from srt.multimodal.inputs import ImageInput, MultimodalInputs

_PAD_SPAN = 1 << 62


def pad_id(content_hash: int) -> int:
    """The (negative) prefix-cache id of an image's placeholder tokens."""
    return -1 - (content_hash % _PAD_SPAN)


class ImageRun:
    """One image of a request: its input, its span, its embedding while it is needed."""

    __slots__ = ("input", "offset", "length", "pad", "embedding", "bidirectional")

    def __init__(self, image: ImageInput, bidirectional: bool = False) -> None:
        self.input = image
        self.bidirectional = bidirectional  # its tokens attend to each other both ways
        self.offset = image.offset
        self.length = image.length
        self.pad = pad_id(image.hash)
        self.embedding: torch.Tensor | None = None  # [length, hidden] once computed

    def pixels(self) -> torch.Tensor:
        return torch.from_numpy(self.input.array().copy())

    @property
    def end(self) -> int:
        return self.offset + self.length


class ImageSpan(NamedTuple):
    """Rows ``src .. src + n`` of ``image``'s embedding replace the step's tokens ``row .. row + n``."""

    row: int
    image: ImageRun
    src: int
    n: int


class ReqImages:
    """The images of one request and what the scheduler derives from them (module docstring)."""

    __slots__ = ("images", "token_id", "mrope", "mrope_delta", "whole_spans")

    def __init__(self, mm: MultimodalInputs, prompt_len: int) -> None:
        self.images = [ImageRun(im, mm.bidirectional) for im in mm.images]
        self.token_id = mm.token_id
        arr = mm.mrope_array(prompt_len)
        self.mrope: torch.Tensor | None = None if arr is None else torch.from_numpy(arr.astype(np.int64))
        self.mrope_delta = mm.mrope_delta
        # the (start, end) sequence positions a prefill chunk may not cut (bidirectional images),
        # in order; empty when chunks may split images
        self.whole_spans = [(im.offset, im.end) for im in self.images if im.bidirectional]

    def key_ids(self, ids: list[int]) -> list[int]:
        """``ids`` (the prompt) with each image span holding the image's pad id."""
        out = list(ids)
        for im in self.images:
            out[im.offset : im.end] = [im.pad] * im.length
        return out

    def model_ids(self, ids: list[int]) -> list[int]:
        """Key ids back to token ids (pads -> the placeholder token)."""
        tok = self.token_id
        return [tok if t < 0 else t for t in ids]

    def spans(self, start: int, end: int, row: int) -> list[ImageSpan]:
        """The image rows an extend of sequence positions ``start .. end`` needs; its first token
        is the step's token ``row``."""
        out = []
        for im in self.images:
            lo, hi = max(start, im.offset), min(end, im.end)
            if lo < hi:
                out.append(ImageSpan(row + lo - start, im, lo - im.offset, hi - lo))
        return out

    def rope_positions(self, start: int, end: int) -> torch.Tensor:
        """int64 ``[3, end - start]`` M-RoPE positions of sequence positions ``start .. end``
        (past the prompt: the position plus the delta, in all three rows)."""
        assert self.mrope is not None
        n = self.mrope.shape[1]
        parts = [torch.empty(3, 0, dtype=torch.int64)]
        if start < n:
            parts.append(self.mrope[:, start : min(end, n)])
        if end > n:
            tail = torch.arange(max(start, n), end, dtype=torch.int64) + self.mrope_delta
            parts.append(tail.expand(3, -1))
        return torch.cat(parts, dim=1)

    def drop_embeddings(self) -> None:
        """Free every kept embedding (the request finished or was retracted)."""
        for im in self.images:
            im.embedding = None


def batch_image_inputs(batch: Any, device: str | torch.device = "cpu") -> dict[str, Any]:
    """ForwardBatch's ``image_spans`` (the extends' image rows) and ``mrope_positions``
    (``[3, tokens]`` on ``device``, when a sequence has M-RoPE positions; 1-D positions repeated
    for the others) of a ScheduleBatch-like ``batch`` (``reqs`` with ``images``, the first
    ``num_extend_reqs`` extending; sequence ``i`` runs positions ``prefix_lens[i] ..
    + extend_lens[i]``)."""
    images = [r.images for r in batch.reqs]
    num_extend, prefix_lens, extend_lens = batch.num_extend_reqs, batch.prefix_lens, batch.extend_lens
    spans: list[ImageSpan] = []
    rope: list[torch.Tensor] = []
    any_mrope = False
    row = 0
    for i, (im, p, e) in enumerate(zip(images, prefix_lens, extend_lens)):
        if im is not None and i < num_extend:
            spans.extend(im.spans(p, p + e, row))
        if im is not None and im.mrope is not None:
            rope.append(im.rope_positions(p, p + e))
            any_mrope = True
        else:
            rope.append(torch.arange(p, p + e, dtype=torch.int64).expand(3, -1))
        row += e
    out: dict[str, Any] = {}
    if spans:
        out["image_spans"] = spans
    if any_mrope:
        out["mrope_positions"] = torch.cat(rope, dim=1).to(device)
    return out

"""The image part of a request as it crosses from the tokenizer manager to the scheduler.

The tokenizer manager decodes each image, runs the model's own image processor (transformers')
on it and expands the prompt's placeholder token to the number of embedding rows the image
becomes; what travels is the pixel tensor as raw bytes (msgpack ``bin``, never a JSON list) and
where its rows go::

    input_ids   ... <start> P P P P P P <end> ...        P: the placeholder token, ``length`` times
                        offset ^                          (``ImageInput.offset`` .. offset + length)

A Gemma 3 request marks its images ``bidirectional``: the decoder's attention lets an image's
tokens see each other both ways (the rest stays causal), so chunked prefill never cuts an image.

A Qwen2-VL request also carries its M-RoPE positions (three rows: time, height, width) for the
whole prompt, and the delta that places generated tokens after them (srt/multimodal/mrope.py).
"""

from __future__ import annotations

import msgspec
import numpy as np


class ImageInput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One image of a prompt, preprocessed."""

    pixel_values: bytes  # the image processor's output, C order
    shape: list[int]
    dtype: str = "float32"
    offset: int  # index of its first placeholder token in input_ids
    length: int  # placeholder tokens = embedding rows the model makes of it
    hash: int  # content hash of the decoded pixels (the prefix cache tells images apart by it)
    grid_thw: list[int] = []  # Qwen2-VL: patches along time, height, width
    image_size: list[int] = []  # LLaVA-NeXT: the original (height, width), which sets its tiling

    @classmethod
    def of_array(cls, pixels: np.ndarray, **fields) -> ImageInput:
        arr = np.ascontiguousarray(pixels)
        return cls(pixel_values=arr.tobytes(), shape=list(arr.shape), dtype=str(arr.dtype), **fields)

    def array(self) -> np.ndarray:
        """The pixel tensor (a read-only view of the message's bytes)."""
        return np.frombuffer(self.pixel_values, dtype=np.dtype(self.dtype)).reshape(self.shape)


class MultimodalInputs(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The images of one prompt, in prompt order (their spans never overlap)."""

    images: list[ImageInput]
    token_id: int  # the placeholder token every image span holds
    mrope_positions: bytes = b""  # int32 [3, len(input_ids)] (Qwen2-VL); empty: 1-D positions
    mrope_delta: int = 0  # a sequence position p past the prompt rotates as p + mrope_delta
    bidirectional: bool = False  # each image's tokens attend to each other both ways (Gemma 3)

    def mrope_array(self, n: int) -> np.ndarray | None:
        if not self.mrope_positions:
            return None
        return np.frombuffer(self.mrope_positions, dtype=np.int32).reshape(3, n)

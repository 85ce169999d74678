"""Image prompts in the tokenizer manager: the model's image processor and placeholder expansion.

A prompt names each image with one placeholder token (the chat template writes it for an image
part; a /generate prompt writes it itself): ``<|image_pad|>`` for Qwen2-VL / Qwen2.5-VL (inside
``<|vision_start|> ... <|vision_end|>``), ``<image>`` for LLaVA. `ImagePromptProcessor.expand`
runs transformers' image processor of the checkpoint (``preprocessor_config.json``; no resizing
or normalising of srt's own) on each image, and repeats its placeholder as many times as the
model makes embedding rows of it:

    qwen2_vl, qwen2_5_vl  (t * h * w patches) / merge_size**2          (dynamic resolution)
    llava                 (crop / patch)**2, +1 with the "full" strategy on a CLS tower
    llava_next            the base crop's rows + the tiled grid's unpadded rows, one newline
                          row per grid row (the anyres packing of srt/models/llava.py)

A family is chosen by the config's ``model_type``; `create_image_processor` returns None for a
text-only model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from srt.multimodal.inputs import ImageInput, MultimodalInputs
from srt.multimodal.mrope import mrope_positions
from srt.utils.errors import RequestError

VISION_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "llava", "llava_next")


class ImagePromptProcessor:
    """One family's expansion (module docstring); subclasses give ``preprocess``."""

    def __init__(self, model_path: str, hf_config: Any, tokenizer: Any) -> None:
        from transformers import AutoImageProcessor

        self.config = hf_config
        self.image_processor = AutoImageProcessor.from_pretrained(model_path)
        self.token_id = int(image_token_id(hf_config))
        self.placeholder = tokenizer.convert_ids_to_tokens(self.token_id) if tokenizer is not None else ""

    def preprocess(self, image: Any) -> tuple[np.ndarray, int, dict[str, Any]]:
        """``(pixel tensor, embedding rows, extra ImageInput fields)`` of one RGB image."""
        raise NotImplementedError

    def _run(self, image: Any) -> dict[str, Any]:
        try:
            return dict(self.image_processor(images=[image], return_tensors="np"))
        except Exception as e:  # the processor's own checks (e.g. too small to resize)
            w, h = image.size
            raise RequestError(f"the model's image processor rejected a {w}x{h} image: {e}") from None

    def expand(
        self, ids: Sequence[int], images: Sequence[Any], hashes: Sequence[int], params: Sequence[str] = ()
    ) -> tuple[list[int], MultimodalInputs]:
        """``ids`` with each placeholder repeated for its image, and the images' inputs.
        `RequestError` when the placeholders and the images do not pair up one to one."""
        where = [i for i, t in enumerate(ids) if t == self.token_id]
        if len(where) != len(images):
            raise RequestError(
                f"the prompt has {len(where)} image placeholder(s) ({self.placeholder!r}, token id "
                f"{self.token_id}) for {len(images)} image(s): one placeholder per image",
                param="image_data",
            )
        out: list[int] = []
        items: list[ImageInput] = []
        prev = 0
        for k, (pos, image, h) in enumerate(zip(where, images, hashes)):
            try:
                pixels, rows, extra = self.preprocess(image)
            except RequestError as e:  # name the image
                raise RequestError(
                    str(e), param=params[k] if k < len(params) else f"image_data[{k}]"
                ) from None
            out.extend(ids[prev:pos])
            items.append(ImageInput.of_array(pixels, offset=len(out), length=rows, hash=h, **extra))
            out.extend([self.token_id] * rows)
            prev = pos + 1
        out.extend(ids[prev:])
        return out, self.finish(out, items)

    def finish(self, ids: list[int], items: list[ImageInput]) -> MultimodalInputs:
        return MultimodalInputs(images=items, token_id=self.token_id)


class QwenVLProcessor(ImagePromptProcessor):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.merge = int(self.config.vision_config.spatial_merge_size)

    def preprocess(self, image: Any) -> tuple[np.ndarray, int, dict[str, Any]]:
        out = self._run(image)
        grid = [int(v) for v in out["image_grid_thw"][0]]
        rows = grid[0] * grid[1] * grid[2] // self.merge**2
        return out["pixel_values"].astype(np.float32), rows, {"grid_thw": grid}

    def finish(self, ids: list[int], items: list[ImageInput]) -> MultimodalInputs:
        spans = [(it.offset, it.length, tuple(it.grid_thw)) for it in items]
        pos, delta = mrope_positions(len(ids), spans, self.merge)
        return MultimodalInputs(
            images=items, token_id=self.token_id, mrope_positions=pos.tobytes(), mrope_delta=delta
        )


class LlavaProcessor(ImagePromptProcessor):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        vc = self.config.vision_config
        self.patch = int(vc.patch_size)
        # CLIP's tower prepends a CLS row; "default" drops the first row, "full" keeps all
        self.cls = 1 if vc.model_type.startswith("clip") else 0
        self.drop = 1 if getattr(self.config, "vision_feature_select_strategy", "default") == "default" else 0

    def preprocess(self, image: Any) -> tuple[np.ndarray, int, dict[str, Any]]:
        pixels = self._run(image)["pixel_values"].astype(np.float32)  # [1, 3, H, W]
        rows = (pixels.shape[-2] // self.patch) * (pixels.shape[-1] // self.patch) + self.cls - self.drop
        return pixels[0], rows, {}


class LlavaNextProcessor(LlavaProcessor):
    def preprocess(self, image: Any) -> tuple[np.ndarray, int, dict[str, Any]]:
        out = self._run(image)
        pixels = out["pixel_values"][0].astype(np.float32)  # [tiles, 3, S, S]
        height, width = (int(v) for v in out["image_sizes"][0])
        tile = int(self.config.vision_config.image_size)
        side = tile // self.patch  # rows/cols of one tile's features
        base = side * side + self.cls - self.drop
        gh, gw = anyres_grid((height, width), self.config.image_grid_pinpoints, tile)
        h, w = unpadded_shape(height, width, gh * side, gw * side)
        return pixels, base + h * w + h, {"image_size": [height, width]}


def anyres_grid(size: tuple[int, int], pinpoints: Sequence[Sequence[int]], tile: int) -> tuple[int, int]:
    """The (rows, cols) of tiles LLaVA-NeXT cuts an image of ``size`` (height, width) into: the
    pinpoint resolution that keeps the most of its pixels at the smallest waste."""
    height, width = size
    best, best_eff, best_waste = None, -1, math.inf
    for ph, pw in pinpoints:
        scale = min(pw / width, ph / height)
        eff = min(int(width * scale) * int(height * scale), width * height)
        waste = ph * pw - eff
        if eff > best_eff or (eff == best_eff and waste < best_waste):
            best, best_eff, best_waste = (ph, pw), eff, waste
    assert best is not None, "image_grid_pinpoints is empty"
    return best[0] // tile, best[1] // tile


def unpadded_shape(height: int, width: int, rows: int, cols: int) -> tuple[int, int]:
    """The feature grid ``rows x cols`` without the padding the resize to the pinpoint added
    (the image keeps its aspect ratio inside the grid, centred)."""
    if width / height > cols / rows:
        new = int(round(height * (cols / width), 7))
        return rows - 2 * ((rows - new) // 2), cols
    new = int(round(width * (rows / height), 7))
    return rows, cols - 2 * ((cols - new) // 2)


def image_token_id(hf_config: Any) -> int:
    for key in ("image_token_id", "image_token_index"):
        value = getattr(hf_config, key, None)
        if value is not None:
            return int(value)
    raise RequestError(f"{hf_config.model_type}: the config names no image token")


_FAMILIES = {
    "qwen2_vl": QwenVLProcessor,
    "qwen2_5_vl": QwenVLProcessor,
    "llava": LlavaProcessor,
    "llava_next": LlavaNextProcessor,
}


def create_image_processor(model_path: str, hf_config: Any, tokenizer: Any) -> ImagePromptProcessor | None:
    """The family's processor, or None for a model that takes no images."""
    cls = _FAMILIES.get(getattr(hf_config, "model_type", ""))
    return cls(model_path, hf_config, tokenizer) if cls is not None else None

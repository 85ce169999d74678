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
    gemma3                ``mm_tokens_per_image`` (256), between ``<start_of_image>`` (the
                          prompt's placeholder) and ``<end_of_image>``, a blank line either side

Gemma 3's processor in transformers expands its placeholder in the text, before tokenizing
(``expand_text``, so a newline beside it merges as its tokenizer merges them); prompts given as
ids are expanded here with the ids of ``"\n\n"``. Its images are ``bidirectional``.

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
from srt.utils.errors import ConfigError, RequestError

VISION_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "llava", "llava_next", "gemma3")


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

    def expand_text(self, text: str) -> str:
        """A prompt's text before it is tokenized (Gemma 3 expands its placeholders here)."""
        return text

    def splice(self, ids: Sequence[int], pos: int, rows: int, out: list[int]) -> tuple[int, int]:
        """Append the image tokens of the placeholder at ``ids[pos]`` to ``out``; returns the
        offset of the image's rows in ``out`` and where the rest of ``ids`` resumes."""
        out.extend([self.token_id] * rows)
        return len(out) - rows, pos + 1

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
            offset, prev = self.splice(ids, pos, rows, out)
            items.append(ImageInput.of_array(pixels, offset=offset, length=rows, hash=h, **extra))
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


class Gemma3Processor(ImagePromptProcessor):
    def __init__(self, model_path: str, hf_config: Any, tokenizer: Any) -> None:
        super().__init__(model_path, hf_config, tokenizer)
        if getattr(self.image_processor, "do_pan_and_scan", False):
            raise ConfigError("Gemma 3 with do_pan_and_scan (images cut into crops) is not supported")
        self.soft_id = self.token_id  # the rows' token; the prompt names an image by boi
        self.boi, self.eoi = int(hf_config.boi_token_index), int(hf_config.eoi_token_index)
        self.rows = int(hf_config.mm_tokens_per_image)
        self.token_id = self.boi
        self.newlines: list[int] = []
        self.full_text = ""
        if tokenizer is not None:
            boi, soft, eoi = tokenizer.convert_ids_to_tokens([self.boi, self.soft_id, self.eoi])
            self.placeholder = boi
            self.newlines = list(tokenizer.encode("\n\n", add_special_tokens=False))
            self.full_text = f"\n\n{boi}{soft * self.rows}{eoi}\n\n"

    def preprocess(self, image: Any) -> tuple[np.ndarray, int, dict[str, Any]]:
        pixels = self._run(image)["pixel_values"].astype(np.float32)  # [1, 3, S, S]
        return pixels[0], self.rows, {}

    def expand_text(self, text: str) -> str:
        return text.replace(self.placeholder, self.full_text) if self.full_text else text

    def splice(self, ids: Sequence[int], pos: int, rows: int, out: list[int]) -> tuple[int, int]:
        end = pos + 1 + rows
        if list(ids[pos + 1 : end]) == [self.soft_id] * rows and end < len(ids) and ids[end] == self.eoi:
            start = len(out) + 1
            out.extend(ids[pos : end + 1])  # expanded in the text already
            return start, end + 1
        out.extend([*self.newlines, self.boi])
        start = len(out)
        out.extend([self.soft_id] * rows + [self.eoi] + self.newlines)
        return start, pos + 1

    def finish(self, ids: list[int], items: list[ImageInput]) -> MultimodalInputs:
        return MultimodalInputs(images=items, token_id=self.soft_id, bidirectional=True)


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
    "gemma3": Gemma3Processor,
}


def create_image_processor(model_path: str, hf_config: Any, tokenizer: Any) -> ImagePromptProcessor | None:
    """The family's processor, or None for a model that takes no images."""
    cls = _FAMILIES.get(getattr(hf_config, "model_type", ""))
    return cls(model_path, hf_config, tokenizer) if cls is not None else None

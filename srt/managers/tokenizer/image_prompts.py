"""Images of a prompt, in the tokenizer manager: load, check, preprocess, expand.

    SingleInput.image_data (data: URIs, http(s) URLs, base64, bytes; srt/multimodal/image_io.py)
        --load_images-------> decoded RGB images (fetched concurrently, limits checked)
        --image_hash--------> each image's content hash (the prefix cache's key for its span)
        --processor.expand--> the prompt with each placeholder repeated, the pixel tensors
                              (srt/multimodal/processor.py; in a worker thread)

Every failure is a `RequestError` (HTTP 400) naming the image: a model that takes no images, too
many images, an image that cannot be fetched or decoded, placeholders that do not pair up with
the images.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Sequence
from typing import Any

from srt.configs.gguf_header import model_config_dict
from srt.multimodal.image_io import ImageLimits, image_hash, load_images
from srt.multimodal.inputs import MultimodalInputs
from srt.multimodal.processor import VISION_MODEL_TYPES, ImagePromptProcessor, create_image_processor
from srt.utils.errors import RequestError
from srt.utils.model_path import resolve_model_path


class ImagePrompts:
    def __init__(self, processor: ImagePromptProcessor | None, limits: ImageLimits, model: str) -> None:
        self.processor = processor  # None: the model takes no images
        self.limits = limits  # what load_images checks, --max-images-per-request included
        self.model = model  # the architecture, for the refusal of a text-only model

    async def expand(
        self, ids: list[int], image_data: Sequence[Any] | None, params: Sequence[str] | None
    ) -> tuple[list[int], MultimodalInputs | None]:
        """``(ids, None)`` for a prompt without images, else the expanded ids and the images."""
        if not image_data:
            if self.processor is not None and self.processor.token_id in ids:
                raise RequestError(
                    f"the prompt holds the image placeholder {self.processor.placeholder!r} but no image "
                    "was given (image_data, or an image_url content part)",
                    param="image_data",
                )
            return ids, None
        names = list(params) if params else [f"image_data[{i}]" for i in range(len(image_data))]
        if self.processor is None:
            raise RequestError(f"this model ({self.model}) takes no image input", param=names[0])
        images = await load_images(list(image_data), self.limits, names)
        return await asyncio.to_thread(self._expand, ids, images, names)

    def _expand(
        self, ids: list[int], images: list[Any], names: list[str]
    ) -> tuple[list[int], MultimodalInputs]:
        # (in a worker thread: hashing and preprocessing read every pixel)
        assert self.processor is not None
        return self.processor.expand(ids, images, [image_hash(im) for im in images], names)


def image_prompts(server_args: Any, tokenizer: Any) -> ImagePrompts:
    """The `ImagePrompts` of the served model: with its image processor when it is a
    vision-language model (srt/multimodal/processor.py), else one that refuses images."""
    path = resolve_model_path(server_args.model_path)
    config = model_config_dict(path)
    arch = (config.get("architectures") or ["a text-only model"])[0]
    processor = None
    if config.get("model_type") in VISION_MODEL_TYPES:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(path, trust_remote_code=server_args.trust_remote_code)
        processor = create_image_processor(path, hf_config, tokenizer)
        _adopt_processor_template(path, tokenizer)
    limits = ImageLimits.from_args(server_args)
    return ImagePrompts(processor, limits, arch)


def _adopt_processor_template(path: str, tokenizer: Any) -> None:
    """A VLM checkpoint may keep its chat template with the processor (chat_template.json)
    rather than the tokenizer: the tokenizer takes it when it has none of its own."""
    file = os.path.join(path, "chat_template.json")
    if tokenizer is None or getattr(tokenizer, "chat_template", None) or not os.path.isfile(file):
        return
    with open(file) as f:
        template = json.load(f).get("chat_template")
    if template:
        tokenizer.chat_template = template

"""Gemma 3 with its vision tower (``Gemma3ForConditionalGeneration``: the 4B / 12B / 27B
checkpoints): the Gemma 3 decoder (gemma3.py), a SigLIP tower and transformers' projector.

An image, resized by the image processor to the tower's square (no pan-and-scan), becomes the
tower's patch rows, average-pooled to ``mm_tokens_per_image`` rows (256 in the released
checkpoints), normed and projected to the decoder's width. The prompt holds them between
``<start_of_image>`` and ``<end_of_image>`` (srt/multimodal/processor.py expands the placeholder).

Two things differ from the other VLMs here:

* the decoder scales its token embeddings by ``sqrt(hidden_size)``; image rows go in unscaled
  (``embed_text`` scales only the text);
* an image's tokens attend to each other both ways, on every layer (the rest stays causal; the
  sliding window still applies): the processor marks the images ``bidirectional``, the
  scheduler never cuts one across prefill chunks and the attention backend opens the blocks
  (srt/layers/attention/image_blocks.py). A backend that cannot (FlashInfer) is refused at start.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from srt.models.gemma3 import Gemma3ForCausalLM
from srt.models.vision_common import (
    VisionLanguageMixin,
    decoder_config,
    srt_tower,
    tower_level_names,
)

if TYPE_CHECKING:
    from srt.layers.linear_backend import LinearBackend
    from srt.multimodal.req_images import ImageRun


class Gemma3ForConditionalGeneration(VisionLanguageMixin, Gemma3ForCausalLM):
    vision_attrs = ("vision_tower", "multi_modal_projector")
    bidirectional_images = True  # the attention backend must support image blocks

    def __init__(
        self, config: Any, dtype: torch.dtype = torch.float32, linear_backend: LinearBackend | None = None
    ) -> None:
        from transformers import AutoModel
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        super().__init__(decoder_config(config), dtype, linear_backend)
        vc = config.vision_config
        vc._attn_implementation = "sdpa"
        tower = AutoModel.from_config(vc).to(dtype)
        self.vision_tower = srt_tower(tower, dtype, linear_backend)
        self.multi_modal_projector = Gemma3MultiModalProjector(config).to(dtype).eval()

    def embed_text(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids) * self.model.normalizer

    def encode_images(self, images: list[ImageRun]) -> Sequence[torch.Tensor]:
        pixels = torch.stack([im.pixels() for im in images]).to(self.vision_device(), self.dtype)
        with torch.no_grad():
            patches = self.vision_tower(pixel_values=pixels).last_hidden_state
            return list(self.multi_modal_projector(patches).unbind(0))

    def _load_vision(self, tensors: dict[str, torch.Tensor]) -> None:
        super()._load_vision(tower_level_names(tensors, self.state_dict()))

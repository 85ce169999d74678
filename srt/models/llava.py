"""LLaVA-1.5 and LLaVA-NeXT: a CLIP or SigLIP tower and a projector over a Llama / Mistral / Qwen2
decoder (``text_config.model_type`` chooses it).

LLaVA-1.5: the image processor crops the image to the tower's square; the tower's hidden states
of ``vision_feature_layer`` (a list: concatenated), without the CLS row under the "default"
strategy, go through the projector (linear, GELU, linear): one row per patch.

LLaVA-NeXT ("anyres"): the processor also cuts the image, resized to the best of
``image_grid_pinpoints``, into tower-sized tiles. The base crop's rows come first; the tiles'
rows are laid out as one grid, the padding the resize added is cut off, and a learned
``image_newline`` row closes every grid row (srt/multimodal/processor.py counts the same rows).

The towers are transformers' (``CLIPVisionModel`` / ``SiglipVisionModel``); checkpoint names
``vision_tower.vision_model.*`` (the Hub's) and ``vision_tower.*`` (transformers 5's) both load.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from srt.models.llama import LlamaForCausalLM, MistralForCausalLM
from srt.models.qwen2 import Qwen2ForCausalLM
from srt.models.vision_common import (
    VisionLanguageMixin,
    decoder_config,
    srt_tower,
    tower_level_names,
    use_srt_linears,
)
from srt.multimodal.processor import anyres_grid, unpadded_shape
from srt.utils.errors import UnsupportedModelError

if TYPE_CHECKING:
    from srt.layers.linear_backend import LinearBackend
    from srt.multimodal.req_images import ImageRun

_DECODERS: dict[str, type] = {
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "qwen2": Qwen2ForCausalLM,
}


class LlavaImages(VisionLanguageMixin):
    """The LLaVA-1.5 image side (module docstring), mixed into a decoder class."""

    vision_attrs = ("vision_tower", "multi_modal_projector")

    def __init__(
        self, config: Any, dtype: torch.dtype = torch.float32, linear_backend: LinearBackend | None = None
    ) -> None:
        from transformers import AutoModel

        super().__init__(decoder_config(config), dtype, linear_backend)
        self.vl_config = config
        vc = config.vision_config
        vc._attn_implementation = "sdpa"
        tower, projector = AutoModel.from_config(vc).to(dtype), self.projector_class()(config).to(dtype)
        self.vision_tower = srt_tower(tower, dtype, linear_backend)
        self.multi_modal_projector = use_srt_linears(projector, dtype, linear_backend)
        layer = config.vision_feature_layer
        self.feature_layers = list(layer) if isinstance(layer, (list, tuple)) else [layer]
        self.drop_cls = config.vision_feature_select_strategy == "default"

    @staticmethod
    def projector_class() -> type:
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        return LlavaMultiModalProjector

    def tile_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[tiles, 3, S, S]`` -> ``[tiles, rows, hidden]`` (tower, feature layers, projector)."""
        with torch.no_grad():
            out = self.vision_tower(pixels.to(self.dtype), output_hidden_states=True)
            layers = [out.hidden_states[i] for i in self.feature_layers]
            if self.drop_cls:
                layers = [h[:, 1:] for h in layers]
            return self.multi_modal_projector(torch.cat(layers, dim=-1))

    def encode_images(self, images: list[ImageRun]) -> Sequence[torch.Tensor]:
        device = self.vision_device()
        pixels = torch.stack([im.pixels() for im in images]).to(device)
        return list(self.tile_features(pixels).unbind(0))

    def _load_vision(self, tensors: dict[str, torch.Tensor]) -> None:
        super()._load_vision(tower_level_names(tensors, self.state_dict()))


class LlavaNextImages(LlavaImages):
    """LLaVA-NeXT's anyres image side (module docstring)."""

    vision_attrs = ("vision_tower", "multi_modal_projector", "image_newline")

    def __init__(self, config: Any, *args: Any) -> None:
        super().__init__(config, *args)
        if not self.drop_cls:
            raise UnsupportedModelError(
                "LLaVA-NeXT with vision_feature_select_strategy 'full' is not supported"
            )
        hidden = config.get_text_config().hidden_size
        self.image_newline = nn.Parameter(torch.zeros(hidden, dtype=self.dtype), requires_grad=False)
        self.tile = int(config.vision_config.image_size)
        self.side = self.tile // int(config.vision_config.patch_size)

    @staticmethod
    def projector_class() -> type:
        from transformers.models.llava_next.modeling_llava_next import LlavaNextMultiModalProjector

        return LlavaNextMultiModalProjector

    def encode_images(self, images: list[ImageRun]) -> Sequence[torch.Tensor]:
        device = self.vision_device()
        tiles = [im.pixels() for im in images]
        feats = self.tile_features(torch.cat(tiles).to(device)).split([t.shape[0] for t in tiles])
        return [self._pack(f, im.input.image_size) for f, im in zip(feats, images)]

    def _pack(self, feats: torch.Tensor, size: list[int]) -> torch.Tensor:
        """One image's tiles' rows ``[tiles, side*side, hidden]`` -> its embedding rows."""
        base, rest = feats[0], feats[1:]
        gh, gw = anyres_grid((size[0], size[1]), self.vl_config.image_grid_pinpoints, self.tile)
        s = self.side
        grid = rest[: gh * gw].view(gh, gw, s, s, -1).permute(0, 2, 1, 3, 4).reshape(gh * s, gw * s, -1)
        h, w = unpadded_shape(size[0], size[1], gh * s, gw * s)
        top, left = (gh * s - h) // 2, (gw * s - w) // 2
        grid = grid[top : top + h, left : left + w]
        newline = self.image_newline.to(grid.dtype).view(1, 1, -1).expand(h, 1, -1)
        rows = torch.cat([grid, newline], dim=1).reshape(h * (w + 1), base.shape[-1])  # (h may be 0)
        return torch.cat([base, rows])


@cache
def _vlm_class(images: type, decoder: type) -> type:
    return type(f"{images.__name__}{decoder.__name__}", (images, decoder), {})


def _build(
    images: type, config: Any, dtype: torch.dtype = torch.float32, linear_backend: Any = None
) -> nn.Module:
    kind = config.get_text_config().model_type
    decoder = _DECODERS.get(kind)
    if decoder is None:
        raise UnsupportedModelError(
            f"{config.architectures[0]} over a {kind!r} decoder is not supported "
            f"(decoders: {', '.join(sorted(_DECODERS))})"
        )
    return _vlm_class(images, decoder)(config, dtype, linear_backend)


def LlavaForConditionalGeneration(
    config: Any, dtype: torch.dtype = torch.float32, linear_backend: Any = None
):  # noqa: N802
    """LLaVA-1.5 over the decoder its ``text_config`` names."""
    return _build(LlavaImages, config, dtype, linear_backend)


def LlavaNextForConditionalGeneration(  # noqa: N802
    config: Any, dtype: torch.dtype = torch.float32, linear_backend: Any = None
):
    """LLaVA-NeXT over the decoder its ``text_config`` names."""
    return _build(LlavaNextImages, config, dtype, linear_backend)

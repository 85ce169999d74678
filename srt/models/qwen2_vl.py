"""Qwen2-VL and Qwen2.5-VL: the Qwen2 decoder with M-RoPE, and a dynamic-resolution vision tower.

An image becomes ``t x h x w`` patches of 14 pixels (the image processor resizes it to multiples
of 28 within its pixel bounds), the tower (transformers' ``Qwen2VisionTransformerPretrainedModel``;
Qwen2.5-VL's adds window attention, RMSNorm and a SwiGLU MLP) attends within each image and
merges 2x2 patches into one row of the decoder's width. Several images of a step go through the
tower in one call (it separates them by their patch counts). The decoder rotates by three
position rows (srt/layers/mrope.py, srt/multimodal/mrope.py).

Checkpoint names: ``visual.*`` and ``model.*`` / ``lm_head.*`` (the Hub's layout), or
transformers 5's ``model.visual.*`` / ``model.language_model.*``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from srt.layers.mrope import MRotaryEmbedding
from srt.models.llama import head_dim_of
from srt.models.qwen2 import Qwen2ForCausalLM
from srt.models.vision_common import VisionLanguageMixin, decoder_config, srt_tower
from srt.models.vision_layers import use_rope_vision_attention

if TYPE_CHECKING:
    from srt.layers.forward_batch import ForwardBatch
    from srt.layers.linear_backend import LinearBackend
    from srt.multimodal.req_images import ImageRun


def _mrope_decoder_config(config: Any) -> tuple[Any, list[int]]:
    """The decoder config with a plain rope (the M-RoPE keys taken out) and ``mrope_section``."""
    text = decoder_config(config)
    params = dict(getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {})
    sections = params.pop("mrope_section", None)
    if sections is None:
        raise ValueError(f"{config.model_type}: the config has no mrope_section")
    theta = float(params.get("rope_theta", getattr(text, "rope_theta", 10000.0)))
    if "rope_scaling" in vars(text):  # transformers 4's attribute (5's is an alias of rope_parameters)
        text.rope_scaling = None
    text.rope_parameters = {"rope_type": "default", "rope_theta": theta}
    text.rope_theta = theta
    return text, list(sections)


def _hf_vision(model_type: str) -> tuple[Any, type, type | None]:
    """transformers' module of the type's tower, the tower class, and its attention class (None
    where this transformers release names it otherwise)."""
    if model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as hf

        return hf, hf.Qwen2_5_VisionTransformerPretrainedModel, getattr(hf, "Qwen2_5_VLVisionAttention", None)
    from transformers.models.qwen2_vl import modeling_qwen2_vl as hf

    return hf, hf.Qwen2VisionTransformerPretrainedModel, getattr(hf, "VisionAttention", None)


def transformers_tower(vision_config: Any, model_type: str) -> torch.nn.Module:
    """transformers' tower as it ships (SDPA attention)."""
    vision_config._attn_implementation = "sdpa"
    return _hf_vision(model_type)[1]._from_config(vision_config)


def _tower(vision_config: Any, model_type: str) -> torch.nn.Module:
    """transformers' tower with srt's rope attention in place of its vision attention."""
    hf, _, attention_cls = _hf_vision(model_type)
    tower = transformers_tower(vision_config, model_type)
    return use_rope_vision_attention(tower, attention_cls, getattr(hf, "apply_rotary_pos_emb_vision", None))


class Qwen2VLForConditionalGeneration(VisionLanguageMixin, Qwen2ForCausalLM):
    vision_attrs = ("visual",)

    def __init__(
        self, config: Any, dtype: torch.dtype = torch.float32, linear_backend: LinearBackend | None = None
    ) -> None:
        text, sections = _mrope_decoder_config(config)
        super().__init__(text, dtype, linear_backend)
        self.vl_config = config
        rope = MRotaryEmbedding(head_dim_of(text), text, sections)
        self.model.rotary_emb = rope
        for layer in self.model.layers:
            layer.self_attn.rotary_emb = rope
        tower = _tower(config.vision_config, config.model_type).to(dtype)
        self.visual = srt_tower(tower, dtype, linear_backend)

    def encode_images(self, images: list[ImageRun]) -> Sequence[torch.Tensor]:
        """Each image's embedding rows ``[length, hidden]``, from one tower call."""
        device = self.vision_device()
        pixels = torch.cat([im.pixels() for im in images]).to(device=device, dtype=self.dtype)
        grid = torch.tensor([im.input.grid_thw for im in images], dtype=torch.int64, device=device)
        with torch.no_grad():
            out = self.visual(pixels, grid_thw=grid)
        merged = out.pooler_output if hasattr(out, "pooler_output") else out
        return merged.split([im.length for im in images])

    def rope_positions(self, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        """``[3, T]`` for a step with an image request's extend; a DECODE step's rows are equal
        (the plain rope, native paths included), so it takes one."""
        mrope = forward_batch.mrope_positions
        if mrope is None:
            return positions
        return mrope if forward_batch.forward_mode.is_extend() else mrope[0]


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    pass

"""Model classes by HF ``architectures`` name, imported lazily (only the one in use is loaded).

Every model class is built as ``Class(hf_config, dtype, linear_backend)`` and offers
``forward(input_ids, positions, forward_batch) -> LogitsProcessorOutput`` and
``load_weights(iterable of (hf_name, tensor))``. To add an architecture: a module under
``srt/models/`` and one entry in ``_MODELS``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from srt.utils.errors import UnsupportedModelError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from srt.layers.linear_backend import LinearBackend

# HF architectures name -> (module under srt.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    # vision-language models (images in, text out; srt/models/vision_common.py)
    "Qwen2VLForConditionalGeneration": ("qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_vl", "Qwen2_5_VLForConditionalGeneration"),
    "LlavaForConditionalGeneration": ("llava", "LlavaForConditionalGeneration"),
    "LlavaNextForConditionalGeneration": ("llava", "LlavaNextForConditionalGeneration"),
    "Gemma3ForConditionalGeneration": ("gemma3_vl", "Gemma3ForConditionalGeneration"),
}


class ModelClass(Protocol):
    """The constructor every registered model class has."""

    def __call__(
        self, config: PretrainedConfig, dtype: torch.dtype, linear_backend: LinearBackend | None = None
    ) -> nn.Module: ...


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> ModelClass:
    """The srt model class for an HF ``architectures`` entry."""
    entry = _MODELS.get(architecture)
    if entry is None:
        raise UnsupportedModelError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(supported_architectures())}."
        )
    module = importlib.import_module(f"srt.models.{entry[0]}")
    return getattr(module, entry[1])

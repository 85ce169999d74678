"""Model classes by HF ``architectures`` name, imported lazily (only the one in use is loaded)."""

from __future__ import annotations

import importlib

from torch import nn

# HF architectures name -> (module under srt.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
}


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture has no srt implementation."""


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type[nn.Module]:
    """The srt model class for an HF ``architectures`` entry."""
    entry = _MODELS.get(architecture)
    if entry is None:
        raise UnsupportedModelError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(supported_architectures())}."
        )
    module = importlib.import_module(f"srt.models.{entry[0]}")
    return getattr(module, entry[1])

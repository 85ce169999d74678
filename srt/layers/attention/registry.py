"""Attention backends by name, imported lazily.

``create_attention_backend(name, model_runner)`` imports the backend's module only when that
backend is asked for, so a CPU install never imports flashinfer (or any GPU-only package).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from srt.layers.attention.base import AttentionBackend

# name -> "module:ClassName"; the class is constructed as Class(model_runner)
_BACKENDS: dict[str, str] = {
    "torch_native": "srt.layers.attention.torch_native:TorchNativeAttnBackend",
    "flashinfer": "srt.layers.attention.flashinfer_backend:FlashInferAttnBackend",
}


class UnknownAttentionBackendError(ValueError):
    pass


def available_attention_backends() -> list[str]:
    """Registered names (whether each one can be imported on this install is not checked)."""
    return sorted(_BACKENDS)


def create_attention_backend(name: str, model_runner) -> AttentionBackend:
    """Build the backend registered as ``name`` for ``model_runner``.

    Raises ``UnknownAttentionBackendError`` for an unregistered name and ``ImportError`` (saying
    what to install) when the backend's module or its dependencies are missing.
    """
    target = _BACKENDS.get(name)
    if target is None:
        raise UnknownAttentionBackendError(
            f"unknown attention backend {name!r}; choose one of {available_attention_backends()}"
        )
    module_name, class_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(
            f"attention backend {name!r} is not available on this install ({e}); "
            "use --attention-backend torch_native"
        ) from e
    return getattr(module, class_name)(model_runner)

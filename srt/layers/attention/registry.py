"""Attention backends by name, imported lazily.

``create_attention_backend(name, model_runner)`` imports the backend's module only when that
backend is asked for, so a CPU install never imports flashinfer (or any GPU-only package). The
name -> module table is configuration (``srt.configs.backends.ATTENTION_BACKENDS``), read by
``ServerArgs.resolve`` to pick only backends that exist here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from srt.configs.backends import ATTENTION_BACKENDS
from srt.layers.attention.base import AttentionBackend, AttentionBackendContext
from srt.utils.errors import ConfigError, UnknownAttentionBackendError


def available_attention_backends() -> list[str]:
    """Registered names (whether each one can be imported on this install is not checked)."""
    return sorted(ATTENTION_BACKENDS)


def create_attention_backend(name: str, model_runner: AttentionBackendContext) -> AttentionBackend:
    """Build the backend registered as ``name`` for ``model_runner``.

    Raises ``UnknownAttentionBackendError`` for an unregistered name and ``ImportError`` (saying
    what to use instead) when the backend's module or its dependencies are missing."""
    spec = ATTENTION_BACKENDS.get(name)
    if spec is None:
        raise UnknownAttentionBackendError(
            f"unknown attention backend {name!r}; choose one of {available_attention_backends()}"
        )
    try:
        module = importlib.import_module(spec.module)
    except ImportError as e:
        raise ImportError(
            f"attention backend {name!r} is not available on this install ({e}); "
            "use --attention-backend torch_native"
        ) from e
    backend_cls: Callable[[AttentionBackendContext], AttentionBackend] = getattr(module, spec.class_name)
    return backend_cls(model_runner)


def check_backend_serves(model: object, backend: AttentionBackend, name: str) -> None:
    """``ConfigError`` when the model needs what backend ``name`` does not do: image tokens that
    attend to each other both ways (``bidirectional_images``, Gemma 3)."""
    if getattr(model, "bidirectional_images", False) and not backend.supports_image_blocks:
        raise ConfigError(
            f"{type(model).__name__}: its image tokens attend to each other both ways, which "
            f"--attention-backend {name} does not do; use --attention-backend torch_native"
        )

"""How an embedding model pools its hidden states, read from the checkpoint (no torch).

A sentence-transformers export says it is an embedding model: a ``modules.json`` listing a
``sentence_transformers.models.Pooling`` module, or a ``1_Pooling/config.json``. The pooling
config's ``pooling_mode_lasttoken`` / ``pooling_mode_mean_tokens`` / ``pooling_mode_cls_token``
flags give the method ("last", "mean", "cls"); a ``Normalize`` module in ``modules.json`` is
what srt does by default anyway (L2 normalisation, unless a request asks otherwise). Without a
pooling config a decoder model pools its last token (Qwen3-Embedding, e5-mistral style).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

_MODE_FLAGS = (
    ("pooling_mode_lasttoken", "last"),
    ("pooling_mode_mean_tokens", "mean"),
    ("pooling_mode_cls_token", "cls"),
)


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    method: str = "last"  # "last" | "mean" | "cls"
    from_checkpoint: bool = False  # read from the checkpoint's sentence-transformers files


def _pooling_dir(model_path: str) -> str | None:
    """The checkpoint's pooling module folder (``1_Pooling`` or as ``modules.json`` names it)."""
    modules = os.path.join(model_path, "modules.json")
    if os.path.isfile(modules):
        try:
            with open(modules, encoding="utf-8") as f:
                entries = json.load(f)
        except (OSError, ValueError):
            entries = []
        for m in entries if isinstance(entries, list) else []:
            if isinstance(m, dict) and str(m.get("type", "")).endswith("Pooling"):
                return os.path.join(model_path, str(m.get("path", "1_Pooling")))
    default = os.path.join(model_path, "1_Pooling")
    return default if os.path.isdir(default) else None


def is_embedding_checkpoint(model_path: str | None) -> bool:
    """Whether ``model_path`` is a directory exported for sentence embeddings."""
    return bool(model_path) and os.path.isdir(model_path) and _pooling_dir(model_path) is not None


def read_pooling_config(model_path: str | None) -> PoolingConfig:
    """The pooling of ``model_path`` (last-token pooling when the checkpoint does not say)."""
    if not model_path or not os.path.isdir(model_path):
        return PoolingConfig()
    folder = _pooling_dir(model_path)
    path = os.path.join(folder, "config.json") if folder else ""
    if not folder or not os.path.isfile(path):
        return PoolingConfig()
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return PoolingConfig()
    for key, method in _MODE_FLAGS:
        if cfg.get(key):
            return PoolingConfig(method, from_checkpoint=True)
    return PoolingConfig(from_checkpoint=True)

"""srt: an SGLang-style LLM serving engine.

``from srt import Engine`` works without importing torch at package import: `Engine` is resolved
lazily on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from srt.entrypoints.engine import Engine

__all__ = ["Engine"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from srt.entrypoints.engine import Engine

        return Engine
    raise AttributeError(f"module 'srt' has no attribute {name!r}")

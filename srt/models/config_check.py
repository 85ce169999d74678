"""Start-up check of a model config against what an srt model class implements.

A config feature srt cannot honour must stop the model from being built, with a message naming
it, rather than run with different outputs. Each model class lists the config keys whose value
it depends on and the values it implements (``ConfigRequirement``); ``check_config`` raises
``UnsupportedModelError`` for the first key whose value is outside them. A key absent from the
config counts as its transformers default (``default``).

Rope settings are checked where the rope is built (``srt/layers/rope_scaling.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from srt.utils.errors import UnsupportedModelError


@dataclass(frozen=True, slots=True)
class ConfigRequirement:
    """``key``'s value must be one of ``allowed`` (``why``: what srt does instead)."""

    key: str
    allowed: tuple[Any, ...]
    default: Any = None
    why: str = ""


def check_config(config, architecture: str, requirements: tuple[ConfigRequirement, ...]) -> None:
    """Raise ``UnsupportedModelError`` naming the first config key whose value srt does not
    implement for ``architecture``."""
    for req in requirements:
        value = getattr(config, req.key, req.default)
        if value not in req.allowed:
            allowed = ", ".join(repr(v) for v in req.allowed)
            detail = f" ({req.why})" if req.why else ""
            raise UnsupportedModelError(
                f"{architecture}: config {req.key}={value!r} is not supported by srt; supported: "
                f"{allowed}{detail}"
            )


# the MLP of the Llama-family decoder is SiLU-gated
SILU_MLP = ConfigRequirement("hidden_act", ("silu",), "silu", "the MLP is SiLU-gated")

"""Gemma 3 (text): the Gemma 2 decoder (``gemma2.py``) with

* a ``(1 + w)`` RMSNorm over ``head_dim`` on q and k, before rope;
* a rope per layer type: sliding layers rotate with ``rope_local_base_freq`` (10k, no scaling),
  global layers with ``rope_theta`` (1M) and its ``rope_scaling`` (e.g. linear, factor 8); in
  transformers 5 configs both sit in ``rope_parameters[layer type]``;
* five sliding layers to one global (``layer_types``, else ``sliding_window_pattern``, default 6);
* no soft-capping in released checkpoints (honoured when a config sets it).

``Gemma3ForConditionalGeneration`` (the multimodal 4B/12B/27B checkpoints) is this decoder with a
vision tower: gemma3_vl.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from srt.layers.rotary_embedding import RotaryEmbedding
from srt.models.gemma2 import FULL, SLIDING, Gemma2ForCausalLM
from srt.models.llama import head_dim_of

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_DEFAULT_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}


def rope_of_layer_type(config: PretrainedConfig, layer_type: str) -> tuple[float, dict[str, Any] | None]:
    """``(theta, scaling or None)`` of a layer type: ``rope_parameters[layer_type]`` (transformers
    5), else ``rope_theta`` + ``rope_scaling`` (global) / ``rope_local_base_freq`` (sliding)."""
    params = getattr(config, "rope_parameters", None)
    entry = params.get(layer_type) if isinstance(params, dict) else None
    if isinstance(entry, dict):
        theta = float(entry.get("rope_theta", _DEFAULT_THETA[layer_type]))
        scaling: dict[str, Any] | None = entry
    elif layer_type == SLIDING:
        theta = float(getattr(config, "rope_local_base_freq", None) or _DEFAULT_THETA[SLIDING])
        scaling = None
    else:
        theta = float(getattr(config, "rope_theta", None) or _DEFAULT_THETA[FULL])
        scaling = getattr(config, "rope_scaling", None) or None
    if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return theta, scaling


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True
    sliding_window_pattern = 6

    @classmethod
    def rotary_embeddings(cls, config: PretrainedConfig) -> dict[str, RotaryEmbedding]:
        """Layer type -> its rope (``rope_of_layer_type``)."""
        head_dim, max_pos = head_dim_of(config), int(config.max_position_embeddings)
        return {
            t: RotaryEmbedding(head_dim, max_pos, *rope_of_layer_type(config, t)) for t in (SLIDING, FULL)
        }

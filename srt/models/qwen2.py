"""Qwen2: the Llama decoder with biases on the q/k/v projections (none on o_proj).

Qwen2's optional sliding window (``use_sliding_window``, off in released Qwen2 and Qwen2.5
checkpoints): the layers ``layer_types`` marks sliding (from ``max_window_layers`` on) attend to
their last ``sliding_window`` keys.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from srt.models.llama import AttentionOptions, LlamaForCausalLM, apply_layer_windows

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def qwen_sliding_window(config: PretrainedConfig) -> int | None:
    """The window of a Qwen config's sliding layers, or None (``use_sliding_window`` off)."""
    if not getattr(config, "use_sliding_window", False):
        return None
    return getattr(config, "sliding_window", None) or None


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: PretrainedConfig, *args: Any, **kwargs: Any) -> None:
        """``LlamaForCausalLM``'s arguments."""
        super().__init__(config, *args, **kwargs)
        apply_layer_windows(self.model.layers, config, qwen_sliding_window(config))

    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True, o_bias=False)

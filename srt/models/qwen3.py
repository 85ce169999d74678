"""Qwen3: the Llama decoder with RMSNorm over head_dim on q and k (before rope).

``head_dim`` is a config field of its own (not hidden_size / num_heads); q/k/v/o biases
follow ``attention_bias`` (False in released checkpoints).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from srt.models.llama import AttentionOptions, LlamaForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)

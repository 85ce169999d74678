"""Qwen3-MoE: the Qwen3 attention (q/k RMSNorm over head_dim, ``head_dim`` its own field) with a
sparse MoE MLP (softmax top-k, renormalised when ``norm_topk_prob``; no shared expert).

Shared MoE machinery: ``srt/models/qwen2_moe.py`` and ``srt/layers/moe.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from srt.models.llama import AttentionOptions
from srt.models.qwen2_moe import Qwen2MoeForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    """Qwen2-MoE's layers (no ``shared_expert_intermediate_size`` in the config: no shared
    expert) with the Qwen3 attention."""

    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)

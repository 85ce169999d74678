"""Qwen3-MoE: the Qwen3 attention (q/k RMSNorm over head_dim, ``head_dim`` its own field) with a
sparse MoE MLP (softmax top-k, renormalised when ``norm_topk_prob``; no shared expert).

Shared MoE machinery: ``srt/models/qwen2_moe.py`` and ``srt/layers/moe.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from srt.layers.moe import GatedMLP, SparseMoeBlock
from srt.models.llama import AttentionOptions
from srt.models.qwen2_moe import MoEForCausalLM

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from srt.layers.linear_backend import LinearBackend


class Qwen3MoeForCausalLM(MoEForCausalLM):
    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)

    def build_mlp(
        self,
        config: PretrainedConfig,
        layer_id: int,
        dtype: torch.dtype,
        linear_backend: LinearBackend | None,
    ) -> nn.Module:
        if not (config.num_experts > 0 and self.is_sparse_layer(config, layer_id)):
            return GatedMLP(config.hidden_size, config.intermediate_size, dtype, linear_backend)
        return SparseMoeBlock(
            config.hidden_size,
            config.num_experts,
            config.num_experts_per_tok,
            config.moe_intermediate_size,
            bool(getattr(config, "norm_topk_prob", False)),
            dtype,
            linear_backend,
        )

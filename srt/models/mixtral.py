"""Mixtral: Llama attention with a sparse MoE MLP in every layer (softmax top-k over
``num_local_experts``, the top-k weights always renormalised to sum 1; no shared expert).

Checkpoint names: ``model.layers.<i>.block_sparse_moe.gate`` (router) and
``block_sparse_moe.experts.<e>.w1`` / ``w3`` / ``w2`` (gate / up / down); llama.cpp files
(architecture "llama" with ``llama.expert_count``) use the merged ``ffn_*_exps`` tensors. A
``sliding_window`` in the config becomes every attention layer's window. Shared MoE machinery:
``srt/models/qwen2_moe.py`` and ``srt/layers/moe.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from srt.layers.moe import SparseMoeBlock
from srt.models.llama import AttentionOptions
from srt.models.qwen2_moe import MoEForCausalLM

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from srt.layers.linear_backend import LinearBackend


class MixtralForCausalLM(MoEForCausalLM):
    checkpoint_alias = "block_sparse_moe"

    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        return AttentionOptions()

    @classmethod
    def sliding_window(cls, config: PretrainedConfig) -> int | None:
        return getattr(config, "sliding_window", None) or None

    def build_mlp(
        self,
        config: PretrainedConfig,
        layer_id: int,
        dtype: torch.dtype,
        linear_backend: LinearBackend | None,
    ) -> nn.Module:
        return SparseMoeBlock(
            config.hidden_size,
            config.num_local_experts,
            config.num_experts_per_tok,
            config.intermediate_size,
            True,
            dtype,
            linear_backend,
            checkpoint_alias=self.checkpoint_alias,
        )

"""Mixture-of-experts decoders on the Llama layer: Qwen2-MoE here, Qwen3-MoE and Mixtral beside it.

A layer is the Llama layer (``LlamaAttention``, two RMSNorms, residual stream) whose MLP is a
``SparseMoeBlock`` (``srt/layers/moe.py``) or, in the layers a config leaves dense, a gated MLP::

    Qwen2-MoE  qkv bias; softmax top-k, renormalised when norm_topk_prob (released: off); a shared
               expert gated by sigmoid(shared_expert_gate(x)); mlp_only_layers / decoder_sparse_step
               pick the dense layers
    Qwen3-MoE  q/k RMSNorm (qwen3_moe.py); norm_topk_prob (released: on); no shared expert
    Mixtral    Llama attention (mixtral.py); top-2 always renormalised; checkpoint names
               ``block_sparse_moe.experts.<e>.w1/w3/w2`` (gate/up/down) and ``block_sparse_moe.gate``

A sliding window in the config (``use_sliding_window`` for Qwen, ``sliding_window`` for Mixtral)
becomes the attention layers' window (per ``layer_types`` where the config has them).

Checkpoint expert tensors come per expert (``mlp.experts.<e>.gate_proj.weight``: HF files, older
GGUFs) or merged over the experts (``mlp.experts.gate_proj.weight``: llama.cpp's ``ffn_*_exps``);
``load_weights`` hands them to the layer's ``MoEExperts``, everything else goes where the Llama
loader would put it. DECODE steps run the layers as one native call (``llama_native.py``) where
the weights allow, the sparse blocks included (router, top-k, the experts grouped by expert, the
shared expert; ``DecodeLayers.set_moe``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from srt.layers.layernorm import RMSNorm
from srt.layers.moe import GatedMLP, MoEExperts, SparseMoeBlock
from srt.layers.quantized_weight import GGUFTensor
from srt.layers.rotary_embedding import get_rope
from srt.layers.vocab_embedding import VocabEmbedding
from srt.models.llama import (
    AttentionOptions,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    apply_layer_windows,
    head_dim_of,
)
from srt.models.qwen2 import qwen_sliding_window

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from srt.layers.linear_backend import LinearBackend

logger = logging.getLogger(__name__)

_EXPERT_RE = re.compile(
    r"^(?P<block>.+)\.experts\.(?:(?P<expert>\d+)\.)?"
    r"(?P<name>gate_proj|up_proj|down_proj|w1|w2|w3|gate_up_proj)(?:\.weight)?$"
)
_EXPERT_PART = {
    "gate_proj": "gate",
    "w1": "gate",
    "up_proj": "up",
    "w3": "up",
    "down_proj": "down",
    "w2": "down",
    "gate_up_proj": "gate_up",
}


class MoEDecoderLayer(LlamaDecoderLayer):
    """``LlamaDecoderLayer`` whose ``mlp`` is given (a ``SparseMoeBlock`` or a ``GatedMLP``)."""

    def __init__(
        self, config: PretrainedConfig, self_attn: LlamaAttention, mlp: nn.Module, dtype: torch.dtype
    ) -> None:
        nn.Module.__init__(self)
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class MoEModel(LlamaModel):
    """``LlamaModel`` of ``MoEDecoderLayer``s; ``build_mlp(layer_id)`` makes each layer's MLP."""

    def __init__(
        self,
        config: PretrainedConfig,
        options: AttentionOptions,
        build_mlp: Callable[[int], nn.Module],
        dtype: torch.dtype,
        linear_backend: LinearBackend | None,
    ) -> None:
        nn.Module.__init__(self)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.rotary_emb = get_rope(head_dim_of(config), config)
        self.layers = nn.ModuleList(
            MoEDecoderLayer(
                config,
                LlamaAttention(config, i, self.rotary_emb, options, dtype, linear_backend),
                build_mlp(i),
                dtype,
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        # the layers as one native call for DECODE batches (llama_native.py), once enabled
        self.native_decode = None


class MoEForCausalLM(LlamaForCausalLM):
    """Base of the MoE families: subclasses give ``attention_options``, ``sliding_window`` and
    ``build_mlp``; the rest (forward, the LM head) is ``LlamaForCausalLM``'s."""

    checkpoint_alias: str | None = None  # a second checkpoint name of the MoE block (Mixtral)

    def build_model(
        self, config: PretrainedConfig, dtype: torch.dtype, linear_backend: LinearBackend | None
    ) -> MoEModel:
        model = MoEModel(
            config,
            self.attention_options(config),
            lambda i: self.build_mlp(config, i, dtype, linear_backend),
            dtype,
            linear_backend,
        )
        apply_layer_windows(model.layers, config, self.sliding_window(config))
        return model

    @classmethod
    def sliding_window(cls, config: PretrainedConfig) -> int | None:
        """The attention window (HF's ``sliding_window``: keys a query sees, itself included), or None."""
        return qwen_sliding_window(config)

    def build_mlp(
        self,
        config: PretrainedConfig,
        layer_id: int,
        dtype: torch.dtype,
        linear_backend: LinearBackend | None,
    ) -> nn.Module:
        raise NotImplementedError

    @staticmethod
    def is_sparse_layer(config: PretrainedConfig, layer_id: int) -> bool:
        """Qwen's rule: a MoE layer unless listed in ``mlp_only_layers`` or off ``decoder_sparse_step``."""
        step = getattr(config, "decoder_sparse_step", 1) or 1
        return layer_id not in (getattr(config, "mlp_only_layers", None) or []) and (layer_id + 1) % step == 0

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """``LlamaForCausalLM.load_weights`` plus the expert tensors (module docstring); then each
        layer's experts are finalized (their GGUF blocks arranged for the matmuls)."""
        self._experts = {name: m for name, m in self.named_modules() if isinstance(m, MoEExperts)}
        alias = self.checkpoint_alias
        if alias:
            weights = ((name.replace(f".{alias}.", ".mlp."), t) for name, t in weights)
        super().load_weights(weights)
        for m in self._experts.values():
            m.finalize()

    def load_special(self, name: str, tensor: torch.Tensor | GGUFTensor) -> bool:
        m = _EXPERT_RE.match(name)
        target = None if m is None else self._experts.get(f"{m['block']}.experts")
        if target is None:
            return False
        expert = None if m["expert"] is None else int(m["expert"])
        target.load(_EXPERT_PART[m["name"]], expert, tensor, name)
        return True

    def missing_weights(self, params: dict[str, nn.Parameter], loaded: dict[str, set]) -> list[str]:
        dense = {n: p for n, p in params.items() if n.rsplit(".", 1)[0] not in self._experts}
        missing = super().missing_weights(dense, loaded)
        return missing + [f"{n}.{part}" for n, m in self._experts.items() for part in m.missing()]


class Qwen2MoeForCausalLM(MoEForCausalLM):
    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=bool(getattr(config, "qkv_bias", True)), o_bias=False)

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
            shared_intermediate_size=getattr(config, "shared_expert_intermediate_size", 0) or 0,
        )

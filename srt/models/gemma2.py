"""Gemma 2 decoder, and the Gemma layers Gemma 3 (``gemma3.py``) builds on.

Differences from the Llama decoder (``llama.py``, whose projections, MLP and weight loading
are reused):

* embeddings are scaled by ``sqrt(hidden_size)`` (the scale a tensor in the model dtype, as HF);
* every RMSNorm scales by ``1 + weight``, in float32 (``GemmaRMSNorm``);
* four norms per layer: before and after attention, before and after the MLP::

      x -> input_layernorm -> attention -> post_attention_layernorm -> + x = h
      h -> pre_feedforward_layernorm -> gate_up_proj -> gelu_tanh(gate) * up -> down_proj
        -> post_feedforward_layernorm -> + h

  (each ``+`` is done by the norm after it, ``forward_with_residual``: one kernel on CUDA);

* attention scores are scaled by ``query_pre_attn_scalar ** -0.5`` (not ``head_dim ** -0.5``)
  and soft-capped (``attn_logit_softcapping``; RadixAttention's ``logit_cap``);
* sliding-window layers alternate with global ones (``config.layer_types``; without it Gemma 2's
  even layers slide): a sliding layer's query sees its last ``sliding_window`` keys, itself
  included (``sliding_window_size = sliding_window - 1``);
* the final logits are soft-capped (``final_logit_softcapping``, in the ``LogitsProcessor``, so
  sampling and logprobs see the capped values);
* the LM head is tied to the embedding (an untied ``lm_head`` is honoured too).

Gemma 3 adds a per-head RMSNorm on q and k and a rope per layer type (``gemma3.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from srt.layers.activation import GeluTanhAndMul
from srt.layers.layernorm import RMSNorm
from srt.layers.linear import Linear, QKVLinear
from srt.layers.linear_backend import LinearBackend
from srt.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from srt.layers.radix_attention import RadixAttention
from srt.layers.rotary_embedding import RotaryEmbedding, get_rope
from srt.layers.vocab_embedding import LMHead, VocabEmbedding
from srt.models.checkpoint_loader import CheckpointLoader
from srt.models.config_check import ConfigRequirement, check_config
from srt.models.llama import LlamaMLP, head_dim_of, run_layers
from srt.utils.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from srt.layers.forward_batch import ForwardBatch

SLIDING, FULL = "sliding_attention", "full_attention"
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_python_tanh", "gelu_new", "gelu_fast")


class GemmaRMSNorm(RMSNorm):
    """``x / sqrt(mean(x^2) + eps) * (1 + weight)`` over the last dim, in float32, cast back to
    the input dtype. ``weight`` is the checkpoint's (zero-centred). One FlashInfer kernel on CUDA
    (``fused``, bound by the model runner), as ``RMSNorm``."""

    gemma = True

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        out = F.rms_norm(x.float(), (self.hidden_size,), None, self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)

    def _add_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + x), residual + x)``, the add out of place."""
        residual = residual + x
        return self.forward(residual), residual


class GemmaMLP(LlamaMLP):
    """The Llama MLP with GeGLU: ``down_proj(gelu_tanh(gate) * up)``."""

    def __init__(self, *args, **kwargs) -> None:
        """``LlamaMLP``'s arguments."""
        super().__init__(*args, **kwargs)
        self.act_fn = GeluTanhAndMul()


def layer_types_of(config: PretrainedConfig, default_pattern: int) -> list[str]:
    """Per layer ``SLIDING`` or ``FULL``: ``config.layer_types`` when given, else every
    ``default_pattern``-th layer (1-based) global and the others sliding; all global without a
    ``sliding_window``."""
    n = config.num_hidden_layers
    if not getattr(config, "sliding_window", None):
        return [FULL] * n
    types = getattr(config, "layer_types", None)
    if types:
        if len(types) != n or any(t not in (SLIDING, FULL) for t in types):
            raise ConfigError(f"layer_types must be {n} entries of {SLIDING!r} / {FULL!r}, got {types}")
        return list(types)
    pattern = int(getattr(config, "sliding_window_pattern", None) or default_pattern)
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(n)]


# config values the Gemma decoder implements (anything else fails at construction: config_check.py)
GEMMA_REQUIREMENTS = (
    ConfigRequirement(
        "hidden_activation", _GELU_TANH, "gelu_pytorch_tanh", "the MLP is GeGLU with tanh-approximated GELU"
    ),
    ConfigRequirement(
        "use_bidirectional_attention", (None, False), None, "srt runs causal LMs, not embedding models"
    ),
)


class GemmaAttention(nn.Module):
    """q/k/v (one matmul) -> (q/k norm) -> rope -> RadixAttention (window, cap) -> o_proj."""

    def __init__(
        self,
        config: PretrainedConfig,
        layer_id: int,
        rotary_emb: RotaryEmbedding,
        sliding: bool,
        qk_norm: bool,
        dtype: torch.dtype,
        linear_backend: LinearBackend | None = None,
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(config)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVLinear(
            hidden, self.head_dim, self.num_heads, self.num_kv_heads, bias, dtype, linear_backend
        )
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, bias, dtype, linear_backend)
        self.q_norm: GemmaRMSNorm | None = None
        self.k_norm: GemmaRMSNorm | None = None
        if qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.rotary_emb = rotary_emb  # shared by the layers of its type
        scalar = getattr(config, "query_pre_attn_scalar", None) or self.head_dim
        window = config.sliding_window if sliding else None
        self.attn = RadixAttention(
            self.num_heads,
            self.head_dim,
            float(scalar) ** -0.5,
            self.num_kv_heads,
            layer_id,
            sliding_window_size=int(window) - 1 if window else -1,
            logit_cap=float(getattr(config, "attn_logit_softcapping", None) or 0.0),
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch,
        keep_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden_states ``[T, hidden]`` -> ``[T, hidden]`` (``[R, hidden]``: only ``keep_rows``
        go through ``o_proj``, as in ``LlamaAttention.forward``)."""
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden_states))
        if self.q_norm is not None and self.k_norm is not None:
            t = hidden_states.shape[0]
            q = self.q_norm.norm_heads(q.view(t, self.num_heads, self.head_dim)).view(t, -1)
            k = self.k_norm.norm_heads(k.view(t, self.num_kv_heads, self.head_dim)).view(t, -1)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, forward_batch)
        return self.o_proj(out if keep_rows is None else out.index_select(0, keep_rows))


class GemmaDecoderLayer(nn.Module):
    """Attention and MLP, each between a pre- and a post-norm, each added to the residual."""

    def __init__(
        self,
        config: PretrainedConfig,
        self_attn: GemmaAttention,
        dtype: torch.dtype,
        linear_backend: LinearBackend | None = None,
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = self_attn
        self.mlp = GemmaMLP(hidden, config.intermediate_size, False, dtype, linear_backend)
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        forward_batch: ForwardBatch,
        keep_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(post-norm MLP output, residual stream)``; the caller adds them (the next layer's
        input norm, or the final norm), so each add rides in a norm (one kernel on CUDA).
        ``keep_rows``: after the attention only those rows go on."""
        if residual is None:
            residual, h = hidden_states, self.input_layernorm(hidden_states)
        else:
            h, residual = self.input_layernorm.forward_with_residual(hidden_states, residual)
        h = self.post_attention_layernorm(self.self_attn(positions, h, forward_batch, keep_rows))
        if keep_rows is not None:
            residual = residual.index_select(0, keep_rows)
        h, residual = self.pre_feedforward_layernorm.forward_with_residual(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class GemmaModel(nn.Module):
    """Scaled embedding -> layers (``layer_types[i]`` picks the window and the rope) -> norm."""

    def __init__(
        self,
        config: PretrainedConfig,
        layer_types: list[str],
        ropes: dict[str, RotaryEmbedding],
        qk_norm: bool,
        dtype: torch.dtype,
        linear_backend: LinearBackend | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype)
        # HF: a float32 scalar cast to the weight dtype (sqrt(2304) = 48.0 in bfloat16)
        normalizer = torch.tensor(config.hidden_size**0.5, dtype=torch.float32).to(dtype)
        self.register_buffer("normalizer", normalizer, persistent=False)
        self.rotary_embs = nn.ModuleDict(ropes)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(
                config,
                GemmaAttention(config, i, ropes[kind], kind == SLIDING, qk_norm, dtype, linear_backend),
                dtype,
                linear_backend,
            )
            for i, kind in enumerate(layer_types)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        input_embeds: torch.Tensor | None = None,
        keep_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids/positions ``[T]`` -> final hidden states ``[T, hidden]``; ``input_embeds``
        (already scaled where they come from the embedding: a VLM's image rows are not) replace
        the embedding lookup. ``keep_rows``: the last layer's rows after its attention, as in
        ``LlamaModel.forward`` (``[R, hidden]``)."""
        if input_embeds is None:
            hidden_states = self.embed_tokens(input_ids) * self.normalizer
        else:
            hidden_states = input_embeds
        hidden_states, residual = run_layers(self.layers, positions, hidden_states, forward_batch, keep_rows)
        if residual is None:
            return self.norm(hidden_states)
        return self.norm.forward_with_residual(hidden_states, residual)[0]


class Gemma2ForCausalLM(CheckpointLoader, nn.Module):
    """``forward(input_ids [T], positions [T], forward_batch) -> LogitsProcessorOutput``;
    checkpoint names are HF's (``load_weights`` is the Llama loader: q/k/v and gate/up fused)."""

    qk_norm = False
    sliding_window_pattern = 2  # without config.layer_types: every 2nd layer global

    def __init__(
        self,
        config: PretrainedConfig,
        dtype: torch.dtype = torch.float32,
        linear_backend: LinearBackend | None = None,
    ) -> None:
        super().__init__()
        check_config(config, type(self).__name__, GEMMA_REQUIREMENTS)
        self.config = config
        self.dtype = dtype
        self.layer_types = layer_types_of(config, self.sliding_window_pattern)
        ropes = self.rotary_embeddings(config)
        self.model = GemmaModel(config, self.layer_types, ropes, self.qk_norm, dtype, linear_backend)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        if self.tie_word_embeddings:
            self.lm_head: nn.Module = self.model.embed_tokens
        else:
            self.lm_head = LMHead(config.vocab_size, config.hidden_size, dtype)
        cap = float(getattr(config, "final_logit_softcapping", None) or 0.0)
        self.logits_processor = LogitsProcessor(config.vocab_size, linear_backend, cap)

    @classmethod
    def rotary_embeddings(cls, config: PretrainedConfig) -> dict[str, RotaryEmbedding]:
        """Layer type -> its rope (Gemma 2: one rope for every layer)."""
        rope = get_rope(head_dim_of(config), config)
        return {SLIDING: rope, FULL: rope}

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> LogitsProcessorOutput:
        keep_rows = self.logits_processor.rows_read(forward_batch)
        hidden_states = self.model(input_ids, positions, forward_batch, keep_rows=keep_rows)
        return self.logits_processor(hidden_states, self.lm_head, forward_batch)

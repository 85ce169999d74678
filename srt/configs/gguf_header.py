"""GGUF headers: the metadata and tensor table of a GGUF file, and the model config they describe.

A GGUF file (llama.cpp's format) holds the config and the tokenizer as key/value metadata
and the weights as (possibly quantized) tensors. This module parses the header itself
(``parse_gguf``; the ``gguf`` package's reader builds a numpy view per vocabulary string and
takes seconds) and derives the HF config fields (``gguf_config_dict``) and end-of-generation
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
}

# metadata value type id -> struct format (scalars); 8 = string, 9 = array
_SCALAR_FORMATS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}


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
        logger.warning(
            "%s has llama.cpp rope frequency factors (rope_freqs); srt ignores them (rope of the base "
            "frequencies), like transformers' GGUF loader.",
            path,
        )
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        value = gf.get(f"tokenizer.ggml.{name}_token_id")
        if value is not None:
            cfg[key] = value
    return cfg


def gguf_eos_token_ids(path: str) -> list[int]:
    """End-of-generation ids from the metadata: eos, then eot / eom when present."""
    gf = open_gguf(path)
    ids: list[int] = []
    for name in ("eos", "eot", "eom"):
        value = gf.get(f"tokenizer.ggml.{name}_token_id")
        if value is not None and value not in ids:
            ids.append(int(value))
    return ids

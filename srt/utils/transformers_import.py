"""A faster first ``import transformers`` in the processes srt owns.

When transformers is imported it builds the table behind its lazy modules by reading every file
under ``transformers/models`` for its ``__all__`` (about 2,600 files in transformers 5): about half
of a 1.8 s import on a 2-core CPU, paid again in each process of a launch (the HTTP server, the
detokenizer, the scheduler) and in every child an ``Engine`` starts. The table depends only on
those files, so `cache_import_structure` keeps it on disk, keyed by every file's path, size and
modification time (and those of transformers' own parser), and reads it back while nothing changed.

The hook is a one-shot import finder for ``transformers.utils.import_utils``: when that module has
run, its ``define_import_structure`` is wrapped. Only directories with subpackages (the recursive
walk that costs the time) go through the disk; the per-model packages keep transformers' own
in-process path. Any failure to read or write the cache falls back to transformers' own function,
and a transformers without that function is left as it is. Installed at the start of srt's own
processes (``srt.launch_server`` and every child), never in a user's process.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.abc
import importlib.machinery
import json
import logging
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

TARGET = "transformers.utils.import_utils"
CACHE_FORMAT = 1


def cache_directory() -> Path:
    """Where the import tables live: $XDG_CACHE_HOME (default ~/.cache) / srt / transformers-imports."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "srt" / "transformers-imports"


def cache_import_structure() -> bool:
    """Install the finder (once per process); False when transformers' import table is already
    built in this process, or the finder is already in place."""
    if TARGET in sys.modules or any(isinstance(f, _ImportUtilsFinder) for f in sys.meta_path):
        return False
    sys.meta_path.insert(0, _ImportUtilsFinder())
    return True


class _ImportUtilsFinder(importlib.abc.MetaPathFinder):
    """Finds ``transformers.utils.import_utils`` as the path finder would, and wraps its
    ``define_import_structure`` once the module has run; removes itself on first use."""

    def find_spec(
        self, fullname: str, path: Any, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            define = getattr(module, "define_import_structure", None)
            if callable(define):
                module.define_import_structure = _disk_cached(define, Path(module.__file__))

        loader.exec_module = exec_module
        return spec


def _disk_cached(define: Callable[..., dict], parser_file: Path) -> Callable[..., dict]:
    @functools.lru_cache
    @functools.wraps(define)
    def define_import_structure(module_path: Any, prefix: str | None = None) -> dict:
        path = _table_path(Path(module_path), prefix, parser_file)
        if path is None:
            return define(module_path, prefix)
        table = _read(path)
        if table is None:
            table = define(module_path, prefix)
            _write(path, table)
        return table

    return define_import_structure


def _table_path(module_path: Path, prefix: str | None, parser_file: Path) -> Path | None:
    """``<which table>-<which contents>.json`` in the cache for a folder with subpackages; None for
    a single package (a model's own, quick on transformers' path) or a folder it cannot read."""
    try:
        folder = module_path.parent if module_path.is_file() else module_path
        with os.scandir(folder) as entries:
            if not any(e.is_dir() and e.name != "__pycache__" for e in entries):
                return None
        kind = hashlib.sha256(f"{folder.resolve()}\0{prefix}".encode()).hexdigest()[:16]
        return cache_directory() / f"{kind}-{_fingerprint(folder, prefix, parser_file)}.json"
    except OSError:
        return None


def _fingerprint(folder: Path, prefix: str | None, parser_file: Path) -> str:
    """The contents' key: the cache format, the prefix, the parser's file and `_tree_digest`."""
    st = parser_file.stat()
    key = f"{CACHE_FORMAT}\0{prefix}\0{parser_file}:{st.st_size}:{st.st_mtime_ns}\0{_tree_digest(folder)}"
    return hashlib.sha256(key.encode()).hexdigest()[:32]


@functools.lru_cache
def _tree_digest(folder: Path) -> str:
    """A digest of the folder's path and of every file's relative path, size and modification
    time under it (``__pycache__`` aside): about 25 ms for transformers' 2,600 model files."""
    root = str(folder.resolve())
    rows = []
    pending = [root]
    while pending:
        with os.scandir(pending.pop()) as entries:
            for e in entries:
                if e.is_dir(follow_symlinks=False):
                    if e.name != "__pycache__":
                        pending.append(e.path)
                    continue
                st = e.stat()
                rows.append(f"{e.path[len(root) :]}:{st.st_size}:{st.st_mtime_ns}")
    rows.sort()  # scandir's order is the file system's
    return hashlib.sha256("\0".join([root, *rows]).encode()).hexdigest()


def _read(path: Path) -> dict | None:
    """The table in ``path`` as transformers builds it ({frozenset(backends): {module: {names}}});
    None when it is missing or unreadable."""
    try:
        rows = json.loads(path.read_text())
        return {
            frozenset(backends): {m: set(names) for m, names in modules.items()} for backends, modules in rows
        }
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def _write(path: Path, table: dict) -> None:
    """Write ``table`` atomically (a concurrent reader sees the old file or the new one), then
    remove the older tables of its kind; a cache that cannot be written is only logged."""
    try:
        rows = [
            [sorted(backends), {m: sorted(names) for m, names in modules.items()}]
            for backends, modules in table.items()
        ]
        text = json.dumps(rows)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    except (OSError, TypeError, ValueError) as e:
        logger.debug("transformers' import table not cached in %s: %s", path.parent, e)
        return
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        logger.debug("transformers' import table not cached in %s: %s", path.parent, e)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return
    kind = path.name.split("-", 1)[0]  # the new table replaces the older ones of its kind
    for old in path.parent.glob(f"{kind}-*.json"):
        if old != path:
            with contextlib.suppress(OSError):
                old.unlink()

"""srt's import structure: no import cycle anywhere in srt/, and the configuration stays light.

The layer rules themselves are import-linter contracts in pyproject.toml (``make lint``); the
cycle finder (tests/helpers/import_cycles.py) reads the source with ``ast`` and imports nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.import_cycles import find_cycles, import_graph

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_no_import_cycle_in_srt():
    cycles = find_cycles(REPO_ROOT / "srt")
    assert not cycles, "import cycles in srt/:\n" + "\n".join(str(c) for c in cycles)


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cycle_finder_sees_lazy_type_only_and_package_init_imports(tmp_path):
    pkg = tmp_path / "pkg"
    _write(pkg, "__init__.py", "")
    _write(pkg, "a.py", "def f():\n    from pkg.b import g\n")
    _write(pkg, "b.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n")
    _write(pkg, "c.py", "import pkg.sub.d\n")
    _write(pkg, "sub/__init__.py", "from pkg.sub.e import x\n")
    _write(pkg, "sub/d.py", "")
    _write(pkg, "sub/e.py", "from pkg import c\nx = 1\n")
    _write(pkg, "ok.py", "import os\nfrom pkg import a\n")

    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.a"}
    assert graph["pkg.c"] == {"pkg.sub", "pkg.sub.d"}  # importing pkg.sub.d runs pkg/sub/__init__.py
    cycles = {c.modules: c for c in find_cycles(pkg)}
    assert set(cycles) == {("pkg.a", "pkg.b"), ("pkg.c", "pkg.sub", "pkg.sub.e")}
    path = cycles[("pkg.a", "pkg.b")].path
    assert path[0] == path[-1] == "pkg.a" and str(cycles[("pkg.a", "pkg.b")]) == "pkg.a -> pkg.b -> pkg.a"


def test_configuration_imports_without_torch():
    """ServerArgs and the backend tables are read by the main process before any model code."""
    code = (
        "import sys\n"
        "import srt.server_args, srt.configs.backends, srt.utils.hf_tokenizer\n"
        "heavy = [m for m in ('torch', 'srt.layers', 'srt.models', 'srt.model_loader') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


def test_srt_modules_and_functions_within_size_limits():
    from tests.helpers.sizes import oversized

    problems = oversized(REPO_ROOT / "srt")
    assert not problems, "split these (STYLE.md):\n" + "\n".join(problems)


def test_size_check_finds_a_long_function_and_module(tmp_path):
    from tests.helpers.sizes import oversized

    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    _write(tmp_path, "pkg/long.py", f"def f():\n{body}\n" + "\n" * 340)
    found = oversized(tmp_path)
    assert any("f: 62 lines" in p for p in found) and any("long.py: 402 lines" in p for p in found)
    _write(tmp_path, "pkg/long.py", "def f():\n    return 1\n")
    assert oversized(tmp_path) == []

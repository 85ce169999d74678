"""transformers' import table kept on disk (srt/utils/transformers_import.py): a process with the
hook reads back the table transformers would build, equal to it, without walking the model files;
a changed file, a corrupt or unwritable cache and a single package fall back to transformers' own
function; every child srt starts has the hook in place."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from srt.utils import transformers_import as ti
from srt.utils.process import ProcessSupervisor
from tests.helpers import child_targets

# a process as srt starts one: the hook, then transformers (torch hidden, as in srt's processes)
_CHILD = """
import json, sys
from srt.utils.transformers_import import cache_import_structure, _ImportUtilsFinder
installed = cache_import_structure()
from srt.utils.torch_free import transformers_without_torch
with transformers_without_torch():
    pass
import transformers
import transformers.utils.import_utils as iu
from transformers import AutoTokenizer, LlamaConfig, Qwen2Config  # the lazy module resolves names
models = str(__import__("pathlib").Path(iu.__file__).parent.parent / "models")
table = iu.define_import_structure(models, prefix="models")
print(json.dumps({
    "installed": installed,
    "finder_left": any(isinstance(f, _ImportUtilsFinder) for f in sys.meta_path),
    "wrapped": hasattr(iu.define_import_structure, "__wrapped__"),
    "walked": iu.create_import_structure_from_path.cache_info().misses,
    "table": sorted([sorted(k), sorted((m, sorted(v)) for m, v in d.items())] for k, d in table.items()),
    "llama": LlamaConfig.__name__,
}))
"""


def _normal(table: dict) -> list:
    """The child's JSON form of a table."""
    return json.loads(
        json.dumps(
            sorted([sorted(k), sorted((m, sorted(v)) for m, v in d.items())] for k, d in table.items())
        )
    )


def _child(cache_home: Path) -> dict:
    env = dict(os.environ, XDG_CACHE_HOME=str(cache_home))
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_new_process_reads_back_the_table_transformers_builds(tmp_path):
    import transformers.utils.import_utils as iu

    models = Path(iu.__file__).parent.parent / "models"
    reference = _normal(iu.define_import_structure(str(models), prefix="models"))  # this process: no hook

    cold = _child(tmp_path)
    assert cold["installed"] and cold["wrapped"] and not cold["finder_left"]
    assert cold["table"] == reference and cold["llama"] == "LlamaConfig"
    assert cold["walked"] > 300  # transformers walked every model folder to build it
    written = sorted(p.name for p in (tmp_path / "srt" / "transformers-imports").iterdir())
    assert len(written) == 2  # the top-level table and models/'s own (two prefixes)

    warm = _child(tmp_path)
    assert warm["table"] == reference and warm["llama"] == "LlamaConfig"
    assert warm["walked"] < 30, warm["walked"]  # only the few model packages it imported
    assert sorted(p.name for p in (tmp_path / "srt" / "transformers-imports").iterdir()) == written


def _tree(root: Path) -> Path:
    for name, text in {
        "__init__.py": "",
        "alpha/__init__.py": "",
        "alpha/configuration_alpha.py": '__all__ = ["AlphaConfig"]\n',
        "beta/modeling_beta.py": '__all__ = ["BetaModel"]\n',
    }.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


class _Define:
    """A stand-in for transformers' function: reads each file's __all__, counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, module_path, prefix=None) -> dict:
        self.calls += 1
        folder = Path(module_path)
        folder = folder.parent if folder.is_file() else folder
        out: dict = {}
        for f in sorted(folder.rglob("*.py")):
            if f.name == "__init__.py":
                continue
            names = set(re.findall(r'"(\w+)"', f.read_text()))
            backends = frozenset({"torch"}) if f.name.startswith("modeling_") else frozenset()
            module = ".".join(f.relative_to(folder).with_suffix("").parts)
            out.setdefault(backends, {})[f"{prefix}.{module}" if prefix else module] = names
        return out


@pytest.fixture
def cache_home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "srt" / "transformers-imports"


def _wrapped(define: _Define, parser: Path):
    ti._tree_digest.cache_clear()  # a new process's view: nothing remembered in memory
    return ti._disk_cached(define, parser)


def test_the_cache_follows_the_files(tmp_path, cache_home):
    root, parser = _tree(tmp_path / "models"), tmp_path / "import_utils.py"
    parser.write_text("# parser v1\n")
    define = _Define()
    first = _wrapped(define, parser)(str(root), prefix="models")
    assert define.calls == 1 and first[frozenset()]["models.alpha.configuration_alpha"] == {"AlphaConfig"}
    assert len(list(cache_home.iterdir())) == 1

    again = _wrapped(define, parser)(str(root), prefix="models")
    assert define.calls == 1 and again == first  # read back, equal, sets and frozensets restored

    (root / "alpha" / "configuration_alpha.py").write_text('__all__ = ["AlphaConfig", "AlphaTextConfig"]\n')
    changed = _wrapped(define, parser)(str(root), prefix="models")
    assert define.calls == 2
    assert changed[frozenset()]["models.alpha.configuration_alpha"] == {"AlphaConfig", "AlphaTextConfig"}
    assert len(list(cache_home.iterdir())) == 1  # the new table replaced the old one

    (root / "gamma").mkdir()
    (root / "gamma" / "configuration_gamma.py").write_text('__all__ = ["GammaConfig"]\n')
    assert (
        "models.gamma.configuration_gamma"
        in _wrapped(define, parser)(str(root), prefix="models")[frozenset()]
    )
    assert define.calls == 3

    parser.write_text("# parser v2, other rules\n")
    _wrapped(define, parser)(str(root), prefix="models")
    assert define.calls == 4

    other = _wrapped(define, parser)(str(root / "__init__.py"))  # a file means its folder; no prefix
    assert define.calls == 5 and "alpha.configuration_alpha" in other[frozenset()]
    assert len(list(cache_home.iterdir())) == 2  # one table per prefix


def test_a_corrupt_table_is_rebuilt_and_rewritten(tmp_path, cache_home):
    root, parser = _tree(tmp_path / "models"), tmp_path / "import_utils.py"
    parser.write_text("")
    define = _Define()
    good = _wrapped(define, parser)(str(root))
    (path,) = cache_home.iterdir()
    for garbage in ("{not json", '{"a": 1}', "[[1, 2]]", ""):
        path.write_text(garbage)
        assert _wrapped(define, parser)(str(root)) == good
    assert define.calls == 5
    assert _wrapped(define, parser)(str(root)) == good and define.calls == 5  # rewritten whole


def test_an_unwritable_cache_falls_back_to_transformers(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    root, parser = _tree(tmp_path / "models"), tmp_path / "import_utils.py"
    parser.write_text("")
    define = _Define()
    assert _wrapped(define, parser)(str(root))[frozenset({"torch"})] == {"beta.modeling_beta": {"BetaModel"}}
    assert _wrapped(define, parser)(str(root)) and define.calls == 2
    assert not list(tmp_path.glob("**/.tmp-*"))


def test_a_single_package_keeps_transformers_path(tmp_path, cache_home):
    root, parser = _tree(tmp_path / "models"), tmp_path / "import_utils.py"
    parser.write_text("")
    define = _Define()
    wrapped = _wrapped(define, parser)
    assert wrapped(str(root / "alpha" / "__init__.py")) == {
        frozenset(): {"configuration_alpha": {"AlphaConfig"}}
    }
    assert wrapped(str(tmp_path / "missing")) == {} and define.calls == 2  # no folder: transformers decides
    assert not cache_home.exists()


def test_a_process_that_already_imported_transformers_is_left_alone():
    import transformers.utils.import_utils  # noqa: F401

    before = list(sys.meta_path)
    assert ti.cache_import_structure() is False
    assert sys.meta_path == before


def test_every_child_srt_starts_has_the_hook_in_place():
    sup = ProcessSupervisor(log_level="error")
    try:
        sup.start("probe", child_targets.report_transformers_import_hook, ())
        ready = sup.wait_ready(timeout_s=120)
    finally:
        sup.stop(timeout_s=5)
    assert ready["probe"] == {"status": "ready", "hook": True, "transformers": False}

"""``python -m srt.kernels.cpu.build`` (srt/kernels/cpu/build.py): the set-up's kernel build. It
never fails without ``--require``; its cache key covers every source; a library already built for
the key is loaded instead of compiled again, and one that does not load is built again; a lock a
killed build left is removed; the sources are compiled in units whose files define no name twice."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import sys

import pytest

import srt.kernels.cpu as kernels
from srt.kernels.cpu import build as kbuild


def _run_build(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "srt.kernels.cpu.build", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _no_compiler_env(tmp_path) -> dict[str, str]:
    return dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), XDG_CACHE_HOME=str(tmp_path))


def test_build_module_exits_0_without_a_compiler(tmp_path):
    proc = _run_build(_no_compiler_env(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "NOT built" in proc.stdout and "no C++ compiler" in proc.stdout


def test_the_build_key_covers_every_source_and_header():
    """A kernel source or header missing from build.py's lists would not change the cache key, and
    an edit to it would load the library built before the edit."""
    on_disk = {p.name for p in kbuild.SOURCE_DIR.iterdir() if p.suffix in (".cpp", ".h")}
    assert on_disk == set(kbuild.SOURCES) | set(kbuild.HEADERS)


# names a kernel source defines at namespace scope (srt's sources do not indent namespace bodies)
_DEFINES = (
    re.compile(r"^(?:template\s*<[^>]*>\s*)?(?:struct|class|enum(?:\s+class)?|union)\s+(\w+)"),
    re.compile(r"^using\s+(\w+)\s*="),
    re.compile(
        r"^(?:static\s+|inline\s+|thread_local\s+)*(?:constexpr|const)\s+[\w:<>, ]+?[\s*&]+(\w+)\s*[=\[{;]"
    ),
    re.compile(
        r"^(?!return\b|else\b|if\b|for\b|while\b|switch\b|case\b|TORCH_|namespace\b)(?:[\w:<>,*&]+\s+)+[*&]*(\w+)\s*\("
    ),
)


def _defined_names(text: str) -> set[str]:
    """Types, aliases, constants and functions ``text`` defines at namespace scope, and the macros
    it defines and leaves defined."""
    names = set()
    for line in text.splitlines():
        for rx in _DEFINES:
            m = rx.match(line)
            if m:
                names.add(m.group(1))
                break
    macros = set(re.findall(r"^#define\s+(\w+)", text, re.M)) - set(
        re.findall(r"^#undef\s+(\w+)", text, re.M)
    )
    return names | macros


def test_the_scan_finds_what_a_source_defines():
    text = """namespace srt_cpu {
namespace {
constexpr int64_t kBlock = 16;
struct Plan {
  int x;
};
using RowsFn = void (*)(int);
template <typename T>
std::vector<int64_t> to_vector(const at::Tensor& t) {
  const int64_t local = 1;
  return {};
}
#define SRT_KEPT 1
#define SRT_DROPPED 2
#undef SRT_DROPPED
}  // namespace
at::Tensor run_panels(const at::Tensor& x) {
  return x;
}
}  // namespace srt_cpu
"""
    assert _defined_names(text) == {"kBlock", "Plan", "RowsFn", "to_vector", "SRT_KEPT", "run_panels"}


def test_the_files_of_one_unit_define_no_name_twice():
    """A unit compiles its sources as one file: a name two of them define (a constant, a helper in
    an anonymous namespace) would not compile, or, as an overload, could be picked by the other's
    calls; a macro one leaves defined would reach the next."""
    assert len(kbuild.SOURCES) == len(set(kbuild.SOURCES))
    assert len(kbuild.UNITS) >= 2 and all(kbuild.UNITS)
    for unit in kbuild.UNITS:
        names = {s: _defined_names((kbuild.SOURCE_DIR / s).read_text()) for s in unit}
        assert len(names[unit[0]]) > 5  # the scan reads the sources
        for a, b in itertools.combinations(unit, 2):
            assert not names[a] & names[b], f"{a} and {b} both define {sorted(names[a] & names[b])}"


def test_the_unit_files_include_every_source_once(tmp_path):
    paths = kbuild.write_units(tmp_path)
    included = [line.split('"')[1] for p in paths for line in open(p) if line.startswith("#include")]
    assert sorted(included) == sorted(str(kbuild.SOURCE_DIR / s) for s in kbuild.SOURCES)
    before = [os.stat(p).st_mtime_ns for p in paths]
    assert kbuild.write_units(tmp_path) == paths
    assert [os.stat(p).st_mtime_ns for p in paths] == before  # unchanged: ninja compiles nothing


def test_build_module_with_require_fails_without_a_compiler(tmp_path):
    """CI builds with --require: a kernel that does not build must turn CI red, not skip tests."""
    proc = _run_build(_no_compiler_env(tmp_path), "--require")
    assert proc.returncode == 1
    assert "NOT built" in proc.stdout and "no C++ compiler" in proc.stderr


def test_a_library_built_for_the_key_is_loaded_not_compiled_again(tmp_path):
    """Another checkout's set-up (or an earlier one) built the library for these sources: the build
    loads it, with no compiler needed and --require satisfied, and the op runs from it."""
    if not kernels.native_available():
        pytest.skip(f"no native library to reuse: {kernels.kernel_status()}")
    built = kbuild.prebuilt_library()
    assert built is not None
    env = _no_compiler_env(tmp_path)
    # the same key under another cache root: build_directory() with XDG_CACHE_HOME=tmp_path
    target = tmp_path / built.parent.relative_to(built.parents[3]) / built.name
    target.parent.mkdir(parents=True)
    shutil.copy2(built, target)
    proc = _run_build(env, "--require")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"reusing {target}" in proc.stderr
    assert f"{target} ready" in proc.stdout and "cpu isa:" in proc.stdout
    assert sorted(p.name for p in target.parent.iterdir()) == [kbuild.OWNER_LOCK, kbuild.NAME + ".so"]


def test_a_library_that_does_not_load_is_removed_and_built_again(tmp_path, monkeypatch):
    """A library cut short (a link killed half-way) is not trusted: the build removes it and
    compiles (here: finds no compiler, and says so)."""
    monkeypatch.setattr(kbuild, "build_directory", lambda: tmp_path)
    broken = kbuild.library_path()
    broken.write_bytes(b"\x7fELF cut short")
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        kbuild.build()
    assert not broken.exists()
    assert kbuild.prebuilt_library() is None


def test_a_build_removes_the_lock_a_killed_build_left(tmp_path, monkeypatch):
    """torch's builder waits forever on the baton file a killed build leaves behind; srt's build
    removes it while holding its own OS lock, then builds."""
    import torch.utils.cpp_extension as cpp

    (tmp_path / kbuild.TORCH_LOCK).write_text("")
    seen = {}

    def fake_load(**kwargs):
        seen["baton_at_load"] = (tmp_path / kbuild.TORCH_LOCK).exists()
        seen["build_directory"] = kwargs["build_directory"]

    monkeypatch.setattr(kbuild, "build_directory", lambda: tmp_path)
    monkeypatch.setattr(kbuild, "missing_tools", lambda: None)

    def fake_precompile(build_dir, base_cflags):  # the real one compiles ATen's headers (15-20 s)
        seen["precompiled_in"] = str(build_dir)

    monkeypatch.setattr(cpp, "load", fake_load)
    monkeypatch.setattr(kbuild.pch, "precompile", fake_precompile)
    kbuild.build()
    assert seen == {"baton_at_load": False, "build_directory": str(tmp_path), "precompiled_in": str(tmp_path)}
    assert kbuild.remove_leftover_lock(tmp_path) is False  # nothing left to remove

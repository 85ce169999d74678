"""The precompiled header of the kernel build (srt/kernels/cpu/pch.py): the flags reach torch's
compile line, the header is made only where ninja will compile, and a failed precompile leaves no
``.gch`` behind and says why. (The build itself runs with it in `make setup`; a compile with the
header is checked here on a small header, as ATen's takes a quarter of a minute.)"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess

import pytest

from srt.kernels.cpu import build as kbuild
from srt.kernels.cpu import pch


def _lines(tmp_path):
    sources = [str(kbuild.SOURCE_DIR / s) for s in kbuild.SOURCES]
    flags = [*kbuild.EXTRA_CFLAGS, *pch.flags(tmp_path)]
    full = pch.ninja_cflags(kbuild.NAME, sources, flags, list(kbuild.EXTRA_LDFLAGS))
    base = pch.ninja_cflags(kbuild.NAME, sources, list(kbuild.EXTRA_CFLAGS), list(kbuild.EXTRA_LDFLAGS))
    return full, base


def test_the_compile_line_takes_the_header_and_torchs_own_flags(tmp_path):
    full, base = _lines(tmp_path)
    assert full is not None and base is not None, "torch's ninja writer changed: the build has no PCH"
    header = tmp_path / pch.HEADER
    assert full == f"{base} -include {header} -Winvalid-pch"
    assert "-O3" in base and "-fopenmp" in base and "torch/include" in base
    assert "#include <ATen/ATen.h>" in header.read_text()


def test_the_header_is_made_only_where_ninja_will_compile(tmp_path):
    full, _ = _lines(tmp_path)
    library = tmp_path / "lib.so"
    assert pch.compile_needed(tmp_path, library, full)  # no library yet
    library.write_bytes(b"")
    assert pch.compile_needed(tmp_path, library, full)  # no record of the last build's flags
    (tmp_path / "build.ninja").write_text(f"ninja_required_version = 1.3\ncflags = {full}\n")
    assert not pch.compile_needed(tmp_path, library, full)
    assert pch.compile_needed(tmp_path, library, full.replace("-O3", "-O2"))


def test_a_failed_precompile_says_why_and_leaves_nothing(tmp_path, monkeypatch):
    pch.flags(tmp_path)
    (tmp_path / f"{pch.HEADER}.gch").write_bytes(b"stale")
    monkeypatch.setattr(pch, "is_gcc", lambda cxx: True)
    monkeypatch.setenv("CXX", "false")
    why = pch.precompile(tmp_path, "-O3")
    assert why == "exit 1"
    assert not (tmp_path / f"{pch.HEADER}.gch").exists()


def test_only_gcc_precompiles(tmp_path, monkeypatch):
    """clang stops on a .gch it cannot read, where g++ falls back to the header's text."""
    fake = tmp_path / "clang-like"
    fake.write_text("#!/bin/sh\necho '#define __GNUC__ 4'\necho '#define __clang__ 1'\n")
    fake.chmod(0o755)
    assert not pch.is_gcc(str(fake)) and not pch.is_gcc(str(tmp_path / "missing"))
    monkeypatch.setenv("CXX", str(fake))
    assert pch.precompile(tmp_path, "-O3") == f"{fake} is not g++"
    if shutil.which("g++"):
        assert pch.is_gcc("g++")


CXX = os.environ.get("CXX", "c++")


@pytest.mark.skipif(not pch.is_gcc(CXX), reason=f"{CXX} is not g++ (or missing): no precompiled header")
def test_a_precompiled_header_is_taken_and_a_missing_one_falls_back(tmp_path, monkeypatch):
    """The mechanism on a small header: the .gch is made with the given flags and g++ takes it
    (no -Winvalid-pch warning); without it, the same line compiles from the header's text."""
    monkeypatch.setattr(pch, "INCLUDES", ("vector",))
    flags = pch.flags(tmp_path)
    assert pch.precompile(tmp_path, "-O2 -fPIC -std=c++17") is None
    assert (tmp_path / f"{pch.HEADER}.gch").is_file()
    src = tmp_path / "a.cpp"
    src.write_text("int n() { return static_cast<int>(std::vector<int>(3).size()); }\n")
    cmd = [CXX, "-O2", "-fPIC", "-std=c++17", *flags, "-H", "-c", str(src), "-o", str(tmp_path / "a.o")]
    taken = subprocess.run(cmd, capture_output=True, text=True)
    assert taken.returncode == 0 and "warning" not in taken.stderr, taken.stderr
    assert f"! {tmp_path / pch.HEADER}.gch" in taken.stderr, shlex.join(cmd)  # -H marks a used PCH with !
    pch.remove(tmp_path)
    parsed = subprocess.run(cmd, capture_output=True, text=True)
    assert parsed.returncode == 0 and ".gch" not in parsed.stderr, parsed.stderr

"""A precompiled header for the build of ``srt_cpu_kernels`` (srt/kernels/cpu/build.py).

Every source includes ATen, whose headers take g++ about as long to parse as the source itself
takes to compile (7 s a file on a 2-core Xeon). The build therefore compiles those headers once
into ``srt_pch.h.gch`` in the build folder and puts ``-include srt_pch.h`` on every compile line;
g++ then loads the parsed headers instead of parsing them again (the build takes about two
thirds of the time). The code is the same as without it; the header order can change the order in which
inline functions are laid out, and the few sources that did not include ATen gain its static
initialisers.

The flags are fixed whether or not the ``.gch`` exists, so that ninja's record of each command
stays the same: where the ``.gch`` is missing or does not match the flags (g++ checks;
``-Winvalid-pch`` says so) g++ reads ``srt_pch.h`` as an ordinary header. The ``.gch`` (several hundred MiB) is
made only when ninja has sources to compile and removed after the build.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import tempfile
from pathlib import Path

HEADER = "srt_pch.h"
INCLUDES = (
    "ATen/ATen.h",
    "ATen/Parallel.h",
    "torch/library.h",
    "algorithm",
    "cmath",
    "cstdint",
    "cstring",
    "vector",
)


def flags(build_dir: Path) -> list[str]:
    """The compile flags that take the header (written here if absent) on every source."""
    header = build_dir / HEADER
    text = (
        "#ifndef SRT_PCH_H\n#define SRT_PCH_H\n" + "".join(f"#include <{i}>\n" for i in INCLUDES) + "#endif\n"
    )
    if not header.is_file() or header.read_text() != text:
        header.write_text(text)
    return ["-include", str(header), "-Winvalid-pch"]


def ninja_cflags(name: str, sources: list[str], cflags: list[str], ldflags: list[str]) -> str | None:
    """The ``cflags`` line torch's builder writes for these arguments, or None where its (private)
    writer is not there or changed."""
    try:
        from torch.utils.cpp_extension import _write_ninja_file_to_build_library as write
    except ImportError:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "build.ninja")
        try:
            write(path, name, sources, cflags, [], [], ldflags, [], False, False, False)
        except (TypeError, ValueError, OSError):
            return None
        return _cflags_line(Path(path))


def _cflags_line(ninja_file: Path) -> str | None:
    if not ninja_file.is_file():
        return None
    for line in ninja_file.read_text().splitlines():
        if line.startswith("cflags = "):
            return line[len("cflags = ") :]
    return None


def compile_needed(build_dir: Path, library: Path, cflags: str) -> bool:
    """Whether ninja will compile: no library yet, or the last build ran other flags."""
    return not library.is_file() or _cflags_line(build_dir / "build.ninja") != cflags


def is_gcc(cxx: str) -> bool:
    """Whether ``cxx`` is g++ (clang reads a ``.gch`` of its own format, and stops on a bad one)."""
    try:
        proc = subprocess.run([cxx, "-dM", "-E", "-x", "c++", os.devnull], capture_output=True, text=True)
    except OSError:
        return False
    return proc.returncode == 0 and "__GNUC__" in proc.stdout and "__clang__" not in proc.stdout


def precompile(build_dir: Path, base_cflags: str) -> str | None:
    """Compile the header with the sources' own flags; returns why not, or None when done."""
    cxx = os.environ.get("CXX", "c++")
    if not is_gcc(cxx):
        return f"{cxx} is not g++"
    header = build_dir / HEADER
    cmd = [cxx, *shlex.split(base_cflags), "-x", "c++-header", str(header), "-o", f"{header}.gch"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        remove(build_dir)
        return (proc.stderr or proc.stdout).strip()[-300:] or f"exit {proc.returncode}"
    return None


def remove(build_dir: Path) -> None:
    (build_dir / f"{HEADER}.gch").unlink(missing_ok=True)

"""Build (or find) srt's CPU extension ``srt_cpu_kernels``: ``python -m srt.kernels.cpu.build``.

The shared library goes to a cache folder keyed by everything that changes the binary::

    $XDG_CACHE_HOME (default ~/.cache) / srt / kernels / <torch version>-<hash>/srt_cpu_kernels.so
    hash = sha256(units, sources, compiler flags, Python ABI tag, machine)[:16]

so a prebuilt library is found without a compiler (``prebuilt_library``), reused by the next
set-up of the same sources (another checkout included) instead of compiled again, and a stale one is
never picked up. ``build`` compiles with ``torch.utils.cpp_extension.load`` (g++ and ninja, -O3, OpenMP
for ``at::parallel_for``; no -march: the AVX2 / AVX-512 paths carry their own target attributes and
are chosen at run time; the ATen headers are precompiled once, srt/kernels/cpu/pch.py; the sources
are compiled in a few units, ``UNITS``). Running
the module never fails: it prints what happened and exits 0, so ``make setup`` succeeds on a machine without a compiler (srt then uses the pure-torch fallback).
With ``--require`` (CI sets it: a test suite that passes on the fallbacks would hide a broken
kernel) a failed build exits 1.

torch's builder guards a build folder with a ``lock`` file that a killed build leaves behind, and
every later build would wait on it forever. ``build`` holds an OS lock of its own on the folder
(released by the kernel when its holder dies) and, holding it, removes such a leftover.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import torch

from srt.kernels.cpu import pch

NAME = "srt_cpu_kernels"
SOURCE_DIR = Path(__file__).resolve().parent
# The sources are compiled in a few units, each one file that includes several of them: every
# compile pays about 5 s of its own (loading the precompiled ATen headers, emitting their inline
# code), so four units instead of nineteen compiles cut the build's CPU time by about 40%. The
# units take about the same time to compile; the files of one unit must not define a name twice
# (tests/unit/test_kernel_build.py checks it).
UNITS = (
    ("decode_attention.cpp", "elementwise.cpp", "moe.cpp", "gguf_x8_a24.cpp", "gguf_simple.cpp"),
    ("bf16_linear.cpp", "gguf_q8act.cpp", "packed_linear.cpp", "w8a8_linear.cpp"),
    ("fp8_linear.cpp", "extend_attention.cpp", "gguf_a24.cpp", "threads.cpp", "w8a8_amx.cpp"),
    ("gguf_linear.cpp", "decode_layers.cpp", "gguf_kquant.cpp", "small_linear.cpp", "lora.cpp"),
)
SOURCES = tuple(sorted(s for unit in UNITS for s in unit))  # compiled
HEADERS = (
    "bf16_tiles.h",
    "cpu_ops.h",
    "decode_attention_kernel.h",
    "elementwise_rows.h",
    "extend_attention_kernel.h",
    "gguf_a24_split.h",
    "gguf_kquant_rows.h",
    "gguf_q8act_rows.h",
    "gguf_q8act_vnni.h",
    "gguf_quant.h",
    "gguf_simple_rows.h",
    "gguf_x8.h",
    "isa_instance_bf16.h",
    "isa_instances.h",
    "online_softmax.h",
    "small_linear_rows.h",
    "vec.h",
    "w8a8_codes.h",
)  # hashed with the sources
# tuples: cpp_extension.load appends to the lists it is given, which would change the hash
EXTRA_CFLAGS = ("-O3", "-fopenmp", "-fno-math-errno")
EXTRA_LDFLAGS = ("-fopenmp",)


def build_directory() -> Path:
    """The cache folder for this source, these flags, this torch and this Python."""
    h = hashlib.sha256(repr(UNITS).encode())
    for name in (*SOURCES, *HEADERS):
        h.update(name.encode())
        h.update((SOURCE_DIR / name).read_bytes())
    tag = [*EXTRA_CFLAGS, *EXTRA_LDFLAGS, sysconfig.get_config_var("SOABI") or "", platform.machine()]
    h.update("\0".join(tag).encode())
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "srt" / "kernels" / f"{torch.__version__}-{h.hexdigest()[:16]}"


def library_path() -> Path:
    return build_directory() / f"{NAME}.so"


def prebuilt_library() -> Path | None:
    """The built library for the current sources, or None (never compiles)."""
    path = library_path()
    return path if path.is_file() else None


def missing_tools() -> str | None:
    """Why a build cannot start (no C++ compiler, no ninja), or None."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx!r} not on PATH)"
    try:
        from torch.utils.cpp_extension import verify_ninja_availability

        verify_ninja_availability()
    except (RuntimeError, OSError) as e:
        return f"ninja unavailable ({e})"
    return None


def build(verbose: bool = False) -> Path:
    """Compile (if needed) and load the library into this process; returns its path.

    Raises RuntimeError (or OSError) when the tools are missing or the build fails; the message
    carries the compiler's output."""
    from torch.utils.cpp_extension import load

    build_dir = build_directory()
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / OWNER_LOCK, "a") as owner:  # closing the file releases the lock
        fcntl.flock(owner, fcntl.LOCK_EX)  # waits only on a live srt build of the same folder
        remove_leftover_lock(build_dir)
        if load_prebuilt():
            return library_path()
        why = missing_tools()
        if why is not None:
            raise RuntimeError(why)
        sources = write_units(build_dir)
        cflags = [*EXTRA_CFLAGS, *pch.flags(build_dir)]
        try:
            precompile_header(build_dir, sources, cflags)
            load(
                name=NAME,
                sources=sources,
                extra_cflags=cflags,
                extra_ldflags=list(EXTRA_LDFLAGS),
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=verbose,
            )
        finally:
            pch.remove(build_dir)
    return library_path()


def write_units(build_dir: Path) -> list[str]:
    """The unit files of ``UNITS`` in ``build_dir`` (each includes its sources from this
    checkout; rewritten only when that changes, so that ninja sees them unchanged); their paths."""
    paths = []
    for i, unit in enumerate(UNITS):
        path = build_dir / f"unit{i}.cpp"
        text = "// generated by srt/kernels/cpu/build.py\n" + "".join(
            f'#include "{SOURCE_DIR / s}"\n' for s in unit
        )
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
        paths.append(str(path))
    return paths


def load_prebuilt() -> bool:
    """Load the library already built for this key (another checkout of the same sources, an
    earlier set-up) into this process; True when it loaded. ninja would compile it all again:
    its build file names the sources by path, and each checkout has its own. One that does not
    load (cut short by a killed link) is removed and built again."""
    path = prebuilt_library()
    if path is None:
        return False
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as e:
        print(
            f"srt.kernels.cpu: {path} does not load ({summarize_error(e)}); building it again",
            file=sys.stderr,
        )
        path.unlink(missing_ok=True)
        return False
    print(f"srt.kernels.cpu: reusing {path}, built earlier from the same sources", file=sys.stderr)
    return True


def precompile_header(build_dir: Path, sources: list[str], cflags: list[str]) -> None:
    """The ATen headers compiled once for this build (srt/kernels/cpu/pch.py), where ninja has
    sources to compile; a failure is printed and the build parses the headers in each source."""
    full = pch.ninja_cflags(NAME, sources, cflags, list(EXTRA_LDFLAGS))
    base = pch.ninja_cflags(NAME, sources, list(EXTRA_CFLAGS), list(EXTRA_LDFLAGS))
    if full is None or base is None or not pch.compile_needed(build_dir, library_path(), full):
        return
    why = pch.precompile(build_dir, base)
    if why is not None:
        print(
            f"srt.kernels.cpu: no precompiled header ({why}); each source parses the headers", file=sys.stderr
        )


OWNER_LOCK = "srt-build.lock"  # flock-ed by the srt process building this folder
TORCH_LOCK = "lock"  # torch.utils.cpp_extension's file baton


def remove_leftover_lock(build_dir: Path) -> bool:
    """Remove torch's baton file from ``build_dir``; call only while holding OWNER_LOCK.

    Every srt build of a folder holds OWNER_LOCK while torch's baton exists, so a baton seen by
    the holder was left by a build that died. Returns whether one was removed."""
    baton = build_dir / TORCH_LOCK
    try:
        baton.unlink()
    except FileNotFoundError:
        return False
    print(f"srt.kernels.cpu: removed {baton}, left by a build that did not finish", file=sys.stderr)
    return True


def summarize_error(err: BaseException, limit: int = 400) -> str:
    """One line for a log: the compiler's first error lines when there are any."""
    text = str(err)
    errors = [ln.strip() for ln in text.splitlines() if "error" in ln.lower()]
    line = " | ".join(errors[:3]) if errors else " ".join(text.split())
    line = f"{type(err).__name__}: {line}"
    return line if len(line) <= limit else line[: limit - 3] + "..."


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    verbose = "-v" in argv or "--verbose" in argv
    require = "--require" in argv
    start = time.perf_counter()
    try:
        path = build(verbose=verbose)
    except Exception as e:  # noqa: BLE001 - setup must go on; the reason is printed
        print(
            f"srt.kernels.cpu: native kernels NOT built ({summarize_error(e)}); srt will use the pure-torch fallback"
        )
        if require:
            print(f"srt.kernels.cpu: --require: failing\n{e}", file=sys.stderr)
            return 1
        return 0
    isa = torch.ops.srt_cpu.cpu_isa()
    print(f"srt.kernels.cpu: {path} ready in {time.perf_counter() - start:.1f} s (cpu isa: {isa})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

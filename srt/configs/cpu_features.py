"""What the host offers, read without torch (the main process resolves ``ServerArgs`` with these and
stays free of torch on a CPU host): the ``SRT_CPU_ISA`` cap on srt's native ops, the CPU's AVX2 /
FMA flags, and whether an NVIDIA driver is present at all (without one torch cannot see a GPU, so
``--device auto`` means the CPU without asking torch)."""

from __future__ import annotations

import glob
import os

from srt.utils.errors import ConfigError

CPU_ISA_ENV = "SRT_CPU_ISA"
CPU_ISAS = ("scalar", "avx2", "avx512")  # narrowest first


def cpu_isa_cap() -> str | None:
    """``SRT_CPU_ISA``: the widest instruction set srt's native ops may run (``scalar``, ``avx2`` or
    ``avx512``; None when unset or empty). It only lowers what the CPU has, never raises it: tests
    set it to run the AVX2 and scalar paths on any CPU. The C++ side (``detect_isa()`` in vec.h)
    reads the same variable once; an unknown value raises ``ConfigError`` here, before any op runs."""
    value = os.environ.get(CPU_ISA_ENV, "")
    if value == "":
        return None
    if value not in CPU_ISAS:
        raise ConfigError(f"{CPU_ISA_ENV} must be one of {', '.join(CPU_ISAS)} (or unset), got {value!r}")
    return value


def cpu_has_avx2_fma() -> bool:
    """This x86-64 CPU has AVX2 + FMA (``/proc/cpuinfo``'s flags; every AVX-512 CPU has them) and
    ``SRT_CPU_ISA`` does not lower the native ops to scalar: where srt's native packed linear
    kernel (AVX2 or AVX-512 tile) was measured faster than oneDNN (``auto`` picks it there).
    False where the flags cannot be read."""
    if cpu_isa_cap() == "scalar":
        return False
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return {"avx2", "fma"} <= flags
    except OSError:
        pass
    return False


def nvidia_driver_present() -> bool:
    """Whether this host has an NVIDIA kernel driver loaded or device nodes (a container given a
    GPU has ``/dev/nvidia<N>``). False means no CUDA device is visible to anything, torch included."""
    return os.path.exists("/proc/driver/nvidia/version") or bool(glob.glob("/dev/nvidia[0-9]*"))

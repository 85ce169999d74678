"""What the host offers, read without torch (the main process resolves ``ServerArgs`` with these and
stays free of torch on a CPU host): the ``SRT_CPU_ISA`` cap on srt's native ops, the CPU's AVX2 /
FMA flags, and whether an NVIDIA driver is present at all (without one torch cannot see a GPU, so
``--device auto`` means the CPU without asking torch)."""

from __future__ import annotations

import functools
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


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo``'s first ``flags`` line); empty where unreadable."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_avx2_fma() -> bool:
    """This x86-64 CPU has AVX2 + FMA (every AVX-512 CPU has them) and ``SRT_CPU_ISA`` does not
    lower the native ops to scalar: where srt's native packed linear kernel (AVX2 or AVX-512 tile)
    was measured faster than oneDNN (``auto`` picks it there). False where the flags cannot be read."""
    return cpu_isa_cap() != "scalar" and {"avx2", "fma"} <= cpu_flags()


def cpu_bf16_units() -> str | None:
    """The CPU's bf16 arithmetic: ``"amx"`` (AMX-BF16 tiles, Intel Xeon from Sapphire Rapids on, which
    also have AVX512-BF16), ``"avx512_bf16"`` (``vdpbf16ps``: AMD Zen 4/5, Intel Cooper Lake) or None
    (AVX2-only CPUs, or ``SRT_CPU_ISA`` below avx512). Whether the units run without trapping is the
    bf16 probe's to say (srt/configs/bf16_probe.py). Intel's cores issue ``vdpbf16ps`` at half the
    FMA's rate: without AMX there, srt's bf16 linear widens the weights to float32 FMAs from 8 rows
    (srt/kernels/cpu/bf16_linear.cpp), the weights still stored in bf16."""
    cap = cpu_isa_cap()
    flags = cpu_flags()
    if (cap is not None and cap != "avx512") or not {"avx512f", "avx512bw", "avx512_bf16"} <= flags:
        return None
    return "amx" if "amx_bf16" in flags else "avx512_bf16"


def nvidia_driver_present() -> bool:
    """Whether this host has an NVIDIA kernel driver loaded or device nodes (a container given a
    GPU has ``/dev/nvidia<N>``). False means no CUDA device is visible to anything, torch included."""
    return os.path.exists("/proc/driver/nvidia/version") or bool(glob.glob("/dev/nvidia[0-9]*"))

"""The instruction sets srt's native CPU ops run, for tests that cover each ISA branch.

Every op takes the CPU's ISA from one place, ``detect_isa()`` in srt/kernels/cpu/vec.h: the widest
the CPU has, lowered by ``SRT_CPU_ISA``. ``cpu_isa()`` is that ISA in this process. A test of an
ISA above it is skipped with the reason (``isa_params``), never passed silently; the lowered runs
(tests/unit/test_isa_lowering.py) run the kernel tests again under ``SRT_CPU_ISA=avx2`` and
``scalar`` so the narrower branches run on any CPU.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from srt.kernels import cpu as cpu_kernels

ISAS = ("scalar", "avx2", "avx512")  # narrowest first, as in vec.h
ISA_RUNS = pytest.StashKey[list[str]]()  # one line per lowered run, for the report (tests/conftest.py)


@functools.cache
def cpu_isa() -> str | None:
    """The ISA the native ops run here, or None when the native kernels are unavailable."""
    if not cpu_kernels.load(build_if_missing=True):
        return None
    return torch.ops.srt_cpu.cpu_isa()


def hardware_isa() -> str | None:
    """The widest ISA the CPU has (``SRT_CPU_ISA`` does not change it)."""
    return torch.ops.srt_cpu.cpu_hardware_isa() if cpu_isa() is not None else None


def intel_cpu() -> bool:
    """Whether the CPU is Intel's (its cores issue ``vdpbf16ps`` at half the FMA's rate, so bf16
    matmuls of 8 rows or more take the widened weights there unless brgemm takes them)."""
    with open("/proc/cpuinfo") as f:
        return any(line.startswith("vendor_id") and "GenuineIntel" in line for line in f)


def cpuinfo_flags() -> set[str]:
    """The CPU's flags as /proc/cpuinfo lists them (the first processor's); skips the calling test
    where there is no /proc/cpuinfo. Tests that a kernel is there exactly when the CPU has its
    instructions compare against these, not against what the kernels detect themselves."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def isa_available(isa: str) -> bool:
    best = cpu_isa()
    return best is not None and ISAS.index(isa) <= ISAS.index(best)


def skip_reason(isa: str) -> str:
    if cpu_isa() is None:
        return f"native CPU kernels unavailable: {cpu_kernels.kernel_status()}"
    return f"this CPU runs up to {cpu_isa()} (hardware {hardware_isa()}), not {isa}"


def isa_params(isas: tuple[str, ...] = ISAS) -> list:
    """One pytest param per ISA, each above ``cpu_isa()`` marked skip with the reason."""
    return [
        pytest.param(
            isa, id=isa, marks=() if isa_available(isa) else pytest.mark.skip(reason=skip_reason(isa))
        )
        for isa in isas
    ]


def available_isas() -> list[str]:
    """Every ISA the ops run here, narrowest first (empty without the native kernels)."""
    return [isa for isa in ISAS if isa_available(isa)]


# argv: op name, the calls' argument lists (torch.save), where the outputs go (torch.save)
_OPS_UNDER_ISA = """
import sys, torch
from srt.kernels import cpu as cpu_kernels
cpu_kernels.load()
op = getattr(torch.ops.srt_cpu, sys.argv[1])
torch.save([op(*args) for args in torch.load(sys.argv[2])], sys.argv[3])
"""


def ops_under_isa(
    isa: str, op: str, calls: list[list[torch.Tensor | int]], tmp: Path, env: dict[str, str] | None = None
) -> list[torch.Tensor]:
    """``torch.ops.srt_cpu.<op>(*args)`` for each ``args`` of ``calls``, all in one fresh process
    under ``SRT_CPU_ISA=isa`` (the ISA is fixed per process), for checks that every ISA branch
    gives the same bits; ``env`` adds other variables the kernels read once per process (tuning
    knobs)."""
    torch.save([list(args) for args in calls], tmp / "calls.pt")
    argv = [sys.executable, "-c", _OPS_UNDER_ISA, op, str(tmp / "calls.pt"), str(tmp / "outs.pt")]
    subprocess.run(argv, check=True, env={**os.environ, **(env or {}), "SRT_CPU_ISA": isa}, timeout=300)
    return torch.load(tmp / "outs.pt")


def op_under_isa(
    isa: str, op: str, args: list[torch.Tensor | int], tmp: Path, env: dict[str, str] | None = None
) -> torch.Tensor:
    """One call of ``ops_under_isa``."""
    return ops_under_isa(isa, op, [args], tmp, env)[0]

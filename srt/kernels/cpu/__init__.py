"""CPU kernels: the one entry point srt calls, the native op when it is built, the reference otherwise.

    paged_decode_attention(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, scale,
                           window_left=-1, logit_cap=0.0)

runs ``torch.ops.srt_cpu.paged_decode_attention`` (decode_attention.cpp) when the extension is
loaded, else ``reference.paged_decode_attention_ref``; both have the same contract (see
``paged_decode_attention``). Loading happens on first use, or explicitly with ``load()``; it
never raises and never compiles unless asked (``load(build_if_missing=True)``): a server process
loads the library ``python -m srt.kernels.cpu.build`` left in its cache folder (see build.py).
``SRT_DISABLE_NATIVE_KERNELS=1`` forces the fallback. ``kernel_status()`` is one line for the log
naming what is in use and why, the instruction set included: every op runs the widest one the CPU
has, or what ``SRT_CPU_ISA`` (``scalar`` / ``avx2`` / ``avx512``) lowers it to (``detect_isa()`` in
vec.h; ``srt.configs.device.cpu_isa_cap`` validates the value, and ``load`` raises ``ConfigError``
for a bad one).

    bind_omp_threads(cpus) -> OmpBinding

pins OpenMP thread i of the caller's pool to ``cpus[i]`` (``torch.ops.srt_cpu.bind_omp_threads``,
threads.cpp), or, as its fallback, confines every thread of the process to the set.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from srt.configs.cpu_features import CPU_ISA_ENV, cpu_isa_cap
from srt.kernels.cpu.reference import paged_decode_attention_ref
from srt.utils.cpu_affinity import format_cpu_list, set_process_affinity, thread_ids

__all__ = [
    "DISABLE_ENV",
    "FALLBACK_STATUS",
    "OmpBinding",
    "bind_omp_threads",
    "kernel_status",
    "load",
    "native_available",
    "paged_decode_attention",
]

DISABLE_ENV = "SRT_DISABLE_NATIVE_KERNELS"
FALLBACK_STATUS = "fallback: pure-torch reference"  # kernel_status()'s prefix when the kernels are not in use


@dataclass(slots=True, frozen=True)
class KernelState:
    native: bool
    status: str  # one line: "native: ..." or "fallback: ... (why)"


_state: KernelState | None = None  # the last load() result (the library, once loaded, stays loaded)


def _op_registered(name: str = "paged_decode_attention") -> bool:
    try:
        getattr(torch.ops.srt_cpu, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def _native(where: str) -> KernelState:
    isa, hardware = torch.ops.srt_cpu.cpu_isa(), torch.ops.srt_cpu.cpu_hardware_isa()
    if isa != hardware:
        isa = f"{isa}, lowered from {hardware} by {CPU_ISA_ENV}"
    return KernelState(True, f"native: torch.ops.srt_cpu.paged_decode_attention ({isa}; {where})")


def _fallback(why: str) -> KernelState:
    return KernelState(False, f"{FALLBACK_STATUS} ({why})")


def _try_load(build_if_missing: bool) -> KernelState:
    cpu_isa_cap()  # a bad SRT_CPU_ISA raises here, before the library reads it
    if os.environ.get(DISABLE_ENV, "0") not in ("", "0"):
        return _fallback(f"{DISABLE_ENV}={os.environ[DISABLE_ENV]}")
    if _op_registered():
        return _native("already loaded")
    verb = "load"
    try:
        from srt.kernels.cpu import build as _build  # here, not at import: `python -m ...build` stays clean

        path = _build.prebuilt_library()
        if path is not None:
            torch.ops.load_library(str(path))
            return _native(str(path))
        if not build_if_missing:
            return _fallback(
                f"not built for these sources and torch {torch.__version__}: "
                f"run `python -m srt.kernels.cpu.build` (looked in {_build.build_directory()})"
            )
        verb = "build"
        return _native(f"built {_build.build()}")
    except Exception as e:  # noqa: BLE001 - any load/build failure means the fallback
        return _fallback(f"{verb} failed: {_build_error(e)}")


def _build_error(e: Exception) -> str:
    from srt.kernels.cpu.build import summarize_error

    return summarize_error(e)


def load(build_if_missing: bool = False) -> bool:
    """(Re)try to make the native op available; True when it is. Raises ``ConfigError`` for an
    invalid ``SRT_CPU_ISA``, nothing else (a failed load or build means the fallback)."""
    global _state
    _state = _try_load(build_if_missing)
    return _state.native


def _current() -> KernelState:
    if _state is None:
        load()
    assert _state is not None
    return _state


def native_available() -> bool:
    return _current().native


def kernel_status() -> str:
    """One line naming the implementation in use and why (build or load error included)."""
    return _current().status


def paged_decode_attention(
    q,
    k_buffer,
    v_buffer,
    req_to_token,
    req_pool_indices,
    seq_lens,
    scale: float,
    window_left: int = -1,
    logit_cap: float = 0.0,
) -> torch.Tensor:
    """Decode attention, one query token per sequence, K/V read through the page table.

    q [bs, H, D] float32; k_buffer, v_buffer [S, H_kv, D] float32/float16/bfloat16 (the pool's
    per-layer buffers, as they are); req_to_token [R, max_ctx] int64/int32; req_pool_indices [bs],
    seq_lens [bs] int64/int32 (CPU tensors) -> out [bs, H, D] float32, where

        out[i, h] = softmax_t(scale * q[i, h] . K[slot(i, t), h // G]) @ V[slot(i, t), h // G]
        slot(i, t) = req_to_token[req_pool_indices[i], t],  t < seq_lens[i],  G = H // H_kv.

    ``window_left`` >= 0: only ``t >= seq_lens[i] - 1 - window_left`` (the query sits at position
    ``seq_lens[i] - 1``; -1: every key); ``logit_cap`` > 0: the scaled scores ``s`` become
    ``logit_cap * tanh(s / logit_cap)`` before the softmax (0: off).
    """
    args = (q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, scale)
    if _current().native:
        return torch.ops.srt_cpu.paged_decode_attention(*args, window_left=window_left, logit_cap=logit_cap)
    return paged_decode_attention_ref(*args, window_left=window_left, logit_cap=logit_cap)


@dataclass(slots=True, frozen=True)
class OmpBinding:
    """What `bind_omp_threads` did. native: thread i (tid ``tids[i]``) pinned to ``cpus[i]``;
    fallback: every thread of the process (``tids``) confined to ``cpus``. ``failures`` is empty
    when every call succeeded."""

    native: bool
    cpus: tuple[int, ...]
    tids: tuple[int, ...]
    failures: tuple[str, ...]

    def describe(self) -> str:
        """One line: which path ran and the thread -> CPU map."""
        if self.native:
            pins = ", ".join(
                f"thread {i} (tid {t}) -> CPU {c}" for i, (t, c) in enumerate(zip(self.tids, self.cpus))
            )
            return f"native srt_cpu.bind_omp_threads, one OpenMP thread per CPU: {pins}"
        return (
            f"fallback os.sched_setaffinity: all {len(self.tids)} threads confined to CPU "
            f"{format_cpu_list(self.cpus)} together, not one per CPU ({kernel_status()})"
        )


def bind_omp_threads(cpus: Sequence[int]) -> OmpBinding:
    """Pin the OpenMP pool of the calling thread: team thread i to ``cpus[i]`` (len(cpus) threads;
    call ``torch.set_num_threads(len(cpus))`` first so torch's parallel regions use exactly that
    team). Without the native op, confine every thread of the process to ``cpus`` instead. Call
    it from the thread that runs the model. Raises only on an empty ``cpus``."""
    if not cpus:
        raise ValueError("bind_omp_threads: give at least one CPU")
    cpus = tuple(int(c) for c in cpus)
    if _current().native and _op_registered("bind_omp_threads"):
        rows = torch.ops.srt_cpu.bind_omp_threads(list(cpus)).tolist()
        failures = tuple(
            f"thread {i} -> CPU {c}: " + ("not started" if tid < 0 else os.strerror(err))
            for i, (tid, c, err) in enumerate(rows)
            if err != 0
        )
        return OmpBinding(True, cpus, tuple(r[0] for r in rows), failures)
    tids = tuple(thread_ids())
    return OmpBinding(False, cpus, tids, tuple(set_process_affinity(cpus)))

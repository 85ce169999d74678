"""How a CPU scheduler process gets and gives back memory (glibc's allocator and torch's).

A big model's prefill allocates activations of tens of MiB per layer (a 2,048-token chunk of a
Llama-3.1-8B shape: 32 MiB hidden states, 48 MiB q/k/v, a 224 MiB gate/up output). glibc serves
a block below its mmap threshold from the heap, and that threshold rises by itself to 32 MiB, so
most of those blocks land in the heap; chunks of varying sizes then leave it fragmented, and
freed pages stay resident. On that shape with a full 4,096-token pool the scheduler held about
700 MiB beyond its weights and pool after a few prefills.

``configure_cpu_allocator(hidden_size)`` (called in the scheduler child before torch is imported),
for models of hidden size ``BIG_HIDDEN_SIZE`` (4096, a 7-8B model) or more:

* a fixed mmap threshold of ``MMAP_THRESHOLD_BYTES`` (4 MiB): every block that large is its own
  mapping, returned to the OS when freed; decode steps' small tensors stay in the heap;
* torch's transparent huge pages for tensors of 2 MiB or more (``THP_MEM_ALLOC_ENABLE=1``, read
  by torch at its first allocation): a fresh mapping then faults in 2 MiB at a time, which keeps
  those per-layer mappings cheap (alone, the 4 MiB threshold slowed a 2,048-token prefill of a
  Qwen2.5-1.5B shape by about 10%; with huge pages it was as fast as before).

Smaller models keep glibc's and torch's defaults: a fresh mapping costs the same page faults
whatever the model, but a small model does little arithmetic per byte of activations, so they
show (SmolLM2-135M, 2,048-token prefill: 23% slower with both settings, 5% with huge pages
alone), while its heap stays small.

Either setting the user made (``MALLOC_MMAP_THRESHOLD_``, ``THP_MEM_ALLOC_ENABLE`` in the
environment) is left as it is. Measured figures: docs/configuration.md and
docs/benchmark-history.md. Standard library only.
"""

from __future__ import annotations

import ctypes
import os
import sys

BIG_HIDDEN_SIZE = 4096
MMAP_THRESHOLD_BYTES = 4 << 20
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
THP_ENV = "THP_MEM_ALLOC_ENABLE"
MMAP_THRESHOLD_ENV = "MALLOC_MMAP_THRESHOLD_"


def _libc() -> ctypes.CDLL | None:
    if sys.platform != "linux":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl): nothing to tune
        return None


def configure_cpu_allocator(hidden_size: int | None) -> str:
    """Apply the settings above in this process (before torch's first allocation) for a model of
    ``hidden_size`` (None: unknown, defaults kept); returns what was done, for the log."""
    if hidden_size is None:
        return "allocator: glibc's and torch's defaults (the model's hidden size is unknown)"
    if hidden_size < BIG_HIDDEN_SIZE:
        return f"allocator: glibc's and torch's defaults (hidden size {hidden_size} < {BIG_HIDDEN_SIZE})"
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return "allocator: not glibc, left as it is"
    done = []
    if MMAP_THRESHOLD_ENV in os.environ:
        done.append(f"mmap threshold from {MMAP_THRESHOLD_ENV}={os.environ[MMAP_THRESHOLD_ENV]}")
    elif libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1:
        done.append(f"mmap threshold {MMAP_THRESHOLD_BYTES >> 20} MiB")
    else:
        done.append("mmap threshold unchanged (mallopt refused)")
    if THP_ENV in os.environ:
        done.append(f"{THP_ENV}={os.environ[THP_ENV]} (as set)")
    else:
        os.environ[THP_ENV] = "1"
        done.append("huge pages for tensors of 2 MiB or more")
    return "allocator: " + "; ".join(done)


def release_free_memory() -> None:
    """Return the allocator's freed pages to the OS (glibc ``malloc_trim``): after loading, the
    per-tensor temporaries of loading would otherwise stay in the resident set."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)

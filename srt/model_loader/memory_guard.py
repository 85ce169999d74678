"""Stop a weight load that would run past the machine's memory, with the figures, before the
kernel's out-of-memory killer does it without a word.

The parameters are allocated untouched and their pages are committed as the weights are written,
so a model larger than the memory used to load for minutes until the OOM killer stopped the
scheduler with SIGKILL: "exited with code -9" and nothing in its log. ``LoadMemoryGuard`` is
told of each checkpoint tensor or dummy parameter before it is written, and raises `ConfigError`
when less memory is free (``free_cpu_memory``: the system's available memory, within the
cgroup's limit) than that write may take: twice the tensor's bytes (a bf16 tensor widened to
float32 parameters, or a dummy value drawn in float32 and copied) plus ``MARGIN``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from srt.mem_cache.pool_size import available_cpu_memory, process_rss_bytes
from srt.utils.errors import ConfigError

MARGIN = 128 << 20  # bytes left free beyond a write's own: the process's other allocations


def free_cpu_memory() -> int:
    """Bytes this process may still commit (``available_cpu_memory`` less what it holds)."""
    return available_cpu_memory() - process_rss_bytes()


class LoadMemoryGuard:
    """See the module docstring. ``free``: the free-memory reader (tests pass their own).

    The memory is read again only when a tensor is larger than the room left by the previous
    reading (half of what was free less ``MARGIN``, less the bytes since): a few readings while
    memory is plentiful, one per tensor near the limit (a model of 18,000 expert tensors would
    otherwise read ``/proc`` 18,000 times)."""

    def __init__(self, free: Callable[[], int] | None = None) -> None:
        self.free = free or free_cpu_memory
        self.room = 0  # bytes that may still be written before the memory is read again
        self.written = 0  # bytes of the tensors checked so far
        self.tensors = 0

    def check(self, name: str, nbytes: int) -> None:
        """Before writing ``name`` (``nbytes`` as stored or drawn): `ConfigError` when it may not fit."""
        if nbytes > self.room:
            free = self.free()
            self.room = max(0, free - MARGIN) // 2
            if nbytes > self.room:
                raise ConfigError(
                    f"the model's weights do not fit in this machine's memory: {free / 2**20:.1f} MiB "
                    f"left before {name} ({nbytes / 2**20:.1f} MiB), after {self.tensors} tensors "
                    f"({self.written / 2**30:.1f} GiB) were loaded. Serve a smaller model or a "
                    "quantized checkpoint (GGUF, AWQ / GPTQ, compressed-tensors; docs/models.md), "
                    "keep a bf16 checkpoint in bf16 (--dtype auto), or shard it over more machines "
                    "(--tp-size, --nnodes)."
                )
        self.room -= nbytes
        self.written += nbytes
        self.tensors += 1

    def iterate(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """``weights`` (``(name, tensor)`` pairs), each checked before it is handed on."""
        for name, tensor in weights:
            self.check(name, int(getattr(tensor, "nbytes", 0)))
            yield name, tensor

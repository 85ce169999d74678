"""KV pool sizing: pure arithmetic plus thin readers of the memory figures it needs.

The protocol (as TGI's warm-up): the ModelRunner loads the weights, runs one dummy extend of
the largest prefill the scheduler may form, and measures the activation peak of that forward.
Then, with ``--mem-fraction-static`` (always on CUDA, where it defaults to 0.88)::

    budget      = mem_fraction_static * total_memory_of_the_process
    kv_bytes    = budget - weight_bytes - activation_peak_bytes
    max_tokens  = floor(kv_bytes / kv_bytes_per_token), rounded down to a whole page

and on CPU without it (``cpu_auto_max_num_tokens``), from what is left once the model is in::

    free        = total_memory_of_the_process - weight_bytes - activation_peak_bytes
    kv_bytes    = max(CPU_KV_SHARE * free, min(one full-context request, free - CPU_HEADROOM))

so the KV cache takes half of the free memory (the rest stays for the other processes, the page
cache and growth), and at least one request of the whole context length where 1 GiB still stays
free. The CPU pool's memory is committed as it is written, so a large pool costs no RSS up front.

``total_memory_of_the_process``:
    CPU   psutil's available memory + this process's RSS (memory the process holds already
          counts as usable), capped by the cgroup limit when one is set
          (limit - cgroup usage + RSS: other processes in the cgroup keep theirs).
    CUDA  ``torch.cuda.mem_get_info()`` total.

``--max-total-tokens`` overrides the result (no profiling is done then).

``max_running_requests`` when not given:
    CUDA  min(max_total_tokens // 2, 4096)
    CPU   min(max_total_tokens // 2, 256) -- a CPU forward over more than a few hundred decoding
          sequences is slower than serving them in turns, so a small cap keeps latency sane.
The ReqToTokenPool gets ``max_running_requests + REQ_POOL_HEADROOM`` rows: a request being
prefilled in chunks holds a row while the running batch is full. Its rows (and the rope tables)
are ``max_positions`` wide: min(context length, pool), since a request's KV must fit the pool.
"""

from __future__ import annotations

import os

from srt.utils.pages import page_floor

REQ_POOL_HEADROOM = 8
CPU_MAX_RUNNING_REQUESTS = 256
CUDA_MAX_RUNNING_REQUESTS = 4096

_GIB = 1 << 30
# CPU without --mem-fraction-static: the share of the free memory the KV cache takes, and what
# the floor of one full-context request always leaves free
CPU_KV_SHARE = 0.5
CPU_HEADROOM = _GIB


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_size: int) -> int:
    """Bytes of K and V of one token over all layers: ``2 * layers * kv_heads * head_dim * dtype_size``."""
    return 2 * layers * kv_heads * head_dim * dtype_size


def profile_max_num_tokens(
    available_bytes: int,
    mem_fraction_static: float,
    weight_bytes: int,
    activation_peak_bytes: int,
    bytes_per_token: int,
    page_size: int,
) -> int:
    """KV pool size in tokens (a multiple of ``page_size``; 0 when nothing is left for KV).

    ``available_bytes``: total memory usable by the process (see the module docstring);
    ``weight_bytes``: the loaded weights; ``activation_peak_bytes``: peak memory growth of one
    forward at the maximum prefill size.
    """
    if bytes_per_token <= 0 or page_size <= 0:
        raise ValueError(f"bytes_per_token and page_size must be > 0, got {bytes_per_token}, {page_size}")
    budget = int(available_bytes * mem_fraction_static) - weight_bytes - activation_peak_bytes
    if budget <= 0:
        return 0
    return page_floor(budget // bytes_per_token, page_size)


def cpu_auto_max_num_tokens(
    available_bytes: int,
    static_bytes: int,
    activation_peak_bytes: int,
    bytes_per_token: int,
    page_size: int,
    context_len: int,
) -> int:
    """KV pool size in tokens on CPU without ``--mem-fraction-static`` (module docstring); 0 when
    nothing is left. ``static_bytes``: the weights and the request table."""
    if bytes_per_token <= 0 or page_size <= 0:
        raise ValueError(f"bytes_per_token and page_size must be > 0, got {bytes_per_token}, {page_size}")
    free = available_bytes - static_bytes - activation_peak_bytes
    budget = max(int(free * CPU_KV_SHARE), min(context_len * bytes_per_token, free - CPU_HEADROOM))
    if budget <= 0:
        return 0
    return page_floor(budget // bytes_per_token, page_size)


def cpu_process_memory(
    sys_available: int, process_rss: int, cgroup_limit: int | None, cgroup_usage: int | None
) -> int:
    """Memory the process may use on CPU: ``available + rss``, capped by the cgroup's room.

    ``cgroup_limit``/``cgroup_usage``: bytes, or None when no limit is set (or it is unreadable).
    """
    total = sys_available + process_rss
    if cgroup_limit is not None:
        usage = cgroup_usage if cgroup_usage is not None else process_rss
        total = min(total, max(0, cgroup_limit - usage) + process_rss)
    return total


def default_max_running_requests(max_total_tokens: int, device: str) -> int:
    """See the module docstring: at least 1, at most 4096 (CUDA) / 256 (CPU)."""
    cap = CUDA_MAX_RUNNING_REQUESTS if device == "cuda" else CPU_MAX_RUNNING_REQUESTS
    return max(1, min(max_total_tokens // 2, cap))


def max_positions(context_len: int, max_total_tokens: int) -> int:
    """Positions a request can reach: its prompt plus its new tokens fit both the context length
    and the whole KV pool (``request_fit``). A Llama-3.1-8B config's 131,072-token rows would
    cost 1 MiB each (int64) for a pool of a few thousand tokens."""
    return max(1, min(context_len, max_total_tokens))


def req_to_token_pool_size(max_running_requests: int) -> int:
    return max_running_requests + REQ_POOL_HEADROOM


def profile_prefill_tokens(max_prefill_tokens: int, chunked_prefill_size: int | None) -> int:
    """Tokens of the dummy extend used to measure the activation peak: the largest extend the
    scheduler may form, i.e. ``max_prefill_tokens``, or ``chunked_prefill_size`` when smaller
    (<= 0 or None means chunking is disabled)."""
    if chunked_prefill_size is not None and 0 < chunked_prefill_size < max_prefill_tokens:
        return chunked_prefill_size
    return max_prefill_tokens


def split_into_sequences(num_tokens: int, max_seq_len: int) -> list[int]:
    """Split ``num_tokens`` into sequence lengths of at most ``max_seq_len`` (the dummy extend
    cannot exceed the model's context length per sequence)."""
    if num_tokens <= 0:
        return []
    full, rest = divmod(num_tokens, max_seq_len)
    return [max_seq_len] * full + ([rest] if rest else [])


def format_kv_cache_line(num_tokens: int, kv_bytes: int, page_size: int, max_prefill_tokens: int) -> str:
    """The one start-up log line describing the KV cache."""
    return (
        f"KV cache: {num_tokens} tokens, {kv_bytes / _GIB:.2f} GiB, page size {page_size}, "
        f"max prefill tokens {max_prefill_tokens}"
    )


# ---------------------------------------------------------------- readers (not pure)
def read_cgroup_memory() -> tuple[int | None, int | None]:
    """``(limit, usage)`` in bytes of this process's memory cgroup (v2, then v1); None when unlimited."""
    candidates = [
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ]
    for limit_path, usage_path in candidates:
        limit = _read_int(limit_path)
        if limit is None:
            continue
        # cgroup v1 reports "no limit" as a huge number close to 2**63
        if limit >= 1 << 60:
            return None, None
        return limit, _read_int(usage_path)
    return None, None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def available_cpu_memory() -> int:
    """Total memory usable by this process on CPU (see ``cpu_process_memory``)."""
    import psutil

    limit, usage = read_cgroup_memory()
    rss = psutil.Process(os.getpid()).memory_info().rss
    return cpu_process_memory(psutil.virtual_memory().available, rss, limit, usage)


def process_rss_bytes() -> int:
    """This process's resident memory now (bytes)."""
    return _proc_status_kib("VmRSS") * 1024


class PeakRSSMeter:
    """Peak resident-memory growth of this process over a region (Linux ``VmHWM``).

    ``start()`` resets the kernel's high-water mark (``/proc/self/clear_refs`` <- 5) and records
    the current RSS; ``peak_growth()`` returns ``VmHWM - rss_at_start`` (>= 0). Where the reset is
    not possible the high-water mark may predate ``start()``; then the growth falls back to
    ``max(0, VmHWM - rss_at_start)``, an over-estimate, which errs on the safe side.
    """

    def __init__(self) -> None:
        self._start_rss = 0

    def start(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        self._start_rss = _proc_status_kib("VmRSS") * 1024

    def peak_growth(self) -> int:
        hwm = _proc_status_kib("VmHWM") * 1024
        return max(0, hwm - self._start_rss)


def _proc_status_kib(key: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    import psutil

    return psutil.Process(os.getpid()).memory_info().rss // 1024

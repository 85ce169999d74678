"""What compare_servers measures beside the client's figures: each server's resident memory, the
machine's bounds, and each run as a fraction of its bound.

* ``GroupRss``: a thread that sums VmRSS over every process of a server's process group (srt's
  three processes, vLLM's engine core, llama.cpp's one) every ``interval_s`` and keeps the
  peak; the group is the one ``start_new_session=True`` made.
* ``machine_bounds()``: measured while no server runs: the memory read bandwidth (the best of
  ``torch.sum`` over 1 GiB at one thread and at all threads) and the float32 and bf16 matmul rates
  (a 512 x 4096 x 4096 matmul at all threads: float32 the best of torch's and oneDNN's, bf16 the
  best of oneDNN's and srt's bf16 linear).
* ``fractions(run, shape, bounds)``: a single stream's TPOT p50 against the weights read per
  token over the bandwidth (``tpot_bound_fraction`` = bound / measured); a batch's matmul FLOPs
  per second (``model_shapes.matmul_flops``: every prompt and output token through the decoder,
  the LM head once per output token) against the matmul rate in the checkpoint's dtype
  (``matmul_fraction``). Both are at most 1 for a server that does the least work.
"""

from __future__ import annotations

import os
import threading

from benchmarks.model_shapes import Shape, checkpoint_dtype, matmul_flops, weight_bytes_per_token

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # field 5 of stat: the process group
            pids.append(int(entry))
    return pids


def group_rss_bytes(pgid: int) -> int:
    """Resident bytes of every process in process group ``pgid`` (0 when none is left)."""
    total = 0
    for pid in group_pids(pgid):
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * PAGE
        except (OSError, IndexError, ValueError):
            continue
    return total


class GroupRss:
    """Peak resident memory of a process group, sampled on a daemon thread while in use."""

    def __init__(self, pgid: int, interval_s: float = 1.0) -> None:
        self.pgid, self.interval_s = pgid, interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="group-rss")

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def sample(self) -> int:
        now = group_rss_bytes(self.pgid)
        self.peak = max(self.peak, now)
        return now

    def __enter__(self) -> GroupRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def machine_bounds() -> dict[str, float]:
    """{"read_gbs": GB/s, "matmul_gflops": float32 GFLOP/s, "bf16_matmul_gflops": bf16 GFLOP/s},
    measured here and now."""
    import torch

    from benchmarks.common import _time_matmul, memory_read_bandwidth

    read = memory_read_bandwidth(1.0, repeats=5)["bandwidth_gbs"]
    rate = _time_matmul(512, 4096, 4096, 0.5)
    bf16 = _time_matmul(512, 4096, 4096, 0.5, torch.bfloat16)
    return {
        "read_gbs": round(read, 2),
        "matmul_gflops": round(rate / 1e9, 1),
        "bf16_matmul_gflops": round(bf16 / 1e9, 1),
        "threads": torch.get_num_threads(),
    }


def matmul_rate_key(shape: Shape) -> str:
    """The bound a shape's matmuls are held to: the bf16 matmul rate for a bf16 checkpoint, else
    the float32 one."""
    return "bf16_matmul_gflops" if checkpoint_dtype(shape) == "bfloat16" else "matmul_gflops"


def fractions(run: dict, shape: Shape, bounds: dict, read_bytes: int | None = None) -> dict[str, float]:
    """The run's figures as fractions of their bounds (module docstring); {} when unknown.
    ``read_bytes``: a decoded token's weight bytes when not the shape's (a quantized checkpoint)."""
    out: dict[str, float] = {}
    tpot = run.get("median_tpot_ms")
    if run.get("concurrency") == 1 and tpot and bounds.get("read_gbs"):
        read = weight_bytes_per_token(shape) if read_bytes is None else read_bytes
        bound_ms = read / (bounds["read_gbs"] * 1e9) * 1e3
        out["tpot_bound_ms"] = round(bound_ms, 2)
        out["tpot_bound_fraction"] = round(bound_ms / tpot, 3)
    metrics = run.get("all_metrics", {})
    dur = metrics.get("duration_s")
    n_in, n_out = metrics.get("total_input") or 0, metrics.get("total_output") or 0
    rate = bounds.get(matmul_rate_key(shape))
    if dur and n_in + n_out and rate:
        achieved = matmul_flops(shape, n_in, n_out) / dur
        out["matmul_fraction"] = round(achieved / (rate * 1e9), 3)
    return out


def plot_throughput(rounds: list[dict], title: str, path: str) -> None:
    """Output tok/s against concurrency, one line per server and round (``rounds``: compare_servers'
    per-round ``{"servers": {name: {"runs": [...]}}}``), written to ``path`` (PNG, matplotlib Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, rnd in enumerate(rounds):
        for name, sec in rnd["servers"].items():
            runs = sorted(sec.get("runs", []), key=lambda r: r["concurrency"])
            if not runs:
                continue
            label = name if len(rounds) == 1 else f"{name}, round {i + 1}"
            xs = [r["concurrency"] for r in runs]
            ax.plot(xs, [r["output_throughput"] for r in runs], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens/s")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

"""Per-step timing histograms: scheduling time vs forward time, and the scheduler-overhead ratio.

For every step that ran a forward, ``Scheduler.step`` measures (``time.perf_counter``)::

    forward     the model runner's ``forward_batch_generation`` call (GPU: up to its results on
                the CPU, which the output processing needs at once)
    scheduling  the rest of the step: batch formation, grammar masks, result processing, output
                building, the idle/integrity bookkeeping (message handling between steps is not
                counted)
    overhead    scheduling / (scheduling + forward), the fraction of the step not spent in the model

The histograms are cumulative bucket counts kept in plain Python (no prometheus_client in the
scheduler process); ``snapshot()`` travels in ``GetInternalStateReqOutput.state["step_histograms"]``
and `srt.managers.tokenizer.metrics` turns it into Prometheus histograms at scrape time.

``StepTrace`` (``--step-trace-path``) writes the same two times per step with the step's work (its
tokens, rows, KV read and attention pairs), one JSON line each, for a benchmark to hold every step
against the machine's bounds.
"""

from __future__ import annotations

import bisect
import json
import time
from dataclasses import dataclass, field
from typing import Any

SCHEDULING_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
FORWARD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
RATIO_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.75, 0.9, 1.0)


@dataclass(slots=True)
class Histogram:
    """Counts per bucket (``counts[i]``: observations <= ``bounds[i]``, not cumulative; the last
    entry counts those above every bound), their sum and number."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def snapshot(self) -> dict[str, Any]:
        """``{"bounds", "cumulative" (one per bound, then +Inf == count), "sum", "count"}``."""
        cumulative, total = [], 0
        for c in self.counts:
            total += c
            cumulative.append(total)
        return {"bounds": list(self.bounds), "cumulative": cumulative, "sum": self.sum, "count": self.count}


@dataclass(slots=True)
class StepTimings:
    """The three per-step histograms (module docstring)."""

    scheduling: Histogram = field(default_factory=lambda: Histogram(SCHEDULING_BUCKETS))
    forward: Histogram = field(default_factory=lambda: Histogram(FORWARD_BUCKETS))
    overhead: Histogram = field(default_factory=lambda: Histogram(RATIO_BUCKETS))

    def observe(self, step_seconds: float, forward_seconds: float) -> None:
        """One step that ran a forward: ``step_seconds`` in all, ``forward_seconds`` of it in the model."""
        scheduling = max(step_seconds - forward_seconds, 0.0)
        self.scheduling.observe(scheduling)
        self.forward.observe(forward_seconds)
        total = scheduling + forward_seconds
        if total > 0:
            self.overhead.observe(scheduling / total)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        return {
            "scheduling_seconds": self.scheduling.snapshot(),
            "forward_seconds": self.forward.snapshot(),
            "overhead_ratio": self.overhead.snapshot(),
        }


# ---------------------------------------------------------------- the step trace (--step-trace-path)
def step_work(prefix_lens: list[int], extend_lens: list[int]) -> dict[str, int]:
    """What one forward computes, from its rows' prefix and new-token lengths (a decode row: its
    KV length before the step and 1)::

        rows      sequences in the batch (each gives at most one row of logits)
        tokens    new tokens through the decoder (the matmuls' rows)
        kv        KV tokens the rows' attention reads, prefix and new (the KV bytes of the step)
        pairs     query-key pairs attention scores, causal (the attention FLOPs)
    """
    pairs = sum(p * n + n * (n + 1) // 2 for p, n in zip(prefix_lens, extend_lens))
    return {
        "rows": len(extend_lens),
        "tokens": sum(extend_lens),
        "kv": sum(prefix_lens) + sum(extend_lens),
        "pairs": pairs,
    }


class StepTrace:
    """One JSON line per completed forward, appended to a file (``--step-trace-path``)::

        {"t": 1796205123.031, "step_s": 0.141, "forward_s": 0.139, "mode": "decode",
         "rows": 32, "tokens": 32, "kv": 9120, "pairs": 9120}

    ``t``: the step's start, in seconds since the epoch (``time.time()``'s clock, so that a client
    can pick the steps of its own run); ``step_s`` and ``forward_s`` as in ``StepTimings.observe``;
    the rest is ``step_work``. What a step costs at the machine's bounds (weights and KV read at
    the memory bandwidth, FLOPs at the matmul rate) is the reader's to work out
    (``benchmarks/roofline.py``). Lines are flushed one by one, so a reader sees every completed
    step while the server runs."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1)  # line buffered

    def record(
        self, step_start: float, step_s: float, forward_s: float, mode: str, work: dict[str, int]
    ) -> None:
        """One step: ``step_start`` is its ``time.perf_counter()`` at the start."""
        t = time.time() - (time.perf_counter() - step_start)
        line = {"t": round(t, 6), "step_s": round(step_s, 6), "forward_s": round(forward_s, 6), "mode": mode}
        self._file.write(json.dumps({**line, **work}, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()


def trace_path(path: str, dp_rank: int | None) -> str:
    """The trace file of one data-parallel group: ``path`` itself without data parallelism,
    ``path.dp<rank>`` with it."""
    return path if dp_rank is None else f"{path}.dp{dp_rank}"

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
"""

from __future__ import annotations

import bisect
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

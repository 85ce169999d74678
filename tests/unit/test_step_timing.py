"""The scheduler's per-step histograms (plain cumulative counts) and their Prometheus export."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from srt.managers.scheduler.step_timing import Histogram, StepTimings
from srt.managers.tokenizer.metrics import TokenizerMetrics


def test_histogram_buckets_are_cumulative_with_inf_last():
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0, 7.0):
        h.observe(v)
    snap = h.snapshot()
    assert snap["cumulative"] == [2, 3, 5] and snap["count"] == 5
    assert snap["sum"] == pytest.approx(10.65)


def test_step_timings_split_a_step_into_scheduling_and_forward():
    t = StepTimings()
    t.observe(step_seconds=0.010, forward_seconds=0.008)
    t.observe(step_seconds=0.004, forward_seconds=0.005)  # clock noise: scheduling clamps at 0
    snap = t.snapshot()
    assert snap["scheduling_seconds"]["sum"] == pytest.approx(0.002)
    assert snap["forward_seconds"]["sum"] == pytest.approx(0.013)
    assert snap["overhead_ratio"]["count"] == 2
    assert snap["overhead_ratio"]["sum"] == pytest.approx(0.2)


def test_prometheus_export_of_the_scheduler_histograms():
    t = StepTimings()
    for _ in range(3):
        t.observe(0.011, 0.010)
    m = TokenizerMetrics("m")
    text = m.render({"step_histograms": t.snapshot(), "num_retractions": 2}).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    fwd = fams["srt:step_forward_seconds"]
    assert fwd.type == "histogram"
    samples = {(s.name, s.labels.get("le")): s.value for s in fwd.samples}
    assert samples[("srt:step_forward_seconds_count", None)] == 3
    assert samples[("srt:step_forward_seconds_bucket", "+Inf")] == 3
    assert samples[("srt:step_forward_seconds_bucket", "0.005")] == 0
    assert samples[("srt:step_forward_seconds_bucket", "0.01")] == 3
    frac = fams["srt:scheduler_overhead_fraction"].samples[0].value
    assert frac == pytest.approx(0.003 / 0.033)
    assert "srt:step_scheduler_overhead_ratio" in fams and "srt:step_scheduling_seconds" in fams
    # no state (the scheduler did not answer): no histogram, the rest still renders
    assert "srt:step_forward_seconds" not in m.render(None).decode()

"""Prometheus families of the data-parallel controller's state (``--dp-size > 1``), one series
per group labelled ``dp_rank``, rendered at /metrics from the ``dp_controller`` entry of the
merged scheduler state (`srt.managers.data_parallel.policy.DpRouter.state`). Nothing without it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# controller state key -> (metric name, help, is_counter)
_DP_SERIES = {
    "num_routed_reqs": ("srt:dp_routed_reqs", "Requests the controller routed to each group.", True),
    "load_tokens": (
        "srt:dp_load_tokens",
        "A group's queued + running tokens as last reported, plus the requests routed since.",
        False,
    ),
    "reported_running_reqs": ("srt:dp_running_reqs", "Requests running in a group (last report).", False),
    "reported_queued_reqs": ("srt:dp_queued_reqs", "Requests waiting in a group (last report).", False),
    "num_live_reqs": ("srt:dp_live_reqs", "Requests routed to a group and not yet finished.", False),
}


def dp_controller_families(
    controller: dict[str, Any] | None, label_names: list[str], label_values: list[str]
) -> Iterator[Any]:
    """The controller's per-group series (nothing when ``controller`` is None)."""
    if not controller:
        return
    for key, (name, help_, is_counter) in _DP_SERIES.items():
        values = controller.get(key)
        if not isinstance(values, list):
            continue
        cls = CounterMetricFamily if is_counter else GaugeMetricFamily
        fam = cls(name, help_, labels=[*label_names, "dp_rank"])
        for rank, v in enumerate(values):
            fam.add_metric([*label_values, str(rank)], float(v))
        yield fam

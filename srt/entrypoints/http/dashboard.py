"""The built-in web page's data: GET /dashboard_state, computed only when asked.

It reads what GET /metrics reads (the scheduler's live state through
``TokenizerManager.get_internal_state`` and the request histograms of `TokenizerMetrics`) and
returns plain JSON; the page keeps the samples and derives windowed figures (rates, percentiles,
means per step) from the differences between two of them::

    {"time": unix seconds,
     "scheduler": null (no answer in time) | {"num_running_reqs", "num_queued_reqs", "token_usage",
                  "max_total_num_tokens", "available_size", "evictable_size", "cache_hit_rate",
                  "gen_throughput", "num_generated_tokens", "num_admitted_input_tokens",
                  "num_admitted_cached_tokens", "num_finished", "num_aborted", "num_retractions",
                  "step": {"scheduling_seconds" | "forward_seconds": {"sum", "count"}}},
     "requests": {"in_flight": requests sent to the scheduler and not finished,
                  "ttft", "itl", "e2e": {"bounds", "cumulative", "count", "sum"} (since start)},
     "config": {"model", "model_path", "dtype", "device", "attention_backend", ...}}
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from srt.managers.tokenizer.tokenizer_manager import TokenizerManager
from srt.utils.errors import SrtError

_SCHEDULER_KEYS = (
    "num_running_reqs",
    "num_queued_reqs",
    "token_usage",
    "max_total_num_tokens",
    "available_size",
    "evictable_size",
    "cache_hit_rate",
    "gen_throughput",
    "num_generated_tokens",
    "num_admitted_input_tokens",
    "num_admitted_cached_tokens",
    "num_finished",
    "num_aborted",
    "num_retractions",
)
_CONFIG_ARGS = (
    "model_path",
    "dtype",
    "kv_cache_dtype",
    "device",
    "quantization",
    "attention_backend",
    "linear_backend",
    "grammar_backend",
    "schedule_policy",
    "chunked_prefill_size",
    "tp_size",
    "dp_size",
    "speculative_algorithm",
)
_CAPACITY = ("max_total_num_tokens", "max_running_requests", "page_size", "context_len")


def histogram_state(histogram: Any) -> dict[str, Any]:
    """A prometheus_client ``Histogram`` (one label set) as ``{"bounds": finite upper bounds,
    "cumulative": counts <= each bound, "count", "sum"}``."""
    bounds: list[float] = []
    cumulative: list[float] = []
    count = total = 0.0
    for family in histogram.collect():
        for s in family.samples:
            if s.name.endswith("_bucket") and s.labels.get("le") != "+Inf":
                bounds.append(float(s.labels["le"]))
                cumulative.append(s.value)
            elif s.name.endswith("_count"):
                count = s.value
            elif s.name.endswith("_sum"):
                total = s.value
    return {"bounds": bounds, "cumulative": cumulative, "count": count, "sum": total}


def scheduler_view(state: dict[str, Any]) -> dict[str, Any]:
    """The figures the page charts from the scheduler's (maybe data-parallel merged) state."""
    out = {k: state.get(k) for k in _SCHEDULER_KEYS}
    hists = state.get("step_histograms") or {}
    out["step"] = {
        k: {"sum": h.get("sum", 0.0), "count": h.get("count", 0)}
        for k in ("scheduling_seconds", "forward_seconds")
        if isinstance(h := hists.get(k), dict)
    }
    return out


def config_view(tm: TokenizerManager) -> dict[str, Any]:
    """The server's configuration at a glance (resolved arguments and the scheduler's capacity)."""
    args = tm.server_args
    out: dict[str, Any] = {"model": tm.model_name}
    out.update({k: getattr(args, k, None) for k in _CONFIG_ARGS})
    out.update({k: tm.scheduler_info.get(k) for k in _CAPACITY})
    out["api_key"] = bool(args.api_key)
    return out


async def dashboard_state(tm: TokenizerManager) -> dict[str, Any]:
    """The body of GET /dashboard_state (module docstring)."""
    try:
        scheduler: dict[str, Any] | None = scheduler_view(await tm.get_internal_state())
    except (SrtError, asyncio.TimeoutError):
        scheduler = None
    m, labels = tm.metrics, tm.metrics.labels
    return {
        "time": time.time(),
        "scheduler": scheduler,
        "requests": {
            "in_flight": tm.num_in_flight,
            "ttft": histogram_state(m.ttft.labels(**labels)),
            "itl": histogram_state(m.itl.labels(**labels)),
            "e2e": histogram_state(m.e2e.labels(**labels)),
        },
        "config": config_view(tm),
    }

"""Prometheus metrics of the serving layer (text format at GET /metrics).

Two sources:
- the tokenizer manager observes every request: histograms of time to first token, inter-token
  latency, end-to-end latency and scheduler queue time; counters of prompt / generation tokens,
  finished requests and aborts by reason;
- the scheduler's live state (``GetInternalStateReqOutput.state``, fetched at scrape time) becomes
  gauges (running / queued requests, KV token usage, available KV tokens, cache hit rate,
  generation throughput), the retraction counter, and the per-step histograms the scheduler keeps
  as cumulative bucket counts (`srt.managers.scheduler.step_timing`): scheduling time, forward
  time and their ratio, plus the overall scheduler-overhead fraction as a gauge.

Aborts are counted by ``reason``: client (disconnect, /abort_request), timeout (the request's
deadline), queue_time (--max-queue-time), shutdown (graceful drain), error (anything else).

Each TokenizerManager owns its own ``CollectorRegistry`` (several Engines may live in one process).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from srt.managers.data_parallel.metrics import dp_controller_families

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)
# tokens per speculative decode step (1 .. --speculative-num-draft-tokens + 1)
_ACCEPT_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)

# scheduler state key -> (metric name, help)
_SCHEDULER_GAUGES = {
    "num_running_reqs": ("srt:num_running_reqs", "Requests running in the scheduler."),
    "num_queued_reqs": ("srt:num_queue_reqs", "Requests waiting in the scheduler queue."),
    "token_usage": ("srt:token_usage", "Fraction of the KV pool used by running requests."),
    "available_size": ("srt:available_kv_tokens", "Free KV slots (excluding the evictable cache)."),
    "evictable_size": ("srt:evictable_kv_tokens", "KV slots held by the prefix cache, evictable."),
    "max_total_num_tokens": ("srt:max_total_num_tokens", "KV pool size in tokens."),
    "cache_hit_rate": ("srt:cache_hit_rate", "Prefix cache hit rate (matched / looked-up tokens)."),
    "gen_throughput": ("srt:gen_throughput", "Recent generation throughput (tokens/s)."),
}


# scheduler state["step_histograms"] key -> (metric name, help)
_STEP_HISTOGRAMS = {
    "scheduling_seconds": (
        "srt:step_scheduling_seconds",
        "Per step: scheduler CPU time outside the forward (batching, masks, output processing).",
    ),
    "forward_seconds": ("srt:step_forward_seconds", "Per step: time in the model forward."),
    "overhead_ratio": (
        "srt:step_scheduler_overhead_ratio",
        "Per step: scheduling time / (scheduling + forward time).",
    ),
}


def _step_histograms(state: dict[str, Any], names: list[str], values: list[str]) -> Iterator[Any]:
    """The scheduler's per-step histograms (cumulative bucket counts) and the overhead gauge."""
    hists = state.get("step_histograms")
    if not isinstance(hists, dict):
        return
    for key, (name, help_) in _STEP_HISTOGRAMS.items():
        h = hists.get(key)
        if not isinstance(h, dict):
            continue
        fam = HistogramMetricFamily(name, help_, labels=names)
        buckets = [(repr(float(b)), float(c)) for b, c in zip(h["bounds"], h["cumulative"])]
        buckets.append(("+Inf", float(h["count"])))
        fam.add_metric(values, buckets, float(h["sum"]))
        yield fam
    sched, fwd = hists.get("scheduling_seconds"), hists.get("forward_seconds")
    if isinstance(sched, dict) and isinstance(fwd, dict):
        total = float(sched["sum"]) + float(fwd["sum"])
        g = GaugeMetricFamily(
            "srt:scheduler_overhead_fraction",
            "Scheduling time / (scheduling + forward time) over every step since start.",
            labels=names,
        )
        g.add_metric(values, float(sched["sum"]) / total if total > 0 else 0.0)
        yield g


class _SchedulerStateCollector(Collector):
    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = labels
        self.state: dict[str, Any] = {}

    def collect(self) -> Iterator[Any]:
        names, values = list(self.labels), list(self.labels.values())
        for key, (name, help_) in _SCHEDULER_GAUGES.items():
            g = GaugeMetricFamily(name, help_, labels=names)
            v = self.state.get(key)
            if isinstance(v, (int, float)):
                g.add_metric(values, float(v))
            yield g
        c = CounterMetricFamily(
            "srt:num_retracted_reqs", "Requests retracted to free KV memory.", labels=names
        )
        v = self.state.get("num_retractions")
        if isinstance(v, (int, float)):
            c.add_metric(values, float(v))
        yield c
        yield from _step_histograms(self.state, names, values)
        yield from dp_controller_families(self.state.get("dp_controller"), names, values)


class TokenizerMetrics:
    """Request-level metrics observed by the tokenizer manager (all times in seconds)."""

    def __init__(self, model_name: str) -> None:
        disable_created_metrics()  # no *_created series (process-wide prometheus_client setting)
        self.registry = CollectorRegistry()
        self.labels = {"model_name": model_name}
        lbl = list(self.labels)
        r = self.registry
        self.prompt_tokens = Counter("srt:prompt_tokens", "Prompt tokens processed.", lbl, registry=r)
        self.generation_tokens = Counter("srt:generation_tokens", "Tokens generated.", lbl, registry=r)
        self.cached_tokens = Counter(
            "srt:cached_tokens", "Prompt tokens served from the prefix cache.", lbl, registry=r
        )
        self.num_requests = Counter("srt:num_requests", "Requests finished (any reason).", lbl, registry=r)
        self.aborted = Counter(
            "srt:num_aborted_requests", "Requests aborted, by reason.", [*lbl, "reason"], registry=r
        )
        self.ttft = Histogram(
            "srt:time_to_first_token_seconds",
            "Time to first token.",
            lbl,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "srt:inter_token_latency_seconds",
            "Time between output tokens.",
            lbl,
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "srt:e2e_request_latency_seconds",
            "End-to-end request latency.",
            lbl,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "srt:queue_time_seconds",
            "Time waiting in the scheduler queue.",
            lbl,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.spec_accept = Histogram(
            "srt:spec_accept_length",
            "Speculative decoding: tokens a request's decode step produced (drafts accepted + 1).",
            lbl,
            buckets=_ACCEPT_BUCKETS,
            registry=r,
        )
        self._scheduler = _SchedulerStateCollector(self.labels)
        r.register(self._scheduler)
        self._l = self.labels

    # ---------------------------------------------------------------- observations
    def observe_first_token(self, ttft: float) -> None:
        self.ttft.labels(**self._l).observe(ttft)

    def observe_tokens(self, gap: float, num_tokens: int) -> None:
        """``num_tokens`` new output tokens arrived ``gap`` seconds after the previous ones."""
        if num_tokens > 0:
            h = self.itl.labels(**self._l)
            per = gap / num_tokens
            for _ in range(num_tokens):
                h.observe(per)

    def observe_spec_accepts(self, accept_lens: list[int]) -> None:
        h = self.spec_accept.labels(**self._l)
        for n in accept_lens:
            h.observe(n)

    def observe_queue_time(self, seconds: float) -> None:
        self.queue_time.labels(**self._l).observe(seconds)

    def observe_finished(
        self,
        e2e: float,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int,
        abort_reason: str | None,
    ) -> None:
        self.e2e.labels(**self._l).observe(e2e)
        self.prompt_tokens.labels(**self._l).inc(prompt_tokens)
        self.generation_tokens.labels(**self._l).inc(completion_tokens)
        self.cached_tokens.labels(**self._l).inc(cached_tokens)
        self.num_requests.labels(**self._l).inc()
        if abort_reason is not None:
            self.aborted.labels(**self._l, reason=abort_reason).inc()

    # ---------------------------------------------------------------- export
    def render(self, scheduler_state: dict[str, Any] | None) -> bytes:
        """Prometheus text exposition, with the scheduler gauges taken from ``scheduler_state``."""
        self._scheduler.state = scheduler_state or {}
        return generate_latest(self.registry)

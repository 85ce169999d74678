"""Serving-benchmark arithmetic, free of I/O so that it can be checked by hand.

Timeline of one streamed request (all times from ``time.perf_counter``)::

    send_time      t_0 (first content chunk)   t_1 ...   t_{k-1}   end_time
        |-------------|------------------------|---------|-----------|
        <---- TTFT --->< ITL_1 >                <ITL_{k-1}>
        <------------------------------ E2E latency ------------------->

* TTFT = t_0 - send_time.
* ITL  = gaps between consecutive content chunks (a chunk may carry several tokens; the
  gap is then counted once, as SGLang does).
* E2E  = end_time - send_time.
* TPOT = (E2E - TTFT) / (output_len - 1), defined only when output_len > 1.

Aggregates (``calculate_metrics``) cover successful requests only; failed requests are
counted separately and never enter a latency or throughput figure.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

RESULT_BLOCK_TITLE = " Serving Benchmark Result "
_LABEL_WIDTH = 40


@dataclass(slots=True)
class RequestOutput:
    """What one benchmark request produced.

    ``chunk_times`` are the absolute arrival times of the chunks that carried content, and
    ``chunk_tokens`` the number of output tokens each carried when the server says so
    (native ``meta_info.completion_tokens``), else 1 per chunk. ``output_len`` is the server's
    completion-token count when it reports one, else the retokenized length of ``generated_text``.
    """

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    generated_text: str = ""
    send_time: float = 0.0
    end_time: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    cached_tokens: int | None = None

    @property
    def ttft(self) -> float:
        return request_ttft(self.send_time, self.chunk_times)

    @property
    def itl(self) -> list[float]:
        return request_itl(self.chunk_times)

    @property
    def latency(self) -> float:
        return self.end_time - self.send_time


def request_ttft(send_time: float, chunk_times: Sequence[float]) -> float:
    """Time to first token: first content chunk minus send time (0.0 when no chunk came)."""
    return chunk_times[0] - send_time if chunk_times else 0.0


def request_itl(chunk_times: Sequence[float]) -> list[float]:
    """Inter-token latencies: the gaps between consecutive content chunks."""
    return [b - a for a, b in zip(chunk_times[:-1], chunk_times[1:])]


def request_tpot(latency: float, ttft: float, output_len: int) -> float | None:
    """Time per output token after the first: (E2E - TTFT) / (output_len - 1); None if output_len <= 1."""
    if output_len <= 1:
        return None
    return (latency - ttft) / (output_len - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (linear interpolation, numpy's default); 0.0 for no values."""
    return float(np.percentile(values, q)) if len(values) else 0.0


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else 0.0


def _median(values: Sequence[float]) -> float:
    return float(np.median(values)) if len(values) else 0.0


@dataclass(slots=True)
class BenchmarkMetrics:
    """Aggregate figures of one run. Latencies are in milliseconds, throughputs per second."""

    completed: int
    failed: int
    duration_s: float
    total_input: int
    total_output: int
    total_output_retokenized: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_throughput: float
    concurrency: float
    mean_e2e_latency_ms: float
    median_e2e_latency_ms: float
    p99_e2e_latency_ms: float
    mean_ttft_ms: float
    median_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float
    median_tpot_ms: float
    p99_tpot_ms: float
    mean_itl_ms: float
    median_itl_ms: float
    p95_itl_ms: float
    p99_itl_ms: float
    max_itl_ms: float
    cache_hit_rate: float | None = None

    def to_dict(self) -> dict[str, float | int | None]:
        return dataclasses.asdict(self)


_STATS = {
    "mean": _mean,
    "median": _median,
    "p95": lambda xs: percentile(xs, 95),
    "p99": lambda xs: percentile(xs, 99),
    "max": lambda xs: max(xs) if xs else 0.0,
}


def _stats_ms(field: str, xs: Sequence[float], stats: tuple[str, ...] = ("mean", "median", "p99")) -> dict:
    """``{"<stat>_<field>_ms": ...}``: the stats of ``xs`` (seconds) in milliseconds."""
    return {f"{s}_{field}_ms": _STATS[s](xs) * 1000.0 for s in stats}


def calculate_metrics(
    outputs: Sequence[RequestOutput],
    duration_s: float,
    retokenized_lens: Sequence[int] | None = None,
) -> BenchmarkMetrics:
    """Aggregate per-request outputs of a run that lasted ``duration_s`` seconds.

    ``retokenized_lens[i]`` is the token count of ``outputs[i].generated_text`` (defaults to
    ``output_len``). Concurrency is the mean number of requests in flight: the sum of the
    successful requests' E2E latencies divided by the duration. The cache hit rate is the
    fraction of input tokens the server reports as served from its prefix cache, when every
    successful request carries ``cached_tokens``.
    """
    ok = [o for o in outputs if o.success]
    retok = list(retokenized_lens) if retokenized_lens is not None else [o.output_len for o in outputs]
    total_input = sum(o.prompt_len for o in ok)
    total_output = sum(o.output_len for o in ok)
    total_retok = sum(r for o, r in zip(outputs, retok) if o.success)
    ttfts = [o.ttft for o in ok]
    e2es = [o.latency for o in ok]
    itls = [x for o in ok for x in o.itl]
    tpots = [t for o in ok if (t := request_tpot(o.latency, o.ttft, o.output_len)) is not None]
    cache_hit_rate = None
    if ok and all(o.cached_tokens is not None for o in ok) and total_input > 0:
        cache_hit_rate = sum(o.cached_tokens or 0 for o in ok) / total_input
    dur = duration_s if duration_s > 0 else math.inf
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(outputs) - len(ok),
        duration_s=duration_s,
        total_input=total_input,
        total_output=total_output,
        total_output_retokenized=total_retok,
        request_throughput=len(ok) / dur,
        input_throughput=total_input / dur,
        output_throughput=total_output / dur,
        total_throughput=(total_input + total_output) / dur,
        concurrency=sum(e2es) / dur,
        **_stats_ms("e2e_latency", e2es),
        **_stats_ms("ttft", ttfts),
        **_stats_ms("tpot", tpots),
        **_stats_ms("itl", itls, ("mean", "median", "p95", "p99", "max")),
        cache_hit_rate=cache_hit_rate,
    )


def throughput_timeline(
    outputs: Sequence[RequestOutput], start_time: float, bin_s: float
) -> tuple[list[float], list[float]]:
    """Output tokens/s in consecutive bins of ``bin_s`` seconds from ``start_time``.

    Returns (bin start times relative to start_time, tokens/s in that bin), built from the
    content chunks of successful requests weighted by ``chunk_tokens``.
    """
    events = [
        (t - start_time, n)
        for o in outputs
        if o.success
        for t, n in zip(o.chunk_times, o.chunk_tokens or [1] * len(o.chunk_times))
    ]
    if not events:
        return [], []
    nbins = int(max(t for t, _ in events) // bin_s) + 1
    counts = [0.0] * nbins
    for t, n in events:
        counts[max(0, int(t // bin_s))] += n
    return [i * bin_s for i in range(nbins)], [c / bin_s for c in counts]


def _section(title: str) -> str:
    return f"{title:-^50}"


def _row(label: str, value: object) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{label:<{_LABEL_WIDTH}} {value!s:<10}".rstrip()


_STAT_NAMES = {"mean": "Mean", "median": "Median", "p95": "P95", "p99": "P99", "max": "Max"}


def _stat_rows(
    title: str,
    label: str,
    m: BenchmarkMetrics,
    field: str,
    stats: tuple[str, ...] = ("mean", "median", "p99"),
) -> list[str]:
    """A section of the block: ``Mean <label> (ms):`` ... read from ``m.<stat>_<field>_ms``."""
    return [_section(title)] + [
        _row(f"{_STAT_NAMES[s]} {label} (ms):", getattr(m, f"{s}_{field}_ms")) for s in stats
    ]


def format_result_block(
    m: BenchmarkMetrics,
    backend: str,
    request_rate: float,
    max_concurrency: int | None,
) -> str:
    """SGLang's result block, with its labels, for one run."""
    lines = [
        f"{RESULT_BLOCK_TITLE:=^50}",
        _row("Backend:", backend),
        _row("Traffic request rate:", "inf" if math.isinf(request_rate) else request_rate),
        _row("Max request concurrency:", max_concurrency if max_concurrency is not None else "not set"),
        _row("Successful requests:", m.completed),
        _row("Failed requests:", m.failed),
        _row("Benchmark duration (s):", m.duration_s),
        _row("Total input tokens:", m.total_input),
        _row("Total generated tokens:", m.total_output),
        _row("Total generated tokens (retokenized):", m.total_output_retokenized),
        _row("Request throughput (req/s):", m.request_throughput),
        _row("Input token throughput (tok/s):", m.input_throughput),
        _row("Output token throughput (tok/s):", m.output_throughput),
        _row("Total token throughput (tok/s):", m.total_throughput),
        _row("Concurrency:", m.concurrency),
    ]
    if m.cache_hit_rate is not None:
        lines.append(_row("Prefix cache hit rate:", m.cache_hit_rate))
    lines += [
        *_stat_rows("End-to-End Latency", "E2E Latency", m, "e2e_latency"),
        *_stat_rows("Time to First Token", "TTFT", m, "ttft"),
        *_stat_rows("Time per Output Token (excl. 1st token)", "TPOT", m, "tpot"),
        *_stat_rows("Inter-Token Latency", "ITL", m, "itl", ("mean", "median", "p95", "p99", "max")),
        "=" * 50,
    ]
    return "\n".join(lines)


_ROW_RE = re.compile(r"^(?P<label>[^:=\-][^:]*):\s+(?P<value>\S.*?)\s*$")


def parse_result_block(text: str) -> dict[str, float | str]:
    """Parse the rows of the (last) result block in ``text`` into {label: value}.

    Labels are returned without the trailing colon (e.g. ``"Successful requests"``); values
    that read as numbers become floats, others ("inf", "not set", backend names) stay strings
    except "inf", which becomes ``math.inf``. Raises ``ValueError`` when no block is found.
    """
    start = text.rfind(f"{RESULT_BLOCK_TITLE:=^50}")
    if start < 0:
        raise ValueError("no 'Serving Benchmark Result' block found")
    out: dict[str, float | str] = {}
    for line in text[start:].splitlines()[1:]:
        if line.startswith("=" * 50):
            break
        m = _ROW_RE.match(line)
        if not m:
            continue
        value = m.group("value")
        try:
            out[m.group("label")] = float(value)
        except ValueError:
            out[m.group("label")] = value
    return out

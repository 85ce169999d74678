"""The metrics part: scheduler counters and its log lines (logger ``srt.scheduler``), in
SGLang's shape::

    Prefill batch. #new-seq: 3, #new-token: 812, #cached-token: 400, token usage: 0.12, #running-req: 5, #queue-req: 2
    Decode batch. #running-req: 8, #token: 2310, token usage: 0.18, gen throughput (token/s): 95.31, #queue-req: 0
    Retract requests. #retracted: 2, #running-req: 6, #queue-req: 4, new_token_ratio: 0.80

(the decode line ends with ``, accept len: 2.41`` with speculative decoding: tokens per request
decode step over the window). A prefill line per prefill (or mixed) step; a decode line at most
once per ``--decode-log-interval`` decode steps; a retract line per step that retracted. The other parts
count into one shared ``SchedulerMetrics``; ``snapshot()`` feeds ``get_internal_state``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

logger = logging.getLogger("srt.scheduler")


@dataclass(slots=True)
class SchedulerMetrics:
    decode_log_interval: int = 40
    # totals since start
    num_steps: int = 0
    num_decode_steps: int = 0
    num_prefill_steps: int = 0
    num_mixed_steps: int = 0
    num_overlapped_steps: int = 0  # launched while the batch before was still in flight
    num_generated_tokens: int = 0
    num_prefill_tokens: int = 0  # tokens computed by extends (chunks included)
    num_admitted_input_tokens: int = 0  # input tokens of (re)admitted requests
    num_admitted_cached_tokens: int = 0  # of which served from the prefix cache
    num_retractions: int = 0
    num_retract_aborts: int = 0
    num_rejected: int = 0
    num_aborted: int = 0
    num_finished: int = 0
    # speculative decoding: request decode steps (each verifies a draft, maybe empty), drafted
    # tokens, tokens those steps produced
    num_verify_steps: int = 0
    num_draft_tokens: int = 0
    num_verify_tokens: int = 0
    # decode log window
    _window_start: float = field(default_factory=time.perf_counter)
    _window_tokens: int = 0
    _last_throughput: float = 0.0
    _window_verify: tuple[int, int] = (0, 0)  # (steps, tokens) at the window start

    @property
    def cache_hit_rate(self) -> float:
        """Fraction of the input tokens of admitted requests that came from the prefix cache."""
        n = self.num_admitted_input_tokens
        return self.num_admitted_cached_tokens / n if n else 0.0

    @property
    def gen_throughput(self) -> float:
        """Generated tokens per second over the last decode log window (or the current one)."""
        if self._last_throughput:
            return self._last_throughput
        dt = time.perf_counter() - self._window_start
        return self._window_tokens / dt if dt > 0 else 0.0

    def snapshot(self) -> dict[str, float | int]:
        """Every counter (``num_*``) plus ``cache_hit_rate`` and ``gen_throughput``."""
        out: dict[str, float | int] = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name.startswith("num_")
        }
        out["cache_hit_rate"] = self.cache_hit_rate
        out["gen_throughput"] = self.gen_throughput
        out["spec_accept_length"] = self.spec_accept_length
        return out

    @property
    def spec_accept_length(self) -> float:
        """Tokens per request decode step with speculative decoding (0.0 without it)."""
        n = self.num_verify_steps
        return self.num_verify_tokens / n if n else 0.0

    def on_verify(self, drafted: int, produced: int) -> None:
        """One request's decode step under speculative decoding."""
        self.num_verify_steps += 1
        self.num_draft_tokens += drafted
        self.num_verify_tokens += produced

    def on_generated(self, n: int) -> None:
        self.num_generated_tokens += n
        self._window_tokens += n

    def log_prefill(
        self, new_seq: int, new_token: int, cached_token: int, token_usage: float, running: int, queue: int
    ) -> None:
        self.num_prefill_steps += 1
        self.num_prefill_tokens += new_token
        if logger.isEnabledFor(logging.INFO):
            logger.info(
                "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
                "#running-req: %d, #queue-req: %d",
                new_seq,
                new_token,
                cached_token,
                token_usage,
                running,
                queue,
            )

    def on_decode_step(self, running: int, num_tokens: int, token_usage: float, queue: int) -> None:
        """Count one decode step; log the decode line every ``decode_log_interval`` steps."""
        self.num_decode_steps += 1
        if self.decode_log_interval <= 0 or self.num_decode_steps % self.decode_log_interval:
            return
        now = time.perf_counter()
        dt = now - self._window_start
        self._last_throughput = self._window_tokens / dt if dt > 0 else 0.0
        self._window_start, self._window_tokens = now, 0
        if not logger.isEnabledFor(logging.INFO):
            return
        spec = ""
        if self.num_verify_steps:  # the window's mean accept length
            steps, tokens = self._window_verify
            self._window_verify = (self.num_verify_steps, self.num_verify_tokens)
            n = self.num_verify_steps - steps
            spec = f", accept len: {(self.num_verify_tokens - tokens) / n:.2f}" if n else ""
        logger.info(
            "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, gen throughput (token/s): %.2f, "
            "#queue-req: %d%s",
            running,
            num_tokens,
            token_usage,
            self._last_throughput,
            queue,
            spec,
        )

    def log_retract(self, retracted: int, running: int, queue: int, new_token_ratio: float) -> None:
        logger.info(
            "Retract requests. #retracted: %d, #running-req: %d, #queue-req: %d, new_token_ratio: %.2f",
            retracted,
            running,
            queue,
            new_token_ratio,
        )

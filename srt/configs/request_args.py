"""The fields of ``ServerArgs`` that bound what one request may ask of the server and how long it
may wait for it, and how ``resolve()`` checks them.

Each limit turns a request that would cost the server more than it can give (a queue past its
length, a wait past its bound, a logprob payload the size of the vocabulary on every token) into a
clean refusal: 429 or 503 with Retry-After for the queue, 413 for a body past its size, 400 for
what the request asked.

This module is configuration: it imports nothing of srt but srt.configs.lora_args' ``arg_field``
and srt.utils. The tokenizer manager reads these fields by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from srt.configs.lora_args import arg_field
from srt.utils.errors import ConfigError


@dataclass
class RequestLimitArgs:
    max_queued_requests: int | None = arg_field(
        None, "Reject requests beyond this many waiting with HTTP 429."
    )
    max_queue_time: float | None = arg_field(
        None,
        "Refuse a request that waited longer than this many seconds in the scheduler's queue without "
        "starting: HTTP 503 with Retry-After (a stream ends with an error event). None: no bound.",
    )
    max_request_body_bytes: int = arg_field(
        64 * 1024 * 1024,
        "The largest HTTP request body accepted, in bytes (inline images and token-id lists count); "
        "larger gets HTTP 413 without being read into memory. The default, 64 MiB, is above the "
        "OpenAI API's own 50 MB bound on a request.",
    )
    max_sequences_per_request: int = arg_field(
        65536,
        "The most sequences one request may ask for: its prompts (a batch, a prompt list) times n "
        "(and the most prompts one /tokenize call takes). "
        "More is refused with HTTP 400 (`RequestError` from the Engine) before any prompt is "
        "tokenized. Each sequence costs the HTTP process memory and event-loop time before it runs: "
        "a 600 KB body of 20,000 prompts with n = 128 took 3.4 GiB and a minute of the loop.",
    )
    max_top_logprobs_num: int = arg_field(
        20,
        "The most top logprobs a request may ask for per token (/generate's top_logprobs_num; the "
        "OpenAI routes' top_logprobs and logprobs, at most 20 there in any case); more is refused "
        "with HTTP 400. Each costs every token returned with logprobs an (id, logprob) pair in each "
        "process the output passes through, so a count near the vocabulary would let one request "
        "take tens of GiB.",
    )


def resolve_request_limit_args(a: Any) -> None:
    """Check the request limits (ConfigError naming the flag)."""
    if a.max_queued_requests is not None and a.max_queued_requests < 1:
        raise ConfigError(
            f"--max-queued-requests must be >= 1 (or unset: no bound), got {a.max_queued_requests}."
        )
    if a.max_queue_time is not None and not a.max_queue_time > 0:
        raise ConfigError(f"--max-queue-time must be > 0 seconds, got {a.max_queue_time}.")
    if a.max_request_body_bytes < 1:
        raise ConfigError(f"--max-request-body-bytes must be >= 1, got {a.max_request_body_bytes}.")
    if a.max_sequences_per_request < 1:
        raise ConfigError(f"--max-sequences-per-request must be >= 1, got {a.max_sequences_per_request}.")
    if a.max_top_logprobs_num < 0:
        raise ConfigError(f"--max-top-logprobs-num must be >= 0, got {a.max_top_logprobs_num}.")

"""The fit rule: can a request ever be scheduled? One rule, used at two places.

The tokenizer manager applies it before anything is sent (HTTP 400 / ``ContextLengthError``),
and the scheduler applies it again at arrival (a request sent by another client of the socket)
and finishes a request that can never fit with an abort carrying status 400. It is a capacity
check: ``max_new_tokens`` is resolved before it, once, by `SamplingParams.normalize` (None: as
many as fit, `srt.sampling.sampling_params.resolve_max_new_tokens`). Pure arithmetic: no torch,
no pools.

A request of ``prompt_len`` tokens that may generate ``max_new_tokens`` more fits when

    0 < prompt_len < context_len
    prompt_len + max_new_tokens <= context_len
    page_ceil(prompt_len + max_new_tokens) <= max_total_tokens   (the whole KV pool; whole pages)
"""

from __future__ import annotations

from dataclasses import dataclass

from srt.utils.pages import page_ceil


@dataclass(frozen=True, slots=True)
class FitError:
    """Why a request can never be scheduled.

    ``param``: the request field to change (``"prompt"`` or the name the client used for
    max_new_tokens); ``context_length``: the request is too long (OpenAI's
    ``context_length_exceeded``), as opposed to an empty prompt."""

    message: str
    param: str
    context_length: bool = True


def request_fit_error(
    prompt_len: int,
    max_new_tokens: int,
    context_len: int,
    max_total_tokens: int,
    page_size: int = 1,
    max_new_name: str = "max_new_tokens",
) -> FitError | None:
    """The fit rule (module docstring): None when the request fits, else why not, with the
    numbers and the flag or field to change."""
    n, m = prompt_len, max_new_tokens
    if n == 0:
        return FitError("The input is empty: give at least one input token.", "prompt", False)
    if n >= context_len:
        return FitError(
            f"The input ({n} tokens) is longer than the model's context length ({context_len} tokens). "
            "Shorten the input or raise --context-length.",
            "prompt",
        )
    total = n + m
    if total > context_len:
        return FitError(
            f"This model's maximum context length is {context_len} tokens, but the request needs "
            f"{total} tokens ({n} in the prompt + {m} for {max_new_name}). Lower {max_new_name}, "
            "shorten the input or raise --context-length.",
            max_new_name,
        )
    if page_ceil(total, page_size) > max_total_tokens:
        return FitError(
            f"The request needs up to {total} KV cache tokens ({n} in the prompt + {m} for "
            f"{max_new_name}) but the whole KV cache holds {max_total_tokens} tokens. Lower "
            f"{max_new_name}, shorten the input or raise --max-total-tokens / --mem-fraction-static.",
            max_new_name,
        )
    return None


def check_request_fits(
    prompt_len: int, max_new_tokens: int, context_len: int, max_total_tokens: int, page_size: int = 1
) -> str | None:
    """``request_fit_error``'s message, or None when the request fits."""
    err = request_fit_error(prompt_len, max_new_tokens, context_len, max_total_tokens, page_size)
    return None if err is None else err.message

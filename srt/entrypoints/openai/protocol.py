"""OpenAI-compatible request models (pydantic, at the HTTP edge only).

Requests are validated with ``Model.model_validate_json(body, strict=True)``: malformed JSON and
wrong types (``"temperature": "hot"``, ``"n": 1.5``, ``"n": true``) are rejected, unknown fields are
ignored (clients send many). Value ranges are checked by `SamplingParams.validation_errors` (via
`sampling_params_from_request`) so that the native and the OpenAI APIs agree. Responses are built
as plain dicts and serialized with orjson (see ``serving_*``).

Besides OpenAI's fields the requests take SGLang's sampling extras: ``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``skip_special_tokens``,
``spaces_between_special_tokens``, ``no_stop_trim``, ``stop_token_ids``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from srt.utils.errors import RequestError


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Model):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Model):
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # SGLang extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    stop_token_ids: list[int] | None = None
    rid: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None  # number of top logprobs per token (0 = the sampled token only)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TextContentPart(_Model):
    type: Literal["text"]
    text: str


class ChatMessage(_Model):
    role: str
    content: str | list[TextContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_MAX_TOP_LOGPROBS = 20


def sampling_params_from_request(
    req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None, max_tokens_name: str
) -> tuple[dict[str, Any], dict[str, str]]:
    """SGLang sampling params for ``req`` and the OpenAI spelling of their names (for errors).

    Fields the client did not send keep SamplingParams' defaults. ``max_tokens <= 0`` is rejected
    here (SamplingParams allows 0 for prefill-only internal requests)."""
    if max_tokens is not None and max_tokens <= 0:
        raise RequestError(f"{max_tokens_name} must be >= 1, got {max_tokens}", param=max_tokens_name)
    if req.n < 1:
        raise RequestError(f"n must be >= 1, got {req.n}", param="n")
    sp: dict[str, Any] = {
        "max_new_tokens": max_tokens,
        "min_new_tokens": req.min_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "frequency_penalty": req.frequency_penalty,
        "presence_penalty": req.presence_penalty,
        "repetition_penalty": req.repetition_penalty,
        "stop": req.stop,
        "stop_token_ids": req.stop_token_ids,
        "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens,
        "spaces_between_special_tokens": req.spaces_between_special_tokens,
        "no_stop_trim": req.no_stop_trim,
        "n": req.n,
        "seed": req.seed,
        "logit_bias": req.logit_bias,
    }
    sp = {k: v for k, v in sp.items() if v is not None or k == "max_new_tokens"}
    names = {"max_new_tokens": max_tokens_name, "min_new_tokens": "min_tokens"}
    return sp, names


def check_top_logprobs(value: int | None, name: str) -> int:
    if value is None:
        return 0
    if not 0 <= value <= _MAX_TOP_LOGPROBS:
        raise RequestError(f"{name} must be in [0, {_MAX_TOP_LOGPROBS}], got {value}", param=name)
    return value


class GenerateRequest(_Model):
    """Body of the native POST /generate (SGLang's shape; one prompt or a batch)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    stream: bool = False


class AbortRequest(_Model):
    rid: str = ""
    abort_all: bool = False

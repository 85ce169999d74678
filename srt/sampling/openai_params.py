"""OpenAI request fields -> `SamplingParams` fields: the one mapping, for chat and completions.

    OpenAI field                              SamplingParams field
    max_completion_tokens, else max_tokens    max_new_tokens   (chat: the first one given)
    min_tokens (SGLang extra)                 min_new_tokens
    response_format                           json_schema      (its JSON schema, or none)
    temperature, top_p, n, stop, seed, frequency_penalty, presence_penalty, logit_bias, and the
    SGLang extras top_k, min_p, repetition_penalty, ignore_eos, skip_special_tokens,
    spaces_between_special_tokens, no_stop_trim, stop_token_ids, regex, ebnf: same name

Fields the client did not send (None) are left out, so they keep SamplingParams' defaults;
``max_new_tokens`` is always there (None: as many as fit). Checked here, once: the OpenAI-only
rule ``max_tokens >= 1`` (SamplingParams allows 0 for prefill-only internal requests) and ``n``
(SamplingParams' own rule, applied before the prompt is built because the response's shape
depends on it). Every other value is checked by `parse_sampling_params`, whose messages use the
OpenAI names returned here.
"""

from __future__ import annotations

from typing import Any, Protocol

from srt.sampling.sampling_params import check_param
from srt.utils.errors import RequestError

# sent under the same name on both sides
SAME_NAME = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "n",
    "seed",
    "logit_bias",
    "regex",
    "ebnf",
)


class _ResponseFormat(Protocol):
    def to_json_schema(self) -> str | None: ...


class OpenAISamplingFields(Protocol):
    """What the mapping reads of an OpenAI request (``srt.entrypoints.openai.protocol``): the
    fields of ``SAME_NAME`` and these."""

    n: int
    max_tokens: int | None
    min_tokens: int | None
    response_format: _ResponseFormat | None


def openai_sampling_params(req: OpenAISamplingFields) -> tuple[dict[str, Any], dict[str, str]]:
    """The sampling params dict of ``req`` and the OpenAI spelling of the names that differ (for
    error messages); `RequestError` for a ``max_tokens`` below 1 or an ``n`` below 1."""
    max_tokens, name = getattr(req, "max_completion_tokens", None), "max_completion_tokens"
    if max_tokens is None:
        max_tokens, name = req.max_tokens, "max_tokens"
    if max_tokens is not None and max_tokens <= 0:
        raise RequestError(f"{name} must be >= 1, got {max_tokens}", param=name)
    err = check_param("n", req.n)
    if err is not None:
        raise RequestError(str(err), param="n")
    sp: dict[str, Any] = {"max_new_tokens": max_tokens, "min_new_tokens": req.min_tokens}
    sp.update((k, getattr(req, k)) for k in SAME_NAME)
    names = {"max_new_tokens": name, "min_new_tokens": "min_tokens"}
    if req.response_format is not None:
        sp["json_schema"] = req.response_format.to_json_schema()
        names["json_schema"] = "response_format"
    return {k: v for k, v in sp.items() if v is not None or k == "max_new_tokens"}, names

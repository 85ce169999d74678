"""Helpers shared by the OpenAI-compatible routes: error bodies, usage, finish reasons, and the
response `Envelope` (streamed chunks are payload dicts; `srt.entrypoints.http.sse` frames them)."""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

import orjson
from fastapi.responses import Response

from srt.utils.errors import RequestAbortedError, RequestTimeoutError, SrtError

if TYPE_CHECKING:
    from srt.entrypoints.openai.protocol import StreamOptions

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    429: "rate_limit_error",
}


def error_body(
    message: str,
    status_code: int,
    param: str | None = None,
    code: str | None = None,
    error_type: str | None = None,
) -> dict[str, Any]:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    etype = error_type or _TYPES.get(
        status_code, "server_error" if status_code >= 500 else "invalid_request_error"
    )
    return {"error": {"message": message, "type": etype, "param": param, "code": code}}


def json_response(content: Any, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        orjson.dumps(content), status_code=status_code, media_type="application/json", headers=headers
    )


def error_response(
    message: str, status_code: int, headers: dict[str, str] | None = None, **fields: str | None
) -> Response:
    """`error_body` as a JSON response (``fields``: its ``param``, ``code``, ``error_type``)."""
    return json_response(error_body(message, status_code, **fields), status_code, headers)


def srt_error_response(e: SrtError) -> Response:
    headers = {"Retry-After": str(e.retry_after)} if e.retry_after is not None else None
    return error_response(
        e.message, e.status_code, headers, param=e.param, code=e.code, error_type=e.error_type
    )


# A finish reason here is the output dict's ``meta_info["finish_reason"]``: None while running,
# else SGLang's dict (`srt.managers.io_struct.FinishReason.to_dict()`). The OpenAI layer reads the
# same output dicts the Engine returns, so it takes that shape and nothing else.
FinishReasonDict = dict[str, Any]


def abort_error(finish_reason: FinishReasonDict | None) -> SrtError | None:
    """The error to report for an output aborted with an HTTP status, or timed out (408); None
    for other finishes."""
    if finish_reason is None:
        return None
    if finish_reason["type"] == "timeout":
        return RequestTimeoutError(str(finish_reason.get("message") or "request timed out"))
    if finish_reason["type"] != "abort":
        return None
    status = int(finish_reason.get("status_code") or 500)
    message = str(finish_reason.get("message") or "request aborted")
    return RequestAbortedError(message, status, finish_reason.get("retry_after"))


def raise_abort_error(finish_reason: FinishReasonDict | None) -> None:
    """Raise the error of an output aborted with an HTTP status other than 499 (the client went
    away: nothing to report to it)."""
    err = abort_error(finish_reason)
    if err is not None and err.status_code != 499:
        raise err


def openai_finish_reason(finish_reason: FinishReasonDict | None) -> str | None:
    """OpenAI's ``finish_reason``: ``"length"``, ``"stop"``, ``"timeout"`` (the request's deadline
    passed), ``"abort"``, or None while running."""
    if finish_reason is None:
        return None
    return {"length": "length", "stop": "stop", "timeout": "timeout"}.get(finish_reason["type"], "abort")


def matched_stop(finish_reason: FinishReasonDict | None) -> int | str | None:
    """The stop token id or stop string that finished the output (None otherwise)."""
    if finish_reason is not None and finish_reason["type"] == "stop":
        return finish_reason.get("matched")
    return None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> dict[str, Any]:
    """OpenAI's usage object; ``prompt_tokens_details`` is null unless ``cached_tokens`` is given
    (``--enable-cache-report``)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": None if cached_tokens is None else {"cached_tokens": cached_tokens},
    }


def usage_of(outputs: list[dict[str, Any]], n: int, cache_report: bool = False) -> dict[str, Any]:
    """Usage of a request whose outputs are prompt-major with ``n`` choices per prompt: the
    prompt is counted once per prompt, the completions of every choice; the cached prompt tokens
    with ``cache_report``."""
    prompt = sum(o["meta_info"]["prompt_tokens"] for o in outputs[::n])
    cached = sum(o["meta_info"]["cached_tokens"] for o in outputs[::n]) if cache_report else None
    completion = sum(o["meta_info"]["completion_tokens"] for o in outputs)
    return usage(prompt, completion, cached)


TIMING_KEYS = ("queue_time", "prefill_time", "decode_time", "ttft", "e2e_latency", "cached_tokens")


def timings_of(meta: dict[str, Any]) -> dict[str, Any]:
    """The phase timings of one output's ``meta_info`` (`srt.managers.tokenizer.req_output`)."""
    return {k: meta.get(k) for k in TIMING_KEYS}


def with_timings(body: dict[str, Any], outputs: list[dict[str, Any]], wanted: bool) -> dict[str, Any]:
    """``body`` with a top-level ``metrics`` list (one entry per choice: ``index`` and
    `timings_of` its output) when the request asked for ``return_timings``."""
    if wanted:
        body["metrics"] = [{"index": o["index"], **timings_of(o["meta_info"])} for o in outputs]
    return body


def token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


def stream_error_payload(e: SrtError) -> dict[str, Any]:
    """The SSE payload of an error met mid-stream (OpenAI's error object)."""
    return {"error": {"message": e.message, "type": e.error_type, "param": e.param, "code": e.code}}


class Envelope:
    """The fields every response object of one request shares: ``id`` (``prefix`` + a uuid),
    ``object``, ``created``, ``model``; streamed chunks and the non-streaming body both carry
    them, with their ``choices`` and ``usage`` (cached prompt tokens in it with ``cache_report``,
    i.e. ``--enable-cache-report``)."""

    def __init__(self, prefix: str, obj: str, model: str, cache_report: bool = False) -> None:
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.object = obj
        self.created = int(time.time())
        self.model = model
        self.cache_report = cache_report

    def body(self, choices: list[dict[str, Any]], usage_: dict[str, Any] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage_ is not None:
            out["usage"] = usage_
        return out

    def chunk(self, choices: list[dict[str, Any]], meta: dict[str, Any] | None = None) -> dict[str, Any]:
        """One streamed chunk; ``meta`` given -> with that output's running usage."""
        if meta is None:
            return self.body(choices)
        cached = meta["cached_tokens"] if self.cache_report else None
        return self.body(choices, usage(meta["prompt_tokens"], meta["completion_tokens"], cached))

    def usage_of(self, outputs: list[dict[str, Any]], n: int) -> dict[str, Any]:
        """`usage_of` ``outputs`` as this response reports it."""
        return usage_of(outputs, n, self.cache_report)

    def usage_chunk(self, last_meta: dict[int, dict[str, Any]], n: int) -> dict[str, Any]:
        """The final ``include_usage`` chunk: empty choices, the usage of every choice's last output."""
        outs = [{"meta_info": last_meta[i]} for i in sorted(last_meta)]
        return self.body([], self.usage_of(outs, n))


class ChunkStream:
    """What one OpenAI streaming response keeps: its `Envelope`, the ``stream_options`` flags and
    each choice's latest ``meta_info`` (for the final usage chunk)."""

    def __init__(
        self, env: Envelope, stream_options: StreamOptions | None, n: int, return_timings: bool = False
    ) -> None:
        self.env = env
        self.return_timings = return_timings
        self.n = n
        self.include_usage = stream_options is not None and stream_options.include_usage
        self.continuous = stream_options is not None and stream_options.continuous_usage_stats
        self.last_meta: dict[int, dict[str, Any]] = {}

    def see(self, out: dict[str, Any]) -> dict[str, Any]:
        """Record output chunk ``out``; returns its meta_info. Raises the error of an output
        aborted with a status (a timed-out output is not an error here: its chunk carries
        ``finish_reason: "timeout"``)."""
        meta = out["meta_info"]
        self.last_meta[out["index"]] = meta
        reason = meta["finish_reason"]
        if reason is None or reason["type"] != "timeout":  # a timeout ends the stream as a finish
            raise_abort_error(reason)
        return meta

    def chunk(self, choices: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
        """One chunk of ``choices`` (with the running usage under ``continuous_usage_stats``; with
        ``return_timings`` the chunk finishing a choice carries its ``metrics``)."""
        out = self.env.chunk(choices, meta if self.continuous else None)
        if self.return_timings:
            finished = [c["index"] for c in choices if c.get("finish_reason") is not None]
            if finished:
                out["metrics"] = [{"index": i, **timings_of(meta)} for i in finished]
        return out

    def closing_chunks(self) -> list[dict[str, Any]]:
        """The chunks after the last output: the usage chunk with ``include_usage``."""
        return [self.env.usage_chunk(self.last_meta, self.n)] if self.include_usage else []

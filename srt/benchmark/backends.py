"""One streaming request per call, for each HTTP API the benchmark speaks.

=================  ========================  ====================================================
backend names      endpoint                  content of a stream chunk
=================  ========================  ====================================================
srt, sglang,       POST /generate            ``{"text", "output_ids", "meta_info": {"completion_tokens",
sglang-native                                ...}}``: the output so far (srt's and SGLang's default) or
                                             only its new part (--incremental-streaming-output)
openai, vllm,      POST /v1/completions      ``choices[0].text``; ``usage`` in the last chunk
sglang-oai, ...
openai-chat, ...   POST /v1/chat/completions ``choices[0].delta.content``; ``usage`` at the end
=================  ========================  ====================================================

Streams are Server-Sent Events: ``data: <json>`` lines, blank-line separated, ending with
``data: [DONE]``. A request that gets a non-200 status, an ``error`` object in the stream, an
empty stream or a transport error returns ``RequestOutput(success=False, error=...)``; the caller
counts it. Every request is greedy (temperature 0) with ``ignore_eos`` unless disabled.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from srt.benchmark.metrics import RequestOutput

AIOHTTP_TIMEOUT = aiohttp.ClientTimeout(total=6 * 60 * 60)


@dataclass(slots=True)
class RequestInput:
    prompt: str
    prompt_len: int
    output_len: int
    api_url: str
    model: str = "default"
    prompt_ids: list[int] | None = None
    ignore_eos: bool = True
    stream: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)


def sse_data(line: bytes | str) -> str | None:
    """The payload of one SSE line: the text after ``data:``; None for blank, comment or other
    field lines. ``[DONE]`` is returned as is (callers stop on it)."""
    if isinstance(line, bytes):
        line = line.decode("utf-8", errors="replace")
    line = line.strip()
    if not line.startswith("data:"):
        return None
    return line[len("data:") :].strip()


def _headers() -> dict[str, str]:
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def _error_text(obj: Any) -> str:
    if isinstance(obj, dict):
        return str(obj.get("message") or obj)
    return str(obj)


class _StreamState:
    """Accumulates the content chunks of one response into a ``RequestOutput``."""

    def __init__(self, out: RequestOutput) -> None:
        self.out = out
        self.text_parts: list[str] = []
        self.usage_completion: int | None = None

    def add_content(self, text: str, now: float, tokens: int = 1) -> None:
        if not text and tokens <= 0:
            return
        self.text_parts.append(text)
        self.out.chunk_times.append(now)
        self.out.chunk_tokens.append(max(tokens, 1))

    def finish(self, now: float) -> RequestOutput:
        out = self.out
        out.end_time = now
        out.generated_text = "".join(self.text_parts)
        if self.usage_completion is not None:
            out.output_len = self.usage_completion
            extra = out.output_len - sum(out.chunk_tokens)
            if out.chunk_tokens and extra > 0:
                out.chunk_tokens[-1] += extra
        if not out.chunk_times and out.output_len == 0 and not out.error:
            out.error = "the response carried no output"
        out.success = not out.error
        return out


async def _post_stream(
    session: aiohttp.ClientSession,
    req: RequestInput,
    payload: dict[str, Any],
    on_chunk: Callable[[dict[str, Any], _StreamState, float], None],
) -> RequestOutput:
    out = RequestOutput(prompt_len=req.prompt_len)
    state = _StreamState(out)
    out.send_time = time.perf_counter()
    try:
        async with session.post(req.api_url, json=payload, headers=_headers()) as resp:
            if resp.status != 200:
                body = (await resp.text())[:500]
                out.error = f"HTTP {resp.status}: {body}"
                return state.finish(time.perf_counter())
            if not req.stream:
                obj = await resp.json(content_type=None)
                now = time.perf_counter()
                if "error" in obj:
                    out.error = _error_text(obj["error"])
                else:
                    on_chunk(obj, state, now)
                return state.finish(now)
            async for raw in resp.content:
                data = sse_data(raw)
                if data is None or data == "":
                    continue
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                obj = json.loads(data)
                if isinstance(obj, dict) and obj.get("error"):
                    out.error = _error_text(obj["error"])
                    break
                on_chunk(obj, state, now)
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, ValueError, KeyError) as e:
        out.error = f"{type(e).__name__}: {e}"
    return state.finish(time.perf_counter())


async def request_native_generate(
    session: aiohttp.ClientSession, req: RequestInput, text_mode: str = "auto"
) -> RequestOutput:
    """srt / SGLang ``POST /generate``; counts tokens from ``meta_info.completion_tokens``.

    ``text_mode`` says how stream chunks carry text: "incremental" (the new text only: srt and
    SGLang with --incremental-streaming-output), "cumulative" (their default: everything so far)
    or "auto": decided by the first chunk after one with tokens that carries ``output_ids`` and
    new tokens (cumulative when it holds every token so far, incremental when only the new
    ones); until then, or without ids, cumulative while each chunk extends the text so far and
    incremental from the first chunk that does not."""
    if text_mode not in ("auto", "incremental", "cumulative"):
        raise ValueError(f"unknown text_mode {text_mode!r}")
    payload: dict[str, Any] = {
        "sampling_params": {
            "temperature": 0.0,
            "max_new_tokens": req.output_len,
            "ignore_eos": req.ignore_eos,
        },
        "stream": req.stream,
        **req.extra_body,
    }
    if req.prompt_ids is not None:
        payload["input_ids"] = req.prompt_ids
    else:
        payload["text"] = req.prompt
    seen_text, seen_tokens, mode = "", 0, text_mode

    def on_chunk(obj: dict[str, Any], st: _StreamState, now: float) -> None:
        nonlocal seen_text, seen_tokens, mode
        text = obj.get("text", "")
        meta = obj.get("meta_info") or {}
        n_tok = meta.get("completion_tokens")
        if mode == "auto" and seen_tokens > 0:
            mode = _text_mode_of_ids(obj.get("output_ids"), n_tok, seen_tokens)
        if mode == "auto" and not text.startswith(seen_text):
            mode = "incremental"
        if mode == "incremental":
            new, seen_text = text, seen_text + text
        else:
            new, seen_text = text[len(seen_text) :], text
        if n_tok is not None:
            delta = int(n_tok) - seen_tokens
            seen_tokens = int(n_tok)
            st.usage_completion = int(n_tok)
            if delta > 0:
                st.add_content(new, now, delta)
        elif new:
            st.add_content(new, now)
        if meta.get("prompt_tokens") is not None:
            st.out.prompt_len = int(meta["prompt_tokens"])
        if meta.get("cached_tokens") is not None:
            st.out.cached_tokens = int(meta["cached_tokens"])
        reason = meta.get("finish_reason")
        if isinstance(reason, dict) and reason.get("type") == "abort":
            st.out.error = f"aborted: {reason.get('message', '')}"

    return await _post_stream(session, req, payload, on_chunk)


def _text_mode_of_ids(ids: Any, n_tok: Any, seen_tokens: int) -> str:
    """ "cumulative" / "incremental" when a chunk's ``output_ids`` tell (it brings new tokens after
    ``seen_tokens``), else "auto"."""
    if not isinstance(ids, list) or n_tok is None or int(n_tok) <= seen_tokens:
        return "auto"
    if len(ids) == int(n_tok):
        return "cumulative"
    if len(ids) == int(n_tok) - seen_tokens:
        return "incremental"
    return "auto"


def _apply_usage(obj: dict[str, Any], st: _StreamState) -> None:
    usage = obj.get("usage")
    if not usage:
        return
    if usage.get("completion_tokens") is not None:
        st.usage_completion = int(usage["completion_tokens"])
    if usage.get("prompt_tokens") is not None:
        st.out.prompt_len = int(usage["prompt_tokens"])
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        st.out.cached_tokens = int(details["cached_tokens"])


def _openai_payload(req: RequestInput, prompt_key: str, prompt: Any) -> dict[str, Any]:
    """The body of an OpenAI request: greedy, ``req.output_len`` tokens, the prompt under
    ``prompt_key``, then ``req.extra_body``."""
    payload: dict[str, Any] = {
        "model": req.model,
        prompt_key: prompt,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "stream": req.stream,
        **req.extra_body,
    }
    # ignore_eos is an extension (vLLM, SGLang, llama.cpp, srt): sent only when wanted, so that
    # strict servers still accept requests run with --disable-ignore-eos
    if req.ignore_eos:
        payload.setdefault("ignore_eos", True)
    if req.stream:
        payload.setdefault("stream_options", {"include_usage": True})
    return payload


async def request_openai_completions(session: aiohttp.ClientSession, req: RequestInput) -> RequestOutput:
    """OpenAI ``POST /v1/completions`` (prompt as token ids for ``random-ids`` rows)."""
    payload = _openai_payload(req, "prompt", req.prompt_ids if req.prompt_ids is not None else req.prompt)

    def on_chunk(obj: dict[str, Any], st: _StreamState, now: float) -> None:
        # a chunk carries a token even when its text is empty (a token the tokenizer decodes to
        # nothing yet: half a UTF-8 character, or an id past the tokenizer's vocabulary, as random
        # weights of a shape with a bigger vocabulary give); only a bare finish chunk does not
        for choice in obj.get("choices") or []:
            text = choice.get("text")
            if isinstance(text, str) and (text or choice.get("finish_reason") is None):
                st.add_content(text, now)
        _apply_usage(obj, st)

    return await _post_stream(session, req, payload, on_chunk)


async def request_openai_chat(session: aiohttp.ClientSession, req: RequestInput) -> RequestOutput:
    """OpenAI ``POST /v1/chat/completions`` with the prompt as one user message."""
    payload = _openai_payload(req, "messages", [{"role": "user", "content": req.prompt}])

    def on_chunk(obj: dict[str, Any], st: _StreamState, now: float) -> None:
        for choice in obj.get("choices") or []:
            content = (choice.get("delta") or choice.get("message") or {}).get("content")
            if content:
                st.add_content(content, now)
        _apply_usage(obj, st)

    return await _post_stream(session, req, payload, on_chunk)


RequestFunc = Callable[[aiohttp.ClientSession, RequestInput], Awaitable[RequestOutput]]

# backend name -> (request function, endpoint path)
BACKENDS: dict[str, tuple[RequestFunc, str]] = {
    "srt": (request_native_generate, "/generate"),
    "sglang": (request_native_generate, "/generate"),
    "sglang-native": (request_native_generate, "/generate"),
    "openai": (request_openai_completions, "/v1/completions"),
    "sglang-oai": (request_openai_completions, "/v1/completions"),
    "vllm": (request_openai_completions, "/v1/completions"),
    "lmdeploy": (request_openai_completions, "/v1/completions"),
    "openai-chat": (request_openai_chat, "/v1/chat/completions"),
    "sglang-oai-chat": (request_openai_chat, "/v1/chat/completions"),
    "vllm-chat": (request_openai_chat, "/v1/chat/completions"),
    "lmdeploy-chat": (request_openai_chat, "/v1/chat/completions"),
}

"""POST /v1/responses: OpenAI's Responses API, served statelessly through the chat path.

The request becomes a chat completion request (`protocol_responses.to_chat_request`), which the
chat serving turns into a `GenerateReqInput` as usual (chat template, tools, grammar for
``text.format`` and forced tool calls, reasoning and tool-call parsers). Its output is read back
by the chat serving and rebuilt as a Responses object (`responses_output`); a streamed one is
rebuilt event by event from the chat chunks (`responses_stream`) and framed as SSE with each
event's type on its ``event:`` line (no ``[DONE]``: ``response.completed`` ends the stream).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson

from srt.entrypoints.openai.protocol import ChatCompletionRequest
from srt.entrypoints.openai.protocol_responses import ResponsesRequest, template_kwargs, to_chat_request
from srt.entrypoints.openai.responses_output import (
    ResponseShell,
    incomplete_reason,
    output_of_message,
    responses_usage,
)
from srt.entrypoints.openai.responses_stream import ResponseEvents
from srt.entrypoints.openai.serving_chat import OpenAIServingChat
from srt.managers.tokenizer.generate_input import GenerateReqInput
from srt.utils.errors import RequestTimeoutError, SrtError

# the chat request's field names in error messages -> this route's
_RENAMED = {"max_tokens": "max_output_tokens", "response_format": "text.format"}


def sse_event(event: dict[str, Any]) -> bytes:
    """One SSE event: ``event: <type>`` and the event as JSON on its ``data:`` line."""
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


class OpenAIServingResponses:
    """Serves one Responses request through ``chat`` (an `OpenAIServingChat`)."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat
        self.tm = chat.tm

    def build_input(self, req: ResponsesRequest) -> tuple[ChatCompletionRequest, GenerateReqInput]:
        """The chat request serving ``req`` and its `GenerateReqInput`; RequestError for bad input."""
        chat_req = to_chat_request(req)
        kwargs = template_kwargs(req, self.chat.reasoning_parser is not None)
        obj = self.chat.build_input(chat_req, template_kwargs=kwargs)
        names = {k: _RENAMED.get(v, v) for k, v in obj.param_names.items()}  # errors name our fields
        obj.serve_as(
            incremental_stream=obj.incremental_stream,
            add_special_tokens=obj.add_special_tokens,
            param_names=names,
        )
        return chat_req, obj

    def _count_tokens(self, text: str) -> int:
        tok = self.tm.tokenizer
        return len(tok.encode(text, add_special_tokens=False)) if tok is not None else 0

    def build_response(
        self, req: ResponsesRequest, chat_req: ChatCompletionRequest, outputs: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """The response object of the finished ``outputs`` (raises the error of an aborted one)."""
        body = self.chat.build_response(chat_req, outputs)
        choice = body["choices"][0]
        reason = incomplete_reason(choice["finish_reason"])
        status = "incomplete" if reason else "completed"
        message = choice["message"]
        output = output_of_message(message, choice["logprobs"], status)
        reasoning = message.get("reasoning_content")
        usage = responses_usage(body["usage"], self._count_tokens(reasoning) if reasoning else 0)
        return ResponseShell(req, req.model or self.tm.model_name).body(status, output, usage, reason)

    async def stream(
        self, req: ResponsesRequest, chat_req: ChatCompletionRequest, chunks: AsyncIterator[dict[str, Any]]
    ) -> AsyncIterator[bytes]:
        """The SSE events of the output stream ``chunks`` (module docstring)."""
        with_logprobs = bool(chat_req.logprobs)
        events = ResponseEvents(
            ResponseShell(req, req.model or self.tm.model_name), with_logprobs, self._count_tokens
        )
        for ev in events.start():
            yield sse_event(ev)
        try:
            async for chunk in self.chat.stream_chunks(chat_req, chunks):
                for ev in events.feed(chunk):
                    yield sse_event(ev)
            if events.finish_reason == "timeout":
                raise RequestTimeoutError("the request's deadline passed")
        except SrtError as e:
            yield sse_event(events.error(e))
            return
        for ev in events.finish():
            yield sse_event(ev)

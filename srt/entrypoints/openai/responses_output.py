"""The Responses API's output objects, built from a chat completion's parts.

A response (``object: "response"``, id ``resp_...``) echoes the request's parameters, as OpenAI's
``Response`` model needs, and holds its ``output`` items in order: a ``reasoning`` item (the text of
the ``<think>`` section, with ``--reasoning-parser``), a ``message`` with one ``output_text`` part
(``annotations: []``; ``logprobs`` when asked), and one ``function_call`` item per tool call. Its
``status`` is ``completed``, or ``incomplete`` with ``incomplete_details.reason``
``max_output_tokens`` when the output hit the token limit.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from srt.entrypoints.openai.protocol_responses import ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text or status != "in_progress" else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def text_part(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return part


def message_item(item_id: str, parts: list[dict[str, Any]], status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": parts}


def function_call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def responses_usage(chat_usage: dict[str, Any] | None, reasoning_tokens: int) -> dict[str, Any] | None:
    """The Responses ``usage`` of a chat usage object (cached tokens as the chat route reports
    them: with ``--enable-cache-report``, else 0)."""
    if chat_usage is None:
        return None
    details = chat_usage.get("prompt_tokens_details") or {}
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": details.get("cached_tokens", 0), "cache_write_tokens": 0},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": chat_usage["total_tokens"],
    }


def _echo_tools(req: ResponsesRequest) -> list[dict[str, Any]]:
    out = []
    for t in req.tools or []:
        tool = {
            "type": "function",
            "name": t["name"],
            "parameters": t.get("parameters"),
            "strict": t.get("strict"),
        }
        if t.get("description") is not None:
            tool["description"] = t["description"]
        out.append(tool)
    return out


class ResponseShell:
    """The parts of one response that do not depend on its output: id, creation time, model and
    the echoed request parameters."""

    def __init__(self, req: ResponsesRequest, model: str) -> None:
        self.req = req
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self.model = model

    def body(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        incomplete_reason: str | None = None,
    ) -> dict[str, Any]:
        req = self.req
        fmt = req.text.format if req.text is not None and req.text.format is not None else {"type": "text"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "completed_at": int(time.time()) if status == "completed" else None,
            "status": status,
            "error": None,
            "incomplete_details": None if incomplete_reason is None else {"reason": incomplete_reason},
            "model": self.model,
            "output": output,
            "usage": usage,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_logprobs": req.top_logprobs,
            "tools": _echo_tools(req),
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "text": {"format": fmt},
            "reasoning": None if req.reasoning is None else req.reasoning.model_dump(exclude_none=True),
            "truncation": "disabled",
            "metadata": req.metadata or {},
            "user": req.user,
            "safety_identifier": req.safety_identifier,
            "prompt_cache_key": req.prompt_cache_key,
            "previous_response_id": None,
            "background": False,
            "store": False,
            "service_tier": "default",
        }


def incomplete_reason(chat_finish: str | None) -> str | None:
    """``incomplete_details.reason`` of a chat ``finish_reason`` (None: the response completed)."""
    return "max_output_tokens" if chat_finish == "length" else None


def output_of_message(
    message: dict[str, Any], logprobs: dict[str, Any] | None, status: str
) -> list[dict[str, Any]]:
    """The output items of a non-streamed chat choice's ``message`` (reasoning, text, calls)."""
    items: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(new_id("rs"), message["reasoning_content"]))
    content = message.get("content")
    if content or not message.get("tool_calls"):
        lp = None if logprobs is None else logprobs["content"]
        items.append(message_item(new_id("msg"), [text_part(content or "", lp)], status))
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        items.append(function_call_item(new_id("fc"), call["id"], fn["name"], fn["arguments"]))
    return items

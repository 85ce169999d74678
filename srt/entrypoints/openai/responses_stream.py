"""Streamed Responses: the chat completion chunks of one choice -> the Responses API's events.

Every event has ``type`` and ``sequence_number`` (0, 1, ...). One response streams as::

    response.created, response.in_progress               (the response, status in_progress)
    per output item, in order (one open at a time):
      reasoning      response.output_item.added, response.content_part.added (reasoning_text),
                     response.reasoning_text.delta ..., response.reasoning_text.done,
                     response.content_part.done, response.output_item.done
      message        response.output_item.added, response.content_part.added (output_text),
                     response.output_text.delta ..., response.output_text.done,
                     response.content_part.done, response.output_item.done
      function_call  response.output_item.added, response.function_call_arguments.delta ...,
                     response.function_call_arguments.done, response.output_item.done
    response.completed, or response.incomplete (the token limit)  (the whole response, usage)

An error after the first event (the request aborted or timed out) ends the stream with an
``error`` event instead of the last one.
"""

from __future__ import annotations

from typing import Any

from srt.entrypoints.openai.responses_output import (
    ResponseShell,
    function_call_item,
    incomplete_reason,
    message_item,
    new_id,
    reasoning_item,
    responses_usage,
    text_part,
)
from srt.utils.errors import SrtError


class _Item:
    """The output item being streamed: its kind, id, index and accumulated text."""

    def __init__(self, kind: str, index: int, call_id: str = "", name: str = "") -> None:
        self.kind = kind
        self.index = index
        self.id = new_id({"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind])
        self.call_id = call_id
        self.name = name
        self.text = ""
        self.logprobs: list[dict[str, Any]] | None = None

    def snapshot(self, status: str) -> dict[str, Any]:
        if self.kind == "reasoning":
            return reasoning_item(self.id, self.text, status)
        if self.kind == "function_call":
            return function_call_item(self.id, self.call_id, self.name, self.text, status)
        parts = [] if status == "in_progress" else [text_part(self.text, self.logprobs)]
        return message_item(self.id, parts, status)


class ResponseEvents:
    """Turns one chat choice's chunks into Responses events (``feed`` per chunk, then ``finish``)."""

    def __init__(self, shell: ResponseShell, with_logprobs: bool, count_tokens: Any) -> None:
        self.shell = shell
        self.with_logprobs = with_logprobs
        self.count_tokens = count_tokens  # text -> number of tokens (the reasoning tokens' count)
        self.seq = 0
        self.items: list[_Item] = []
        self.done: list[dict[str, Any]] = []
        self.open: _Item | None = None
        self.calls: dict[int, _Item] = {}  # the chat delta's tool call index -> its item
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def start(self) -> list[dict[str, Any]]:
        body = self.shell.body("in_progress", [])
        return [
            self.event("response.created", response=body),
            self.event("response.in_progress", response=body),
        ]

    def _where(self, item: _Item) -> dict[str, Any]:
        return {"item_id": item.id, "output_index": item.index}

    def _open(self, kind: str, call_id: str = "", name: str = "") -> list[dict[str, Any]]:
        events = self._close("completed")
        item = _Item(kind, len(self.items), call_id, name)
        self.items.append(item)
        self.open = item
        events.append(
            self.event(
                "response.output_item.added", output_index=item.index, item=item.snapshot("in_progress")
            )
        )
        if kind == "reasoning":
            part = {"type": "reasoning_text", "text": ""}
            events.append(
                self.event("response.content_part.added", **self._where(item), content_index=0, part=part)
            )
        elif kind == "message":
            item.logprobs = [] if self.with_logprobs else None
            part = text_part("", item.logprobs)
            events.append(
                self.event("response.content_part.added", **self._where(item), content_index=0, part=part)
            )
        return events

    def _close(self, status: str) -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        where = self._where(item)
        if item.kind == "function_call":
            events = [
                self.event(
                    "response.function_call_arguments.done", **where, name=item.name, arguments=item.text
                )
            ]
        else:
            snap = item.snapshot(status)
            part = snap["content"][0]
            done = "response.reasoning_text.done" if item.kind == "reasoning" else "response.output_text.done"
            extra = {"logprobs": item.logprobs or []} if item.kind == "message" else {}
            events = [
                self.event(done, **where, content_index=0, text=item.text, **extra),
                self.event("response.content_part.done", **where, content_index=0, part=part),
            ]
        snap = item.snapshot(status)
        self.done.append(snap)
        events.append(self.event("response.output_item.done", output_index=item.index, item=snap))
        return events

    def _text(self, kind: str, text: str, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events = self._open(kind) if self.open is None or self.open.kind != kind else []
        item = self.open
        assert item is not None
        item.text += text
        fields: dict[str, Any] = {"content_index": 0, "delta": text}
        if kind == "message":
            fields["logprobs"] = logprobs
            if item.logprobs is not None:
                item.logprobs.extend(logprobs)
            events.append(self.event("response.output_text.delta", **self._where(item), **fields))
        else:
            events.append(self.event("response.reasoning_text.delta", **self._where(item), **fields))
        return events

    def _call(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        fn = delta.get("function") or {}
        events: list[dict[str, Any]] = []
        if delta.get("id") is not None:
            events = self._open("function_call", delta["id"], fn.get("name") or "")
            assert self.open is not None
            self.calls[delta["index"]] = self.open
        item = self.calls.get(delta["index"])
        args = fn.get("arguments") or ""
        if item is not None and args:
            item.text += args
            events.append(
                self.event("response.function_call_arguments.delta", **self._where(item), delta=args)
            )
        return events

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat completion chunk (the last one carries the usage)."""
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        events: list[dict[str, Any]] = []
        for choice in chunk.get("choices", []):
            delta = choice["delta"]
            lp = (choice.get("logprobs") or {}).get("content") or []
            if delta.get("reasoning_content"):
                events += self._text("reasoning", delta["reasoning_content"], [])
            if delta.get("content"):
                events += self._text("message", delta["content"], lp)
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
        return events

    def finish(self) -> list[dict[str, Any]]:
        """The closing events: the open item's, then response.completed or response.incomplete."""
        reason = incomplete_reason(self.finish_reason)
        events = self._close("incomplete" if reason else "completed")
        if not self.done:  # an empty output is still one (empty) message
            events = self._open("message") + self._close("incomplete" if reason else "completed")
        reasoning = "".join(
            d["content"][0]["text"] for d in self.done if d["type"] == "reasoning" and d["content"]
        )
        usage = responses_usage(self.usage, self.count_tokens(reasoning) if reasoning else 0)
        status = "incomplete" if reason else "completed"
        body = self.shell.body(status, self.done, usage, reason)
        return [*events, self.event(f"response.{status}", response=body)]

    def error(self, e: SrtError) -> dict[str, Any]:
        code = e.code or e.error_type
        return self.event("error", code=code, message=e.message, param=e.param)

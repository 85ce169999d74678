"""POST /v1/chat/completions: chat messages -> chat template -> generation -> OpenAI chat shape.

The prompt is the tokenizer's chat template applied to ``messages`` (roles system / developer /
user / assistant / tool; ``developer`` is passed as ``system``; list contents keep their text
parts joined by newlines) with the generation prompt appended, tokenized without adding special
tokens again; ``chat_template_kwargs``, ``add_generation_prompt``, ``continue_final_message`` and
``reasoning_effort`` change how it is rendered (`chat_fields.template_options`). Streaming sends, per choice, a first delta with the role, then content deltas, then
the finish reason; with ``stream_options.include_usage`` a last chunk with empty choices and the
usage; and ``data: [DONE]``.

Tools (`_OutputPlan` says how a request's output is read back):

    tool_choice none, or no tools   plain content
    auto (the default with tools)   the model writes calls in its own format, which
                                    ``--tool-call-parser`` reads (400 without one); with
                                    ``parallel_tool_calls: false`` only the first call is
                                    returned (later ones are dropped, whole or streamed)
    required / a named function     the grammar constrains the output to a JSON array of calls
                                    (``tool_choice_schema``), whose arguments therefore parse
                                    against the function's parameters schema

The tools are passed to the chat template; a template that does not render them gets their
description as a system message. Calls come back as ``message.tool_calls`` (streamed: deltas of
``tool_calls`` with index, id, name, then the arguments), ``finish_reason`` ``tool_calls``. With
``--reasoning-parser`` the text of a ``<think>`` section is ``reasoning_content`` (streamed as its
own deltas) and only the rest is content or calls.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from srt.entrypoints.openai.chat_fields import (
    FirstCallFilter,
    chat_message_errors,
    first_call_only,
    template_options,
)
from srt.entrypoints.openai.common import (
    ChunkStream,
    matched_stop,
    openai_finish_reason,
    token_text,
)
from srt.entrypoints.openai.protocol import (
    CHAT_ROLES,
    ChatCompletionRequest,
    NamedToolChoice,
    check_top_logprobs,
)
from srt.entrypoints.openai.serving_base import OpenAIServing
from srt.managers.tokenizer.generate_input import GenerateReqInput
from srt.parsers.reasoning import ReasoningParser, create_reasoning_parser
from srt.parsers.tool_calls import (
    ContentDelta,
    StreamEvent,
    ToolCall,
    ToolCallParser,
    ToolChoiceStream,
    create_tool_call_parser,
    parse_tool_choice_json,
    render_tools_system_prompt,
    tool_choice_schema,
)
from srt.sampling.openai_params import openai_sampling_params
from srt.utils.errors import RequestError


@dataclass(frozen=True, slots=True)
class _OutputPlan:
    """How one request's output text is read back (see the module docstring)."""

    tools: list[dict[str, Any]] | None  # the tools the model is shown (None: none, or tool_choice none)
    forced: str | None  # "required" or the named function: the output is a JSON array of calls
    parser: ToolCallParser | None  # tool_choice auto: the server's --tool-call-parser
    reasoning: ReasoningParser | None
    one_call: bool = False  # parallel_tool_calls false under tool_choice auto: the first call only

    def split(self, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        """(reasoning_content, content, calls) of a whole output."""
        reasoning, content = self.reasoning.parse(text) if self.reasoning is not None else (None, text)
        if content is None or self.tools is None:
            return reasoning, content, []
        if self.forced is not None:
            calls = parse_tool_choice_json(content)
            return (reasoning, None, calls) if calls else (reasoning, content, [])
        assert self.parser is not None
        content, calls = self.parser.parse(content)
        if self.one_call:
            content, calls = first_call_only(content, calls)
        return reasoning, content, calls


class _ChoiceStream:
    """One streamed choice's text split into reasoning, content and call deltas."""

    def __init__(self, plan: _OutputPlan) -> None:
        self.reasoning = plan.reasoning.stream() if plan.reasoning is not None else None
        self.calls = None
        if plan.tools is not None:
            self.calls = ToolChoiceStream() if plan.forced is not None else plan.parser.stream()  # type: ignore[union-attr]
        self.one_call = FirstCallFilter() if plan.one_call else None
        self.call_ids: dict[int, str] = {}

    def feed(self, text: str, last: bool) -> tuple[str, list[StreamEvent]]:
        """(reasoning delta, content and call events) of a text delta (``last``: the output ended)."""
        reasoning, content = "", text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text)
            if last:
                r, c = self.reasoning.finish()
                reasoning, content = reasoning + r, content + c
        if self.calls is None:
            return reasoning, [ContentDelta(content)] if content else []
        events = self.calls.feed(content) if content else []
        if last:
            events += self.calls.finish()
        return reasoning, self.one_call.filter(events) if self.one_call is not None else events

    def delta_of(self, event: StreamEvent) -> dict[str, Any]:
        if isinstance(event, ContentDelta):
            return {"content": event.text}
        call: dict[str, Any] = {"index": event.index}
        if event.name is not None:
            call_id = self.call_ids.setdefault(event.index, _call_id())
            call.update(id=call_id, type="function", function={"name": event.name, "arguments": ""})
        else:
            call["function"] = {"arguments": event.arguments}
        return {"tool_calls": [call]}


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _history_message(m: Any) -> dict[str, Any]:
    """A request message as the chat template sees it (tool-call arguments as objects when they
    are JSON, as templates expect)."""
    content = m.content
    if isinstance(content, list) and any(part.type == "image_url" for part in content):
        # the chat template of a vision-language model writes its image placeholder for an
        # {"type": "image"} part; the images travel beside the prompt (chat_images)
        content = [
            {"type": "image"} if part.type == "image_url" else {"type": "text", "text": part.text}
            for part in content
        ]
    elif isinstance(content, list):
        content = "\n".join(part.text for part in content)
    msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
    if m.name:
        msg["name"] = m.name
    if m.tool_call_id is not None:
        msg["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        calls = []
        for c in m.tool_calls:
            try:
                args: Any = json.loads(c.function.arguments)
            except ValueError:
                args = c.function.arguments
            calls.append(
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}}
            )
        msg["tool_calls"] = calls
    return msg


def chat_images(messages: list[Any]) -> tuple[list[str], list[str]]:
    """The image URLs of the messages' image parts in prompt order, and how each is named."""
    urls: list[str] = []
    params: list[str] = []
    for i, m in enumerate(messages):
        for j, part in enumerate(m.content if isinstance(m.content, list) else ()):
            if part.type == "image_url":
                urls.append(part.image_url.url)
                params.append(f"messages[{i}].content[{j}].image_url")
    return urls, params


def _token_entry(tokenizer: Any, lp: float, tid: int) -> dict[str, Any]:
    text = token_text(tokenizer, tid)
    return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer: Any, meta: dict[str, Any], with_top: bool) -> dict[str, Any]:
    """OpenAI's chat ``logprobs`` object for the tokens in ``meta`` (one chunk or the whole output)."""
    tops = meta.get("output_top_logprobs", []) if with_top else []
    content = []
    for k, (lp, tid, _) in enumerate(meta.get("output_token_logprobs", [])):
        entry = _token_entry(tokenizer, lp, tid)
        top = tops[k] if k < len(tops) else []
        entry["top_logprobs"] = [_token_entry(tokenizer, v, t) for v, t, _ in top]
        content.append(entry)
    return {"content": content}


class OpenAIServingChat(OpenAIServing):
    id_prefix = "chatcmpl"

    def __init__(self, tokenizer_manager: Any) -> None:
        super().__init__(tokenizer_manager)
        args = tokenizer_manager.server_args
        self.tool_call_parser_name: str | None = args.tool_call_parser
        self.tool_call_parser = (
            create_tool_call_parser(args.tool_call_parser) if args.tool_call_parser else None
        )
        self.reasoning_parser = (
            create_reasoning_parser(args.reasoning_parser) if args.reasoning_parser else None
        )

    def output_plan(self, req: ChatCompletionRequest) -> _OutputPlan:
        """How ``req``'s output is read back; RequestError for tool settings that cannot work."""
        choice = req.tool_choice
        if not req.tools:
            if choice is not None and choice != "none":
                raise RequestError("tool_choice needs tools", param="tool_choice")
            return _OutputPlan(None, None, None, self.reasoning_parser)
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
        if choice == "none":
            return _OutputPlan(None, None, None, self.reasoning_parser)
        if isinstance(choice, NamedToolChoice):
            names = [t["function"]["name"] for t in tools]
            if choice.function.name not in names:
                raise RequestError(
                    f"tool_choice names the function {choice.function.name!r}, which is not among the tools",
                    param="tool_choice",
                )
            return _OutputPlan(tools, choice.function.name, None, self.reasoning_parser)
        if choice == "required":
            return _OutputPlan(tools, "required", None, self.reasoning_parser)
        if self.tool_call_parser is None:
            raise RequestError(
                "tools with tool_choice auto need a server started with --tool-call-parser; "
                'use tool_choice "required" or a named function (constrained to JSON calls)',
                param="tools",
            )
        one_call = req.parallel_tool_calls is False
        parser = self.tool_call_parser.for_tools(tools)
        return _OutputPlan(tools, None, parser, self.reasoning_parser, one_call)

    def build_input(
        self, req: ChatCompletionRequest, template_kwargs: dict[str, Any] | None = None
    ) -> GenerateReqInput:
        """``template_kwargs``: extra chat template variables (the Responses route's reasoning
        effort; the request's ``chat_template_kwargs`` win), see `chat_fields.template_options`."""
        if not req.messages:
            raise RequestError("messages must be a non-empty list", param="messages")
        for i, m in enumerate(req.messages):
            if m.role not in CHAT_ROLES:
                raise RequestError(
                    f"messages[{i}].role {m.role!r} is not one of {', '.join(sorted(CHAT_ROLES))}",
                    param=f"messages[{i}].role",
                )
        chat_message_errors(req.messages)
        urls, image_params = self._images(req)
        apply_fn = getattr(self.tm.tokenizer, "apply_chat_template", None)
        options = template_options(req, apply_fn, self.reasoning_parser is not None, template_kwargs)
        messages = [_history_message(m) for m in req.messages]
        sp, names = openai_sampling_params(req)
        top = check_top_logprobs(req.top_logprobs, "top_logprobs")
        names["top_logprobs_num"] = "top_logprobs"
        if top and not req.logprobs:
            raise RequestError("top_logprobs requires logprobs=true", param="top_logprobs")
        plan = self.output_plan(req)
        if sp.get("skip_special_tokens") is None and any(
            p is not None and p.keeps_special_tokens for p in (plan.parser, plan.reasoning)
        ):
            sp["skip_special_tokens"] = False  # the parsers read markers that are special tokens
        kwargs: dict[str, Any] = {}
        if plan.tools is not None:
            if plan.forced is not None:
                if any(k in sp for k in ("json_schema", "regex", "ebnf")):
                    raise RequestError(
                        "a required or named tool_choice cannot be combined with response_format, regex or ebnf",
                        param="tool_choice",
                    )
                name_ = None if plan.forced == "required" else plan.forced
                parallel = req.parallel_tool_calls is not False
                sp["json_schema"] = json.dumps(tool_choice_schema(plan.tools, name_, parallel))
                names["json_schema"] = "tool_choice"
            if self.tm.chat_template_renders_tools():
                kwargs["tools"] = plan.tools
            else:
                parser = None if plan.forced is not None else self.tool_call_parser_name
                system = {"role": "system", "content": render_tools_system_prompt(plan.tools, parser)}
                if messages and messages[0]["role"] == "system":
                    system["content"] = messages[0]["content"] + "\n\n" + system["content"]
                    messages = messages[1:]
                messages = [system, *messages]
        prompt = self.tm.apply_chat_template(messages, **options, **kwargs)
        return self._generate_input(
            req,
            (sp, names),
            add_special_tokens=False,
            text=prompt,
            return_logprob=req.logprobs,
            top_logprobs_num=top,
            image_data=urls or None,
            image_params=image_params,
        )

    def _images(self, req: ChatCompletionRequest) -> tuple[list[str], list[str]]:
        """`chat_images` of the messages; `RequestError` when the model takes no images."""
        urls, params = chat_images(req.messages)
        if urls and not self.tm.takes_images:
            raise RequestError(f"this model ({self.tm.model_name}) takes no image input", param=params[0])
        return urls, params

    def build_response(self, req: ChatCompletionRequest, outputs: list[dict[str, Any]]) -> dict[str, Any]:
        self._raise_aborts(outputs)
        plan = self.output_plan(req)
        choices = []
        for o in outputs:
            meta = o["meta_info"]
            reasoning, content, calls = plan.split(o["text"])
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if reasoning is not None:
                message["reasoning_content"] = reasoning
            finish = openai_finish_reason(meta["finish_reason"])
            if calls:
                message["tool_calls"] = [
                    {
                        "id": _call_id(),
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments},
                    }
                    for c in calls
                ]
                finish = "tool_calls" if finish == "stop" else finish
            choices.append(
                {
                    "index": o["index"],
                    "message": message,
                    "logprobs": chat_logprobs(self.tm.tokenizer, meta, req.top_logprobs is not None)
                    if req.logprobs
                    else None,
                    "finish_reason": finish,
                    "matched_stop": matched_stop(meta["finish_reason"]),
                }
            )
        return self._body(req, outputs, choices, "chat.completion")

    async def stream_chunks(
        self, req: ChatCompletionRequest, chunks: AsyncIterator[dict[str, Any]]
    ) -> AsyncIterator[dict[str, Any]]:
        """The ``chat.completion.chunk`` payloads of ``chunks`` (raises the error of an output
        aborted with a status)."""
        cs = ChunkStream(
            self._envelope(req, "chat.completion.chunk"), req.stream_options, req.n, req.return_timings
        )
        plan = self.output_plan(req)
        plain = plan.tools is None and plan.reasoning is None
        streams: dict[int, _ChoiceStream] = {}
        called: set[int] = set()
        async for out in chunks:
            idx = out["index"]
            meta = cs.see(out)
            if idx not in streams:
                streams[idx] = _ChoiceStream(plan)
                delta = {"role": "assistant", "content": ""}
                yield cs.env.chunk([{"index": idx, "delta": delta, "logprobs": None, "finish_reason": None}])
            finish = openai_finish_reason(meta["finish_reason"])
            logprobs = (
                chat_logprobs(self.tm.tokenizer, meta, req.top_logprobs is not None) if req.logprobs else None
            )
            if plain:
                if not out["text"] and finish is None and not (req.logprobs and out["output_ids"]):
                    continue  # nothing to show yet (e.g. text held back by a possible stop string)
                deltas = [{"content": out["text"]}] if out["text"] or finish is None else []
            else:
                cstream = streams[idx]
                reasoning, events = cstream.feed(out["text"], finish is not None)
                deltas = [{"reasoning_content": reasoning}] if reasoning else []
                deltas += [cstream.delta_of(e) for e in events]
                if any("tool_calls" in d for d in deltas):
                    called.add(idx)
                if finish == "stop" and idx in called:
                    finish = "tool_calls"
            for k, delta in enumerate(deltas):
                last = k == len(deltas) - 1
                choice: dict[str, Any] = {
                    "index": idx,
                    "delta": delta,
                    "logprobs": logprobs if k == 0 else None,
                    "finish_reason": finish if last else None,
                }
                if last and finish is not None:
                    choice["matched_stop"] = matched_stop(meta["finish_reason"])
                yield cs.chunk([choice], meta)
            if not deltas and (finish is not None or logprobs):
                choice = {"index": idx, "delta": {}, "logprobs": logprobs, "finish_reason": finish}
                if finish is not None:
                    choice["matched_stop"] = matched_stop(meta["finish_reason"])
                yield cs.chunk([choice], meta)
        for c in cs.closing_chunks():
            yield c

"""The chat request fields that shape the prompt or the tool-call read-back, checked once.

    chat_template_kwargs     extra variables for the chat template (``{"enable_thinking": false}``
                             for Qwen3's); names that are arguments of the tokenizer's
                             ``apply_chat_template`` itself (``tokenize``, ``tools`` ...) are refused
    add_generation_prompt    append the opening of the assistant turn (default true)
    continue_final_message   the last message, an assistant one, is continued: no generation prompt,
                             no end-of-turn after it (needs ``add_generation_prompt: false``)
    reasoning_effort         passed to the template as ``reasoning_effort`` (``"none"`` also sets
                             ``enable_thinking: false``); needs ``--reasoning-parser``
    parallel_tool_calls      false: at most one call comes back (see `first_call_only`)

`chat_message_errors` refuses message fields srt cannot honour (an assistant ``refusal``, ``audio``
or ``function_call``; content parts other than text and image_url; ``prompt_cache_breakpoint``) and
`chat_route_errors` the fields whose meaning srt cannot keep on /v1/chat/completions (a
``strict`` function under ``tool_choice: "auto"``, whose arguments are not constrained there; a
``response_format.json_schema.description``, which srt does not show the model).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from srt.parsers.tool_calls import ContentDelta, StreamEvent, ToolCall
from srt.utils.errors import RequestError

# apply_chat_template's own arguments (the tokenizer's signature adds any newer ones)
_TEMPLATE_CALL_ARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
# message fields srt cannot honour -> the values that mean "not used"
_MESSAGE_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "refusal": (None, ""),
    "audio": (None,),
    "function_call": (None,),
}


def _call_args(apply_fn: Callable[..., Any] | None) -> frozenset[str]:
    names = set(_TEMPLATE_CALL_ARGS)
    if apply_fn is not None:
        try:
            params = inspect.signature(apply_fn).parameters.values()
        except (TypeError, ValueError):
            params = []  # type: ignore[assignment]
        names.update(p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))
    return frozenset(names)


def reasoning_effort_kwargs(effort: str | None, has_reasoning_parser: bool) -> dict[str, Any]:
    """The chat template variables of ``reasoning_effort`` (RequestError without a reasoning parser)."""
    if effort is None:
        return {}
    if not has_reasoning_parser:
        raise RequestError(
            "reasoning_effort needs a server started with --reasoning-parser", param="reasoning_effort"
        )
    return {"reasoning_effort": effort, **({"enable_thinking": False} if effort == "none" else {})}


def template_options(
    req: Any, apply_fn: Callable[..., Any] | None, has_reasoning_parser: bool, base: dict[str, Any] | None
) -> dict[str, Any]:
    """The keyword arguments of ``apply_chat_template`` for ``req`` (a chat completion request):
    ``add_generation_prompt``, ``continue_final_message`` and the template variables (``base``,
    then ``reasoning_effort``'s, then ``chat_template_kwargs``, later ones winning). RequestError
    for an invalid combination or a variable named like one of ``apply_fn``'s arguments."""
    if req.continue_final_message:
        if req.add_generation_prompt:
            raise RequestError(
                "continue_final_message needs add_generation_prompt: false", param="continue_final_message"
            )
        if req.messages[-1].role != "assistant":
            raise RequestError(
                "continue_final_message needs the last message to be an assistant message, "
                f"got {req.messages[-1].role!r}",
                param="continue_final_message",
            )
    variables = dict(base or {})
    variables.update(reasoning_effort_kwargs(req.reasoning_effort, has_reasoning_parser))
    extra = req.chat_template_kwargs or {}
    clash = sorted(set(extra) & _call_args(apply_fn))
    if clash:
        raise RequestError(
            f"chat_template_kwargs may not set {', '.join(clash)} (an argument of the template call, "
            "not a template variable)",
            param=f"chat_template_kwargs.{clash[0]}",
        )
    variables.update(extra)
    return {
        **variables,
        "add_generation_prompt": req.add_generation_prompt,
        "continue_final_message": req.continue_final_message,
    }


def chat_message_errors(messages: list[Any]) -> None:
    """RequestError naming the first message field srt cannot honour (module docstring)."""
    for i, m in enumerate(messages):
        for name, off in _MESSAGE_UNSUPPORTED.items():
            if getattr(m, name, None) not in off:
                raise RequestError(
                    f"messages[{i}].{name} is not supported by this server", param=f"messages[{i}].{name}"
                )
        if not isinstance(m.content, list):
            continue
        for j, part in enumerate(m.content):
            where = f"messages[{i}].content[{j}]"
            if part.type == "image_url":
                if part.image_url is None:
                    raise RequestError(
                        f"{where} is an image part without image_url", param=f"{where}.image_url"
                    )
                continue
            if part.type != "text":
                raise RequestError(
                    f"{where}.type {part.type!r} is not supported (text and image_url parts only)",
                    param=f"{where}.type",
                )
            if part.text is None:
                raise RequestError(f"{where} is a text part without text", param=f"{where}.text")
            if part.prompt_cache_breakpoint is not None:
                raise RequestError(
                    f"{where}.prompt_cache_breakpoint is not supported (prefix caching is automatic)",
                    param=f"{where}.prompt_cache_breakpoint",
                )


def chat_route_errors(req: Any) -> None:
    """RequestError naming the first field of a /v1/chat/completions request whose meaning srt
    cannot keep on that route (module docstring)."""
    fmt = req.response_format
    if fmt is not None and fmt.json_schema is not None and fmt.json_schema.description:
        raise RequestError(
            "response_format.json_schema.description is not supported (the schema constrains the "
            "output; describe the task in the messages)",
            param="response_format.json_schema.description",
        )
    if req.tools and req.tool_choice in (None, "auto"):
        for i, tool in enumerate(req.tools):
            if tool.function.strict:
                raise RequestError(
                    'strict function arguments are only enforced with tool_choice "required" or a '
                    'named function (constrained decoding); send "strict": false or change tool_choice',
                    param=f"tools[{i}].function.strict",
                )


def first_call_only(content: str | None, calls: list[ToolCall]) -> tuple[str | None, list[ToolCall]]:
    """``parallel_tool_calls: false`` on a whole output: its first call (the others are dropped)."""
    return content, calls[:1]


class FirstCallFilter:
    """``parallel_tool_calls: false`` on a streamed output: the events of call index 0 and the
    content pass, those of later calls are dropped (as `first_call_only` does for a whole one)."""

    def filter(self, events: list[StreamEvent]) -> list[StreamEvent]:
        return [e for e in events if isinstance(e, ContentDelta) or e.index == 0]

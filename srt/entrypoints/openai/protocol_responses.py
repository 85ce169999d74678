"""POST /v1/responses request: its pydantic model and its conversion to an internal chat request.

srt keeps no state between requests, so a Responses request is served as one chat completion:

    Responses field                     chat completion field
    instructions                        a system message before the input
    input (a string)                    one user message
    input items: message                a message (developer is passed as system; text parts joined)
                 function_call          an assistant message's tool_calls (consecutive calls merge)
                 function_call_output   a tool message answering its call_id
                 reasoning              not shown to the model (chat templates drop earlier reasoning)
    max_output_tokens                   max_tokens
    tools {type: function, name, ...}   tools {type: function, function: {name, ...}}
    tool_choice {type: function, name}  tool_choice {type: function, function: {name}}
    text.format                         response_format (json_schema / json_object / text)
    include message.output_text.logprobs, top_logprobs    logprobs, top_logprobs
    reasoning.effort                    the chat template's reasoning_effort (effort "none" also
                                        sets enable_thinking false); needs --reasoning-parser

``temperature``, ``top_p``, ``parallel_tool_calls``, ``stream`` and SGLang's sampling extras keep
their names; ``lora_path`` and ``model`` select a LoRA adapter as on the chat route. ``model``,
``metadata``, ``user``, ``safety_identifier`` and ``prompt_cache_key`` are echoed in the response
(prefix caching is automatic). Every other field of OpenAI's request is in ``REJECTED_FIELDS`` with
the values srt can accept (the default, or "off"); any other value, and any field srt does not know,
is a 400 naming it. Items echoing earlier outputs may carry bookkeeping
fields (``id``, ``status``, ``annotations``): they do not change the prompt and are not read.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from srt.entrypoints.openai.list_types import ListOf, Strs, fail_fast
from srt.entrypoints.openai.protocol import ChatCompletionRequest
from srt.utils.errors import RequestError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextConfig(_Strict):
    format: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: str | None = None
    generate_summary: str | None = None
    context: str | None = None
    mode: str | None = None


class ResponsesStreamOptions(_Strict):
    include_obfuscation: bool = False


class ResponsesRequest(BaseModel):
    """The fields srt honours; the others land in ``model_extra`` and are checked by `check_fields`."""

    model_config = ConfigDict(extra="allow")
    input: str | ListOf[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: ListOf[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    include: Strs | None = None
    top_logprobs: int | None = None
    metadata: dict[str, str] | None = fail_fast(None)
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # SGLang's sampling extras (same names as on /v1/chat/completions)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    stop: str | Strs | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    priority: int | None = None
    timeout: float | None = None
    lora_path: str | None = None  # SGLang's: a loaded LoRA adapter (``model`` may name it too)


# OpenAI request fields srt cannot honour and the values it accepts for them (absent, the default,
# or "off"); any other value is a 400 naming the field
REJECTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "store": (None, False),
    "previous_response_id": (None,),
    "conversation": (None,),
    "background": (None, False),
    "background_options": (None,),
    "prompt": (None,),
    "truncation": (None, "disabled"),
    "service_tier": (None, "auto", "default"),
    "max_tool_calls": (None,),
    "prompt_cache_retention": (None, "in_memory"),
    "prompt_cache_options": (None,),
    "context_management": (None, []),
    "moderation": (None,),
    "access_programs": (None,),
    "image": (None,),
}
_WHY = {
    "store": "srt keeps no state; send store false and pass earlier output items back in input",
    "previous_response_id": "srt keeps no state; pass earlier output items back in input",
    "conversation": "srt keeps no state; pass earlier output items back in input",
    "background": "responses are served while the request is open",
}
LOGPROBS_INCLUDE = "message.output_text.logprobs"


def _reject(param: str, message: str) -> RequestError:
    return RequestError(f"{param}: {message}", param=param)


def check_fields(req: ResponsesRequest) -> None:
    """RequestError naming the first field srt cannot honour (see the module docstring)."""
    for name, value in (req.model_extra or {}).items():
        if name not in REJECTED_FIELDS:
            raise _reject(name, "unknown field for /v1/responses")
        if value not in REJECTED_FIELDS[name]:
            why = _WHY.get(name, f"not supported by this server (accepted: {REJECTED_FIELDS[name]})")
            raise _reject(name, why)
    for item in req.include or []:
        if item != LOGPROBS_INCLUDE:
            raise _reject("include", f"{item!r} is not supported (only {LOGPROBS_INCLUDE!r})")
    if req.stream_options is not None and req.stream_options.include_obfuscation:
        raise _reject("stream_options.include_obfuscation", "not supported by this server")
    if req.text is not None and req.text.verbosity not in (None, "medium"):
        raise _reject("text.verbosity", "not supported by this server")
    r = req.reasoning
    if r is not None:
        for name in ("summary", "generate_summary", "context", "mode"):
            if getattr(r, name) is not None:
                why = "srt returns the reasoning text itself (a reasoning item), not a summary"
                raise _reject(f"reasoning.{name}", why if "summary" in name else "not supported")


def _text_of(content: Any, where: str, images: bool = False) -> str | list[dict[str, Any]]:
    """The text of a message's content: a string, or text parts joined by newlines; with
    ``images`` (a message's content) and an ``input_image`` part, chat content parts instead."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _reject(f"{where}.content", "must be a string or a list of content parts")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image" and images:
            parts.append(_image_part(part, f"{where}.content[{j}]"))
            continue
        if kind not in ("input_text", "output_text", "text", "refusal"):
            allowed = "text and input_image parts" if images else "text parts only"
            raise _reject(f"{where}.content[{j}].type", f"{kind!r} is not supported ({allowed})")
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise _reject(f"{where}.content[{j}]", "a text part needs its text")
        parts.append({"type": "text", "text": text})
    if any(p["type"] == "image_url" for p in parts):
        return parts
    return "\n".join(p["text"] for p in parts)


def _image_part(part: dict[str, Any], where: str) -> dict[str, Any]:
    """The chat ``image_url`` part of a Responses ``input_image`` part."""
    if part.get("file_id") is not None:
        raise _reject(f"{where}.file_id", "not supported by this server (send image_url)")
    url = part.get("image_url")
    if not isinstance(url, str):
        raise _reject(f"{where}.image_url", "must be a string (a data: URI or an http(s) URL)")
    image: dict[str, Any] = {"url": url}
    if part.get("detail") is not None:
        image["detail"] = part["detail"]
    return {"type": "image_url", "image_url": image}


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _reject(f"{where}.{key}", "must be a string")
    return value


_ROLES = ("user", "system", "developer", "assistant")


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages of ``req.instructions`` and ``req.input`` (module docstring)."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return [*messages, {"role": "user", "content": req.input}]
    names: dict[str, str] = {}  # call_id -> function name, for the tool messages
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise _reject(f"{where}.role", f"{role!r} is not one of {', '.join(_ROLES)}")
            messages.append({"role": role, "content": _text_of(item.get("content"), where, images=True)})
        elif kind == "function_call":
            call_id, name = _string(item, "call_id", where), _string(item, "name", where)
            names[call_id] = name
            call = {"id": call_id, "type": "function", "function": {"name": name}}
            call["function"]["arguments"] = _string(item, "arguments", where)
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            output = _text_of(item.get("output"), where)
            msg = {"role": "tool", "tool_call_id": call_id, "content": output}
            if call_id in names:
                msg["name"] = names[call_id]
            messages.append(msg)
        elif kind != "reasoning":
            raise _reject(f"{where}.type", f"{kind!r} is not supported by this server")
    if not messages:
        raise _reject("input", "must not be empty")
    return messages


_TOOL_HARMLESS = {"defer_loading": (False,), "async": (False,), "allowed_callers": (None,)}
_TOOL_HARMLESS["output_schema"] = (None,)


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat ``tools`` of Responses function tools; RequestError for other tool types."""
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if tool.get("type") != "function":
            raise _reject(f"{where}.type", f"{tool.get('type')!r} is not supported (function tools only)")
        fn: dict[str, Any] = {"name": _string(tool, "name", where)}
        for key, value in tool.items():
            if key in ("description", "parameters", "strict"):
                fn[key] = value
            elif key not in ("type", "name") and value not in _TOOL_HARMLESS.get(key, ()):
                raise _reject(f"{where}.{key}", "not supported by this server")
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> Any:
    """The chat ``tool_choice`` of a Responses one."""
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str) or len(choice) != 2:
        raise _reject("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "name"}')
    return {"type": "function", "function": {"name": choice["name"]}}


def chat_response_format(text: TextConfig | None) -> dict[str, Any] | None:
    """The chat ``response_format`` of ``text.format``."""
    fmt = None if text is None else text.format
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind in ("text", "json_object") and len(fmt) == 1:
        return {"type": kind}
    if kind != "json_schema":
        raise _reject("text.format", 'type must be "text", "json_object" or "json_schema"')
    extra = (
        set(fmt)
        - {"type", "name", "schema", "strict"}
        - ({"description"} if not fmt.get("description") else set())
    )
    if extra:
        raise _reject(f"text.format.{sorted(extra)[0]}", "not supported (the schema constrains the output)")
    if not isinstance(fmt.get("schema"), dict):
        raise _reject("text.format.schema", "a json_schema format needs its schema (an object)")
    spec = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


def _check_strict(tools: list[dict[str, Any]], choice: Any) -> None:
    """Strict arguments are enforced by the grammar only when a call is forced."""
    if choice not in (None, "auto"):
        return
    for i, tool in enumerate(tools):
        if tool.get("strict"):
            why = 'enforced only with tool_choice "required" or a named function; send strict false'
            raise _reject(f"tools[{i}].strict", why)


_PASSED = (
    "temperature", "top_p", "parallel_tool_calls", "stream", "top_k", "min_p", "repetition_penalty",
    "frequency_penalty", "presence_penalty", "seed", "stop", "min_tokens", "ignore_eos", "priority",
    "timeout", "user",
)  # fmt: skip


def to_chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request that serves ``req`` (`check_fields` first)."""
    check_fields(req)
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise _reject("max_output_tokens", f"must be >= 1, got {req.max_output_tokens}")
    body: dict[str, Any] = {k: getattr(req, k) for k in _PASSED if getattr(req, k) is not None}
    body["messages"] = input_messages(req)
    body["max_tokens"] = req.max_output_tokens
    body["stream_options"] = {"include_usage": True} if req.stream else None
    if req.tools:
        body["tools"] = chat_tools(req.tools)
        _check_strict(req.tools, req.tool_choice)
    body["tool_choice"] = chat_tool_choice(req.tool_choice)
    body["response_format"] = chat_response_format(req.text)
    if LOGPROBS_INCLUDE in (req.include or []) or req.top_logprobs is not None:
        body["logprobs"] = True
        body["top_logprobs"] = req.top_logprobs or 0
    return ChatCompletionRequest.model_validate(body)


def template_kwargs(req: ResponsesRequest, has_reasoning_parser: bool) -> dict[str, Any]:
    """The chat template arguments of ``reasoning.effort`` (RequestError without a reasoning parser)."""
    effort = None if req.reasoning is None else req.reasoning.effort
    if effort is None:
        return {}
    if not has_reasoning_parser:
        raise _reject("reasoning.effort", "needs a server started with --reasoning-parser")
    return {"reasoning_effort": effort, **({"enable_thinking": False} if effort == "none" else {})}

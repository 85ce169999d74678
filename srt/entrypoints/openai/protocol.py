"""OpenAI-compatible request models (pydantic, at the HTTP edge only).

Requests are validated with ``Model.model_validate_json(body, strict=True)``: malformed JSON and
wrong types (``"temperature": "hot"``, ``"n": 1.5``, ``"n": true``) are rejected. A field srt
has never heard of is a 400 naming it (``unknown_field``: srt cannot honour what it does not know,
e.g. another server's ``guided_json``); fields srt knows but cannot honour (``UNSUPPORTED_FIELDS``, and the nested ones of
`srt.entrypoints.openai.chat_fields`) are rejected with a 400 naming them; ``INFORMATIONAL_FIELDS``
(end-user and cache-routing identifiers) are accepted and have no effect by definition. The
sampling fields are mapped to `SamplingParams` by `srt.sampling.openai_params` and their ranges
checked by `SamplingParams.validation_errors`, so that the native and the OpenAI APIs agree.
Responses are built as plain dicts and serialized with orjson (see ``serving_*``). The native
/generate body is `srt.managers.tokenizer.generate_input.GenerateReqInput`.

Besides OpenAI's fields the requests take SGLang's sampling extras: ``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``skip_special_tokens``,
``spaces_between_special_tokens``, ``no_stop_trim``, ``stop_token_ids``, the constraints
``regex`` and ``ebnf`` (``response_format`` is OpenAI's way to ask for JSON), and the request's
queue ``priority`` (with ``--enable-priority-scheduling``) and the LoRA adapter ``lora_path``.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from srt.entrypoints.openai.chat_fields import chat_route_errors
from srt.entrypoints.openai.list_types import ListOf, PromptInput, Strs, TokenIds, fail_fast
from srt.utils.errors import RequestError

logger = logging.getLogger("srt.openai")


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Request(BaseModel):
    """A request body: extra fields are kept (``model_extra``) so that they can be logged."""

    model_config = ConfigDict(extra="allow")


class JsonSchemaFormat(_Model):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def to_json_schema(self) -> str | None:
        """The JSON schema (as JSON text) this format constrains the output to, or None."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return json.dumps({"type": "object"})
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise RequestError(
                "response_format of type json_schema needs json_schema.schema", param="response_format"
            )
        return json.dumps(self.json_schema.schema_)


class StreamOptions(_Model):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    include_obfuscation: bool | None = None  # refused when true (reject_unsupported_fields)


class _SamplingFields(_Request):
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | Strs | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = fail_fast(None)
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
    stop_token_ids: TokenIds | None = None
    rid: str | None = None
    priority: int | None = None  # SGLang extra: queue priority (--enable-priority-scheduling)
    # SGLang extra: a loaded LoRA adapter's name (one per prompt in a list; ``model`` may name it too)
    lora_path: str | ListOf[str | None] | None = None
    # srt extras: a deadline in seconds from receipt (finish_reason "timeout" past it; the
    # X-Request-Timeout header when absent) and the per-choice phase timings ("metrics")
    timeout: float | None = None
    return_timings: bool = False
    # constrained decoding (SGLang extras; response_format is OpenAI's JSON mode)
    response_format: ResponseFormat | None = None
    regex: str | None = None
    ebnf: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: PromptInput
    max_tokens: int | None = 16
    logprobs: int | None = None  # number of top logprobs per token (0 = the sampled token only)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ImageURL(_Model):
    url: str  # a data: URI, an http(s) URL (srt/multimodal/image_io.py)
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's processor sets the size


class ContentPart(_Model):
    """A message content part: text, or an image for a vision-language model
    (`chat_fields.chat_message_errors` refuses other types)."""

    type: str
    text: str | None = None
    image_url: ImageURL | None = None
    prompt_cache_breakpoint: Any = None  # refused when set


class ToolCallFunction(_Model):
    name: str
    arguments: str


class ToolCallItem(_Model):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Model):
    role: str
    content: str | ListOf[ContentPart] | None = None
    name: str | None = None
    tool_calls: ListOf[ToolCallItem] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers
    # OpenAI fields srt cannot honour: refused unless null (chat_fields.chat_message_errors)
    refusal: str | None = None
    audio: Any = None
    function_call: Any = None


class FunctionDefinition(_Model):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: ListOf[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: ListOf[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None  # a chat template variable (needs --reasoning-parser)
    # how the prompt is rendered (chat_fields.template_options; SGLang's / vLLM's extras)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_MAX_TOP_LOGPROBS = 20


# OpenAI request fields srt knows but cannot honour, and the values that are harmless to accept
# (the default, or "off"): any other value gets a 400 naming the field, never a silent drop
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "store": (None, False),
    "metadata": (None, {}),  # kept only by stored completions
    "service_tier": (None, "auto", "default"),
    "moderation": (None,),
    "verbosity": (None,),
    "prompt_cache_retention": (None, "in_memory"),
    "prompt_cache_options": (None, {}),
    # SGLang extras srt does not implement
    "session_params": (None,),
    "return_hidden_states": (None, False),
    "separate_reasoning": (None, True),
    "stream_reasoning": (None, True),
    "bootstrap_host": (None,),
    "bootstrap_port": (None,),
    "bootstrap_room": (None,),
}
_UNSUPPORTED_WHY = {
    "functions": "use tools",
    "function_call": "use tool_choice",
    "prompt_cache_retention": "the prefix cache keeps entries in memory until evicted",
    "prompt_cache_options": "prefix caching is automatic",
}
# accepted and without effect by their definition: they identify the end user or group requests
# for the provider's abuse monitoring and cache routing, and never change the output; a JSON
# schema's name is its label, and srt enforces every schema whatever its "strict" says
INFORMATIONAL_FIELDS = frozenset(
    {
        "user",
        "safety_identifier",
        "prompt_cache_key",
        "response_format.json_schema.name",
        "response_format.json_schema.strict",
    }
)


def reject_unsupported_fields(req: _Request) -> None:
    """RequestError naming the first field of UNSUPPORTED_FIELDS set to something srt cannot do
    (and, for a chat request, `chat_fields.chat_route_errors`), then any field srt does not know."""
    extra = req.model_extra or {}
    for name, harmless in UNSUPPORTED_FIELDS.items():
        if name in extra and extra[name] not in harmless:
            hint = _UNSUPPORTED_WHY.get(name)
            raise RequestError(
                f"{name} is not supported by this server" + (f" ({hint})" if hint else ""), param=name
            )
    options = getattr(req, "stream_options", None)
    if options is not None and options.include_obfuscation:
        raise RequestError(
            "stream_options.include_obfuscation is not supported by this server",
            param="stream_options.include_obfuscation",
        )
    if isinstance(req, ChatCompletionRequest):
        chat_route_errors(req)
    unknown = sorted(k for k in extra if k not in UNSUPPORTED_FIELDS and k not in INFORMATIONAL_FIELDS)
    if unknown:
        raise RequestError(
            f"unknown request field(s) {', '.join(unknown)}: this server does not know them, so it "
            "cannot honour them",
            param=unknown[0],
            code="unknown_field",
        )


def check_top_logprobs(value: int | None, name: str) -> int:
    if value is None:
        return 0
    if not 0 <= value <= _MAX_TOP_LOGPROBS:
        raise RequestError(f"{name} must be in [0, {_MAX_TOP_LOGPROBS}], got {value}", param=name)
    return value


class AbortRequest(_Model):
    rid: str = ""
    abort_all: bool = False


class TokenizeRequest(_Model):
    """Body of POST /tokenize (SGLang's shape)."""

    prompt: str | Strs
    add_special_tokens: bool = True


class DetokenizeRequest(_Model):
    """Body of POST /detokenize (SGLang's shape)."""

    tokens: TokenIds
    skip_special_tokens: bool = True


class ProfileRequest(_Model):
    """Body of POST /start_profile (every field optional; the scheduler checks the values)."""

    output_dir: str | None = None
    num_steps: int | None = None
    activities: Strs | None = None


class UpdateWeightsFromDiskRequest(_Model):
    """Body of POST /update_weights_from_disk."""

    model_path: str
    load_format: str | None = None


class LoadLoRAAdapterRequest(_Model):
    """Body of POST /load_lora_adapter (SGLang's shape)."""

    lora_name: str
    lora_path: str
    pinned: bool = False


class UnloadLoRAAdapterRequest(_Model):
    """Body of POST /unload_lora_adapter (SGLang's shape)."""

    lora_name: str

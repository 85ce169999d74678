"""Every request field of the official `openai` client is honoured or refused, never dropped.

The fields of the client's request TypedDicts (recursively for messages, tools, tool_choice,
response_format and stream_options) are enumerated by `field_paths`; each must have a case here
saying how srt treats it, and the case is run through srt's own request parsing and conversion:

    honoured       the field changes what srt does: the `GenerateReqInput` built from the request
                   (prompt, sampling params, logprob settings, streaming), the route's model check,
                   or the response / stream built from the same fake output
    rejected       a request setting it (to a value that is not "off") is refused with a
                   `RequestError` (HTTP 400) whose ``param`` names it
    informational  accepted and without effect by definition (srt's ``INFORMATIONAL_FIELDS``)

A new field in a newer client fails `test_chat_fields` / `test_completion_fields` until it is
classified. `check_field` is generic (any TypedDict, any route's observe function) so that other
routes' request types can be added the same way.
"""

from __future__ import annotations

import asyncio
import collections.abc
import copy
import json
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import typing_extensions
from pydantic import ValidationError

from srt.entrypoints.http.deps import ServerContext
from srt.entrypoints.http.serving import _validation_message
from srt.entrypoints.openai.protocol import (
    INFORMATIONAL_FIELDS,
    UNSUPPORTED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    reject_unsupported_fields,
)
from srt.entrypoints.openai.serving_chat import OpenAIServingChat
from srt.entrypoints.openai.serving_completions import OpenAIServingCompletion
from srt.utils.errors import RequestError

openai_chat = pytest.importorskip("openai.types.chat.completion_create_params")
openai_completion = pytest.importorskip("openai.types.completion_create_params")


# ---------------------------------------------------------------- the generic walker
def _typed_dicts(ann: Any) -> list[tuple[Any, bool]]:
    """The TypedDicts an annotation holds: (type, inside a list)."""
    if typing_extensions.is_typeddict(ann):
        return [(ann, False)]
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin in (typing.Union, types.UnionType):
        return [x for a in args for x in _typed_dicts(a)]
    if origin in (list, tuple, collections.abc.Iterable, collections.abc.Sequence):
        return [(td, True) for a in args for td, _ in _typed_dicts(a)]
    return []


def field_paths(td: Any, descend: frozenset[str] = frozenset(), prefix: str = "") -> set[str]:
    """The field paths of TypedDict ``td`` (``messages[].content[].text``), entering the fields
    named in ``descend`` (every member of a union is entered)."""
    out = set()
    for name, ann in typing.get_type_hints(td).items():
        path = prefix + name
        out.add(path)
        if path in descend:
            for sub, many in _typed_dicts(ann):
                out |= field_paths(sub, descend, f"{path}{'[]' if many else ''}.")
    return out


Body = dict[str, Any]


@dataclass
class Case:
    kind: str  # "honoured", "rejected" or "informational"
    patch: Callable[[Body], None]  # sets the field on a body
    base: Callable[[Body], None] = field(default=lambda b: None)  # what both bodies share
    tm: dict[str, Any] = field(default_factory=dict)  # stub tokenizer-manager options
    param: str | None = None  # the field the 400 names, when not ``path`` (a part's type)


def _named(param: str | None, path: str) -> bool:
    """Whether an error's ``param`` names the field at ``path`` (indices dropped; a validation
    error names the outermost field)."""
    norm = re.sub(r"\[\d+\]", "[]", param or "")
    return bool(norm) and (norm == path or path.startswith(norm + ".") or path.startswith(norm + "[]"))


def outcome(observe: Callable[[Body, dict], Any], body: Body, tm: dict) -> Any:
    """What srt makes of ``body``: the observation, or ("400", param) for a refused request."""
    try:
        return observe(body, tm)
    except RequestError as e:
        return ("400", e.param)
    except ValidationError as e:
        return ("400", _validation_message(e)[1])


def check_field(
    path: str, case: Case | None, base_body: Body, observe: Callable[[Body, dict], Any], rejected: set[str]
) -> None:
    """Run ``case`` of the field at ``path``: honoured changes the observation, rejected is a 400
    naming it (and top-level names are in srt's ``rejected`` set or checked by the serving),
    informational is accepted without effect (and listed in ``INFORMATIONAL_FIELDS``)."""
    assert case is not None, f"{path}: unclassified request field (add a case: honoured, rejected ...)"
    base = copy.deepcopy(base_body)
    case.base(base)
    patched = copy.deepcopy(base)
    case.patch(patched)
    before = outcome(observe, base, case.tm)
    assert not (isinstance(before, tuple) and before[0] == "400"), f"{path}: base body refused: {before}"
    after = outcome(observe, patched, case.tm)
    if case.kind == "rejected":
        assert isinstance(after, tuple) and after[0] == "400", f"{path}: accepted, expected a 400"
        assert _named(after[1], case.param or path), f"{path}: the 400 names {after[1]!r}"
        if "." not in path and "[" not in path:
            assert path in rejected, f"{path}: refused but not in srt's rejected list"
    elif case.kind == "honoured":
        assert not (isinstance(after, tuple) and after[0] == "400"), f"{path}: refused: {after}"
        assert after != before, f"{path}: accepted but changed nothing"
    else:
        assert case.kind == "informational"
        assert path in INFORMATIONAL_FIELDS, f"{path}: not in INFORMATIONAL_FIELDS"
        assert after == before, f"{path}: informational but changed the request"


# ---------------------------------------------------------------- srt's side, stubbed
class _Tokenizer:
    def decode(self, ids: list[int]) -> str:
        return "".join(f"<{i}>" for i in ids)

    def apply_chat_template(self, conversation, tools=None, tokenize=True, add_generation_prompt=False, **kw):
        raise AssertionError("the stub tokenizer manager renders the prompt")


class _StubTM:
    """Renders the prompt as JSON of everything the chat template is given."""

    def __init__(self, tool_call_parser: str | None = "hermes", reasoning_parser: str | None = None):
        self.server_args = SimpleNamespace(
            tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser, enable_cache_report=False
        )
        self.tokenizer = _Tokenizer()
        self.model_name = "m"

    def chat_template_renders_tools(self) -> bool:
        return True

    takes_images = True

    def apply_chat_template(self, messages, **kwargs) -> str:
        return json.dumps({"messages": messages, **kwargs}, sort_keys=True, default=str)


_CTX = ServerContext(SimpleNamespace(model_name="m"), None, None, frozenset({"m"}))  # type: ignore[arg-type]
_TWO_CALLS = (
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
    '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
)


def _output(text: str) -> dict[str, Any]:
    return {
        "index": 0,
        "text": text,
        "output_ids": [5, 6],
        "meta_info": {
            "id": "r",
            "finish_reason": {"type": "stop", "matched": 2},
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "cached_tokens": 0,
            "output_token_logprobs": [(-0.5, 5, None), (-0.25, 6, None)],
            "output_top_logprobs": [[(-0.5, 5, None)], [(-0.25, 6, None)]],
            "input_token_logprobs": [(None, 1, None), (-1.0, 2, None)],
        },
    }


def _scrub(x: Any) -> Any:
    """A response without its random parts (ids, creation time)."""
    if isinstance(x, dict):
        return {k: _scrub(v) for k, v in x.items() if k not in ("id", "created")}
    if isinstance(x, list):
        return [_scrub(v) for v in x]
    return x


def _stream(serving: Any, req: Any, text: str) -> list[dict[str, Any]]:
    async def chunks():
        yield _output(text)

    async def collect():
        return [c async for c in serving.stream_chunks(req, chunks())]

    return _scrub(asyncio.run(collect()))


def _observe(model: type, serving_cls: type, text: str) -> Callable[[Body, dict], Any]:
    def observe(body: Body, tm: dict) -> Any:
        req = model.model_validate_json(json.dumps(body), strict=True)
        reject_unsupported_fields(req)
        serving = serving_cls(_StubTM(**tm))
        obj = serving.build_input(req)
        return {
            "model_served": _CTX.model_not_found(req.model) is None,
            "input": (obj.text, obj.input_ids, obj.sampling_params, obj.return_logprob, obj.image_data),
            "logprobs": (obj.top_logprobs_num, obj.logprob_start_len, obj.stream),
            "response": _scrub(serving.build_response(req, [_output(text)])),
            "stream": _stream(serving, req, text),
        }

    return observe


# ---------------------------------------------------------------- chat completions
def _set(**fields: Any) -> Callable[[Body], None]:
    return lambda b: b.update(copy.deepcopy(fields))


def _msg(**fields: Any) -> Callable[[Body], None]:
    """Set fields on the last message."""
    return lambda b: b["messages"][-1].update(copy.deepcopy(fields))


def _assistant(**fields: Any) -> Callable[[Body], None]:
    """Append an assistant turn with ``fields`` and a user turn after it."""

    def patch(b: Body) -> None:
        b["messages"] += [
            {"role": "assistant", "content": "ok", **copy.deepcopy(fields)},
            {"role": "user", "content": "?"},
        ]

    return patch


def _parts(*parts: dict[str, Any]) -> Callable[[Body], None]:
    return _msg(content=[{"type": "text", "text": "hi"}, *parts])


_WITH_CALL = _assistant(
    tool_calls=[{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
)


def _in_call(**over: Any) -> Callable[[Body], None]:
    """Change the call of the assistant turn `_WITH_CALL` added."""
    return lambda b: b["messages"][-2]["tool_calls"][0].update(copy.deepcopy(over))


_PART_TYPE = "messages[].content[].type"  # what a 400 for a non-text part names


def _call(**over: Any) -> dict[str, Any]:
    return {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}, **over}


_FN = {"name": "f", "description": "does f", "parameters": {"type": "object"}}
_TOOLS = [{"type": "function", "function": _FN}, {"type": "function", "function": {**_FN, "name": "g"}}]
_SCHEMA = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}}


def _tool(**fn: Any) -> Callable[[Body], None]:
    return lambda b: b["tools"][0]["function"].update(copy.deepcopy(fn))


def _schema(**js: Any) -> Callable[[Body], None]:
    return lambda b: b["response_format"]["json_schema"].update(copy.deepcopy(js))


H, R, INFO = "honoured", "rejected", "informational"
_WITH_TOOLS = _set(tools=_TOOLS)
_WITH_SCHEMA = _set(response_format=_SCHEMA)
_NAMED = _set(tools=_TOOLS, tool_choice={"type": "function", "function": {"name": "f"}})

CHAT_CASES: dict[str, Case] = {
    "model": Case(H, _set(model="other")),
    "messages": Case(H, _set(messages=[{"role": "user", "content": "bye"}])),
    "messages[].role": Case(H, _msg(role="system")),
    "messages[].content": Case(H, _msg(content="bye")),
    "messages[].content[].text": Case(H, _parts({"type": "text", "text": "more"})),
    "messages[].content[].type": Case(R, _parts({"type": "input_audio", "text": "x"})),
    # (the image travels as image_data; a text-only model refuses it when the request is prepared)
    "messages[].content[].image_url": Case(H, _parts({"type": "image_url", "image_url": {"url": "x"}})),
    "messages[].content[].input_audio": Case(
        R, _parts({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}), param=_PART_TYPE
    ),
    "messages[].content[].file": Case(
        R, _parts({"type": "file", "file": {"file_id": "f"}}), param=_PART_TYPE
    ),
    "messages[].content[].refusal": Case(R, _parts({"type": "refusal", "refusal": "no"}), param=_PART_TYPE),
    "messages[].content[].prompt_cache_breakpoint": Case(
        R, _parts({"type": "text", "text": "x", "prompt_cache_breakpoint": {"type": "ephemeral"}})
    ),
    "messages[].name": Case(H, _msg(name="bob")),
    "messages[].refusal": Case(R, _assistant(refusal="I cannot")),
    "messages[].audio": Case(R, _assistant(audio={"id": "a1"})),
    "messages[].function_call": Case(R, _assistant(function_call={"name": "f", "arguments": "{}"})),
    "messages[].tool_calls": Case(H, lambda b: b["messages"][-2].update(tool_calls=[_call()]), _assistant()),
    "messages[].tool_calls[].id": Case(H, _in_call(id="c2"), _WITH_CALL),
    "messages[].tool_calls[].type": Case(R, _in_call(type="custom"), _WITH_CALL),
    "messages[].tool_calls[].custom": Case(
        R, _assistant(tool_calls=[{"id": "c", "type": "custom", "custom": {"name": "f", "input": ""}}])
    ),
    "messages[].tool_calls[].function": Case(
        H, _in_call(function={"name": "g", "arguments": '{"x": 1}'}), _WITH_CALL
    ),
    "messages[].tool_calls[].function.name": Case(
        H, _in_call(function={"name": "g", "arguments": "{}"}), _WITH_CALL
    ),
    "messages[].tool_calls[].function.arguments": Case(
        H, _in_call(function={"name": "f", "arguments": '{"x": 1}'}), _WITH_CALL
    ),
    "messages[].tool_call_id": Case(
        H,
        lambda b: b["messages"].insert(-1, {"role": "tool", "content": "42", "tool_call_id": "c9"}),
        _assistant(tool_calls=[_call()]),
    ),
    "max_tokens": Case(H, _set(max_tokens=5)),
    "max_completion_tokens": Case(H, _set(max_completion_tokens=5)),
    "temperature": Case(H, _set(temperature=0.5)),
    "top_p": Case(H, _set(top_p=0.5)),
    "n": Case(H, _set(n=2)),
    "seed": Case(H, _set(seed=7)),
    "stop": Case(H, _set(stop=["x"])),
    "frequency_penalty": Case(H, _set(frequency_penalty=0.5)),
    "presence_penalty": Case(H, _set(presence_penalty=0.5)),
    "logit_bias": Case(H, _set(logit_bias={"5": 1})),
    "logprobs": Case(H, _set(logprobs=True)),
    "top_logprobs": Case(H, _set(top_logprobs=2), _set(logprobs=True)),
    "stream": Case(H, _set(stream=True)),
    "stream_options": Case(H, _set(stream_options={"include_usage": True})),
    "stream_options.include_usage": Case(H, _set(stream_options={"include_usage": True})),
    "stream_options.include_obfuscation": Case(R, _set(stream_options={"include_obfuscation": True})),
    "tools": Case(H, _WITH_TOOLS),
    "tools[].type": Case(R, lambda b: b["tools"][0].update(type="custom"), _WITH_TOOLS),
    "tools[].custom": Case(
        R, lambda b: b["tools"].append({"type": "custom", "custom": {"name": "c"}}), _WITH_TOOLS
    ),
    "tools[].function": Case(H, _tool(name="h"), _WITH_TOOLS),
    "tools[].function.name": Case(H, _tool(name="h"), _WITH_TOOLS),
    "tools[].function.description": Case(H, _tool(description="does more"), _WITH_TOOLS),
    "tools[].function.parameters": Case(
        H, _tool(parameters={"type": "object", "properties": {}}), _WITH_TOOLS
    ),
    "tools[].function.strict": Case(R, _tool(strict=True), _WITH_TOOLS),
    "tool_choice": Case(H, _set(tool_choice="none"), _WITH_TOOLS),
    "tool_choice.type": Case(R, lambda b: b["tool_choice"].update(type="custom"), _NAMED),
    "tool_choice.function": Case(
        H, _set(tool_choice={"type": "function", "function": {"name": "g"}}), _NAMED
    ),
    "tool_choice.function.name": Case(
        H, _set(tool_choice={"type": "function", "function": {"name": "g"}}), _NAMED
    ),
    "tool_choice.allowed_tools": Case(
        R,
        _set(tool_choice={"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}),
        _WITH_TOOLS,
    ),
    "tool_choice.custom": Case(R, _set(tool_choice={"type": "custom", "custom": {"name": "c"}}), _WITH_TOOLS),
    "parallel_tool_calls": Case(H, _set(parallel_tool_calls=False), _WITH_TOOLS),
    "response_format": Case(H, _set(response_format={"type": "json_object"})),
    "response_format.type": Case(
        H, _set(response_format={"type": "json_object"}), _set(response_format={"type": "text"})
    ),
    "response_format.json_schema": Case(H, _schema(schema={"type": "array"}), _WITH_SCHEMA),
    "response_format.json_schema.schema": Case(H, _schema(schema={"type": "array"}), _WITH_SCHEMA),
    "response_format.json_schema.name": Case(INFO, _schema(name="other"), _WITH_SCHEMA),
    "response_format.json_schema.strict": Case(INFO, _schema(strict=True), _WITH_SCHEMA),
    "response_format.json_schema.description": Case(R, _schema(description="a thing"), _WITH_SCHEMA),
    "reasoning_effort": Case(H, _set(reasoning_effort="low"), tm={"reasoning_parser": "qwen3"}),
    "user": Case(INFO, _set(user="u1")),
    "safety_identifier": Case(INFO, _set(safety_identifier="s1")),
    "prompt_cache_key": Case(INFO, _set(prompt_cache_key="k1")),
    # OpenAI features srt does not have
    "audio": Case(R, _set(audio={"voice": "alloy", "format": "wav"})),
    "modalities": Case(R, _set(modalities=["text", "audio"])),
    "prediction": Case(R, _set(prediction={"type": "content", "content": "x"})),
    "web_search_options": Case(R, _set(web_search_options={})),
    "functions": Case(R, _set(functions=[{"name": "f"}])),
    "function_call": Case(R, _set(function_call="auto")),
    "store": Case(R, _set(store=True)),
    "metadata": Case(R, _set(metadata={"k": "v"})),
    "service_tier": Case(R, _set(service_tier="flex")),
    "moderation": Case(R, _set(moderation={"model": "omni-moderation-latest"})),
    "verbosity": Case(R, _set(verbosity="low")),
    "prompt_cache_retention": Case(R, _set(prompt_cache_retention="24h")),
    "prompt_cache_options": Case(R, _set(prompt_cache_options={"mode": "explicit"})),
}
CHAT_DESCEND = frozenset(
    {
        "messages",
        "messages[].content",
        "messages[].tool_calls",
        "messages[].tool_calls[].function",
        "tools",
        "tools[].function",
        "tool_choice",
        "tool_choice.function",
        "response_format",
        "response_format.json_schema",
        "stream_options",
    }
)
CHAT_PATHS = field_paths(openai_chat.CompletionCreateParamsStreaming, CHAT_DESCEND)
CHAT_BASE: Body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
_chat_observe = _observe(ChatCompletionRequest, OpenAIServingChat, _TWO_CALLS)


@pytest.mark.parametrize("path", sorted(CHAT_PATHS))
def test_chat_fields(path):
    check_field(path, CHAT_CASES.get(path), CHAT_BASE, _chat_observe, set(UNSUPPORTED_FIELDS))


def test_every_chat_case_is_a_client_field():
    assert set(CHAT_CASES) <= CHAT_PATHS, sorted(set(CHAT_CASES) - CHAT_PATHS)


# ---------------------------------------------------------------- completions
COMPLETION_CASES: dict[str, Case] = {
    "model": Case(H, _set(model="other")),
    "prompt": Case(H, _set(prompt="bye")),
    "max_tokens": Case(H, _set(max_tokens=5)),
    "temperature": Case(H, _set(temperature=0.5)),
    "top_p": Case(H, _set(top_p=0.5)),
    "n": Case(H, _set(n=2)),
    "seed": Case(H, _set(seed=7)),
    "stop": Case(H, _set(stop="x")),
    "frequency_penalty": Case(H, _set(frequency_penalty=0.5)),
    "presence_penalty": Case(H, _set(presence_penalty=0.5)),
    "logit_bias": Case(H, _set(logit_bias={"5": 1})),
    "logprobs": Case(H, _set(logprobs=1)),
    "echo": Case(H, _set(echo=True)),
    "stream": Case(H, _set(stream=True)),
    "stream_options": Case(H, _set(stream_options={"include_usage": True})),
    "stream_options.include_usage": Case(H, _set(stream_options={"include_usage": True})),
    "stream_options.include_obfuscation": Case(R, _set(stream_options={"include_obfuscation": True})),
    "user": Case(INFO, _set(user="u1")),
    "suffix": Case(R, _set(suffix="end")),
    "best_of": Case(R, _set(best_of=3)),
}
COMPLETION_PATHS = field_paths(
    openai_completion.CompletionCreateParamsStreaming, frozenset({"stream_options"})
)
COMPLETION_BASE: Body = {"model": "m", "prompt": "hi", "max_tokens": 4}
_completion_observe = _observe(CompletionRequest, OpenAIServingCompletion, "xyz")
# refused by the completion serving itself (declared fields with a value check)
_COMPLETION_CHECKED = {"suffix", "best_of"}


@pytest.mark.parametrize("path", sorted(COMPLETION_PATHS))
def test_completion_fields(path):
    rejected = set(UNSUPPORTED_FIELDS) | _COMPLETION_CHECKED
    check_field(path, COMPLETION_CASES.get(path), COMPLETION_BASE, _completion_observe, rejected)


def test_every_completion_case_is_a_client_field():
    assert set(COMPLETION_CASES) <= COMPLETION_PATHS, sorted(set(COMPLETION_CASES) - COMPLETION_PATHS)


# ---------------------------------------------------------------- embeddings (declared fields)
def test_embedding_fields_are_declared():
    """Each field of the client's embedding request is a field of srt's request model (its
    behaviour is checked by the embedding route's own tests) or informational."""
    params = pytest.importorskip("openai.types.embedding_create_params")
    protocol = pytest.importorskip("srt.entrypoints.openai.protocol_embedding")
    model = getattr(protocol, "EmbeddingRequest", None)
    if model is None:
        pytest.skip("no embedding request model")
    for path in field_paths(params.EmbeddingCreateParams):
        assert path in model.model_fields or path in INFORMATIONAL_FIELDS, path

"""The chat fields that shape the prompt and the tool-call read-back (chat_fields.py), through the
chat serving with the default model's real tokenizer and chat template (no server)."""

from __future__ import annotations

import asyncio
import copy
import json
from functools import cache, partial
from types import SimpleNamespace
from typing import Any

import pytest

from srt.entrypoints.openai.protocol import ChatCompletionRequest
from srt.entrypoints.openai.serving_chat import OpenAIServingChat
from srt.managers.tokenizer.tokenizer_manager import TokenizerManager
from srt.utils.errors import RequestError

USER = {"role": "user", "content": "Name a colour."}
PARTIAL = {"role": "assistant", "content": "My favourite colour is"}


@cache
def _tokenizer():
    from srt.server_args import ServerArgs
    from srt.utils.hf_tokenizer import load_tokenizer, tokenizer_source

    return load_tokenizer(tokenizer_source(ServerArgs()))


def _chat(template: str | None = None, tool_call_parser=None, reasoning_parser=None) -> OpenAIServingChat:
    """The chat serving over a tokenizer manager stand-in whose prompt rendering is the real one
    (`TokenizerManager.apply_chat_template` on the default tokenizer, or a copy with ``template``)."""
    tok = _tokenizer()
    if template is not None:
        tok = copy.copy(tok)
        tok.chat_template = template
    holder = SimpleNamespace(tokenizer=tok)
    tm = SimpleNamespace(
        tokenizer=tok,
        model_name="m",
        server_args=SimpleNamespace(
            tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser, enable_cache_report=False
        ),
        chat_template_renders_tools=lambda: False,
        apply_chat_template=partial(TokenizerManager.apply_chat_template, holder),
    )
    return OpenAIServingChat(tm)


def _req(**body: Any) -> ChatCompletionRequest:
    body.setdefault("messages", [USER])
    return ChatCompletionRequest.model_validate_json(json.dumps(body), strict=True)


def _render(messages, **kw) -> str:
    return _tokenizer().apply_chat_template(messages, tokenize=False, **kw)


# ---------------------------------------------------------------- prompt rendering
def test_continue_final_message_continues_the_assistant_turn():
    text = (
        _chat()
        .build_input(_req(messages=[USER, PARTIAL], continue_final_message=True, add_generation_prompt=False))
        .text
    )
    # the open assistant turn of the generation prompt, then the partial answer, nothing after it
    assert text == _render([USER], add_generation_prompt=True) + PARTIAL["content"]
    closed = _chat().build_input(_req(messages=[USER, PARTIAL], add_generation_prompt=False)).text
    assert closed.startswith(text) and len(closed) > len(text)  # the closed turn has its end-of-turn


def test_add_generation_prompt_false_leaves_out_the_assistant_opening():
    with_prompt = _chat().build_input(_req()).text
    without = _chat().build_input(_req(add_generation_prompt=False)).text
    assert without == _render([USER], add_generation_prompt=False)
    assert with_prompt.startswith(without) and len(with_prompt) > len(without)


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [USER, PARTIAL], "continue_final_message": True},  # add_generation_prompt defaults true
        {"messages": [USER], "continue_final_message": True, "add_generation_prompt": False},
    ],
)
def test_invalid_continue_final_message_combinations_are_400(body):
    with pytest.raises(RequestError) as e:
        _chat().build_input(_req(**body))
    assert e.value.status_code == 400 and e.value.param == "continue_final_message"


THINKING = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}<no_think>{% endif %}"
    "{% if reasoning_effort is defined %}<effort={{ reasoning_effort }}>{% endif %}"
)


def test_chat_template_kwargs_reach_the_template():
    chat = _chat(THINKING)
    assert "<no_think>" not in chat.build_input(_req()).text
    assert chat.build_input(_req(chat_template_kwargs={"enable_thinking": False})).text.endswith("<no_think>")


@pytest.mark.parametrize(
    "name", ["tokenize", "tools", "add_generation_prompt", "chat_template", "return_dict"]
)
def test_chat_template_kwargs_may_not_set_the_template_call_arguments(name):
    with pytest.raises(RequestError) as e:
        _chat(THINKING).build_input(_req(chat_template_kwargs={name: True}))
    assert e.value.param == f"chat_template_kwargs.{name}"


def test_reasoning_effort_is_a_template_variable_with_a_reasoning_parser():
    with pytest.raises(RequestError) as e:
        _chat(THINKING).build_input(_req(reasoning_effort="low"))
    assert e.value.param == "reasoning_effort"
    chat = _chat(THINKING, reasoning_parser="qwen3")
    assert chat.build_input(_req(reasoning_effort="low")).text.endswith("<effort=low>")
    assert chat.build_input(_req(reasoning_effort="none")).text.endswith("<no_think><effort=none>")
    # the request's own chat_template_kwargs win
    req = _req(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True})
    assert chat.build_input(req).text.endswith("<effort=none>")


# ---------------------------------------------------------------- parallel_tool_calls
TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
    for n in ("get_a", "get_b")
]
TWO_CALLS = (
    '<tool_call>\n{"name": "get_a", "arguments": {"x": 1}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_b", "arguments": {}}\n</tool_call>'
)


def _out(text: str) -> dict[str, Any]:
    meta = {
        "id": "r",
        "finish_reason": {"type": "stop"},
        "prompt_tokens": 3,
        "completion_tokens": 9,
        "cached_tokens": 0,
    }
    return {"index": 0, "text": text, "output_ids": [1], "meta_info": meta}


def _streamed_calls(chat: OpenAIServingChat, req, pieces: list[str]) -> list[str]:
    async def chunks():
        for k, piece in enumerate(pieces):
            out = _out(piece)
            if k < len(pieces) - 1:
                out["meta_info"] = {**out["meta_info"], "finish_reason": None}
            yield out

    async def collect():
        return [c async for c in chat.stream_chunks(req, chunks())]

    names = []
    for c in asyncio.run(collect()):
        for choice in c["choices"]:
            for call in choice["delta"].get("tool_calls") or []:
                if call.get("function", {}).get("name"):
                    names.append(call["function"]["name"])
    return names


@pytest.mark.parametrize("parallel", [None, True, False])
def test_parallel_tool_calls_false_returns_one_call(parallel):
    chat = _chat(tool_call_parser="hermes")
    body: dict[str, Any] = {"tools": TOOLS}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    req = _req(**body)
    chat.build_input(req)
    message = chat.build_response(req, [_out(TWO_CALLS)])["choices"][0]["message"]
    expected = ["get_a"] if parallel is False else ["get_a", "get_b"]
    assert [c["function"]["name"] for c in message["tool_calls"]] == expected
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"x": 1}
    pieces = [TWO_CALLS[i : i + 7] for i in range(0, len(TWO_CALLS), 7)]
    assert _streamed_calls(chat, req, pieces) == expected


def test_parallel_tool_calls_false_with_a_forced_choice_is_one_call_by_grammar():
    chat = _chat(tool_call_parser="hermes")
    obj = chat.build_input(_req(tools=TOOLS, tool_choice="required", parallel_tool_calls=False))
    assert json.loads(obj.sampling_params["json_schema"])["maxItems"] == 1

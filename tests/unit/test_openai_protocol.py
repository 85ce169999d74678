"""OpenAI protocol parsing and response shaping, and native request validation (no server)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import orjson
import pytest
from pydantic import ValidationError

from srt.entrypoints.openai.common import error_body, usage_of
from srt.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    reject_unsupported_fields,
)
from srt.entrypoints.openai.serving_chat import OpenAIServingChat
from srt.entrypoints.openai.serving_completions import OpenAIServingCompletion
from srt.managers.tokenizer.generate_input import GenerateReqInput
from srt.sampling.user_params import parse_sampling_params
from srt.utils.errors import RequestError


def parse(model, body: dict | bytes):
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    return model.model_validate_json(raw, strict=True)


class FakeTokenizer:
    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)


def fake_tm(cache_report: bool = False):
    return SimpleNamespace(
        tokenizer=FakeTokenizer(),
        model_name="m",
        server_args=SimpleNamespace(
            tool_call_parser=None, reasoning_parser=None, enable_cache_report=cache_report
        ),
        apply_chat_template=lambda msgs, **kw: (
            "|".join(f"{m['role']}:{m['content']}" for m in msgs) + "|assistant:"
        ),
        chat_template_renders_tools=lambda: False,
    )


def output(index, text, ids, reason=None, prompt=3, cached=0, **meta):
    return {
        "index": index,
        "text": text,
        "output_ids": ids,
        "meta_info": {
            "id": f"r{index}",
            "finish_reason": reason,
            "prompt_tokens": prompt,
            "completion_tokens": len(ids),
            "cached_tokens": cached,
        }
        | meta,
    }


# ---------------------------------------------------------------- request parsing
@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        {"prompt": "x", "temperature": "hot"},
        {"prompt": "x", "n": 1.5},
        {"prompt": "x", "n": True},
        {"prompt": "x", "max_tokens": "10"},
        {"prompt": 5},
        {"temperature": 0.5},  # no prompt
    ],
)
def test_malformed_or_mistyped_completion_bodies_are_rejected(body):
    with pytest.raises(ValidationError):
        parse(CompletionRequest, body)


@pytest.mark.parametrize("prompt", ["hi", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
def test_completion_prompt_forms(prompt):
    req = parse(CompletionRequest, {"model": "m", "prompt": prompt})
    obj = OpenAIServingCompletion(fake_tm()).build_input(req)
    if isinstance(prompt, str) or isinstance(prompt[0], str):
        assert obj.text == prompt and obj.input_ids is None
    else:
        assert obj.input_ids == prompt and obj.text is None
    assert obj.sampling_params["max_new_tokens"] == 16  # OpenAI's completion default


def test_completion_sampling_params_mapping_and_errors_use_openai_names():
    req = parse(
        CompletionRequest,
        {
            "prompt": "x",
            "max_tokens": 5,
            "temperature": 0,
            "top_p": 0.5,
            "n": 2,
            "stop": "END",
            "seed": 7,
            "frequency_penalty": 0.1,
            "presence_penalty": 0.2,
            "top_k": 3,
            "min_p": 0.1,
            "repetition_penalty": 1.1,
            "min_tokens": 2,
            "ignore_eos": True,
            "skip_special_tokens": False,
            "stop_token_ids": [2],
        },
    )
    obj = OpenAIServingCompletion(fake_tm()).build_input(req)
    sp = obj.sampling_params
    assert sp == {
        "max_new_tokens": 5,
        "min_new_tokens": 2,
        "temperature": 0,
        "top_p": 0.5,
        "top_k": 3,
        "min_p": 0.1,
        "frequency_penalty": 0.1,
        "presence_penalty": 0.2,
        "repetition_penalty": 1.1,
        "stop": "END",
        "stop_token_ids": [2],
        "ignore_eos": True,
        "skip_special_tokens": False,
        "n": 2,
        "seed": 7,
    }
    parsed = parse_sampling_params(sp, 100, obj.param_names)
    assert parsed.stop == ["END"] and parsed.is_greedy and parsed.n == 2

    with pytest.raises(RequestError) as e:
        parse_sampling_params({"max_new_tokens": 5, "min_new_tokens": 9}, 100, obj.param_names)
    assert "min_tokens" in str(e.value) and "max_tokens" in str(e.value)


@pytest.mark.parametrize(
    "field, value, param",
    [("max_tokens", 0, "max_tokens"), ("max_tokens", -3, "max_tokens"), ("n", 0, "n")],
)
def test_completion_value_errors_before_sampling_params(field, value, param):
    req = parse(CompletionRequest, {"prompt": "x", field: value})
    with pytest.raises(RequestError) as e:
        OpenAIServingCompletion(fake_tm()).build_input(req)
    assert e.value.param == param and str(value) in e.value.message


def test_every_bad_sampling_value_gets_its_own_message():
    with pytest.raises(RequestError) as e:
        parse_sampling_params({"temperature": -1, "top_p": 1.5, "top_k": -7}, 100)
    msg = e.value.message
    assert "temperature" in msg and "top_p" in msg and "top_k" in msg
    assert "-1" in msg and "1.5" in msg and "(0, 1]" in msg
    assert e.value.param == "temperature"


def test_unknown_and_mistyped_native_sampling_params():
    with pytest.raises(RequestError, match="unknown sampling parameter"):
        parse_sampling_params({"temprature": 0.5}, 100)
    with pytest.raises(RequestError) as e:
        parse_sampling_params({"max_new_tokens": "ten"}, 100)
    assert e.value.param == "max_new_tokens"
    with pytest.raises(RequestError, match="stop_token_ids"):
        parse_sampling_params({"stop_token_ids": [100]}, 100)


@pytest.mark.parametrize("body", [{"messages": []}, {"messages": [{"role": "wizard", "content": "hi"}]}])
def test_chat_empty_messages_and_unknown_roles(body):
    req = parse(ChatCompletionRequest, body)
    with pytest.raises(RequestError) as e:
        OpenAIServingChat(fake_tm()).build_input(req)
    assert e.value.param.startswith("messages")


def test_chat_input_template_and_max_completion_tokens():
    req = parse(
        ChatCompletionRequest,
        {
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ],
            "max_tokens": 3,
            "max_completion_tokens": 9,
            "logprobs": True,
            "top_logprobs": 2,
        },
    )
    obj = OpenAIServingChat(fake_tm()).build_input(req)
    assert obj.text == "system:be brief|user:a\nb|assistant:"
    assert obj.add_special_tokens is False
    assert (
        obj.sampling_params["max_new_tokens"] == 9
        and obj.param_names["max_new_tokens"] == "max_completion_tokens"
    )
    assert obj.return_logprob and obj.top_logprobs_num == 2


def test_chat_top_logprobs_needs_logprobs_and_is_bounded():
    with pytest.raises(RequestError, match="requires logprobs"):
        OpenAIServingChat(fake_tm()).build_input(
            parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})
        )
    with pytest.raises(RequestError, match="top_logprobs must be in"):
        OpenAIServingChat(fake_tm()).build_input(
            parse(
                ChatCompletionRequest,
                {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 50},
            )
        )


def test_top_logprobs_are_named_as_each_route_spells_them():
    """The server's bound on top logprobs (checked after the route) names the route's own field."""
    chat = parse(
        ChatCompletionRequest,
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 7},
    )
    obj = OpenAIServingChat(fake_tm()).build_input(chat)
    assert obj.top_logprobs_num == 7 and obj.param_names["top_logprobs_num"] == "top_logprobs"
    obj = OpenAIServingCompletion(fake_tm()).build_input(
        parse(CompletionRequest, {"prompt": "x", "logprobs": 3})
    )
    assert obj.top_logprobs_num == 3 and obj.param_names["top_logprobs_num"] == "logprobs"


# ---------------------------------------------------------------- native input
def test_generate_req_input_expand_batch_and_rids():
    obj = GenerateReqInput(
        text=["a", "b"], sampling_params={"max_new_tokens": 2}, rid="base", top_logprobs_num=2
    )
    singles = obj.expand()
    assert [s.rid for s in singles] == ["base-0", "base-1"]
    assert all(s.return_logprob and s.top_logprobs_num == 2 for s in singles)
    assert obj.is_batch
    with pytest.raises(RequestError, match="entries for 2 prompts"):
        GenerateReqInput(text=["a", "b"], sampling_params=[{}]).expand()
    with pytest.raises(RequestError, match="either text"):
        GenerateReqInput().expand()
    with pytest.raises(RequestError, match="integers"):
        GenerateReqInput(input_ids=[1, "x"]).expand()
    with pytest.raises(RequestError, match=r"logprob_start_len must be >= 0 .* or -1 \(none\), got -5") as e:
        GenerateReqInput(text="a", return_logprob=True, logprob_start_len=-5).expand()
    assert e.value.param == "logprob_start_len"
    assert (
        GenerateReqInput(text="a", return_logprob=True, logprob_start_len=-1).expand()[0].logprob_start_len
        == -1
    )
    assert not GenerateReqInput(input_ids=[1, 2]).is_batch and GenerateReqInput(input_ids=[[1], [2]]).is_batch


def test_native_generate_request_model():
    obj = GenerateReqInput.from_json(
        orjson.dumps({"text": "x", "sampling_params": {"max_new_tokens": 3}, "stream": True})
    )
    assert obj.stream and obj.sampling_params == {"max_new_tokens": 3}


# ---------------------------------------------------------------- responses
def test_completion_response_usage_echo_and_logprobs():
    req = parse(CompletionRequest, {"prompt": ["p0", "p1"], "n": 2, "echo": True, "logprobs": 1})
    outs = [
        output(
            0,
            "x",
            [5],
            {"type": "length", "length": 1},
            prompt=4,
            cached=1,
            output_token_logprobs=[(-0.5, 5, None)],
            output_top_logprobs=[[(-0.5, 5, None)]],
            input_token_logprobs=[(None, 1, None), (-1.0, 2, None)],
            input_top_logprobs=[None, [(-1.0, 2, None)]],
        ),
        output(
            1,
            "y",
            [6],
            {"type": "stop", "matched": "END"},
            prompt=4,
            cached=3,
            output_token_logprobs=[(-0.25, 6, None)],
            output_top_logprobs=[[(-0.25, 6, None)]],
        ),
        output(
            2,
            "z",
            [7, 8],
            {"type": "length", "length": 2},
            prompt=2,
            output_token_logprobs=[(-1.0, 7, None), (-2.0, 8, None)],
            output_top_logprobs=[[], []],
        ),
        output(
            3,
            "w",
            [9],
            {"type": "stop", "matched": 2},
            prompt=2,
            output_token_logprobs=[(-3.0, 9, None)],
            output_top_logprobs=[[]],
        ),
    ]
    resp = OpenAIServingCompletion(fake_tm(cache_report=True)).build_response(req, outs)
    # prompts counted once each, completions of every choice; cached from each prompt's first choice
    assert resp["usage"] == {
        "prompt_tokens": 6,
        "completion_tokens": 5,
        "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 1},
    }
    c0, c1 = resp["choices"][:2]
    assert c0["text"] == "p0x" and c1["text"] == "p0y" and resp["choices"][2]["text"] == "p1z"
    assert [c["finish_reason"] for c in resp["choices"]] == ["length", "stop", "length", "stop"]
    assert c1["matched_stop"] == "END"
    assert c0["logprobs"]["tokens"] == ["<1>", "<2>", "<5>"]
    assert c0["logprobs"]["token_logprobs"] == [None, -1.0, -0.5]
    assert c0["logprobs"]["text_offset"] == [0, 3, 6]
    assert c0["logprobs"]["top_logprobs"] == [None, {"<2>": -1.0}, {"<5>": -0.5}]


def test_aborted_output_with_status_becomes_an_error():
    req = parse(CompletionRequest, {"prompt": "p"})
    outs = [output(0, "", [], {"type": "abort", "message": "too long", "status_code": 400})]
    with pytest.raises(Exception) as e:
        OpenAIServingCompletion(fake_tm()).build_response(req, outs)
    assert getattr(e.value, "status_code", None) == 400 and "too long" in str(e.value)


async def _agen(items):
    for it in items:
        yield it


def _events(chunks: list[bytes]) -> list:
    out = []
    for c in chunks:
        assert c.startswith(b"data: ") and c.endswith(b"\n\n")
        body = c[6:-2]
        out.append("[DONE]" if body == b"[DONE]" else orjson.loads(body))
    return out


def test_chat_stream_shape_with_usage():
    req = parse(
        ChatCompletionRequest,
        {
            "messages": [{"role": "user", "content": "x"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    chunks = [
        output(0, "Hel", [1]),
        output(0, "", [2]),
        output(0, "lo", [3], {"type": "length", "length": 3}, cached=2, completion_tokens=3),
    ]

    async def collect():
        return [b async for b in OpenAIServingChat(fake_tm(cache_report=True)).stream(req, _agen(chunks))]

    ev = _events(asyncio.run(collect()))
    assert ev[-1] == "[DONE]"
    assert ev[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [e["choices"][0]["delta"].get("content", "") for e in ev[1:-2]]
    assert "".join(deltas) == "Hello" and "" not in deltas[:-1]  # the empty (held-back) chunk is skipped
    assert ev[-3]["choices"][0]["finish_reason"] == "length"
    assert ev[-2]["choices"] == [] and ev[-2]["usage"]["total_tokens"] == 6
    assert ev[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}


def test_error_body_shape():
    body = error_body("bad", 400, param="temperature", code="invalid_value")
    assert body == {
        "error": {
            "message": "bad",
            "type": "invalid_request_error",
            "param": "temperature",
            "code": "invalid_value",
        }
    }
    assert error_body("x", 503)["error"]["type"] == "server_error"
    assert usage_of([output(0, "", [1, 2], prompt=5)], 1)["total_tokens"] == 7


@pytest.mark.parametrize("cache_report", [False, True])
def test_cached_tokens_only_with_cache_report(cache_report):
    """--enable-cache-report: usage.prompt_tokens_details.cached_tokens on both routes, streamed
    or not; without it prompt_tokens_details is null (SGLang's behaviour)."""
    want = {"cached_tokens": 2} if cache_report else None
    tm = fake_tm(cache_report=cache_report)
    outs = [output(0, "ab", [1, 2], {"type": "length", "length": 2}, cached=2)]
    cmpl = OpenAIServingCompletion(tm).build_response(parse(CompletionRequest, {"prompt": "p"}), outs)
    assert cmpl["usage"]["prompt_tokens_details"] == want
    chat_req = {"messages": [{"role": "user", "content": "x"}]}
    chat = OpenAIServingChat(tm).build_response(parse(ChatCompletionRequest, chat_req), outs)
    assert chat["usage"]["prompt_tokens_details"] == want
    stream_req = parse(
        ChatCompletionRequest,
        {
            **chat_req,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    )

    async def collect():
        return [b async for b in OpenAIServingChat(tm).stream(stream_req, _agen(outs))]

    usages = [e["usage"] for e in _events(asyncio.run(collect()))[:-1] if e.get("usage")]
    assert usages and all(u["prompt_tokens_details"] == want for u in usages)


def test_priority_and_delta_streams_reach_the_generate_input():
    """The OpenAI routes pass priority through and always stream deltas (whatever
    --incremental-streaming-output says for /generate)."""
    tm = fake_tm()
    cmpl = OpenAIServingCompletion(tm).build_input(parse(CompletionRequest, {"prompt": "p", "priority": 3}))
    assert cmpl.priority == 3 and cmpl.incremental_stream is True
    chat_req = parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]})
    chat = OpenAIServingChat(tm).build_input(chat_req)
    assert chat.priority is None and chat.incremental_stream is True
    assert GenerateReqInput.from_json(orjson.dumps({"text": "x", "priority": [1, 2]})).priority == [1, 2]


@pytest.mark.parametrize("route", [CompletionRequest, ChatCompletionRequest])
def test_unknown_fields_are_refused_by_name(route):
    """A field srt does not know (another server's guided_json) cannot be honoured: a 400 naming it."""
    body = {"model": "m", "guided_json": {"type": "object"}}
    body |= (
        {"prompt": "x"} if route is CompletionRequest else {"messages": [{"role": "user", "content": "x"}]}
    )
    with pytest.raises(RequestError) as exc:
        reject_unsupported_fields(parse(route, body))
    assert exc.value.param == "guided_json" and exc.value.code == "unknown_field"

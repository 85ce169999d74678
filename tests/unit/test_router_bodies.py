"""The bodies SGLang's router (sglang-router 0.3) forwards to a worker are accepted as they are.

The router re-serializes every request and adds fields at their defaults (``"model": null`` on
/generate, ``"separate_reasoning": true`` on chat, ...); srt refuses fields it cannot honour, so
each of these must be among the values it accepts. The bodies below are what the router sent,
captured between it and srt."""

from __future__ import annotations

import json

from srt.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    reject_unsupported_fields,
)
from srt.managers.tokenizer.generate_input import GenerateReqInput

GENERATE = {
    "text": "Hello",
    "model": None,
    "sampling_params": {"temperature": 0.0, "max_new_tokens": 4},
    "return_text_in_logprobs": False,
    "stream": False,
    "log_metrics": True,
    "return_hidden_states": False,
    "background": False,
    "no_logs": False,
    "return_bytes": False,
    "return_entropy": False,
}
CHAT = {
    "messages": [{"role": "user", "content": "Hi"}],
    "model": "SmolLM2-135M-Instruct",
    "logprobs": True,
    "max_completion_tokens": 4,
    "n": 1,
    "seed": 3,
    "stop": ["x"],
    "stream": False,
    "temperature": 0.0,
    "top_logprobs": 2,
    "no_stop_trim": False,
    "ignore_eos": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
}
COMPLETION = {
    "model": "SmolLM2-135M-Instruct",
    "prompt": ["Hello", "Bye"],
    "max_tokens": 4,
    "stream": True,
    "stream_options": {"include_usage": True},
    "logprobs": 1,
    "echo": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "return_hidden_states": False,
}


def test_generate_body_from_the_router_is_accepted():
    obj = GenerateReqInput.from_json(json.dumps(GENERATE).encode())
    assert obj.text == "Hello" and obj.sampling_params["max_new_tokens"] == 4


def test_openai_bodies_from_the_router_are_accepted():
    for model, body in ((ChatCompletionRequest, CHAT), (CompletionRequest, COMPLETION)):
        reject_unsupported_fields(model.model_validate(body))

"""Native generation requests: SGLang fields srt cannot honour, and unknown fields, are refused
(POST /generate's body and ``Engine.generate``'s keywords), their off values accepted."""

from __future__ import annotations

import inspect
import json

import pytest

from srt.entrypoints.engine import Engine, generate_request
from srt.managers.tokenizer.generate_fields import UNSUPPORTED_GENERATE_FIELDS
from srt.managers.tokenizer.generate_input import GenerateReqInput
from srt.utils.errors import RequestError

# a value of each field that asks for the feature
ASKING = {
    "video_data": ["v.mp4"],
    "audio_data": "a.wav",
    "input_embeds": [[0.1, 0.2]],
    "lora_id": "adapter-id",
    "custom_logit_processor": "{}",
    "session_params": {"id": "s"},
    "bootstrap_host": "10.0.0.1",
    "return_hidden_states": True,
    "log_metrics": False,
    "routed_dp_rank": 0,
    "routed_experts_start_len": 1,
}


def _body(**fields) -> bytes:
    return json.dumps({"text": "hi", **fields}).encode()


@pytest.mark.parametrize("name", sorted(ASKING))
def test_unsupported_fields_are_refused_naming_them(name):
    with pytest.raises(RequestError) as e:
        GenerateReqInput.from_json(_body(**{name: ASKING[name]}))
    assert e.value.status_code == 400 and e.value.param == name and name in e.value.message
    with pytest.raises(RequestError) as e:
        generate_request("hi", **{name: ASKING[name]})
    assert e.value.param == name


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_GENERATE_FIELDS))
def test_off_values_are_accepted(name):
    off = UNSUPPORTED_GENERATE_FIELDS[name]
    for value in off:
        assert GenerateReqInput.from_json(_body(**{name: value})).text == "hi"
        assert generate_request("hi", **{name: value}).text == "hi"


def test_every_asking_value_is_not_off():
    assert set(ASKING) <= set(UNSUPPORTED_GENERATE_FIELDS)


def test_unknown_fields_are_refused_naming_them():
    with pytest.raises(RequestError) as e:
        GenerateReqInput.from_json(_body(max_tokens=3))  # belongs in sampling_params
    assert e.value.param == "max_tokens" and "unknown" in e.value.message
    with pytest.raises(RequestError) as e:
        generate_request("hi", temprature=0.5)
    assert e.value.param == "temprature"


def test_known_fields_still_decode():
    obj = GenerateReqInput.from_json(
        _body(sampling_params={"max_new_tokens": 2}, rid="r", return_logprob=True, stream=True, priority=1)
    )
    assert (obj.rid, obj.return_logprob, obj.stream, obj.priority) == ("r", True, True, 1)
    assert GenerateReqInput.from_json(b"").text is None  # an empty body is {} (expand names the prompt)


def test_engine_generate_takes_the_same_keywords():
    params = inspect.signature(Engine.generate).parameters
    assert "sampling_params" in params and any(p.kind is p.VAR_KEYWORD for p in params.values())


@pytest.mark.parametrize("extra", [{"lora_id": "adapter"}, {"video_data": ["v.mp4"]}, {"temprature": 0.5}])
def test_engine_generate_raises_before_sending(extra):
    """The keywords are checked when the call is made, before the engine is involved."""
    engine = object.__new__(Engine)  # never started: a request reaching it would fail differently
    with pytest.raises(RequestError) as e:
        engine.generate("hi", **extra)
    assert e.value.param == next(iter(extra))


@pytest.mark.parametrize(
    "body, says",
    [
        (b'{"text": "a\\ud800"}', "unpaired UTF-16 surrogate"),
        (b'{"text": "\\ud800 b", "sampling_params": {}}', "surrogate"),
        (b'{"text": "a', "truncated"),  # truly cut short
        (b'{"text": "\\udc00"}', "surrogate"),
    ],
)
def test_malformed_bodies_say_what_is_wrong(body, says):
    with pytest.raises(RequestError, match="malformed JSON body") as e:
        GenerateReqInput.from_json(body)
    assert says in str(e.value)
    assert GenerateReqInput.from_json(b'{"text": "a\\ud83d\\ude00"}').text == "a\U0001f600"  # a pair is text


@pytest.mark.parametrize(
    "fields, count",
    [
        ({"text": "a"}, 1),
        ({"text": ["a"] * 5}, 5),
        ({"text": ["a"] * 5, "sampling_params": {"n": 3}}, 15),
        ({"input_ids": [1, 2, 3], "sampling_params": {"n": 4}}, 4),
        ({"input_ids": [[1], [2]], "sampling_params": [{"n": 2}, {"n": 300}]}, 2 + 128),  # n past MAX_N
        (
            {"text": ["a", "b", "c"], "sampling_params": [{"n": 4}]},
            6,
        ),  # a short list: the shape is refused later
        ({"text": "a", "sampling_params": {"n": True}}, 1),
        ({"text": [], "sampling_params": {"n": 9}}, 9),  # an empty batch: refused by expand
    ],
)
def test_the_sequences_a_request_asks_for_are_counted_without_expanding_it(fields, count):
    assert GenerateReqInput(**fields).sequence_count() == count

"""SamplingParams: defaults, validation messages, normalization, msgspec round trip."""

from __future__ import annotations

import math
import re

import msgspec
import pytest

from srt.sampling.sampling_params import SamplingParams, SamplingParamsError


def test_defaults_follow_sglang() -> None:
    p = SamplingParams()
    assert p.max_new_tokens == 128
    assert p.min_new_tokens == 0
    assert p.temperature == 1.0 and p.top_p == 1.0 and p.top_k == -1 and p.min_p == 0.0
    assert p.frequency_penalty == 0.0 and p.presence_penalty == 0.0 and p.repetition_penalty == 1.0
    assert p.stop is None and p.stop_token_ids is None
    assert p.ignore_eos is False and p.skip_special_tokens is True
    assert p.spaces_between_special_tokens is True and p.no_stop_trim is False
    assert p.n == 1 and p.seed is None and p.logit_bias is None
    assert not p.is_greedy
    p.verify(vocab_size=10)


def test_stop_string_is_normalized_to_list() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert msgspec.json.decode(b'{"stop": "END"}', type=SamplingParams).stop == ["END"]
    assert SamplingParams(stop=["a", "b"]).stop_strs == ["a", "b"]
    assert SamplingParams().stop_strs == []


@pytest.mark.parametrize(
    ("field", "value", "range_text"),
    [
        ("temperature", -0.1, ">= 0"),
        ("temperature", math.nan, ">= 0"),
        ("temperature", math.inf, ">= 0"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", 1.5, "(0, 1]"),
        ("top_k", -2, "-1 (disabled)"),
        ("min_p", -0.01, "[0, 1]"),
        ("min_p", 1.01, "[0, 1]"),
        ("frequency_penalty", 2.5, "[-2, 2]"),
        ("frequency_penalty", -2.01, "[-2, 2]"),
        ("presence_penalty", -3.0, "[-2, 2]"),
        ("repetition_penalty", 0.0, "(0, 2]"),
        ("repetition_penalty", 2.1, "(0, 2]"),
        ("max_new_tokens", -1, ">= 0"),
        ("max_new_tokens", 1.5, "integer"),
        ("min_new_tokens", -1, ">= 0"),
        ("n", 0, "[1, 128]"),
        ("n", True, "[1, 128]"),
        ("n", 3134, "[1, 128]"),  # found by the API fuzzer: thousands of copies stalled the server
        ("seed", 2**64, "integer in"),
        ("seed", "abc", "integer in"),
        ("stop", [""], "non-empty"),
        ("stop_token_ids", [-1], ">= 0"),
        ("ignore_eos", 1, "boolean"),
        ("logit_bias", {"5": 101.0}, "[-100, 100]"),
        ("logit_bias", {"x": 1.0}, "token ids"),
    ],
)
def test_each_bad_value_has_its_own_clear_message(field: str, value: object, range_text: str) -> None:
    p = SamplingParams(**{field: value})
    with pytest.raises(SamplingParamsError) as exc:
        p.verify()
    err = exc.value
    assert isinstance(err, ValueError)
    assert err.param == field
    msg = str(err)
    assert msg.startswith(field)
    assert repr(value) in msg
    assert range_text in msg
    assert [e.param for e in p.validation_errors()] == [field]


def test_stop_strings_are_bounded_in_number_and_length() -> None:
    SamplingParams(stop=["x" * 512] * 64).verify()
    for stop, needle in [
        (["x"] * 65, "(65 given, the longest of 1)"),
        (["x" * 513], "(1 given, the longest of 513)"),
    ]:
        with pytest.raises(SamplingParamsError, match=re.escape(needle)) as exc:
            SamplingParams(stop=stop).verify()
        assert exc.value.param == "stop"


def test_a_huge_bad_value_is_not_echoed_back_whole() -> None:
    with pytest.raises(SamplingParamsError) as exc:
        SamplingParams(stop=["stop"] * 20000).verify()
    msg = str(exc.value)
    assert (
        "at most 64 strings of at most 512 characters (20000 given" in msg
        and "(160000 characters)" in msg
        and len(msg) < 400
    )


def test_min_new_tokens_must_not_exceed_max_new_tokens() -> None:
    with pytest.raises(SamplingParamsError, match=r"min_new_tokens must be <= max_new_tokens \(4\), got 5"):
        SamplingParams(max_new_tokens=4, min_new_tokens=5).verify()
    SamplingParams(max_new_tokens=5, min_new_tokens=5).verify()
    # None means "up to the context length": no upper bound here
    SamplingParams(max_new_tokens=None, min_new_tokens=1000).verify()


def test_vocab_bounds_for_token_ids() -> None:
    SamplingParams(stop_token_ids=[0, 99], logit_bias={"99": -100}).verify(vocab_size=100)
    with pytest.raises(
        SamplingParamsError, match=r"stop_token_ids must be token ids in \[0, 100\), got \[100\]"
    ):
        SamplingParams(stop_token_ids=[100]).verify(vocab_size=100)
    with pytest.raises(SamplingParamsError, match="logit_bias"):
        SamplingParams(logit_bias={"100": 1.0}).verify(vocab_size=100)
    # without a vocab size only the sign is checked
    SamplingParams(stop_token_ids=[10**6]).verify()


def test_validation_errors_lists_every_bad_value() -> None:
    p = SamplingParams(temperature=-1, top_p=0, top_k=-5, n=0, presence_penalty=9)
    errs = p.validation_errors()
    assert [e.param for e in errs] == ["temperature", "top_p", "top_k", "presence_penalty", "n"]
    assert all(isinstance(e, SamplingParamsError) for e in errs)
    # verify raises the first one
    with pytest.raises(SamplingParamsError) as exc:
        p.verify()
    assert exc.value.param == "temperature"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"temperature": 2},
        {"top_p": 1.0},
        {"top_p": 1e-9},
        {"top_k": -1},
        {"top_k": 0},
        {"top_k": 1},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"frequency_penalty": -2.0, "presence_penalty": 2.0},
        {"repetition_penalty": 2.0},
        {"repetition_penalty": 0.5},
        {"max_new_tokens": 0},
        {"max_new_tokens": None},
        {"seed": -(2**63)},
        {"seed": 2**64 - 1},
        {"stop": "x", "stop_token_ids": [1, 2]},
    ],
)
def test_boundary_values_are_accepted(kwargs: dict) -> None:
    SamplingParams(**kwargs).verify(vocab_size=100)


def test_normalize_and_is_greedy() -> None:
    p = SamplingParams(temperature=1e-7, top_k=50)
    assert p.is_greedy
    assert p.normalize() is p
    assert (p.temperature, p.top_k) == (0.0, 1)

    q = SamplingParams(temperature=0.7, top_k=1)
    assert q.is_greedy
    q.normalize()
    assert (q.temperature, q.top_k) == (0.0, 1)

    r = SamplingParams(temperature=0.7, top_k=0).normalize()
    assert r.top_k == -1 and not r.is_greedy and r.temperature == 0.7

    s = SamplingParams(temperature=1e-6)
    assert not s.is_greedy


def test_logit_bias_items() -> None:
    assert SamplingParams(logit_bias={"3": 1.5, "7": -100}).logit_bias_items() == [(3, 1.5), (7, -100.0)]
    assert SamplingParams().logit_bias_items() == []


def test_msgspec_round_trip() -> None:
    p = SamplingParams(
        max_new_tokens=None,
        temperature=0.3,
        top_k=20,
        stop=["\n\n"],
        stop_token_ids=[2],
        seed=2**63 + 1,
        logit_bias={"11": -5.0},
        ignore_eos=True,
    )
    for codec in (msgspec.msgpack, msgspec.json):
        assert codec.decode(codec.encode(p), type=SamplingParams) == p
    # omit_defaults: a default struct is an empty map on the wire
    assert msgspec.json.encode(SamplingParams()) == b"{}"
    # kw_only
    with pytest.raises(TypeError):
        SamplingParams(10)  # type: ignore[misc]


def test_embedded_in_io_struct_message() -> None:
    from srt.managers import io_struct

    msg = io_struct.TokenizedGenerateReqInput(
        rid="r1", input_ids=[1, 2, 3], sampling_params=SamplingParams(temperature=0.0, stop="x")
    )
    out = io_struct.scheduler_input_decoder.decode(io_struct.encode(msg))
    assert out == msg
    assert out.sampling_params.stop == ["x"]


def test_decode_rejects_wrong_types() -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"temperature": "hot"}', type=SamplingParams)

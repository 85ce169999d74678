"""Every cross-process message round-trips through msgspec msgpack, via the decoder its receiver uses."""

from __future__ import annotations

import inspect

import msgspec
import pytest

from srt.managers import io_struct as io
from srt.sampling.sampling_params import SamplingParams

SAMPLES: list[io._Msg] = [
    io.TokenizedGenerateReqInput(
        rid="r1",
        lora_name="sql",
        input_ids=[1, 2, 3, 49151],
        sampling_params=SamplingParams(
            max_new_tokens=7,
            temperature=0.5,
            top_p=0.9,
            top_k=20,
            stop=["</s>", "\n\n"],
            stop_token_ids=[2],
            seed=-5,
            n=1,
            logit_bias={"17": -3.5},
            ignore_eos=True,
        ),
        input_text="héllo 世界",
        return_logprob=True,
        logprob_start_len=1,
        top_logprobs_num=3,
        stream=True,
        priority=2,
        arrival_time=1234.5,
    ),
    io.AbortReq(rid="r1", message="client disconnected", status_code=499),
    io.AbortReq(rid=""),
    io.FlushCacheReq(),
    io.GetInternalStateReq(),
    io.ProfileReq(action="start", output_dir="/tmp/p", num_steps=5, activities=["CPU"]),
    io.ProfileReq(action="stop"),
    io.UpdateWeightsFromDiskReq(model_path="/models/m.gguf", load_format="gguf"),
    io.LoadLoRAAdapterReq(lora_name="sql", lora_path="/adapters/sql", pinned=True),
    io.UnloadLoRAAdapterReq(lora_name="sql"),
    io.StopStringHit(rid="r1", matched="\n\n"),
    io.BatchTokenIDOut(
        rids=["a", "b"],
        output_ids=[[5, 6], []],
        finished_reasons=[None, io.FinishReason.of_stop(2)],
        prompt_tokens=[3, 4],
        completion_tokens=[2, 9],
        cached_tokens=[0, 4],
        skip_special_tokens=[True, False],
        spaces_between_special_tokens=[True, True],
        no_stop_trim=[False, True],
        stop_strs=[["x"], []],
        output_token_logprobs=[[-0.1, -0.2], []],
        output_top_logprobs=[[[(5, -0.1), (7, -2.0)], [(6, -0.2)]], []],
        input_token_logprobs=[[None, -1.5, -0.25], []],
        input_top_logprobs=[[None, [(9, -1.0)], [(3, -0.25)]], []],
        queue_times=[0.01, None],
    ),
    io.SchedulerReady(
        max_total_num_tokens=16384,
        max_running_requests=64,
        max_req_input_len=8191,
        context_len=8192,
        page_size=16,
        vocab_size=49152,
    ),
    io.FlushCacheReqOutput(success=False, message="busy"),
    io.GetInternalStateReqOutput(state={"num_running_reqs": 3, "token_usage": 0.25, "policy": "fcfs"}),
    io.ProfileReqOutput(success=True, message="started", trace_path="/tmp/p/srt-1.trace.json.gz"),
    io.UpdateWeightsFromDiskReqOutput(success=False, message="shapes differ"),
    io.LoRAAdapterReqOutput(success=True, message="loaded", loaded_adapters={"sql": "/adapters/sql"}),
    io.BatchStrOut(
        rids=["a"],
        output_strs=["🎉 ok"],
        output_ids=[[5]],
        finished_reasons=[io.FinishReason.of_abort("boom", 500)],
        prompt_tokens=[3],
        completion_tokens=[1],
        cached_tokens=[0],
        output_token_logprobs=[[-0.5]],
        output_top_logprobs=[[[(5, -0.5)]]],
        queue_times=[0.5],
    ),
    io.DpLoadReport(
        dp_rank=1,
        num_received=7,
        num_queued_reqs=2,
        num_running_reqs=3,
        queued_tokens=40,
        running_tokens=300,
        idle=False,
        finished_rids=["a", "b"],
    ),
    io.DpControlReply(dp_rank=0, reply=io.FlushCacheReqOutput(success=True, message="Cache flushed.")),
]

# which decoder the receiving process uses for each message type
DECODERS = {
    io.TokenizedGenerateReqInput: io.scheduler_input_decoder,
    io.AbortReq: io.scheduler_input_decoder,
    io.FlushCacheReq: io.scheduler_input_decoder,
    io.GetInternalStateReq: io.scheduler_input_decoder,
    io.ProfileReq: io.scheduler_input_decoder,
    io.UpdateWeightsFromDiskReq: io.scheduler_input_decoder,
    io.LoadLoRAAdapterReq: io.scheduler_input_decoder,
    io.UnloadLoRAAdapterReq: io.scheduler_input_decoder,
    io.StopStringHit: io.scheduler_input_decoder,
    io.BatchTokenIDOut: io.detokenizer_input_decoder,
    io.SchedulerReady: io.detokenizer_input_decoder,
    io.FlushCacheReqOutput: io.detokenizer_input_decoder,
    io.GetInternalStateReqOutput: io.detokenizer_input_decoder,
    io.ProfileReqOutput: io.detokenizer_input_decoder,
    io.UpdateWeightsFromDiskReqOutput: io.detokenizer_input_decoder,
    io.LoRAAdapterReqOutput: io.detokenizer_input_decoder,
    io.BatchStrOut: io.tokenizer_input_decoder,
    io.DpLoadReport: io.dp_controller_input_decoder,
    io.DpControlReply: io.dp_controller_input_decoder,
}


def _normalize(v):
    """msgpack has no tuples: compare tuples and lists alike."""
    if isinstance(v, (list, tuple)):
        return [_normalize(x) for x in v]
    if isinstance(v, dict):
        return {k: _normalize(x) for k, x in v.items()}
    if isinstance(v, msgspec.Struct):
        return {f: _normalize(getattr(v, f)) for f in v.__struct_fields__}
    return v


def test_every_message_struct_has_a_sample():
    structs = {
        obj
        for _, obj in inspect.getmembers(io, inspect.isclass)
        if issubclass(obj, io._Msg) and obj is not io._Msg
    }
    assert structs == {type(s) for s in SAMPLES} == set(DECODERS)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    raw = io.encode(msg)
    back = DECODERS[type(msg)].decode(raw)
    assert type(back) is type(msg)
    assert _normalize(back) == _normalize(msg)


def test_forwarded_messages_decode_for_the_tokenizer_manager():
    # the detokenizer forwards these raw bytes unchanged; the tokenizer manager must decode them
    for msg in SAMPLES:
        if isinstance(msg, (io.SchedulerReady, *io.ControlReply.__args__)):
            assert _normalize(io.tokenizer_input_decoder.decode(io.encode(msg))) == _normalize(msg)


def test_messages_are_tagged_and_rejected_by_the_wrong_decoder():
    raw = io.encode(io.StopStringHit(rid="x", matched="y"))
    assert b"StopStringHit" in raw
    with pytest.raises(msgspec.ValidationError):
        io.tokenizer_input_decoder.decode(raw)


def test_stop_string_given_as_string_becomes_a_list_after_decode():
    msg = io.TokenizedGenerateReqInput(rid="r", input_ids=[1], sampling_params=SamplingParams(stop="END"))
    back = io.scheduler_input_decoder.decode(io.encode(msg))
    assert back.sampling_params.stop == ["END"]


@pytest.mark.parametrize(
    "reason, sglang_dict",
    [
        (io.FinishReason.of_length(7), {"type": "length", "length": 7}),
        (io.FinishReason.of_stop(2), {"type": "stop", "matched": 2}),
        (io.FinishReason.of_stop("\n\n"), {"type": "stop", "matched": "\n\n"}),
        (io.FinishReason.of_abort("gone"), {"type": "abort", "message": "gone"}),
        (
            io.FinishReason.of_abort("too long", 400),
            {"type": "abort", "message": "too long", "status_code": 400},
        ),
    ],
    ids=lambda v: v.type if isinstance(v, io.FinishReason) else "",
)
def test_finish_reason_round_trips_in_batch_outputs(reason, sglang_dict):
    token_out = io.BatchTokenIDOut(
        rids=["a", "b"],
        output_ids=[[1], [2]],
        finished_reasons=[reason, None],
        prompt_tokens=[1, 1],
        completion_tokens=[1, 1],
        cached_tokens=[0, 0],
        skip_special_tokens=[True, True],
        spaces_between_special_tokens=[True, True],
        no_stop_trim=[False, False],
        stop_strs=[[], []],
    )
    str_out = io.BatchStrOut(
        rids=["a"],
        output_strs=["x"],
        output_ids=[[1]],
        finished_reasons=[reason],
        prompt_tokens=[1],
        completion_tokens=[1],
        cached_tokens=[0],
    )
    back = io.detokenizer_input_decoder.decode(io.encode(token_out))
    assert back.finished_reasons == [reason, None] and type(back.finished_reasons[0]) is io.FinishReason
    back = io.tokenizer_input_decoder.decode(io.encode(str_out))
    assert back.finished_reasons == [reason]
    assert back.finished_reasons[0].to_dict() == sglang_dict
    assert back.finished_reasons[0].is_abort == (sglang_dict["type"] == "abort")

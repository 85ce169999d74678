"""Every message that crosses a process boundary, and nothing else.

All are tagged ``msgspec.Struct``s sent with ``msgspec.msgpack`` (no pickle, no tensors).
Token ids travel as ``list[int]``; batched outputs are parallel arrays (index i of every
list belongs to ``rids[i]``).

    tokenizer manager --TokenizedGenerateReqInput/AbortReq/FlushCacheReq/GetInternalStateReq--> scheduler
                        ProfileReq/UpdateWeightsFromDiskReq/LoadLoRAAdapterReq/UnloadLoRAAdapterReq
    detokenizer       --StopStringHit----------------------------------------------------------> scheduler
    scheduler         --BatchTokenIDOut---------------------------------------------------------> detokenizer
    scheduler         --FlushCacheReqOutput/GetInternalStateReqOutput/SchedulerReady------------> detokenizer
                        ProfileReqOutput/UpdateWeightsFromDiskReqOutput/LoRAAdapterReqOutput
                         (the detokenizer forwards non-token messages to the tokenizer manager unchanged)
    detokenizer       --BatchStrOut (+ forwarded messages)--------------------------------------> tokenizer manager

With ``--dp-size N`` the data-parallel controller takes the scheduler's place for the tokenizer
manager and the detokenizer (it forwards each ``SchedulerInput`` to one group or to all), and
each group sends its control replies and load to the controller instead:
    scheduler group   --DpLoadReport / DpControlReply------------------------------------------> controller
    controller        --merged control replies-------------------------------------------------> tokenizer manager

Finish reasons travel as ``FinishReason`` structs, built only through its three constructors;
``FinishReason.to_dict()`` gives SGLang's ``meta_info["finish_reason"]`` shape:
    {"type": "length", "length": N}
    {"type": "stop", "matched": <token id or stop string>}
    {"type": "abort", "message": "...", "status_code": 4xx/5xx (optional), "retry_after": s (optional)}
    {"type": "timeout", "message": "request timed out after X s", "status_code": 408}
(``timeout``: the request's deadline passed, see `TokenizedGenerateReqInput.deadline`.)
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from srt.multimodal.inputs import MultimodalInputs
from srt.sampling.sampling_params import SamplingParams


class _Msg(msgspec.Struct, tag=True, kw_only=True, omit_defaults=True):
    pass


class FinishReason(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Why a request finished. Build it with ``length`` / ``stop`` / ``abort``."""

    type: str  # "length" | "stop" | "abort" | "timeout"
    length: int | None = None  # length: the number of generated tokens
    matched: int | str | None = None  # stop: the stop token id or stop string
    message: str | None = None  # abort: what happened
    status_code: int | None = None  # abort: the HTTP status it maps to (None: not an HTTP error)
    retry_after: int | None = None  # abort (503): seconds after which a retry may succeed

    @classmethod
    def of_length(cls, length: int) -> FinishReason:
        return cls(type="length", length=length)

    @classmethod
    def of_stop(cls, matched: int | str) -> FinishReason:
        return cls(type="stop", matched=matched)

    @classmethod
    def of_abort(
        cls, message: str, status_code: int | None = None, retry_after: int | None = None
    ) -> FinishReason:
        return cls(type="abort", message=message, status_code=status_code, retry_after=retry_after)

    @classmethod
    def of_timeout(cls, timeout: float) -> FinishReason:
        """The request's deadline (``timeout`` seconds after the server received it) passed."""
        return cls(type="timeout", message=f"request timed out after {timeout:g} s", status_code=408)

    @property
    def is_abort(self) -> bool:
        return self.type == "abort"

    def to_dict(self) -> dict[str, Any]:
        """SGLang's ``meta_info["finish_reason"]`` dict (unset fields left out)."""
        return msgspec.to_builtins(self)


# ---------------- tokenizer manager -> scheduler ----------------
class TokenizedGenerateReqInput(_Msg):
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    input_text: str = ""
    return_logprob: bool = False
    # absolute position from which prompt logprobs are returned (-1: none)
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    priority: int = 0
    arrival_time: float = 0.0  # time.time() when the server received the request
    # time.time() past which the request is aborted with a "timeout" finish reason (0: none);
    # the per-request ``timeout`` (or X-Request-Timeout) added to ``arrival_time``
    deadline: float = 0.0
    # prefill-only outputs (max_new_tokens 0; srt/layers/pooler.py): pool the final hidden
    # states ("last" | "mean" | "cls"; "" none), and/or return the next-token logprobs of these ids
    pooling: str = ""
    label_token_ids: list[int] = []
    # the LoRA adapter the request runs under (its name as loaded; "" the base model alone)
    lora_name: str = ""
    # the prompt's images, preprocessed (srt/multimodal/inputs.py); None: text only
    mm: MultimodalInputs | None = None


class AbortReq(_Msg):
    rid: str  # "" aborts every request
    message: str = "aborted"
    status_code: int = 499


class FlushCacheReq(_Msg):
    pass


class GetInternalStateReq(_Msg):
    pass


class ProfileReq(_Msg):
    """Start or stop the scheduler's torch profiler (POST /start_profile, /stop_profile)."""

    action: str  # "start" | "stop"
    output_dir: str | None = None  # start: None = $SRT_TORCH_PROFILER_DIR, else /tmp/srt_profile
    num_steps: int | None = None  # start: stop (and write the trace) by itself after this many steps
    activities: list[str] | None = None  # start: "CPU" and/or "GPU" (None: ["CPU"])


class UpdateWeightsFromDiskReq(_Msg):
    """Reload the model's weights from ``model_path`` (same architecture and shapes) once the
    running requests finished; requests arriving meanwhile wait and run on the new weights."""

    model_path: str
    load_format: str | None = None  # None: "auto" (the file's format)


class LoadLoRAAdapterReq(_Msg):
    """Load a PEFT adapter (a folder with adapter_config.json) under ``lora_name``; requests may
    name it once the reply says so. Loading runs beside the running requests."""

    lora_name: str
    lora_path: str
    pinned: bool = False  # never evicted from its adapter slot


class UnloadLoRAAdapterReq(_Msg):
    """Forget the adapter ``lora_name``; refused while requests (queued or running) use it."""

    lora_name: str


class StopStringHit(_Msg):
    """The detokenizer found a stop string in rid's output: finish it (no further tokens)."""

    rid: str
    matched: str


# ---------------- scheduler -> detokenizer ----------------
class BatchTokenIDOut(_Msg):
    rids: list[str]
    # token ids produced since the request's previous output (usually one; none when it finishes
    # without a new token: aborted, stopped by a stop string, or max_new_tokens=0)
    output_ids: list[list[int]]
    finished_reasons: list[FinishReason | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    # detokenization options per request (sent every time so the detokenizer holds no config)
    skip_special_tokens: list[bool]
    spaces_between_special_tokens: list[bool]
    no_stop_trim: list[bool]
    stop_strs: list[list[str]]
    # logprobs, per request: lists aligned with output_ids (empty when not requested)
    output_token_logprobs: list[list[float]] = []
    output_top_logprobs: list[list[list[tuple[int, float]]]] = []
    # prompt logprobs, sent once with the first output of a request (empty otherwise)
    input_token_logprobs: list[list[float | None]] = []
    input_top_logprobs: list[list[list[tuple[int, float]] | None]] = []
    # seconds each request waited in the scheduler queue before its first prefill, given with its
    # first output (None otherwise; empty when the scheduler does not report it)
    queue_times: list[float | None] = []
    # seconds from the first admission to the first output token, given with the first output
    # (None otherwise; empty when no entry has one)
    prefill_times: list[float | None] = []
    # seconds from the first output token to the finish, given with the finishing output
    decode_times: list[float | None] = []
    # speculative decoding: per request, the tokens each of its decode steps produced since its
    # previous output (empty without --speculative-algorithm)
    spec_accept_lens: list[list[int]] = []
    # per request, with its finishing output: the pooled hidden state (``pooling``) followed by
    # the logprobs of ``label_token_ids`` (None for other requests; empty when no entry has one)
    pooled_outputs: list[list[float] | None] = []


class SchedulerReady(_Msg):
    max_total_num_tokens: int
    max_running_requests: int
    max_req_input_len: int
    context_len: int
    page_size: int
    # the model's vocabulary size (0: not reported); bounds input token ids at the tokenizer manager
    vocab_size: int = 0


class FlushCacheReqOutput(_Msg):
    success: bool
    message: str = ""


class GetInternalStateReqOutput(_Msg):
    state: dict[str, Any]


class ProfileReqOutput(_Msg):
    success: bool
    message: str = ""
    # start: the file the trace will be written to; stop: the file written ("" on failure)
    trace_path: str = ""


class UpdateWeightsFromDiskReqOutput(_Msg):
    success: bool
    message: str = ""


class LoRAAdapterReqOutput(_Msg):
    """The reply to a LoadLoRAAdapterReq or UnloadLoRAAdapterReq: the adapters loaded afterwards
    (name -> path), whatever the outcome."""

    success: bool
    message: str = ""
    loaded_adapters: dict[str, str] = {}


# ---------------- detokenizer -> tokenizer manager ----------------
class BatchStrOut(_Msg):
    rids: list[str]
    # incremental text since the previous BatchStrOut of this request (never a broken UTF-8 char,
    # never text that a stop string trims later)
    output_strs: list[str]
    output_ids: list[list[int]]
    finished_reasons: list[FinishReason | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    output_token_logprobs: list[list[float]] = []
    output_top_logprobs: list[list[list[tuple[int, float]]]] = []
    input_token_logprobs: list[list[float | None]] = []
    input_top_logprobs: list[list[list[tuple[int, float]] | None]] = []
    queue_times: list[float | None] = []
    prefill_times: list[float | None] = []
    decode_times: list[float | None] = []
    spec_accept_lens: list[list[int]] = []
    pooled_outputs: list[list[float] | None] = []


SchedulerInput = Union[
    TokenizedGenerateReqInput,
    AbortReq,
    FlushCacheReq,
    GetInternalStateReq,
    ProfileReq,
    UpdateWeightsFromDiskReq,
    LoadLoRAAdapterReq,
    UnloadLoRAAdapterReq,
    StopStringHit,
]
# the scheduler's replies to control requests (forwarded unchanged by the detokenizer)
ControlReply = Union[
    FlushCacheReqOutput,
    GetInternalStateReqOutput,
    ProfileReqOutput,
    UpdateWeightsFromDiskReqOutput,
    LoRAAdapterReqOutput,
]
# control request type -> the type of its reply
REPLY_TYPE: dict[type, type] = {
    FlushCacheReq: FlushCacheReqOutput,
    GetInternalStateReq: GetInternalStateReqOutput,
    ProfileReq: ProfileReqOutput,
    UpdateWeightsFromDiskReq: UpdateWeightsFromDiskReqOutput,
    LoadLoRAAdapterReq: LoRAAdapterReqOutput,
    UnloadLoRAAdapterReq: LoRAAdapterReqOutput,
}
DetokenizerInput = Union[
    BatchTokenIDOut,
    SchedulerReady,
    FlushCacheReqOutput,
    GetInternalStateReqOutput,
    ProfileReqOutput,
    UpdateWeightsFromDiskReqOutput,
    LoRAAdapterReqOutput,
]
TokenizerInput = Union[
    BatchStrOut,
    SchedulerReady,
    FlushCacheReqOutput,
    GetInternalStateReqOutput,
    ProfileReqOutput,
    UpdateWeightsFromDiskReqOutput,
    LoRAAdapterReqOutput,
]


# ---------------- scheduler group -> data-parallel controller (--dp-size > 1) ----------------
class DpLoadReport(_Msg):
    """A scheduler group's load, pushed after steps that changed it (rate-limited) and when it
    goes idle. ``num_received`` counts every message the group took from its input socket, so the
    controller knows which of the requests it routed the report already includes."""

    dp_rank: int
    num_received: int
    num_queued_reqs: int
    num_running_reqs: int
    queued_tokens: int  # prompt tokens of the requests waiting (queue, grammar, weight update)
    running_tokens: int  # prompt + output tokens of the requests running
    idle: bool = False
    # requests reported finished since the previous report (the controller forgets their group)
    finished_rids: list[str] = []


class DpControlReply(_Msg):
    """A group's reply to a control request, for the controller to merge with the other groups'."""

    dp_rank: int
    reply: ControlReply


DpControllerInput = Union[DpLoadReport, DpControlReply]

_encoder = msgspec.msgpack.Encoder()
scheduler_input_decoder = msgspec.msgpack.Decoder(SchedulerInput)
detokenizer_input_decoder = msgspec.msgpack.Decoder(DetokenizerInput)
tokenizer_input_decoder = msgspec.msgpack.Decoder(TokenizerInput)
dp_controller_input_decoder = msgspec.msgpack.Decoder(DpControllerInput)


def encode(msg: _Msg) -> bytes:
    return _encoder.encode(msg)

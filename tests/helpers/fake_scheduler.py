"""A model-free scheduler process for serving-layer tests (starts in a fraction of a second).

``run_fake_scheduler_process(server_args, port_args, pipe_writer)`` follows the scheduler's
process contract (ready message, PULL at scheduler_input_ipc_name, PUSH to detokenizer_ipc_name)
and "generates" by echoing each prompt's token ids cyclically, one token per request per step
(a step every ``STEP_S`` seconds while any request runs; blocking receive when idle). It honours
max_new_tokens, stop_token_ids, AbortReq, StopStringHit, FlushCacheReq and GetInternalStateReq.
"""

from __future__ import annotations

import os
import time
from typing import Any

import msgspec
import zmq

from srt.managers.io_struct import (
    AbortReq,
    BatchTokenIDOut,
    FinishReason,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    StopStringHit,
    TokenizedGenerateReqInput,
    encode,
    scheduler_input_decoder,
)
from srt.utils.zmq import get_zmq_socket

STEP_S = 0.01
READY = {
    "max_total_num_tokens": 4096,
    "max_running_requests": 16,
    "max_req_input_len": 2047,
    "context_len": 2048,
    "page_size": 1,
}


class _Running(msgspec.Struct):
    req: TokenizedGenerateReqInput
    produced: int = 0
    reason: FinishReason | None = None
    new: list[int] = []


def run_fake_scheduler_process(server_args: Any, port_args: Any, pipe_writer: Any) -> None:
    ctx = zmq.Context()
    recv = get_zmq_socket(ctx, zmq.PULL, port_args.scheduler_input_ipc_name, bind=True)
    send = get_zmq_socket(ctx, zmq.PUSH, port_args.detokenizer_ipc_name, bind=False)
    pipe_writer.send({"status": "ready", **READY})
    running: dict[str, _Running] = {}
    finished: list[_Running] = []
    steps = 0
    while True:
        if recv.poll(None if not running and not finished else int(STEP_S * 1000)):
            while True:
                try:
                    msg = scheduler_input_decoder.decode(recv.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                if isinstance(msg, TokenizedGenerateReqInput):
                    running[msg.rid] = _Running(msg)
                elif isinstance(msg, (AbortReq, StopStringHit)):
                    rids = list(running) if isinstance(msg, AbortReq) and not msg.rid else [msg.rid]
                    for rid in rids:
                        r = running.pop(rid, None)
                        if r is not None:
                            r.reason = (
                                FinishReason.of_abort(msg.message)
                                if isinstance(msg, AbortReq)
                                else FinishReason.of_stop(msg.matched)
                            )
                            r.new = []
                            finished.append(r)
                elif isinstance(msg, FlushCacheReq):
                    send.send(encode(FlushCacheReqOutput(success=not running)))
                elif isinstance(msg, GetInternalStateReq):
                    send.send(
                        encode(
                            GetInternalStateReqOutput(
                                state={
                                    "num_running_reqs": len(running),
                                    "num_queued_reqs": 0,
                                    "num_steps": steps,
                                    "max_total_num_tokens": READY["max_total_num_tokens"],
                                    "available_size": READY["max_total_num_tokens"],
                                    "evictable_size": 0,
                                }
                            )
                        )
                    )
        if not running and not finished:
            continue
        time.sleep(STEP_S)
        steps += 1
        for rid, r in list(running.items()):
            sp = r.req.sampling_params
            r.new = []
            if sp.max_new_tokens != 0:
                tok = r.req.input_ids[r.produced % len(r.req.input_ids)]
                r.produced += 1
                r.new = [tok]
                if sp.stop_token_ids and tok in sp.stop_token_ids:
                    r.reason = FinishReason.of_stop(tok)
            if r.reason is None and sp.max_new_tokens is not None and r.produced >= sp.max_new_tokens:
                r.reason = FinishReason.of_length(r.produced)
            if r.reason is not None:
                running.pop(rid)
                finished.append(r)
        out = list({id(r): r for r in [*running.values(), *finished]}.values())
        finished = []
        send.send(
            encode(
                BatchTokenIDOut(
                    rids=[r.req.rid for r in out],
                    output_ids=[r.new for r in out],
                    finished_reasons=[r.reason for r in out],
                    prompt_tokens=[len(r.req.input_ids) for r in out],
                    completion_tokens=[r.produced for r in out],
                    cached_tokens=[0 for _ in out],
                    skip_special_tokens=[r.req.sampling_params.skip_special_tokens for r in out],
                    spaces_between_special_tokens=[
                        r.req.sampling_params.spaces_between_special_tokens for r in out
                    ],
                    no_stop_trim=[r.req.sampling_params.no_stop_trim for r in out],
                    stop_strs=[r.req.sampling_params.stop_strs for r in out],
                )
            )
        )


def run_fake_scheduler_after_file(path: str, server_args: Any, port_args: Any, pipe_writer: Any) -> None:
    """The fake scheduler, once ``path`` exists (an error after 60 s): a launch is ready only
    after the parent did what creates it."""
    deadline = time.monotonic() + 60
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)
    run_fake_scheduler_process(server_args, port_args, pipe_writer)

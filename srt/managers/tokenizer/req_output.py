"""Response assembly: the SGLang-shaped output dicts built from a `ReqState`.

Output dict (what ``TokenizerManager.run``, ``Engine.generate`` and ``POST /generate`` return)::

    {"index": k, "text": str, "output_ids": list[int],
     "meta_info": {"id", "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason",
                   "e2e_latency", "ttft", "queue_time", "prefill_time", "decode_time",
                   ["spec_verify_ct", "spec_accept_length"], ["output_token_logprobs", "output_top_logprobs",
                   "input_token_logprobs", "input_top_logprobs"]}}

Phase timings (seconds; None until known, e.g. ``decode_time`` before the finish, or a phase a
request never reached)::

    queue_time    arrival at the scheduler -> first admission (scheduler clock)
    prefill_time  first admission -> first output token sampled (scheduler clock; every chunk)
    decode_time   first output token -> finish (scheduler clock; retractions included)
    ttft          server receipt -> first output token here (main process clock)
    e2e_latency   server receipt -> finish (or now, while running)
    cached_tokens prompt tokens served from the prefix cache at the first admission

With ``--speculative-algorithm``: ``spec_verify_ct`` decode steps of the request (each verified
its draft, maybe empty) and ``spec_accept_length`` the tokens they produced per step.

so ``ttft <= e2e_latency`` and ``queue_time + prefill_time + decode_time`` is ``e2e_latency``
less the time spent outside the scheduler (tokenization, sockets, detokenization).

``finish_reason`` is None while the request runs, else SGLang's dict
(``FinishReason.to_dict()``: ``{"type": "length", "length": N}``, ``{"type": "stop", "matched": ...}``,
``{"type": "abort", "message": ..., ["status_code": ...]}``). Logprob entries are
``(logprob, token_id, None)`` tuples; the None is the token text slot, which
``return_text_in_logprobs`` fills with the token decoded alone (``token_texts``). Streaming chunks hold
either the *new* text / ids / logprobs since the previous chunk (incremental: the OpenAI routes,
and /generate and the Engine with ``--incremental-streaming-output``) or everything so far
(SGLang's default for /generate and the Engine); meta_info counts are cumulative either way.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from srt.managers.tokenizer.req_state import ReqState

# the text of each token id (``return_text_in_logprobs``); None: the text slots stay None
TokenTexts = Callable[[list[int]], list[str]] | None


def final_output(st: ReqState, token_texts: TokenTexts = None) -> dict[str, Any]:
    """The whole result of ``st`` (non-streaming)."""
    return _output(st, st.text(), st.output_ids, 0, True, token_texts)


def stream_chunk(
    st: ReqState, incremental: bool = True, token_texts: TokenTexts = None
) -> dict[str, Any] | None:
    """The next streamed chunk of ``st`` (advances the streaming cursors); None when nothing
    arrived since the previous one and it is not finished. ``incremental``: what arrived since
    the previous chunk; else everything so far (as `final_output` would give it now)."""
    if not st.has_new_output and not st.finished:
        return None
    if incremental:
        text = "".join(st.text_parts[st.sent_parts :])
        start = st.sent_ids
        include_input = not st.sent_input_logprobs and bool(st.in_logprobs)
    else:
        text, start, include_input = st.text(), 0, bool(st.in_logprobs)
    out = _output(st, text, st.output_ids[start:], start, include_input, token_texts)
    st.sent_parts = len(st.text_parts)
    st.sent_ids = len(st.output_ids)
    st.sent_input_logprobs = st.sent_input_logprobs or include_input
    if incremental:
        st.drop_sent_logprobs()
    return out


def _output(
    st: ReqState, text: str, ids: list[int], start: int, include_input: bool, token_texts: TokenTexts
) -> dict[str, Any]:
    """The output dict of ``ids`` (output positions ``start ...``) and ``text``."""
    meta: dict[str, Any] = {
        "id": st.rid,
        "finish_reason": None if st.finish_reason is None else st.finish_reason.to_dict(),
        "prompt_tokens": st.prompt_tokens or len(st.req.input_ids),
        "completion_tokens": st.completion_tokens,
        "cached_tokens": st.cached_tokens,
        "e2e_latency": (st.finish_time or time.perf_counter()) - st.created,
        "ttft": st.first_token_time - st.created if st.first_token_time else None,
        "queue_time": st.queue_time,
        "prefill_time": st.prefill_time,
        "decode_time": st.decode_time,
    }
    if st.spec_verify_ct:  # speculative decoding (SGLang's names)
        meta["spec_verify_ct"] = st.spec_verify_ct
        meta["spec_accept_length"] = st.spec_tokens / st.spec_verify_ct
    if st.req.return_logprob:
        _add_logprobs(st, meta, ids, start, include_input, token_texts)
    out = {"index": st.index, "text": text, "output_ids": list(ids), "meta_info": meta}
    if st.pooled is not None:  # a prefill-only request's raw pooled output (pooled_run.py)
        out["pooled"] = st.pooled
    return out


def _add_logprobs(
    st: ReqState,
    meta: dict[str, Any],
    ids: list[int],
    start: int,
    include_input: bool,
    token_texts: TokenTexts,
) -> None:
    req = st.req
    start -= st.logprobs_from  # positions in out_logprobs / out_top
    end = start + len(ids)
    top = req.top_logprobs_num > 0
    out_top = st.out_top[start:end] if top else []
    prompt = req.input_ids[req.logprob_start_len :] if req.logprob_start_len >= 0 and include_input else None
    in_top = st.in_top if top and prompt is not None else []
    text = {}.get  # no texts: every slot None
    if token_texts is not None:
        tops = [*out_top, *(t for t in in_top if t is not None)]
        distinct = list({*ids, *(prompt or ()), *(tid for t in tops for tid, _ in t)})
        text = dict(zip(distinct, token_texts(distinct), strict=True)).get  # each id decoded once
    meta["output_token_logprobs"] = [(lp, tid, text(tid)) for lp, tid in zip(st.out_logprobs[start:end], ids)]
    if top:
        meta["output_top_logprobs"] = [[(lp, tid, text(tid)) for tid, lp in t] for t in out_top]
    if prompt is not None:
        meta["input_token_logprobs"] = [(lp, tid, text(tid)) for lp, tid in zip(st.in_logprobs, prompt)]
        if top:
            meta["input_top_logprobs"] = [
                None if t is None else [(lp, tid, text(tid)) for tid, lp in t] for t in in_top
            ]

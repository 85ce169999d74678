"""Turning one forward's results into request state and the step's ``BatchTokenIDOut``.

``process_batch_result`` (per step, O(1) Python work per request):

    extend row i (i < num_extend_reqs):  kv_committed_len = prefix + extend
        more prompt left  -> cache_unfinished_req (the chunk becomes shareable); stays PREFILLING
        prompt complete   -> append the sampled token; finished -> released,
                             else cache_unfinished_req and DECODING (joins the running batch)
    decode row i:                        kv_committed_len += 1, append the sampled token;
                                         finished -> released

``build_batch_output`` collects every request that produced tokens or finished: its new
tokens since the last output (``Req.num_sent``), its finish reason on the last one, and
logprobs when asked for (prompt logprobs once, with the first output).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from srt.managers.io_struct import BatchTokenIDOut
from srt.managers.req import Req, ReqState, finish_length
from srt.managers.schedule_batch import ScheduleBatch
from srt.mem_cache.base_prefix_cache import BasePrefixCache


def process_batch_result(
    batch: ScheduleBatch,
    logits_output: Any,
    sample_output: Any,
    tree_cache: BasePrefixCache,
    release: Callable[[Req], None],
) -> tuple[list[Req], int]:
    """Apply one forward's results to ``batch.reqs``.

    Returns ``(new_decoding, num_generated)``: the extend requests that completed their prompt
    and keep decoding (to be merged into the running batch, in batch order) and how many
    tokens were generated. Finished requests are handed to ``release``.
    """
    next_ids: list[int] = sample_output.next_token_ids.tolist()
    want_lp = sample_output.next_token_logprobs is not None
    lps: list[float] | None = sample_output.next_token_logprobs.tolist() if want_lp else None
    tops = sample_output.top_logprobs if want_lp else None
    reqs = batch.reqs
    n_ext = batch.num_extend_reqs
    new_decoding: list[Req] = []
    generated = 0

    input_lp = _input_logprobs_per_req(batch, logits_output) if want_lp else None

    for i in range(n_ext):
        req = reqs[i]
        end = batch.prefix_lens[i] + batch.extend_lens[i]
        req.kv_committed_len = end
        if input_lp is not None and input_lp[i] is not None:
            vals, top_vals = input_lp[i]
            req.input_token_logprobs.extend(vals)
            req.input_top_logprobs.extend(top_vals)
        if end < req.all_ids_len:  # a non-final chunk
            tree_cache.cache_unfinished_req(req)
            continue
        if req.remaining_new_tokens == 0:  # max_new_tokens == 0: prompt (logprobs) only
            req.finish(finish_length(len(req.output_ids)))
        else:
            req.append_token(next_ids[i])
            generated += 1
            if req.return_logprob and lps is not None:
                _record_logprob(req, lps[i], tops[i] if tops is not None else [])
        if req.finished_reason is not None:
            release(req)
        else:
            tree_cache.cache_unfinished_req(req)
            req.set_state(ReqState.DECODING)
            new_decoding.append(req)

    for i in range(n_ext, len(reqs)):  # the hot loop: O(1) per decoding request
        req = reqs[i]
        t = next_ids[i]
        req.kv_committed_len += 1
        out = req.output_ids
        out.append(t)
        if lps is not None and req.return_logprob:
            _record_logprob(req, lps[i], tops[i] if tops is not None else [])
        if len(out) >= req.max_new_tokens or t in req.stop_ids:
            req.check_finished(t)
            if req.finished_reason is not None:
                release(req)
    generated += len(reqs) - n_ext
    return new_decoding, generated


def _record_logprob(req: Req, lp: float, top: list[tuple[int, float]]) -> None:
    req.pending_token_logprobs.append(lp)
    if req.top_logprobs_num > 0:
        req.pending_top_logprobs.append([(int(t), float(v)) for t, v in top[: req.top_logprobs_num]])


def _input_logprobs_per_req(
    batch: ScheduleBatch, logits_output: Any
) -> list[tuple[list[float | None], list[list[tuple[int, float]] | None]] | None] | None:
    """Prompt logprobs of this step's extend rows (None where not asked for).

    ``logits_output.input_token_logprobs[i]`` scores the prompt tokens of row i from its
    logprob start (or where the previous chunk stopped) up to the first token of the next
    chunk; concatenated over the chunks they give one entry per prompt position from
    ``logprob_start_len`` (None for position 0). See srt/layers/logits_processor.py."""
    vals = getattr(logits_output, "input_token_logprobs", None)
    if vals is None:
        return None
    tops = getattr(logits_output, "input_top_logprobs", None)
    out: list[Any] = [None] * len(batch.reqs)
    for i in range(batch.num_extend_reqs):
        req = batch.reqs[i]
        if req.wants_input_logprobs:
            top = list(tops[i]) if tops is not None and req.top_logprobs_num > 0 else []
            out[i] = (list(vals[i]), top)
    return out


def build_batch_output(reqs: Iterable[Req]) -> BatchTokenIDOut | None:
    """One ``BatchTokenIDOut`` for every request in ``reqs`` that has unsent tokens or finished
    (each request at most once per call); None when there is nothing to send."""
    emitted = [r for r in reqs if r.num_sent != len(r.output_ids) or r.finished_reason is not None]
    if not emitted:
        return None
    rids, prompt_tokens, skip_special, spaces, no_stop_trim, stop_strs = map(
        list, zip(*[r.out_static for r in emitted])
    )
    output_ids = [r.output_ids[r.num_sent :] for r in emitted]
    first = [r.num_sent == 0 for r in emitted]
    for r in emitted:
        r.num_sent = len(r.output_ids)
    out = BatchTokenIDOut(
        rids=rids,
        output_ids=output_ids,
        finished_reasons=[r.finished_reason for r in emitted],
        prompt_tokens=prompt_tokens,
        completion_tokens=[r.num_sent for r in emitted],
        cached_tokens=[r.cached_tokens for r in emitted],
        skip_special_tokens=skip_special,
        spaces_between_special_tokens=spaces,
        no_stop_trim=no_stop_trim,
        stop_strs=stop_strs,
    )
    if any(first):
        out.queue_times = [r.queue_time if f else None for r, f in zip(emitted, first)]
    if any([r.return_logprob for r in emitted]):
        _attach_logprobs(out, emitted)
    return out


def _attach_logprobs(out: BatchTokenIDOut, emitted: list[Req]) -> None:
    """Output logprobs of the tokens sent now; prompt logprobs once, with the first output."""
    out.output_token_logprobs = [r.pending_token_logprobs for r in emitted]
    out.output_top_logprobs = [r.pending_top_logprobs for r in emitted]
    in_lp: list[list[float | None]] = []
    in_top: list[list[list[tuple[int, float]] | None]] = []
    for r in emitted:
        r.pending_token_logprobs = []
        r.pending_top_logprobs = []
        if r.logprob_start_len >= 0 and not r.input_logprobs_sent:
            r.input_logprobs_sent = True
            in_lp.append(r.input_token_logprobs)
            in_top.append(r.input_top_logprobs)
            r.input_token_logprobs = []
            r.input_top_logprobs = []
        else:
            in_lp.append([])
            in_top.append([])
    out.input_token_logprobs = in_lp
    out.input_top_logprobs = in_top

"""The output part: one forward's results -> request state, and the step's ``BatchTokenIDOut``.

``process_batch_result`` (per step, O(1) Python work per request):

    extend row i (i < num_extend_reqs):  kv_committed_len = prefix + extend
        more prompt left  -> cache_unfinished (the chunk becomes shareable); stays PREFILLING
        prompt complete   -> append the sampled token; finished -> released,
                             else cache_unfinished and DECODING (joins the running batch)
    decode row i:                        kv_committed_len += 1, append the sampled token;
                                         finished -> released
    (a request with a grammar advances its matcher past the token; a complete grammar
    finishes it)
    a row whose request finished before the batch completed (overlap scheduling: it stopped
    in the batch before, or was aborted while this one ran) is discarded: its request released
    everything already, its token is dropped

``build_batch_output`` collects every request that produced tokens or finished: its new
tokens since the last output (``Req.num_sent``), its finish reason on the last one, and
logprobs when asked for (prompt logprobs once, with the first output). A streaming request
sends its tokens in groups of ``--stream-interval`` (its first token and its finish at once).
Phase timings ride along only where they are new: ``queue_times`` and ``prefill_times`` with a
request's first output, ``decode_times`` with its finishing one (empty lists otherwise).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from srt.managers.io_struct import BatchTokenIDOut, FinishReason
from srt.managers.scheduler import pooling
from srt.managers.scheduler.grammar import GrammarManager
from srt.managers.scheduler.req import Req, ReqStatus

if TYPE_CHECKING:
    from srt.managers.scheduler.cache import CacheManager
    from srt.managers.scheduler.runner_protocol import LogitsResult, SampleResult
    from srt.managers.scheduler.schedule_batch import ScheduleBatch

# per extend row: (prompt logprobs, their top logprobs)
InputLogprobs = tuple[list[float | None], list[list[tuple[int, float]] | None]]


@dataclass(slots=True)
class BatchResult:
    """What processing one forward's results changed for the scheduler.

    ``new_decoding``: the extend requests that completed their prompt and keep decoding (to
    join the running batch, in batch order); ``num_generated``: tokens sampled;
    ``decode_finished``: some decode row (a running request) finished and was released;
    ``reqs``: the requests whose rows were applied (every one but the discarded rows)."""

    new_decoding: list[Req]
    num_generated: int
    decode_finished: bool
    reqs: list[Req]


def process_batch_result(
    batch: ScheduleBatch,
    logits_output: LogitsResult,
    sample_output: SampleResult,
    cache: CacheManager,
    release: Callable[[Req], None],
    discard_released: bool = False,
) -> BatchResult:
    """Apply one forward's results to ``batch.reqs`` (see the module docstring); finished
    requests are handed to ``release``. ``discard_released`` (overlap scheduling, where a
    request can finish while its batch runs): skip the rows of requests released already."""
    next_ids, lps, tops = sampled_lists(sample_output)
    input_lp = _input_logprobs_per_req(batch, logits_output) if lps is not None else None
    reqs = batch.reqs
    # rows of requests that finished before the batch completed (None: no such row)
    stale: list[bool] | None = None
    if discard_released:
        stale = [r.state == ReqStatus.FINISHED for r in reqs]
        if not any(stale):
            stale = None
    new_decoding, generated = _process_extend_rows(
        batch, next_ids, lps, tops, input_lp, cache, release, stale, logits_output
    )
    decode_finished, decoded = _process_decode_rows(batch, next_ids, lps, tops, release, stale)
    applied = reqs if stale is None else [r for r, gone in zip(reqs, stale) if not gone]
    return BatchResult(new_decoding, generated + decoded, decode_finished, applied)


def sampled_lists(
    sample_output: SampleResult,
) -> tuple[list[int], list[float] | None, list[list[tuple[int, float]]] | None]:
    """(next token ids, their logprobs or None, their top logprobs or None) as Python lists."""
    token_lps = sample_output.next_token_logprobs
    lps: list[float] | None = token_lps.tolist() if token_lps is not None else None
    return sample_output.next_token_ids.tolist(), lps, sample_output.top_logprobs if lps is not None else None


def _process_extend_rows(
    batch: ScheduleBatch,
    next_ids: list[int],
    lps: list[float] | None,
    tops: list[list[tuple[int, float]]] | None,
    input_lp: list[InputLogprobs | None] | None,
    cache: CacheManager,
    release: Callable[[Req], None],
    stale: list[bool] | None,
    logits_output: LogitsResult | None = None,
) -> tuple[list[Req], int]:
    """Rows ``[0, num_extend_reqs)`` but the ``stale`` ones; returns (the requests that start
    decoding, tokens sampled). Pooled outputs are folded in from ``logits_output``."""
    new_decoding: list[Req] = []
    generated = 0
    for i in range(batch.num_extend_reqs):
        if stale is not None and stale[i]:
            continue
        req = batch.reqs[i]
        end = batch.prefix_lens[i] + batch.extend_lens[i]
        req.kv_committed_len = end
        if input_lp is not None and (lp := input_lp[i]) is not None:
            req.input_token_logprobs.extend(lp[0])
            req.input_top_logprobs.extend(lp[1])
        if req.pooling or req.label_token_ids:
            pooling.absorb(req, logits_output, i, end >= req.all_ids_len)
        if end < req.all_ids_len:  # a non-final chunk
            cache.cache_unfinished(req)
            continue
        if req.remaining_new_tokens == 0:  # max_new_tokens == 0: prompt (logprobs) only
            req.finish(FinishReason.of_length(len(req.output_ids)))
        else:
            req.append_token(next_ids[i])
            if not req.first_token_time:
                req.first_token_time = time.perf_counter()
            if req.grammar is not None and req.finished_reason is None:
                GrammarManager.accept(req, next_ids[i])
            generated += 1
            if req.return_logprob and lps is not None:
                record_logprob(req, lps[i], tops[i] if tops is not None else [])
        if req.finished_reason is not None:
            release(req)
        else:
            cache.cache_unfinished(req)
            req.set_state(ReqStatus.DECODING)
            new_decoding.append(req)
    return new_decoding, generated


def _process_decode_rows(
    batch: ScheduleBatch,
    next_ids: list[int],
    lps: list[float] | None,
    tops: list[list[tuple[int, float]]] | None,
    release: Callable[[Req], None],
    stale: list[bool] | None,
) -> tuple[bool, int]:
    """Rows ``[num_extend_reqs, bs)`` (the hot loop: O(1) per decoding request), skipping the
    ``stale`` ones (their requests finished before the batch completed); returns whether one of
    them finished and how many tokens were appended."""
    reqs = batch.reqs
    finished = False
    decoded = 0
    for i in range(batch.num_extend_reqs, len(reqs)):
        if stale is not None and stale[i]:
            continue
        req = reqs[i]
        t = next_ids[i]
        decoded += 1
        if req.spec is not None:  # speculative decoding above its batch size: a plain step
            req.spec.on_plain_step()
        req.kv_committed_len += 1
        out = req.output_ids
        out.append(t)
        if lps is not None and req.return_logprob:
            record_logprob(req, lps[i], tops[i] if tops is not None else [])
        if len(out) >= req.max_new_tokens or t in req.stop_ids:
            req.check_finished(t)
        if req.grammar is not None and req.finished_reason is None:
            GrammarManager.accept(req, t)
        if req.finished_reason is not None:
            release(req)
            finished = True
    return finished, decoded


def record_logprob(req: Req, lp: float, top: list[tuple[int, float]]) -> None:
    req.pending_token_logprobs.append(lp)
    if req.top_logprobs_num > 0:
        req.pending_top_logprobs.append([(int(t), float(v)) for t, v in top[: req.top_logprobs_num]])


def _input_logprobs_per_req(
    batch: ScheduleBatch, logits_output: LogitsResult
) -> list[InputLogprobs | None] | None:
    """Prompt logprobs of this step's extend rows (None where not asked for).

    ``logits_output.input_token_logprobs[i]`` scores the prompt tokens of row i from its
    logprob start (or where the previous chunk stopped) up to the first token of the next
    chunk; concatenated over the chunks they give one entry per prompt position from
    ``logprob_start_len`` (None for position 0). See srt/layers/logits_processor.py."""
    vals = logits_output.input_token_logprobs
    if vals is None:
        return None
    tops = logits_output.input_top_logprobs
    out: list[InputLogprobs | None] = [None] * len(batch.reqs)
    for i in range(batch.num_extend_reqs):
        req = batch.reqs[i]
        if req.wants_input_logprobs:
            top = list(tops[i]) if tops is not None and req.top_logprobs_num > 0 else []
            out[i] = (list(vals[i]), top)
    return out


def build_batch_output(reqs: Iterable[Req], stream_interval: int = 1) -> BatchTokenIDOut | None:
    """One ``BatchTokenIDOut`` for every request in ``reqs`` that finished or has tokens to send
    (each request at most once per call); None when there is nothing to send.

    A streaming request's tokens are held until ``stream_interval`` of them are unsent
    (``--stream-interval``), except its first token(s) (time to first token) and its finish; a
    non-streaming request sends every step (the detokenizer looks for its stop strings)."""
    emitted = [
        r
        for r in reqs
        if r.finished_reason is not None
        or (
            (unsent := len(r.output_ids) - r.num_sent) > 0
            and (unsent >= stream_interval or not r.stream or r.num_sent == 0)
        )
    ]
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
        out.prefill_times = [_prefill_time(r) if f else None for r, f in zip(emitted, first)]
    if any([r.finished_reason is not None for r in emitted]):
        now = time.perf_counter()
        out.decode_times = [
            now - r.first_token_time if r.finished_reason is not None and r.first_token_time else None
            for r in emitted
        ]
    if any([r.return_logprob for r in emitted]):
        _attach_logprobs(out, emitted)
    if any([r.pooled_out is not None for r in emitted]):
        out.pooled_outputs = [r.pooled_out if r.finished_reason is not None else None for r in emitted]
    if any([r.spec is not None for r in emitted]):
        out.spec_accept_lens = [r.spec.take_accepts() if r.spec is not None else [] for r in emitted]
    return out


def _prefill_time(r: Req) -> float | None:
    """First admission -> first output token (None when it has no token or was never admitted)."""
    if r.first_token_time and r.admit_time:
        return r.first_token_time - r.admit_time
    return None


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

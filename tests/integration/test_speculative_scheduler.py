"""Speculative decoding (--speculative-algorithm NGRAM) in the scheduler, with the fake model of
tests/helpers/scheduler_fakes.py in its copying mode: four times in five it repeats what followed
the last token's previous occurrence, so n-gram drafts are often right and often wrong.

The fake model reads every row's context back from the KV slots, so a verify row that attends
to a wrong slot (a rejected draft's KV, another row's token) changes the output. Under every
configuration (paging, chunking, retraction, no radix cache, mixed steps, EOS stops, a batch-size
threshold) the outputs equal the request run alone token by token, drafts were accepted and
rejected, and afterwards every KV slot and request row is free.
"""

from __future__ import annotations

import pytest

from srt.managers.io_struct import AbortReq, TokenizedGenerateReqInput
from srt.managers.scheduler import Scheduler
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs
from tests.helpers.scheduler_fakes import KVEchoRunner, fake_logprob, reference_generate
from tests.integration.test_scheduler_exactness import (
    _fake_group,
    _fake_prompts,
    build_workload,
    check_clean,
    check_eos_outputs,
    drive,
    eos_workload,
)

SPEC = dict(speculative_algorithm="NGRAM", speculative_max_batch_size=64)
_SMALL = dict(_total=1024, schedule_conservativeness=0.3)
CONFIGS = {
    "default": dict(),
    "drafts2": dict(speculative_num_draft_tokens=2),
    "page16": dict(page_size=16, chunked_prefill_size=64),
    "page4_small": dict(page_size=4, chunked_prefill_size=32, **_SMALL),
    "small_pool": dict(chunked_prefill_size=64, **_SMALL),
    "no_radix": dict(disable_radix_cache=True),
    "mixed": dict(enable_mixed_chunk=True, chunked_prefill_size=64),
    "threshold4": dict(speculative_max_batch_size=4),
    "store": dict(speculative_ngram_capacity=5000, speculative_ngram_min_match_window_size=2),
}


def spec_scheduler(eos_every: int = 0, **cfg) -> Scheduler:
    cfg = {**SPEC, **cfg}
    total = cfg.pop("_total", 8192)
    page = cfg.get("page_size", 1)
    args = ServerArgs(device="cpu", enable_debug_checks=True, max_running_requests=64, **cfg).resolve()
    runner = KVEchoRunner(
        max_total_tokens=total, page_size=page, max_running_requests=64, eos_every=eos_every, copy=True
    )
    return Scheduler(args, runner)


def _check_speculated(sched: Scheduler) -> None:
    m = sched.metrics
    assert m.num_draft_tokens > 0, "no draft was verified"
    accepted = m.num_verify_tokens - m.num_verify_steps
    assert 0 < accepted < m.num_draft_tokens, (accepted, m.num_draft_tokens)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_outputs_equal_the_request_alone(name):
    items = build_workload(_fake_prompts, _fake_group, seed=3)
    sched = spec_scheduler(**CONFIGS[name])
    out = drive(sched, items)
    for it in items:
        assert out[it.rid] == reference_generate(it.prompt, it.max_new, copy=True), it.rid
    _check_speculated(sched)
    if "_total" in CONFIGS[name]:
        assert sched.metrics.num_retractions > 0, "the small pool must force retractions"
    check_clean(sched)


@pytest.mark.parametrize("name", ["default", "page4_small"])
def test_eos_and_min_new_tokens_inside_accepted_drafts(name):
    """A stop token among the accepted tokens ends the request there (the rest is dropped),
    unless min_new_tokens is not reached yet; max_new_tokens caps a step's tokens."""
    items = eos_workload(seed=4)
    sched = spec_scheduler(eos_every=7, **CONFIGS[name])
    assert check_eos_outputs(drive(sched, items), items, eos_every=7, copy=True) > 0
    _check_speculated(sched)
    check_clean(sched)


def _req(rid: str, prompt: list[int], max_new: int, **kw) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(
        rid=rid,
        input_ids=prompt,
        sampling_params=SamplingParams(max_new_tokens=max_new, temperature=0.0),
        **kw,
    )


def test_logprobs_and_accept_lengths_per_token():
    """Every accepted token gets its own logprob (the fake's value for its context), and the
    outputs report the tokens each decode step produced."""
    sched = spec_scheduler()
    prompt = [5, 6, 7, 8, 9] * 12
    sched.handle_message(_req("lp", prompt, 40, return_logprob=True, top_logprobs_num=1))
    ids, lps, tops, accepts = [], [], [], []
    for o in sched.run_until_idle():
        ids += o.output_ids[0]
        lps += o.output_token_logprobs[0]
        tops += o.output_top_logprobs[0]
        accepts += o.spec_accept_lens[0] if o.spec_accept_lens else []
    assert ids == reference_generate(prompt, 40, copy=True)
    ctx, expect = list(prompt), []
    for t in ids:
        expect.append(fake_logprob(ctx))
        ctx.append(t)
    assert lps == pytest.approx(expect) and [x[0][0] for x in tops] == ids
    # the first token comes from the prefill; every later one from a counted decode step
    assert sum(accepts) == len(ids) - 1 and max(accepts) > 1
    check_clean(sched)


def test_abort_while_speculating_frees_everything():
    sched = spec_scheduler()
    for i in range(4):
        sched.handle_message(_req(f"r{i}", [10 + i, 11, 12, 13] * 20, 200))
    for _ in range(6):
        sched.step()
    assert sched.metrics.num_draft_tokens > 0
    sched.handle_message(AbortReq(rid="r1"))
    sched.handle_message(AbortReq(rid="r2"))
    sched.run_until_idle()
    check_clean(sched)


def test_no_speculation_above_the_batch_size_threshold():
    sched = spec_scheduler(speculative_max_batch_size=2)
    for i in range(3):
        sched.handle_message(_req(f"r{i}", [20 + i, 21, 22] * 10, 30))
    outs = sched.run_until_idle()
    assert sched.metrics.num_draft_tokens == 0
    got: dict[str, list[int]] = {}
    for o in outs:
        for rid, ids in zip(o.rids, o.output_ids):
            got.setdefault(rid, []).extend(ids)
    for i in range(3):
        assert got[f"r{i}"] == reference_generate([20 + i, 21, 22] * 10, 30, copy=True)
    check_clean(sched)

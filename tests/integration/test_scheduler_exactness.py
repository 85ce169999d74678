"""Token exactness under continuous batching.

Workload (fixed seed): 64 requests arriving at random steps, prompts of 5 to 600 tokens (independent
ones plus groups sharing long prefixes), max_new_tokens 8 to 96 (8 to 32 with the real model),
greedy, EOS ignored.

* Real model (the acceptance test): every output equals transformers' greedy ``generate`` for that
  prompt alone (near-tie rule of tests/helpers/hf_reference.py, at most one near-tie per 24
  prompts), under each of: chunked prefill of 64 (fcfs), --enable-mixed-chunk, page size 16,
  a KV pool so small that retraction happens without the radix cache, the lpm policy, and overlap
  scheduling with mixed chunks and retractions together. One ModelRunner serves every
  configuration (its pools are swapped where the page or pool size differs); the references are
  cached on disk.
* Fake model (fast, tests/helpers/scheduler_fakes.py): the same workload shape with a model whose
  next token is a hash of the context READ BACK FROM THE KV SLOTS, so any bookkeeping slip changes
  the output; outputs must match exactly, also with EOS stops, min_new_tokens, priorities,
  prompt logprobs and tiny pools.

After every run the cache's integrity holds, and after a flush every KV slot and request row is free.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass, field

import pytest

from srt.managers.io_struct import TokenizedGenerateReqInput
from srt.managers.scheduler import Scheduler
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs
from tests.helpers import early_runs
from tests.helpers.device_like import DeviceLikeTensor, device_like_pools
from tests.helpers.hf_reference import warm_command
from tests.helpers.scheduler_fakes import (
    EOS,
    KVEchoRunner,
    fake_logprob,
    reference_generate,
    reference_prompt_logprobs,
)

NUM_REQS = 64
MAX_ARRIVAL_STEP = 40


@dataclass
class Item:
    rid: str
    prompt: list[int]
    max_new: int
    arrival: int
    params: dict = field(default_factory=dict)
    logprob_start: int = -1


def log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return min(hi, max(lo, round(math.exp(rng.uniform(math.log(lo), math.log(hi))))))


def build_workload(make_prompts, make_group, seed: int = 0, max_new: int = 96) -> list[Item]:
    """24 requests in 4 groups of 6 sharing a 150-450 token prefix (prompts up to 600 tokens),
    40 independent ones (5, 450 and 600 tokens, the rest log-uniform in [5, 300]); max_new_tokens
    log-uniform in [8, max_new] (both ends included); arrivals uniform in [0, 40] steps."""
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    for g in range(4):
        prefix = rng.randint(150, 450)
        suffixes = [rng.randint(1, min(150, 600 - prefix)) for _ in range(6)]
        prompts += make_group(prefix, suffixes, seed * 100 + g)
    lengths = [5, 600, 450] + [log_uniform(rng, 5, 300) for _ in range(NUM_REQS - len(prompts) - 3)]
    prompts += make_prompts(lengths, seed + 1)
    news = [8, max_new] + [log_uniform(rng, 8, max_new) for _ in range(NUM_REQS - 2)]
    rng.shuffle(news)
    order = list(range(NUM_REQS))
    rng.shuffle(order)
    return [
        Item(f"req{i}", prompts[k], news[i], rng.randint(0, MAX_ARRIVAL_STEP)) for i, k in enumerate(order)
    ]


def drive(sched: Scheduler, items: list[Item], max_steps: int = 20_000) -> dict[str, list[int]]:
    """Submit each item at its arrival step, step until idle; return the output token streams
    (checking stream order: nothing after a request's finish reason, which must come)."""
    pending = sorted(items, key=lambda it: it.arrival)
    tokens: dict[str, list[int]] = {it.rid: [] for it in items}
    finished: dict[str, dict] = {}
    step = 0
    while pending or not sched.is_idle():
        while pending and pending[0].arrival <= step:
            it = pending.pop(0)
            sched.handle_message(
                TokenizedGenerateReqInput(
                    rid=it.rid,
                    input_ids=it.prompt,
                    sampling_params=SamplingParams(max_new_tokens=it.max_new, temperature=0.0, **it.params),
                    return_logprob=it.logprob_start >= 0,
                    logprob_start_len=it.logprob_start,
                    priority=len(it.prompt) % 3,
                )
            )
        for out in sched.step():
            for rid, ids, fr in zip(out.rids, out.output_ids, out.finished_reasons):
                assert rid not in finished, f"output for {rid} after its finish reason"
                tokens[rid].extend(ids)
                if fr is not None:
                    finished[rid] = fr.to_dict()
        step += 1
        assert step < max_steps, "the scheduler made no progress"
    assert set(finished) == set(tokens), "every request reports a finish reason"
    assert all(fr["type"] != "abort" for fr in finished.values()), finished
    return tokens


def check_clean(sched: Scheduler) -> None:
    sched.tree_cache.check_integrity(0)
    flushed = sched.flush_cache()
    assert flushed.success and flushed.message == "", flushed
    assert sched.allocator.available_size() == sched.allocator.size
    assert sched.req_to_token_pool.available_size() == sched.req_to_token_pool.size


# ====================================================================== fake model (fast)
def _fake_prompts(lengths, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in lengths]


def _fake_group(prefix_len, suffix_lens, seed):
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 1000) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(3, 1000) for _ in range(n)] for n in suffix_lens]


# "_total": KV pool size; "_retract": the run must retract (a small pool with an optimistic
# new-token estimate)
_SMALL = dict(_total=1024, schedule_conservativeness=0.3, _retract=True)
FAKE_CONFIGS = {
    "default": dict(),
    "chunk32": dict(chunked_prefill_size=32),
    "no_chunk": dict(chunked_prefill_size=-1, max_prefill_tokens=512),
    "mixed": dict(enable_mixed_chunk=True, chunked_prefill_size=64),
    "page16": dict(page_size=16, chunked_prefill_size=64),
    "page16_mixed_small": dict(page_size=16, chunked_prefill_size=32, enable_mixed_chunk=True, **_SMALL),
    "no_radix": dict(disable_radix_cache=True, chunked_prefill_size=64),
    "no_radix_small": dict(disable_radix_cache=True, **_SMALL),
    "small_pool": dict(chunked_prefill_size=64, **_SMALL),
    "lpm": dict(schedule_policy="lpm"),
    "lpm_small": dict(schedule_policy="lpm", **_SMALL),
    "priority": dict(schedule_policy="priority", max_running_requests=8),
    "conservative": dict(schedule_conservativeness=2.0, _total=1024),
    # overlap scheduling: decode rows whose input is the token in flight, one-step-late finishes
    "overlap": dict(enable_overlap_schedule=True),
    "overlap_mixed_page16_small": dict(
        enable_overlap_schedule=True, page_size=16, chunked_prefill_size=32, enable_mixed_chunk=True, **_SMALL
    ),
    "overlap_lpm_small": dict(enable_overlap_schedule=True, schedule_policy="lpm", **_SMALL),
}


def fake_scheduler(eos_every: int = 0, **cfg) -> Scheduler:
    cfg = dict(cfg)
    total = cfg.pop("_total", 8192)
    cfg.pop("_retract", None)
    page = cfg.get("page_size", 1)
    max_running = cfg.setdefault("max_running_requests", 64)
    args = ServerArgs(device="cpu", enable_debug_checks=True, **cfg).resolve()
    runner = KVEchoRunner(
        max_total_tokens=total, page_size=page, max_running_requests=max_running, eos_every=eos_every
    )
    return Scheduler(args, runner)


@pytest.mark.parametrize("name", list(FAKE_CONFIGS))
def test_exact_outputs_fake_model(name):
    items = build_workload(_fake_prompts, _fake_group, seed=1)
    sched = fake_scheduler(**FAKE_CONFIGS[name])
    out = drive(sched, items)
    for it in items:
        assert out[it.rid] == reference_generate(it.prompt, it.max_new), it.rid
    if FAKE_CONFIGS[name].get("_retract"):
        assert sched.metrics.num_retractions > 0, "the small pool must force retractions"
    if FAKE_CONFIGS[name].get("enable_mixed_chunk"):
        assert "MIXED" in sched.model_runner.modes and sched.metrics.num_mixed_steps > 0
    if FAKE_CONFIGS[name].get("enable_overlap_schedule"):  # prefills sync; most decodes overlap
        m = sched.metrics
        assert m.num_overlapped_steps > (m.num_decode_steps // 2 if name == "overlap" else 0)
    check_clean(sched)


@pytest.mark.parametrize(
    "name", ["page16_mixed_small", "overlap_mixed_page16_small", "lpm_small", "no_radix_small"]
)
def test_exact_outputs_with_a_device_like_table(name, monkeypatch):
    """The scheduler's host code never converts the request-to-token table (or what it reads
    from it) to numpy implicitly, which fails when the table lives on a GPU: the table is a
    CPU tensor that refuses it (tests/helpers/device_like.py); prefix reuse, chunks, mixed
    steps, retraction and overlap all touch it."""
    device_like_pools(monkeypatch)
    items = build_workload(_fake_prompts, _fake_group, seed=1)
    sched = fake_scheduler(**FAKE_CONFIGS[name])
    assert isinstance(sched.req_to_token_pool.req_to_token, DeviceLikeTensor)
    out = drive(sched, items)
    for it in items:
        assert out[it.rid] == reference_generate(it.prompt, it.max_new), it.rid
    assert sched.metrics.num_retractions > 0
    check_clean(sched)


@pytest.mark.parametrize(
    "name", ["default", "small_pool", "page16_mixed_small", "overlap", "overlap_mixed_page16_small"]
)
def test_eos_min_new_tokens_and_logprobs_fake_model(name):
    """EOS stops (some requests ignore it or must reach min_new_tokens first) and prompt/output
    logprobs, under continuous batching with chunking and retraction."""
    items = eos_workload(seed=2)
    sched = fake_scheduler(eos_every=5, **FAKE_CONFIGS[name])
    assert check_eos_outputs(drive(sched, items), items, eos_every=5) > 0, (
        "the workload must exercise EOS stops"
    )
    check_clean(sched)


def eos_workload(seed: int) -> list[Item]:
    """``build_workload`` where a third of the requests need min_new_tokens 6 (or their
    max_new_tokens) before EOS may stop them and a third ignore EOS."""
    items = build_workload(_fake_prompts, _fake_group, seed=seed)
    for i, it in enumerate(items):
        if i % 3 == 0:
            it.params = {"min_new_tokens": min(it.max_new, 6)}
        elif i % 3 == 1:
            it.params = {"ignore_eos": True}
    return items


def check_eos_outputs(
    out: dict[str, list[int]], items: list[Item], eos_every: int, copy: bool = False
) -> int:
    """Every output equals the request alone; returns how many stopped at EOS early."""
    stopped = 0
    for it in items:
        ref = reference_generate(
            it.prompt,
            it.max_new,
            eos_every=eos_every,
            ignore_eos=it.params.get("ignore_eos", False),
            min_new_tokens=it.params.get("min_new_tokens", 0),
            copy=copy,
        )
        assert out[it.rid] == ref, it.rid
        stopped += ref[-1] == EOS and len(ref) < it.max_new
    return stopped


def test_output_logprobs_and_metadata_fake_model():
    sched = fake_scheduler(chunked_prefill_size=16)
    prompt = list(range(10, 90))
    sched.handle_message(
        TokenizedGenerateReqInput(
            rid="lp",
            input_ids=prompt,
            sampling_params=SamplingParams(max_new_tokens=5, temperature=0.0),
            return_logprob=True,
            logprob_start_len=0,
            top_logprobs_num=1,
        )
    )
    outs = sched.run_until_idle()
    ids, lps, tops = [], [], []
    firsts = []
    for o in outs:
        assert o.rids == ["lp"]
        ids += o.output_ids[0]
        lps += o.output_token_logprobs[0]
        tops += o.output_top_logprobs[0]
        firsts.append(o.queue_times[0] if o.queue_times else None)
        assert o.prompt_tokens == [80] and o.cached_tokens == [0]
    assert ids == reference_generate(prompt, 5)
    ctx = list(prompt)
    expect = []
    for t in ids:
        expect.append(fake_logprob(ctx))
        ctx.append(t)
    assert lps == pytest.approx(expect) and [x[0][0] for x in tops] == ids
    assert firsts[0] is not None and firsts[0] >= 0 and all(f is None for f in firsts[1:])
    assert outs[-1].finished_reasons[0].to_dict() == {"type": "length", "length": 5}
    assert outs[-1].completion_tokens == [5]
    check_clean(sched)


@pytest.mark.parametrize("chunk", [16, -1])
@pytest.mark.parametrize("start", [0, 1, 10, 79])
def test_prompt_logprobs_across_chunks_and_cached_prefixes(chunk, start):
    """Prompt logprobs arrive once, with the first output, one per position from
    logprob_start_len, even when the prompt is chunked and most of it is cached."""
    sched = fake_scheduler(chunked_prefill_size=chunk)
    prompt = list(range(10, 90))
    sched.handle_message(  # caches most of the prompt
        TokenizedGenerateReqInput(
            rid="warm", input_ids=prompt, sampling_params=SamplingParams(max_new_tokens=2, temperature=0)
        )
    )
    sched.run_until_idle()
    sched.handle_message(
        TokenizedGenerateReqInput(
            rid="lp",
            input_ids=prompt,
            sampling_params=SamplingParams(max_new_tokens=3, temperature=0),
            return_logprob=True,
            logprob_start_len=start,
        )
    )
    outs = sched.run_until_idle()
    got = [o.input_token_logprobs[0] for o in outs]
    assert got[0] == pytest.approx(reference_prompt_logprobs(prompt, start))
    assert all(g == [] for g in got[1:]), "prompt logprobs are sent once"
    assert sum(len(o.output_ids[0]) for o in outs) == 3
    check_clean(sched)


def test_requests_arriving_together_share_their_prefix():
    """16 requests with one 400-token system prompt arrive at once: the prompt is computed
    once (the others wait a step for it instead of computing it again)."""
    sched = fake_scheduler()
    rng = random.Random(9)
    system = [rng.randrange(3, 1000) for _ in range(400)]
    prompts = [system + [rng.randrange(3, 1000) for _ in range(20)] for _ in range(16)]
    items = [Item(f"g{i}", p, 8, 0) for i, p in enumerate(prompts)]
    out = drive(sched, items)
    assert all(out[it.rid] == reference_generate(it.prompt, 8) for it in items)
    assert sched.metrics.num_prefill_tokens <= 400 + 16 * 20 + 16
    assert sched.metrics.cache_hit_rate > 0.85
    check_clean(sched)


def test_cached_tokens_reported_for_a_shared_prefix():
    sched = fake_scheduler()
    prompt = list(range(100, 400))
    for rid in ("a", "b"):
        sched.handle_message(
            TokenizedGenerateReqInput(
                rid=rid,
                input_ids=prompt + [7],
                sampling_params=SamplingParams(max_new_tokens=3, temperature=0),
            )
        )
        outs = sched.run_until_idle()
    assert outs[-1].cached_tokens == [300]
    assert sched.get_internal_state()["cache_hit_rate"] == pytest.approx(300 / 602)
    check_clean(sched)


# ====================================================================== real model (acceptance)
# Each configuration combines features that do not mask one another, so that the real model runs
# four times rather than once per feature (CI time): small chunks with mixed steps (every chunk of
# a long prompt rides with the running decodes), pages of 16 with the longest-prefix-first order,
# retraction without the radix cache, and retraction with it under overlap and mixed chunks.
REAL_CONFIGS = {
    "chunk64_mixed_fcfs": dict(chunked_prefill_size=64, enable_mixed_chunk=True, schedule_policy="fcfs"),
    "page16_lpm": dict(page_size=16, schedule_policy="lpm", _total=16384),
    # without the prefix cache, a pool of a third of the workload's KV and an optimistic
    # new-token estimate: retracted requests prefill their whole prompts again
    "retraction_no_radix": dict(_total=4096, schedule_conservativeness=0.05, disable_radix_cache=True),
    # overlap scheduling with mixed chunks and retractions together (mixed chunks keep fewer
    # tokens in the pool: a smaller one forces the retractions)
    "overlap_mixed_retraction": dict(
        enable_overlap_schedule=True,
        chunked_prefill_size=64,
        enable_mixed_chunk=True,
        _total=1024,
        schedule_conservativeness=0.05,
    ),
}
NEAR_TIES_ALLOWED = NUM_REQS // 24
REAL_MAX_NEW = 32


@functools.cache
def real_workload() -> tuple[Item, ...]:
    from tests.helpers.hf_reference import make_prompts, make_shared_prefix_group

    # outputs up to 32 tokens: transformers' references (one prompt at a time, about 50 ms a
    # token on 2 cores, nearly all of it the model's own forward) are most of this module's time
    # where they are not yet cached (tests/helpers/hf_reference.py)
    items = build_workload(make_prompts, make_shared_prefix_group, seed=0, max_new=REAL_MAX_NEW)
    for it in items:  # the references run with EOS disabled
        it.params = {"ignore_eos": True}
    return tuple(items)


def reference_items() -> list[tuple[list[int], int]]:
    return [(it.prompt, it.max_new) for it in real_workload()]


REFERENCES_RUN = "hf-references:scheduler-exactness"  # computed early (tests/helpers/early_runs.py)


@pytest.fixture(scope="module")
def references():
    from tests.helpers.hf_reference import default_model_references_each

    early_runs.wait(REFERENCES_RUN)
    items = real_workload()
    refs = default_model_references_each(reference_items())
    return {it.rid: ref for it, ref in zip(items, refs)}


@pytest.fixture(scope="module")
def model_runner():
    from srt.model_executor.model_runner import ModelRunner

    args = ServerArgs(device="cpu", max_total_tokens=16384, max_running_requests=NUM_REQS).resolve()
    return ModelRunner(args)


def set_pools(runner, total: int, page_size: int) -> None:
    """Give the shared runner fresh KV pools of another size / page size (the model and the
    attention backend do not depend on them)."""
    from srt.mem_cache.allocator import TokenToKVPoolAllocator
    from srt.mem_cache.memory_pool import MHATokenToKVPool

    cfg = runner.model_config
    if runner.max_total_num_tokens == total and runner.page_size == page_size:
        return
    runner.token_to_kv_pool = None  # free the old buffers first
    runner.token_to_kv_pool = MHATokenToKVPool(
        total,
        page_size,
        runner.kv_cache_dtype,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.num_hidden_layers,
        runner.device,
    )
    runner.token_to_kv_pool_allocator = TokenToKVPoolAllocator(total, page_size, runner.device, debug=True)
    runner.page_size = page_size
    runner.max_total_num_tokens = total


@pytest.mark.early_run(REFERENCES_RUN, functools.partial(warm_command, reference_items))
@pytest.mark.parametrize("name", list(REAL_CONFIGS))
def test_token_exactness_default_model(name, model_runner, references):
    from tests.helpers.hf_reference import assert_tokens_match

    cfg = dict(REAL_CONFIGS[name])
    total = cfg.pop("_total", 16384)
    set_pools(model_runner, total, cfg.get("page_size", 1))
    args = ServerArgs(
        device="cpu", max_running_requests=NUM_REQS, max_total_tokens=total, enable_debug_checks=True, **cfg
    ).resolve()
    sched = Scheduler(args, model_runner)
    items = list(real_workload())
    out = drive(sched, items)
    near_ties = 0
    for it in items:
        ref = references[it.rid]
        near_ties += assert_tokens_match(out[it.rid], ref.token_ids, ref.top_logprobs)
    assert near_ties <= NEAR_TIES_ALLOWED, f"{near_ties} near-ties in {NUM_REQS} prompts"
    if "retraction" in name:
        assert sched.metrics.num_retractions > 0, "the small pool must force retractions"
    if "mixed" in name:
        assert sched.metrics.num_mixed_steps > 0
    if name.startswith("overlap"):
        assert sched.metrics.num_overlapped_steps > 0
    check_clean(sched)


def test_log_lines_have_sglang_shape(caplog):
    import logging
    import re

    sched = fake_scheduler(decode_log_interval=4)
    items = build_workload(_fake_prompts, _fake_group, seed=3)[:8]
    with caplog.at_level(logging.INFO, logger="srt.scheduler"):
        drive(sched, items)
    lines = [r.getMessage() for r in caplog.records if r.name == "srt.scheduler"]
    prefill = re.compile(
        r"^Prefill batch\. #new-seq: \d+, #new-token: \d+, #cached-token: \d+, token usage: \d\.\d\d, "
        r"#running-req: \d+, #queue-req: \d+$"
    )
    decode = re.compile(
        r"^Decode batch\. #running-req: \d+, #token: \d+, token usage: \d\.\d\d, "
        r"gen throughput \(token/s\): \d+\.\d\d, #queue-req: \d+$"
    )
    n_prefill = sum(bool(prefill.match(x)) for x in lines)
    n_decode = sum(bool(decode.match(x)) for x in lines)
    assert n_prefill == sched.metrics.num_prefill_steps > 0
    assert n_decode == sched.metrics.num_decode_steps // 4 > 0, "one decode line per 4 decode steps"
    check_clean(sched)

"""Acceptance: ModelRunner greedy tokens equal transformers' ``generate`` for each prompt alone.

Workload (``run_workload``): prompts of 5..400 tokens are admitted a few at a time and
prefilled in chunks (so later chunks extend on the sequence's own cached prefix); members of
a shared-prefix group start on their donor's cached KV (page-aligned common prefix copied
into req_to_token, only the rest extended); steps rotate between MIXED (prefill chunks + all
running decodes), DECODE-only and EXTEND-only batches, so decode batches mix sequences of
different lengths. KV slots come from the real allocator (debug checks on), with page sizes
1 and 16.

Checks: every sequence's 48 tokens equal transformers' greedy tokens for that prompt alone,
except explained near-ties (``assert_tokens_match``; at most one per 24 prompts); the
sampled tokens' logprobs equal transformers' log-softmax within 1e-3 (up to any near-tie);
a MIXED batch gives the same tokens (and logprobs) as the same work split into EXTEND and
DECODE batches. On the default SmolLM2 GGUF and on tiny random Llama (llama3 rope scaling),
Qwen2 and Qwen3 models against transformers with the same weights.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from srt.layers.forward_batch import ForwardMode
from srt.model_executor.model_runner import ModelRunner
from srt.server_args import ServerArgs
from tests.helpers import early_runs
from tests.helpers.hf_reference import (
    GreedyReference,
    assert_tokens_match,
    default_model_references,
    default_prompt_set,
    make_prompts,
    warm_command,
)
from tests.helpers.ref_cache import hf_folder_references
from tests.helpers.runner_driver import DriverSeq, RunnerDriver
from tests.helpers.tiny_models import TINY_KINDS, save_tiny_model
from tests.helpers.tolerance import REORDER_C, assert_reordered_close, reduction_len

MAX_NEW_TOKENS = 48
NUM_PROMPTS = 24
LOGPROB_ATOL = 1e-3
PAGE_SIZES = [1, 16]
CHUNK = 48  # prompt tokens per sequence per step: long prompts are prefilled in several chunks


def make_runner(model_path: str | None, page_size: int, max_total_tokens: int) -> ModelRunner:
    args = ServerArgs(
        model_path=model_path,
        dtype="float32",
        device="cpu",
        page_size=page_size,
        max_total_tokens=max_total_tokens,
        max_running_requests=64,
        enable_debug_checks=True,
    )
    return ModelRunner(args.resolve())


def pool_tokens_for(prompts: list[list[int]], page_size: int) -> int:
    per_seq = [-(-(len(p) + MAX_NEW_TOKENS) // page_size) * page_size for p in prompts]
    return sum(per_seq) + 4 * page_size


def share_lens(
    prompts: list[list[int]], groups: list[list[int]], page_size: int
) -> dict[int, tuple[int, int]]:
    """member -> (donor, page-aligned shared prefix length) for every non-first group member."""
    out = {}
    for g in groups:
        donor = g[0]
        for m in g[1:]:
            common = len(os.path.commonprefix([prompts[donor], prompts[m]]))
            share = min(common, len(prompts[m]) - 1) // page_size * page_size
            if share:
                out[m] = (donor, share)
    return out


def run_workload(
    driver: RunnerDriver,
    prompts: list[list[int]],
    groups: list[list[int]],
    chunk: int = CHUNK,
    extend_per_step: int = 2,
) -> list[DriverSeq]:
    """Drive every prompt to MAX_NEW_TOKENS outputs (see the module docstring)."""
    sharing = share_lens(prompts, groups, driver.runner.page_size)
    # donors first so that members can find their prefix
    waiting = sorted(range(len(prompts)), key=lambda i: (i in sharing, i))
    seqs: dict[int, DriverSeq] = {}
    prefilling: list[int] = []
    step = 0
    while waiting or any(not s.finished for s in seqs.values()):
        for i in list(waiting):
            if len(prefilling) >= extend_per_step:
                break
            if i in sharing:
                donor, share = sharing[i]
                if donor not in seqs or seqs[donor].kv_len < share:
                    continue
                seqs[i] = driver.add(prompts[i], MAX_NEW_TOKENS, seqs[donor], share)
            else:
                seqs[i] = driver.add(prompts[i], MAX_NEW_TOKENS)
            waiting.remove(i)
            prefilling.append(i)
        extends = [(seqs[i], min(chunk, seqs[i].prompt_left)) for i in prefilling]
        decodes = [s for s in seqs.values() if s.needs_decode]
        phase = step % 3
        if phase == 1 and decodes:
            driver.step([], decodes)
        elif phase == 2 and extends:
            driver.step(extends, [])
        else:
            driver.step(extends, decodes)
        prefilling = [i for i in prefilling if seqs[i].prompt_left > 0]
        step += 1
    return [seqs[i] for i in range(len(prompts))]


def check_against_reference(seqs: list[DriverSeq], refs: list[GreedyReference]) -> int:
    """Tokens (near-tie rule) and logprobs; returns the number of near-ties."""
    near_ties = 0
    for i, (seq, ref) in enumerate(zip(seqs, refs)):
        try:
            near_ties += assert_tokens_match(seq.output_ids, ref.token_ids, ref.top_logprobs)
        except AssertionError as e:
            raise AssertionError(f"prompt {i} ({len(seq.prompt)} tokens): {e}") from None
        for t, (a, b) in enumerate(zip(seq.output_ids, ref.token_ids)):
            if a != b:
                break
            assert abs(seq.output_logprobs[t] - ref.logprobs[t]) < LOGPROB_ATOL, (
                f"prompt {i} token {t}: logprob {seq.output_logprobs[t]} vs transformers {ref.logprobs[t]}"
            )
    return near_ties


def check_coverage(driver: RunnerDriver, seqs: list[DriverSeq]) -> None:
    """The workload really exercised what the test claims."""
    assert {ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED} <= set(driver.modes)
    assert sum(s.shared_len > 0 for s in seqs) >= 3
    assert any(len(s.prompt) > 2 * CHUNK for s in seqs)  # chunked: extends on the sequence's own prefix


def mixed_vs_split(runner: ModelRunner, prompts: list[list[int]]) -> None:
    """Same work, once with MIXED batches and once split into EXTEND + DECODE batches."""
    results = []
    for split in (False, True):
        driver = RunnerDriver(runner)
        a, b = (driver.add(p, 8) for p in prompts[:2])
        driver.step([(a, len(a.prompt)), (b, len(b.prompt))], [])
        driver.step([], [a, b])
        c, d = (driver.add(p, 8) for p in prompts[2:4])
        lps = []
        for ext in ([(c, len(c.prompt) - 5)], [(c, 5), (d, len(d.prompt))]):
            if split:
                lps.append(driver.step(ext, [])[1].next_token_logprobs)
                lps.append(driver.step([], [a, b])[1].next_token_logprobs)
            else:
                lps.append(driver.step(ext, [a, b])[1].next_token_logprobs)
        while not all(s.finished for s in (a, b, c, d)):
            driver.step([], [s for s in (a, b, c, d) if not s.finished])
        assert (ForwardMode.MIXED in driver.modes) != split
        results.append(([s.output_ids for s in (a, b, c, d)], torch.cat(lps)))
        driver.reset()
    (tok_mixed, lp_mixed), (tok_split, lp_split) = results
    assert tok_mixed == tok_split
    # the split run's logprobs come in (extend, decode) order; the mixed run's in the same order
    # the MIXED step's matmuls run more rows than the split steps': float32 sums in another order
    # (a logprob carries at most twice the logits' error)
    assert_reordered_close(lp_mixed, lp_split, reduction_len(runner.model_config.hf_config), c=2 * REORDER_C)


# ---------------------------------------------------------------- default model
def reference_items() -> list[tuple[list[int], int]]:
    prompts, _ = default_prompt_set(NUM_PROMPTS, seed=0, min_len=5, max_len=400)
    return [(p, MAX_NEW_TOKENS) for p in prompts]


REFERENCES_RUN = "hf-references:runner-exactness"  # computed early (tests/helpers/early_runs.py)


@pytest.fixture(scope="module")
def default_workload():
    early_runs.wait(REFERENCES_RUN)
    prompts, groups = default_prompt_set(NUM_PROMPTS, seed=0, min_len=5, max_len=400)
    refs = default_model_references(prompts, MAX_NEW_TOKENS)
    return prompts, groups, refs


@pytest.mark.early_run(REFERENCES_RUN, functools.partial(warm_command, reference_items))
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_default_model_matches_transformers(default_workload, page_size):
    prompts, groups, refs = default_workload
    assert len(prompts) >= 24 and min(map(len, prompts)) == 5 and max(map(len, prompts)) == 400
    runner = make_runner(None, page_size, pool_tokens_for(prompts, page_size))
    driver = RunnerDriver(runner)
    seqs = run_workload(driver, prompts, groups)
    check_coverage(driver, seqs)
    near_ties = check_against_reference(seqs, refs)
    print(f"default model, page size {page_size}: {near_ties} near-ties over {len(prompts)} prompts")
    assert near_ties <= len(prompts) // 24
    if page_size == PAGE_SIZES[-1]:
        driver.reset()
        mixed_vs_split(runner, make_prompts([40, 23, 70, 9], seed=5))


# ---------------------------------------------------------------- tiny random models
@pytest.fixture(scope="module", params=TINY_KINDS)
def tiny_model(request, tmp_path_factory):
    path = save_tiny_model(request.param, tmp_path_factory.mktemp(f"tiny-{request.param}"), seed=3)
    return request.param, path


def test_tiny_models_match_transformers(tiny_model):
    kind, path = tiny_model
    prompts, groups = default_prompt_set(NUM_PROMPTS, seed=1, min_len=5, max_len=400, vocab_size=320)
    refs = hf_folder_references(path, prompts, MAX_NEW_TOKENS)
    near_ties = 0
    for page_size in PAGE_SIZES:
        runner = make_runner(path, page_size, pool_tokens_for(prompts, page_size))
        driver = RunnerDriver(runner)
        seqs = run_workload(driver, prompts, groups)
        check_coverage(driver, seqs)
        near_ties += check_against_reference(seqs, refs)
        driver.reset()
        mixed_vs_split(runner, make_prompts([40, 23, 70, 9], seed=6, vocab_size=320))
    assert near_ties <= 1, f"{kind}: {near_ties} near-ties over {2 * len(prompts)} sequences"

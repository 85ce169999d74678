"""Sampler + SamplingBatchInfo + penalties: correctness of every filter, reproducibility, logprobs.

Run as a script for a micro-benchmark: ``python tests/unit/test_sampler.py``.
"""

from __future__ import annotations

import math
import random
import time

import pytest
import torch
from msgspec.structs import replace as msgspec_replace

from srt.layers import sampler as sampler_mod
from srt.layers.sampler import Sampler, counter_uniform
from srt.sampling import sampling_batch_info as sbi_mod
from srt.sampling.sampling_batch_info import SamplingBatchInfo, seed_to_int64
from srt.sampling.sampling_params import SamplingParams

SAMPLER = Sampler()


def make_info(
    params: list[SamplingParams],
    vocab: int,
    seeds: list[int] | None = None,
    output_ids: list[list[int]] | None = None,
    prompt_ids: list[list[int]] | None = None,
    eos: list[int] | None = None,
    step: list[int] | None = None,
) -> SamplingBatchInfo:
    bs = len(params)
    return SamplingBatchInfo.from_reqs(
        params,
        seeds if seeds is not None else list(range(bs)),
        output_ids if output_ids is not None else [[] for _ in range(bs)],
        prompt_ids,
        vocab,
        "cpu",
        eos_token_ids=eos,
        step=step,
    )


def sample(logits: torch.Tensor, params: list[SamplingParams], **kw) -> list[int]:
    return SAMPLER(logits, make_info(params, logits.shape[1], **kw)).next_token_ids.tolist()


def draw_many(logits_row: list[float], p: SamplingParams, n: int) -> list[int]:
    """n samples of one distribution: n rows with seeds 0..n-1 (position 0)."""
    logits = torch.tensor([logits_row], dtype=torch.float32).expand(n, -1).contiguous()
    return sample(logits, [p] * n)


def chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * q) ** 2 / (n * q) for c, q in zip(counts, probs) if q > 0)


# 99.9% quantiles of the chi-square distribution by degrees of freedom
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 6: 22.46, 7: 24.32}


# ---------------------------------------------------------------- noise
_M = (1 << 64) - 1


def _ref_fmix(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M
    return z ^ (z >> 31)


def _ref_uniform(seed: int, pos: int) -> float:
    h = _ref_fmix((_ref_fmix(seed & _M) + (pos + 1) * 0x9E3779B97F4A7C15) & _M)
    return ((h >> 11) + 0.5) / 2**53


def test_counter_uniform_is_splitmix64_of_seed_and_position() -> None:
    seeds = [0, 1, 42, 2**63 - 1, 2**63 + 5, 2**64 - 1, -7, 123456789]
    positions = [0, 1, 5, 1000, 7, 2**40, 3, 0]
    got = counter_uniform(torch.tensor([seed_to_int64(s) for s in seeds]), torch.tensor(positions)).tolist()
    assert got == [_ref_uniform(s, p) for s, p in zip(seeds, positions)]


def test_counter_uniform_is_uniform_and_keyed() -> None:
    n = 20000
    u = counter_uniform(torch.arange(n), torch.zeros(n, dtype=torch.int64))
    assert bool(((u > 0) & (u < 1)).all())
    hist = torch.histc(u.float(), bins=10, min=0, max=1).tolist()
    assert chi_square([int(h) for h in hist], [0.1] * 10) < 30
    v = counter_uniform(torch.zeros(n, dtype=torch.int64), torch.arange(n))
    assert len(set(v.tolist())) == n
    assert abs(float(v.mean()) - 0.5) < 0.01


# ---------------------------------------------------------------- greedy
def test_temperature_zero_is_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(16, 1000) * 5
    expect = logits.argmax(-1).tolist()
    assert sample(logits, [SamplingParams(temperature=0.0)] * 16) == expect
    assert sample(logits, [SamplingParams(temperature=1e-7)] * 16) == expect


def test_top_k_one_is_greedy() -> None:
    torch.manual_seed(1)
    logits = torch.randn(16, 1000)
    params = [SamplingParams(temperature=1.5, top_k=1)] * 16
    info = make_info(params, 1000)
    assert info.is_all_greedy
    assert SAMPLER(logits, info).next_token_ids.tolist() == logits.argmax(-1).tolist()


def test_greedy_rows_in_a_mixed_batch_are_argmax() -> None:
    torch.manual_seed(2)
    logits = torch.randn(8, 300) * 3
    params = [SamplingParams(temperature=0.0) if i % 2 else SamplingParams(top_k=10) for i in range(8)]
    info = make_info(params, 300)
    assert info.greedy_idx.tolist() == [1, 3, 5, 7] and info.topk_idx.tolist() == [0, 2, 4, 6]
    out = SAMPLER(logits, info).next_token_ids.tolist()
    assert [out[i] for i in (1, 3, 5, 7)] == logits.argmax(-1)[1::2].tolist()


def test_from_reqs_groups_rows_by_their_own_params() -> None:
    params = [
        SamplingParams(),
        SamplingParams(top_k=0),
        SamplingParams(top_k=5),
        SamplingParams(top_k=5000),
        SamplingParams(temperature=0),
        SamplingParams(top_k=1),
    ]
    info = make_info(params, 10000)
    assert info.greedy_idx.tolist() == [4, 5]
    assert info.topk_idx.tolist() == [2]
    assert info.full_idx.tolist() == [0, 1, 3]
    assert info.top_ks.tolist() == [10000, 10000, 5, 5000, 10000, 1]
    assert info.topk_max == 5 and info.full_needs_top_k
    assert info.temperatures.tolist()[4] == 1.0  # greedy rows never divide by 0
    assert not info.need_top_p and not info.need_min_p and info.adjustments.is_empty
    # a small vocab does not turn "top_k disabled" into a top-k row
    small = make_info([SamplingParams(), SamplingParams(top_k=299), SamplingParams(top_k=300)], 300)
    assert small.full_idx.tolist() == [0, 2] and small.topk_idx.tolist() == [1]


# ---------------------------------------------------------------- reproducibility
def _varied_requests(vocab: int, n: int, rng: random.Random) -> list[tuple[SamplingParams, int, list[int]]]:
    kinds = [
        SamplingParams(temperature=0.7),
        SamplingParams(top_k=20),
        SamplingParams(top_k=5, top_p=0.8, temperature=1.3),
        SamplingParams(top_p=0.9),
        SamplingParams(min_p=0.05, temperature=1.1),
        SamplingParams(top_k=1500, top_p=0.95),
        SamplingParams(temperature=0.9, frequency_penalty=0.4, presence_penalty=0.2, repetition_penalty=1.2),
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=50, min_new_tokens=5, stop_token_ids=[3]),
    ]
    reqs = []
    for i in range(n):
        out = [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))]
        reqs.append((kinds[i % len(kinds)], rng.randrange(2**64), out))
    return reqs


def test_fixed_seed_gives_same_tokens_in_any_batch_and_row() -> None:
    vocab, n = 2000, 27
    rng = random.Random(0)
    torch.manual_seed(3)
    reqs = _varied_requests(vocab, n, rng)
    logits = torch.randn(n, vocab) * 4
    prompts = [[rng.randrange(vocab) for _ in range(5)] for _ in range(n)]

    def run(order: list[int], extra: int = 0) -> dict[int, int]:
        fillers = _varied_requests(vocab, extra, random.Random(99))
        rows = [reqs[i] for i in order] + fillers
        lg = torch.cat([logits[order], torch.randn(extra, vocab) * 4])
        info = SamplingBatchInfo.from_reqs(
            [r[0] for r in rows],
            [r[1] for r in rows],
            [r[2] for r in rows],
            [prompts[i] for i in order] + [[1, 2]] * extra,
            vocab,
            "cpu",
            eos_token_ids=[0],
        )
        out = SAMPLER(lg, info).next_token_ids.tolist()
        return {order[j]: out[j] for j in range(len(order))}

    alone = {}
    for i in range(n):
        alone.update(run([i]))
    perm = list(range(n))
    rng.shuffle(perm)
    assert run(list(range(n))) == alone
    assert run(perm) == alone
    assert run(perm[:10], extra=40) == {i: alone[i] for i in perm[:10]}


def test_different_seeds_and_positions_give_different_tokens() -> None:
    logits = torch.zeros(200, 1000)  # uniform distribution
    by_seed = sample(logits, [SamplingParams()] * 200, seeds=list(range(200)))
    # 200 draws from 1000 equally likely tokens: ~181 distinct expected
    assert len(set(by_seed)) > 150
    by_pos = sample(logits, [SamplingParams()] * 200, seeds=[7] * 200, step=list(range(200)))
    assert len(set(by_pos)) > 150
    same = sample(logits, [SamplingParams()] * 200, seeds=[7] * 200, step=[5] * 200)
    assert len(set(same)) == 1


def test_step_defaults_to_number_of_output_tokens() -> None:
    logits = torch.zeros(4, 1000)
    outs = [[1] * k for k in range(4)]
    a = sample(logits, [SamplingParams()] * 4, seeds=[11] * 4, output_ids=outs)
    b = sample(logits, [SamplingParams()] * 4, seeds=[11] * 4, step=[0, 1, 2, 3])
    assert a == b


# ---------------------------------------------------------------- distributions
LOGITS8 = [1.0, 0.2, -0.5, 2.0, 0.0, -1.5, 0.7, 1.3]


def _softmax(xs: list[float], t: float = 1.0) -> list[float]:
    m = max(xs)
    e = [math.exp((x - m) / t) for x in xs]
    s = sum(e)
    return [v / s for v in e]


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_empirical_distribution_matches_softmax(temperature: float) -> None:
    draws = draw_many(LOGITS8, SamplingParams(temperature=temperature), 20000)
    counts = [draws.count(t) for t in range(8)]
    assert chi_square(counts, _softmax(LOGITS8, temperature)) < CHI2_999[7]


def test_top_k_distribution_is_renormalized_top_k() -> None:
    draws = draw_many(LOGITS8, SamplingParams(top_k=4), 20000)
    top4 = sorted(range(8), key=lambda t: -LOGITS8[t])[:4]
    assert set(draws) == set(top4)
    probs = _softmax([LOGITS8[t] for t in top4])
    assert chi_square([draws.count(t) for t in top4], probs) < CHI2_999[3]


def test_top_k_restricts_support_to_k_highest() -> None:
    torch.manual_seed(4)
    row = (torch.randperm(300).float() / 100).tolist()  # distinct logits in [0, 3)
    top = set(sorted(range(300), key=lambda t: -row[t])[:7])
    for k_params in (SamplingParams(top_k=7), SamplingParams(top_k=7, temperature=3.0)):
        draws = draw_many(row, k_params, 3000)
        assert set(draws) == top


def _four_token_row(vocab: int, ids: list[int], probs: list[float]) -> list[float]:
    row = [float("-inf")] * vocab
    for t, q in zip(ids, probs):
        row[t] = math.log(q)
    return row


FOUR_IDS = [150, 7, 299, 3]  # scattered ids: the draw order is token-id order, not probability order
FOUR_PROBS = [0.5, 0.3, 0.15, 0.05]


@pytest.mark.parametrize("top_k", [-1, 10])  # full-vocab path and top-k candidate path
@pytest.mark.parametrize(
    ("top_p", "nucleus"), [(0.4, 1), (0.79, 2), (0.81, 3), (0.94, 3), (0.96, 4), (1.0, 4)]
)
def test_top_p_keeps_the_smallest_nucleus(top_k: int, top_p: float, nucleus: int) -> None:
    row = _four_token_row(300, FOUR_IDS, FOUR_PROBS)
    draws = draw_many(row, SamplingParams(top_p=top_p, top_k=top_k), 6000)
    assert set(draws) == set(FOUR_IDS[:nucleus])
    if nucleus > 1:
        kept = FOUR_PROBS[:nucleus]
        probs = [q / sum(kept) for q in kept]
        assert chi_square([draws.count(t) for t in FOUR_IDS[:nucleus]], probs) < CHI2_999[nucleus - 1]


@pytest.mark.parametrize("top_k", [-1, 10])
@pytest.mark.parametrize(("min_p", "kept"), [(0.05, 4), (0.2, 3), (0.5, 2), (0.7, 1)])
def test_min_p_removes_tokens_below_min_p_times_max(top_k: int, min_p: float, kept: int) -> None:
    # thresholds: min_p * 0.5 = 0.025, 0.1, 0.25, 0.35
    row = _four_token_row(300, FOUR_IDS, FOUR_PROBS)
    draws = draw_many(row, SamplingParams(min_p=min_p, top_k=top_k), 4000)
    assert set(draws) == set(FOUR_IDS[:kept])


@pytest.mark.parametrize("max_rounds", [0, 1, 32])
def test_top_p_rejection_and_its_sort_fallback_sample_the_nucleus(monkeypatch, max_rounds: int) -> None:
    # nucleus of 0.5 is {0.3, 0.25}: the first draw is rejected 45% of the time
    monkeypatch.setattr(sampler_mod, "MAX_TOP_P_ROUNDS", max_rounds)
    ids, probs = [40, 2, 399, 77, 150], [0.3, 0.25, 0.2, 0.15, 0.1]
    row = _four_token_row(400, ids, probs)
    draws = draw_many(row, SamplingParams(top_p=0.5), 6000)
    assert set(draws) == {40, 2}
    assert chi_square([draws.count(40), draws.count(2)], [0.3 / 0.55, 0.25 / 0.55]) < CHI2_999[1]


def test_top_k_candidate_path_equals_full_vocab_path(monkeypatch) -> None:
    torch.manual_seed(6)
    logits = torch.randn(100, 3000) * 3
    params = [SamplingParams(top_k=40, temperature=0.9, min_p=0.02)] * 100
    info = make_info(params, 3000)
    assert info.topk_idx.numel() == 100
    base = SAMPLER(logits, info).next_token_ids.tolist()
    monkeypatch.setattr(sbi_mod, "TOPK_CANDIDATE_LIMIT", 0)
    info = make_info(params, 3000)
    assert info.full_idx.numel() == 100 and info.full_needs_top_k
    assert SAMPLER(logits, info).next_token_ids.tolist() == base


# ---------------------------------------------------------------- penalties and masks
def test_penalties_bias_and_masks_follow_their_definitions() -> None:
    vocab = 6
    base = [2.0, -1.0, 0.5, -0.5, 3.0, 0.0]
    params = [
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(repetition_penalty=2.0),
        SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0),
        SamplingParams(logit_bias={"1": 5.0, "5": -2.5}),
        SamplingParams(min_new_tokens=3, stop_token_ids=[2]),
        SamplingParams(min_new_tokens=3, stop_token_ids=[2]),
        SamplingParams(min_new_tokens=3, stop_token_ids=[2], ignore_eos=True),
        SamplingParams(),
    ]
    output_ids = [[0, 0, 3, 0], [1, 2, 2], [4, 4], [0], [1], [1, 1, 1], [], [0, 1, 2]]
    prompt_ids = [[4], [4, 1], [0], [1], [], [], [], [3]]
    info = make_info(params, vocab, output_ids=output_ids, prompt_ids=prompt_ids, eos=[5, 77])
    got = info.adjustments.apply_(torch.tensor([base] * len(params)))
    inf = float("inf")
    expect = [
        # OpenAI: l -= f*count + p*(count > 0), output tokens only (prompt token 4 untouched)
        [2.0 - 0.5 * 3 - 0.25, -1.0, 0.5, -0.5 - 0.5 - 0.25, 3.0, 0.0],
        # HF repetition: tokens {4, 1, 2} of prompt + output, each once: >0 divided, <0 multiplied
        [2.0, -1.0 * 2.0, 0.5 / 2.0, -0.5, 3.0 / 2.0, 0.0],
        # repetition first, then frequency (count 2 of token 4)
        [2.0 / 1.5, -1.0, 0.5, -0.5, 3.0 / 1.5 - 2 * 1.0, 0.0],
        [2.0, -1.0 + 5.0, 0.5, -0.5, 3.0, 0.0 - 2.5],
        # 1 of 3 min tokens: stop token 2 and eos 5 banned (eos 77 is outside the vocab)
        [2.0, -1.0, -inf, -0.5, 3.0, -inf],
        # min_new_tokens reached
        base,
        # ignore_eos: eos is not a stop, only the stop token is banned
        [2.0, -1.0, -inf, -0.5, 3.0, 0.0],
        base,
    ]
    torch.testing.assert_close(got, torch.tensor(expect), rtol=0, atol=1e-6)


def test_penalties_steer_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]])
    greedy = SamplingParams(temperature=0.0)
    assert sample(logits, [greedy], output_ids=[[1]]) == [1]
    assert sample(logits, [SamplingParams(temperature=0.0, presence_penalty=1.5)], output_ids=[[1]]) == [2]
    assert sample(logits, [SamplingParams(temperature=0.0, repetition_penalty=1.3)], output_ids=[[1]]) == [2]
    assert sample(logits, [SamplingParams(temperature=0.0, logit_bias={"3": 4.5})]) == [3]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_new_tokens_masks_eos_until_reached(temperature: float) -> None:
    eos = 2
    logits = torch.tensor([[0.0, 1.0, 50.0, 0.5]])
    p = SamplingParams(temperature=temperature, min_new_tokens=2)
    assert sample(logits, [p], output_ids=[[]], eos=[eos]) != [eos]
    assert sample(logits, [p], output_ids=[[1]], eos=[eos]) != [eos]
    assert sample(logits, [p], output_ids=[[1, 1]], eos=[eos]) == [eos]
    # stop_token_ids are banned too; ignore_eos leaves eos alone
    q = SamplingParams(temperature=temperature, min_new_tokens=2, stop_token_ids=[1], ignore_eos=True)
    logits2 = torch.tensor([[0.0, 50.0, 49.0, -9.0]])
    assert sample(logits2, [q], output_ids=[[]], eos=[eos]) == [eos]


def test_a_row_with_every_token_banned_still_gets_a_valid_token_id() -> None:
    vocab = 300  # not a multiple of the CDF block: the padding must never be returned
    ban_all = SamplingParams(min_new_tokens=1, stop_token_ids=list(range(vocab)))
    for p in (ban_all, msgspec_replace(ban_all, top_p=0.5), msgspec_replace(ban_all, top_k=5)):
        for t in (0.0, 1.0):
            q = msgspec_replace(p, temperature=t)
            out = sample(torch.randn(4, vocab), [q] * 4)
            assert all(0 <= t < vocab for t in out)


# ---------------------------------------------------------------- logprobs
def test_logprobs_are_log_softmax_of_raw_logits() -> None:
    torch.manual_seed(7)
    logits = torch.randn(5, 100) * 3
    raw = logits.clone()
    params = [
        SamplingParams(temperature=0.5, frequency_penalty=1.0),
        SamplingParams(top_k=3, repetition_penalty=1.8),
        SamplingParams(temperature=0.0, logit_bias={"9": 30.0}),
        SamplingParams(top_p=0.5, min_p=0.1),
        SamplingParams(),
    ]
    nums = [0, 3, 1, 5, 0]
    info = make_info(params, 100, output_ids=[[1, 2], [3], [], [4, 4], []], prompt_ids=[[5]] * 5)
    out = SAMPLER(logits, info, return_logprob=True, top_logprobs_nums=nums)
    assert torch.equal(logits, raw)  # input untouched
    ref = torch.log_softmax(raw, dim=-1)
    ids = out.next_token_ids
    assert ids.dtype == torch.int64 and ids.shape == (5,)
    assert ids[2].item() == 9  # the bias decided the greedy row, the logprob is still the raw one
    assert out.next_token_logprobs is not None and out.next_token_logprobs.dtype == torch.float32
    torch.testing.assert_close(out.next_token_logprobs, ref.gather(1, ids[:, None]).squeeze(1))
    assert out.top_logprobs is not None
    assert [len(t) for t in out.top_logprobs] == nums
    for i, n in enumerate(nums):
        vals, top_ids = ref[i].topk(n) if n else (torch.empty(0), torch.empty(0, dtype=torch.int64))
        assert [t for t, _ in out.top_logprobs[i]] == top_ids.tolist()
        torch.testing.assert_close(torch.tensor([lp for _, lp in out.top_logprobs[i]]), vals)


def test_no_logprobs_unless_asked() -> None:
    out = SAMPLER(torch.randn(3, 10), make_info([SamplingParams()] * 3, 10))
    assert out.next_token_logprobs is None and out.top_logprobs is None
    assert out.next_token_ids.shape == (3,)


# ---------------------------------------------------------------- micro-benchmark (not a test)
def _bench(bs: int = 256, vocab: int = 49152, reps: int = 5) -> None:
    torch.manual_seed(0)
    logits = torch.randn(bs, vocab) * 3
    outs = [list(range(i, i + 200)) for i in range(bs)]
    cases = {
        "greedy": SamplingParams(temperature=0),
        "temperature": SamplingParams(temperature=0.8),
        "top_k=50": SamplingParams(temperature=0.8, top_k=50),
        "top_k=40,top_p=0.9,min_p": SamplingParams(top_k=40, top_p=0.9, min_p=0.05),
        "top_p=0.9": SamplingParams(temperature=0.8, top_p=0.9),
        "penalties": SamplingParams(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.1),
    }
    print(f"bs={bs} vocab={vocab} threads={torch.get_num_threads()}")
    for name, p in cases.items():
        t0 = time.perf_counter()
        for _ in range(reps):
            info = SamplingBatchInfo.from_reqs([p] * bs, list(range(bs)), outs, None, vocab, "cpu")
        t1 = time.perf_counter()
        for _ in range(reps):
            SAMPLER(logits, info)
        t2 = time.perf_counter()
        print(
            f"{name:28s} from_reqs {1e3 * (t1 - t0) / reps:7.1f} ms   sample {1e3 * (t2 - t1) / reps:7.1f} ms"
        )


if __name__ == "__main__":
    _bench()

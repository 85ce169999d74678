"""bench_serving arithmetic on a synthetic timeline, the result block, arrivals, SSE and datasets."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from srt.bench_serving import first_errors, poisson_arrival_times
from srt.benchmark.backends import sse_data
from srt.benchmark.datasets import (
    load_jsonl_requests,
    sample_generated_shared_prefix_requests,
    sample_lengths,
    sample_random_requests,
    sample_sharegpt_requests,
    word_token_ids,
)
from srt.benchmark.metrics import (
    RequestOutput,
    calculate_metrics,
    format_result_block,
    parse_result_block,
    percentile,
    request_itl,
    request_tpot,
    request_ttft,
    throughput_timeline,
)

approx = pytest.approx


def _timeline() -> list[RequestOutput]:
    """Four requests; the third failed. Hand-computed figures are in the tests below."""
    return [
        # TTFT 0.25, ITL [0.05, 0.10, 0.05], E2E 0.5, TPOT (0.5 - 0.25) / 3
        RequestOutput(
            success=True,
            prompt_len=100,
            output_len=4,
            send_time=10.0,
            end_time=10.5,
            chunk_times=[10.25, 10.30, 10.40, 10.45],
            chunk_tokens=[1, 1, 1, 1],
        ),
        # TTFT 0.5, ITL [0.2], E2E 0.7, TPOT 0.2 / 1
        RequestOutput(
            success=True,
            prompt_len=50,
            output_len=2,
            send_time=10.1,
            end_time=10.8,
            chunk_times=[10.6, 10.8],
            chunk_tokens=[1, 1],
        ),
        RequestOutput(
            success=False, error="HTTP 500", prompt_len=999, output_len=0, send_time=10.1, end_time=10.2
        ),
        # TTFT 0.1, no ITL, E2E 0.1, no TPOT (one token)
        RequestOutput(
            success=True,
            prompt_len=10,
            output_len=1,
            send_time=10.2,
            end_time=10.3,
            chunk_times=[10.3],
            chunk_tokens=[1],
        ),
    ]


def test_per_request_figures():
    r = _timeline()[0]
    assert request_ttft(r.send_time, r.chunk_times) == approx(0.25)
    assert request_itl(r.chunk_times) == approx([0.05, 0.10, 0.05])
    assert r.latency == approx(0.5)
    assert request_tpot(r.latency, r.ttft, r.output_len) == approx(0.25 / 3)
    assert request_tpot(0.1, 0.1, 1) is None
    assert request_ttft(1.0, []) == 0.0 and request_itl([]) == []


def test_percentile_interpolates_linearly():
    assert percentile([0.1, 0.25, 0.5], 99) == approx(0.25 + 0.98 * 0.25)
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == approx(2.5)
    assert percentile([], 99) == 0.0


def test_aggregate_metrics_against_hand_computed_values():
    m = calculate_metrics(_timeline(), duration_s=1.0, retokenized_lens=[5, 2, 7, 1])
    assert (m.completed, m.failed) == (3, 1)
    assert m.total_input == 160 and m.total_output == 7
    assert m.total_output_retokenized == 8  # the failed request's 7 is not counted
    assert m.request_throughput == approx(3.0)
    assert m.input_throughput == approx(160.0)
    assert m.output_throughput == approx(7.0)
    assert m.total_throughput == approx(167.0)
    assert m.concurrency == approx(0.5 + 0.7 + 0.1)
    # E2E [0.5, 0.7, 0.1]
    assert m.mean_e2e_latency_ms == approx(1300 / 3)
    assert m.median_e2e_latency_ms == approx(500.0)
    assert m.p99_e2e_latency_ms == approx(500 + 0.98 * 200)
    # TTFT [0.25, 0.5, 0.1]
    assert m.mean_ttft_ms == approx(850 / 3)
    assert m.median_ttft_ms == approx(250.0)
    assert m.p99_ttft_ms == approx(250 + 0.98 * 250)
    # TPOT [1/12, 0.2] (the one-token request has none)
    assert m.mean_tpot_ms == approx((1000 / 12 + 200) / 2)
    assert m.median_tpot_ms == approx((1000 / 12 + 200) / 2)
    assert m.p99_tpot_ms == approx(1000 / 12 + 0.99 * (200 - 1000 / 12))
    # ITL [0.05, 0.10, 0.05, 0.2]
    assert m.mean_itl_ms == approx(100.0)
    assert m.median_itl_ms == approx(75.0)
    assert m.p95_itl_ms == approx(100 + 0.85 * 100)
    assert m.p99_itl_ms == approx(100 + 0.97 * 100)
    assert m.max_itl_ms == approx(200.0)
    assert m.cache_hit_rate is None


def test_cache_hit_rate_needs_every_request_to_report():
    outs = _timeline()
    outs[0].cached_tokens, outs[1].cached_tokens, outs[3].cached_tokens = 80, 40, 0
    assert calculate_metrics(outs, 1.0).cache_hit_rate == approx(120 / 160)
    outs[3].cached_tokens = None
    assert calculate_metrics(outs, 1.0).cache_hit_rate is None


def test_no_successful_request_gives_zeros_not_nan():
    m = calculate_metrics([RequestOutput(success=False, error="x")], 2.0)
    assert m.completed == 0 and m.failed == 1
    assert m.output_throughput == 0.0 and m.mean_ttft_ms == 0.0 and m.p99_itl_ms == 0.0


def test_throughput_timeline_bins_tokens():
    outs = _timeline()
    outs[0].chunk_tokens = [1, 1, 1, 3]  # a chunk that carried three tokens
    xs, ys = throughput_timeline(outs, start_time=10.0, bin_s=0.5)
    # chunk offsets: 0.25 0.30 0.40 0.45(x3) | 0.6 0.8 | 0.3 -> bin0: 1+1+1+3+1 = 7, bin1: 2
    assert xs == approx([0.0, 0.5])
    assert ys == approx([7 / 0.5, 2 / 0.5])
    assert throughput_timeline([], 0.0, 1.0) == ([], [])


def test_result_block_has_sglang_labels_and_parses_back():
    m = calculate_metrics(_timeline(), 1.0)
    text = "noise before\n" + format_result_block(m, "srt", math.inf, None) + "\ntrailer\n"
    assert "============ Serving Benchmark Result ============" in text
    parsed = parse_result_block(text)
    for label in (
        "Backend",
        "Traffic request rate",
        "Max request concurrency",
        "Successful requests",
        "Benchmark duration (s)",
        "Total input tokens",
        "Total generated tokens",
        "Request throughput (req/s)",
        "Input token throughput (tok/s)",
        "Output token throughput (tok/s)",
        "Total token throughput (tok/s)",
        "Concurrency",
        "Mean E2E Latency (ms)",
        "Median E2E Latency (ms)",
        "P99 E2E Latency (ms)",
        "Mean TTFT (ms)",
        "Median TTFT (ms)",
        "P99 TTFT (ms)",
        "Mean TPOT (ms)",
        "Median TPOT (ms)",
        "P99 TPOT (ms)",
        "Mean ITL (ms)",
        "Median ITL (ms)",
        "P99 ITL (ms)",
    ):
        assert label in parsed, label
    assert parsed["Backend"] == "srt"
    assert parsed["Traffic request rate"] == math.inf
    assert parsed["Max request concurrency"] == "not set"
    assert parsed["Successful requests"] == 3.0 and parsed["Failed requests"] == 1.0
    assert parsed["Output token throughput (tok/s)"] == approx(7.0)
    assert parsed["P99 TTFT (ms)"] == approx(495.0, abs=0.005)
    assert parsed["Median ITL (ms)"] == approx(75.0, abs=0.005)


def test_parse_takes_the_last_block_and_rejects_text_without_one():
    a = format_result_block(calculate_metrics(_timeline(), 1.0), "srt", 2.0, 8)
    b = format_result_block(calculate_metrics(_timeline(), 2.0), "vllm", 4.0, 32)
    parsed = parse_result_block(a + "\n" + b)
    assert parsed["Backend"] == "vllm" and parsed["Max request concurrency"] == 32.0
    assert parsed["Traffic request rate"] == 4.0
    assert parsed["Output token throughput (tok/s)"] == approx(3.5)
    with pytest.raises(ValueError):
        parse_result_block("Backend: srt\n")


def test_poisson_arrivals_statistics():
    rate, n = 4.0, 20000
    t = poisson_arrival_times(np.random.default_rng(0), n, rate)
    assert len(t) == n and t[0] == 0.0
    gaps = np.diff(t)
    assert (gaps >= 0).all()
    assert gaps.mean() == approx(1 / rate, rel=0.03)
    assert gaps.std() == approx(1 / rate, rel=0.05)  # exponential: std == mean
    counts = np.bincount(np.floor(np.asarray(t)).astype(int))[:-1]  # arrivals per whole second
    assert counts.mean() == approx(rate, rel=0.05)
    assert counts.var() == approx(rate, rel=0.15)  # Poisson counts: variance == mean
    assert poisson_arrival_times(np.random.default_rng(0), 50, rate) == t[:50]
    assert poisson_arrival_times(np.random.default_rng(1), 50, rate) != t[:50]


def test_infinite_rate_sends_everything_at_once_and_bad_rates_fail():
    assert poisson_arrival_times(np.random.default_rng(0), 5, math.inf) == [0.0] * 5
    assert poisson_arrival_times(np.random.default_rng(0), 0, 1.0) == []
    with pytest.raises(ValueError):
        poisson_arrival_times(np.random.default_rng(0), 5, 0.0)


def test_sse_data_lines():
    assert sse_data(b'data: {"a": 1}\n') == '{"a": 1}'
    assert sse_data("data:[DONE]") == "[DONE]"
    assert sse_data(b"\n") is None
    assert sse_data(": keep-alive") is None
    assert sse_data("event: message") is None


def test_first_errors_are_distinct_and_ordered():
    outs = [RequestOutput(success=False, error=e) for e in ("a", "b", "a", "c", "d")]
    outs.insert(1, RequestOutput(success=True))
    assert first_errors(outs) == ["a", "b", "c"]


class WordTokenizer:
    """A word-level stand-in for a BPE tokenizer: " word" is one token."""

    def __init__(self, words: list[str]) -> None:
        self.vocab = ["<s>", "</s>", "x1", "Ġ9z", "Ġé"] + [f"Ġ{w}" for w in words]
        self.index = {t: i for i, t in enumerate(self.vocab)}
        self.all_special_ids = [0, 1]

    def __len__(self) -> int:
        return len(self.vocab)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.vocab[i] for i in ids]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self.index["Ġ" + w] for w in text.split()]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(self.vocab[i].replace("Ġ", " ") for i in ids)


WORDS = ["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "theta"]


def test_sample_lengths_bounds():
    rng = np.random.default_rng(0)
    lens = sample_lengths(rng, 5000, 512, 1 / 16)
    assert min(lens) == 32 and max(lens) == 512
    assert sample_lengths(rng, 10, 7, 1.0) == [7] * 10
    assert min(sample_lengths(rng, 2000, 10, 0.0)) == 1
    with pytest.raises(ValueError):
        sample_lengths(rng, 1, 10, 1.5)


def test_word_tokens_exclude_specials_and_non_words():
    tok = WordTokenizer(WORDS)
    assert [tok.vocab[i] for i in word_token_ids(tok)] == [f"Ġ{w}" for w in WORDS]


def test_random_dataset_lengths_are_measured_and_seeded():
    tok = WordTokenizer(WORDS)
    rows = sample_random_requests(tok, np.random.default_rng(3), 20, 40, 16, 0.5)
    again = sample_random_requests(tok, np.random.default_rng(3), 20, 40, 16, 0.5)
    assert [r.prompt for r in rows] == [r.prompt for r in again]
    for r in rows:
        assert 20 <= r.prompt_len <= 40 and 8 <= r.output_len <= 16
        assert r.prompt_len == len(tok.encode(r.prompt)) and r.prompt_ids is None
    ids_rows = sample_random_requests(tok, np.random.default_rng(3), 20, 40, 16, 0.5, random_ids=True)
    for r in ids_rows:
        assert len(r.prompt_ids) == r.prompt_len and not set(r.prompt_ids) & {0, 1}


def test_jsonl_rows_in_file_order_cycled(tmp_path):
    tok = WordTokenizer(WORDS)
    path = tmp_path / "rows.jsonl"
    rows = [{"prompt": " ".join(WORDS[:3]), "output_len": 5}, {"prompt": WORDS[4], "output_len": 9}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    got = load_jsonl_requests(tok, str(path), 5)
    assert [(r.prompt, r.output_len) for r in got] == [
        (rows[i % 2]["prompt"], rows[i % 2]["output_len"]) for i in range(5)
    ]
    assert got[0].prompt_len == len(tok.encode(rows[0]["prompt"]))
    path.write_text(json.dumps({"prompt": 3, "output_len": 5}) + "\n")
    with pytest.raises(ValueError, match="rows.jsonl:1"):
        load_jsonl_requests(tok, str(path), 1)


def test_speculative_workloads_are_the_committed_files():
    """benchmarks/data/spec_*.jsonl are what benchmarks/spec_workloads.py writes (fixed seeds)."""
    from pathlib import Path

    from benchmarks import spec_workloads

    data = Path(spec_workloads.__file__).parent / "data"
    for name, rows in (
        ("spec_copy.jsonl", spec_workloads.copy_rows()),
        ("spec_free.jsonl", spec_workloads.free_rows()),
    ):
        committed = [json.loads(line) for line in (data / name).read_text().splitlines()]
        assert committed == rows, name


def test_generated_shared_prefix_groups_share_their_system_prompt():
    tok = WordTokenizer(WORDS)
    rows = sample_generated_shared_prefix_requests(tok, np.random.default_rng(0), 3, 4, 30, 5, 7)
    assert len(rows) == 12
    systems: dict[str, int] = {}
    for r in rows:
        system, question = r.prompt.split("\n\n")
        systems[system] = systems.get(system, 0) + 1
        assert len(tok.encode(system)) == 30 and len(tok.encode(question)) == 5
        assert r.prompt_len == 35 and r.output_len == 7
    assert sorted(systems.values()) == [4, 4, 4]
    # shuffled: the first group's prompts are not all at the front
    assert len({r.prompt.split("\n\n")[0] for r in rows[:4]}) > 1


def test_sharegpt_rows_filter_and_fixed_output_len(tmp_path):
    tok = WordTokenizer(WORDS)
    data = [
        {
            "conversations": [
                {"from": "human", "value": "alpha beta gamma delta"},
                {"from": "gpt", "value": "omega " * 6},
            ]
        },
        {
            "conversations": [
                {"from": "human", "value": "alpha beta"},
                {"from": "gpt", "value": "kappa " * 9},
            ]
        },  # short
        {
            "conversations": [{"from": "human", "value": "sigma " * 5}, {"from": "gpt", "value": "theta"}]
        },  # 1 token
        {"conversations": [{"from": "human", "value": "only one turn"}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    rows = sample_sharegpt_requests(tok, np.random.default_rng(0), str(path), 1)
    assert [(r.prompt_len, r.output_len) for r in rows] == [(4, 6)]
    fixed = sample_sharegpt_requests(tok, np.random.default_rng(0), str(path), 2, fixed_output_len=3)
    assert sorted((r.prompt_len, r.output_len) for r in fixed) == [(4, 3), (5, 3)]
    with pytest.raises(ValueError):
        sample_sharegpt_requests(tok, np.random.default_rng(0), str(path), 2)


def test_warmup_prompts_share_no_prefix_with_the_measured_ones():
    """The warm-up runs a measured prompt's shape of work, but a prefix cache cannot serve the
    measured request from it: its first token (ids) or its first words (text) differ."""
    from srt.bench_serving import _unshared
    from srt.benchmark.datasets import DatasetRow

    for ids in ([5, 9, 2], [9, 5, 2], [0, 0], [7]):
        row = DatasetRow(prompt="", prompt_len=len(ids), output_len=4, prompt_ids=ids)
        warm = _unshared(row, 0)
        assert warm.prompt_ids[0] != ids[0] and warm.prompt_ids[1:] == ids[1:] and warm.prompt_ids[0] >= 0
        assert len(warm.prompt_ids) == len(ids) and warm.output_len == 4
    text = _unshared(DatasetRow(prompt="The capital", prompt_len=2, output_len=4), 1)
    assert text.prompt.endswith("The capital") and not text.prompt.startswith("The capital")

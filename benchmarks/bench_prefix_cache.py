"""Offline throughput on a shared-prefix workload: radix prefix cache vs --disable-radix-cache.

Protocol: one process, one ModelRunner (the default model unless ``--model-path`` /
``--load-format`` say otherwise), driven through the real ``Scheduler`` in-process. Workload
(fixed seed): ``--groups`` groups x ``--per-group`` requests; the requests of a group share a
``--prefix-len``-token system prompt followed by their own ``--suffix-len``-token question; each
generates exactly ``--output-len`` tokens (greedy, EOS ignored). After a short warm-up, the
whole workload is submitted at once (``--max-running-requests`` 128: all of it may run at
once, in a 65536-token KV pool) and run to completion, first with the radix cache, then (same
runner, cache flushed) with ``--disable-radix-cache``. Throughput = generated tokens /
wall time of the run. ``hit_rate`` = prompt tokens served from the cache / prompt tokens of the
admitted requests, in the radix run.

Target: speedup >= 3 with the defaults (8 x 16 requests, 400-token prefix, 32 new tokens).

    python benchmarks/bench_prefix_cache.py [--groups 8 --per-group 16 --prefix-len 400 ...] [--json]

With ``--json`` the last output line is ``{"radix_tok_s": .., "no_radix_tok_s": .., "speedup": ..,
"hit_rate": ..}``.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from srt.managers.io_struct import TokenizedGenerateReqInput
from srt.managers.scheduler import Scheduler
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs


def make_workload(groups: int, per_group: int, prefix_len: int, suffix_len: int, vocab: int, seed: int):
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    for _ in range(groups):
        prefix = [rng.randrange(100, vocab) for _ in range(prefix_len)]
        for _ in range(per_group):
            prompts.append(prefix + [rng.randrange(100, vocab) for _ in range(suffix_len)])
    rng.shuffle(prompts)  # groups interleave in arrival order
    return prompts


def run(sched: Scheduler, prompts: list[list[int]], output_len: int, tag: str) -> tuple[float, int]:
    """Submit every prompt, run to completion; returns (seconds, generated tokens)."""
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        sched.handle_message(TokenizedGenerateReqInput(rid=f"{tag}{i}", input_ids=p, sampling_params=params))
    generated = 0
    for out in sched.run_until_idle():
        generated += sum(len(x) for x in out.output_ids)
    return time.perf_counter() - t0, generated


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--per-group", type=int, default=16)
    ap.add_argument("--prefix-len", type=int, default=400)
    ap.add_argument("--suffix-len", type=int, default=24)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument(
        "--max-running-requests", type=int, default=128, help="default: the whole workload at once"
    )
    ap.add_argument("--max-total-tokens", type=int, default=65536, help="KV pool (tokens)")
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    a = ap.parse_args()

    from srt.model_executor.model_runner import ModelRunner

    base = dict(
        model_path=a.model_path,
        load_format=a.load_format,
        device="cpu",
        max_total_tokens=a.max_total_tokens,
        max_running_requests=a.max_running_requests,
        num_threads=a.num_threads,
        log_level="warning",
    )
    runner = ModelRunner(ServerArgs(**base).resolve())
    vocab = runner.model_config.vocab_size
    prompts = make_workload(a.groups, a.per_group, a.prefix_len, a.suffix_len, vocab, a.seed)
    warm = make_workload(1, 2, 32, 8, vocab, a.seed + 1)

    results: dict[str, tuple[float, int]] = {}
    hit_rate = 0.0
    for name, disable in (("radix", False), ("no_radix", True)):
        sched = Scheduler(ServerArgs(**base, disable_radix_cache=disable).resolve(), runner)
        run(sched, warm, 4, "warm")
        assert sched.flush_cache().success
        sched.metrics.num_admitted_input_tokens = sched.metrics.num_admitted_cached_tokens = 0
        secs, generated = run(sched, prompts, a.output_len, name)
        results[name] = (secs, generated)
        if not disable:
            hit_rate = sched.metrics.cache_hit_rate
        assert sched.flush_cache().success
        print(f"{name:>9}: {generated} tokens in {secs:.1f} s = {generated / secs:.2f} tok/s")

    radix = results["radix"][1] / results["radix"][0]
    no_radix = results["no_radix"][1] / results["no_radix"][0]
    print(f"speedup {radix / no_radix:.2f}x, cache hit rate {hit_rate:.3f}")
    if a.json:
        print(
            json.dumps(
                {
                    "radix_tok_s": round(radix, 2),
                    "no_radix_tok_s": round(no_radix, 2),
                    "speedup": round(radix / no_radix, 3),
                    "hit_rate": round(hit_rate, 4),
                }
            )
        )


if __name__ == "__main__":
    main()

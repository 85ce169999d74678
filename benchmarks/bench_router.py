"""The router's cost: ``srt.bench_serving`` against one srt worker directly, then through SGLang's
router (``sglang-router``) in front of that worker alone, then in front of two workers, in one run
on the same workload (seeded random prompts, concurrency 8, streamed, greedy, ignore_eos).

    python benchmarks/bench_router.py [--num-prompts 32] [--input-len 128] [--output-len 64]
                                      [--policy round_robin] [--concurrency 8]

Prints TTFT p50 and output tok/s of each setup and the router's TTFT p50 overhead against the
worker alone (acceptance: at most +10% at concurrency 8).

Read the figures for what they are: on a small CPU machine (2 cores here) the two workers share
the same cores, so the two-worker row measures the router's overhead and the cost of splitting
batches, not scaling; the router-to-one-worker row isolates the router's own cost (one extra
loopback hop and its re-serialization of each request). Scaling needs one machine (or one GPU)
per worker.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import cpu_model  # noqa: E402
from tests.helpers.router import RouterProcess, router_unavailable  # noqa: E402
from tests.helpers.server import DEFAULT_TEST_ARGS, ServerProcess  # noqa: E402


def bench(base_url: str, args: argparse.Namespace) -> dict:
    """One srt.bench_serving run; its JSON result line."""
    with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as f:
        out = f.name
    cmd = [
        sys.executable, "-m", "srt.bench_serving", "--base-url", base_url,
        "--dataset-name", "random", "--num-prompts", str(args.num_prompts),
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--random-range-ratio", "1.0", "--max-concurrency", str(args.concurrency),
        "--seed", "1", "--warmup-requests", "2", "--flush-cache", "--disable-tqdm",
        "--output-file", out,
    ]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        line = json.loads(f.readlines()[-1])
    os.unlink(out)
    if line.get("failed"):
        raise RuntimeError(f"{line['failed']} requests failed: {line.get('errors')}")
    return line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--policy", default="round_robin")
    args = p.parse_args(argv)
    if (why := router_unavailable()) is not None:
        print(why)
        return 1
    a, b = ServerProcess(DEFAULT_TEST_ARGS), ServerProcess(DEFAULT_TEST_ARGS)
    rows = []
    try:
        a.launch(), b.launch()
        a.wait_ready(), b.wait_ready()
        rows.append(("worker alone (direct)", bench(a.base_url, args)))
        with RouterProcess([a.base_url], policy=args.policy) as router:
            rows.append(("router -> the same worker", bench(router.base_url, args)))
        with RouterProcess([a.base_url, b.base_url], policy=args.policy) as router:
            rows.append(("router -> two workers", bench(router.base_url, args)))
    finally:
        a.stop(), b.stop()
    print(f"CPU: {cpu_model()} ({os.cpu_count()} CPUs); policy {args.policy}; concurrency {args.concurrency}; "
          f"{args.num_prompts} prompts of {args.input_len} -> {args.output_len} tokens")  # fmt: skip
    base = rows[0][1]["median_ttft_ms"]
    print(f"{'setup':28s} {'TTFT p50 (ms)':>14s} {'vs direct':>10s} {'output tok/s':>13s}")
    for name, r in rows:
        ttft = r["median_ttft_ms"]
        print(f"{name:28s} {ttft:14.1f} {100 * (ttft / base - 1):+9.1f}% {r['output_throughput']:13.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""CPU cost of the scheduler itself: microseconds per decode step at 1 / 64 / 256 / 1024 running requests.

Protocol: the real ``Scheduler`` (policy, batch building, ``ForwardBatch`` + sampling-info
construction, result processing, output messages) with the real ``ReqToTokenPool``,
``TokenToKVPoolAllocator`` and ``RadixCache``, driving a no-op model runner that returns a fixed
token instantly. For each batch size N: N requests (distinct 32-token prompts, greedy,
``ignore_eos``, long ``max_new_tokens``) are admitted; once all N are decoding, ``--steps`` decode
steps are timed one by one with ``time.perf_counter``; the reported figure is the median step
(the mean is printed too). Single process, fixed inputs; the model's cost is excluded by design.

Target: <= 1000 us per decode step at 256 running requests.

With ``--waiting W1,W2,..`` it also times a burst: 256 request rows (``--burst-running``) and W more
requests waiting, every request asking for 4-32 new tokens, so each step some finish and the
next are admitted from the queue; the median and mean of ``--steps`` steps of any kind (prefill
or decode) are reported with the queue's length before and after. What this adds to the decode
table is the cost of reading a long waiting queue in the policy's order (``--schedule-policy``).

    python benchmarks/bench_scheduler_overhead.py [--sizes 1,64,256,1024] [--steps 200] [--json]
    python benchmarks/bench_scheduler_overhead.py --sizes 256 --waiting 0,10000,60000

With ``--json`` the last output line is ``{"per_step_us": {"1": .., "64": .., "256": .., "1024": ..}}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace

import torch

from srt.layers.forward_batch import ForwardBatch
from srt.layers.sampler import SampleOutput
from srt.managers.io_struct import TokenizedGenerateReqInput
from srt.managers.scheduler import Scheduler
from srt.mem_cache.allocator import TokenToKVPoolAllocator
from srt.mem_cache.memory_pool import ReqToTokenPool
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs

PROMPT_LEN = 32
VOCAB = 32000
TOKEN = 17  # what the no-op model always "generates"


class NoOpModelRunner:
    """The attributes the scheduler reads from a ModelRunner, with real pools and no model."""

    def __init__(
        self, max_total_tokens: int, max_running_requests: int, context_len: int, page_size: int
    ) -> None:
        self.device = "cpu"
        self.page_size = page_size
        self.model_config = SimpleNamespace(vocab_size=VOCAB, eos_token_ids=[2], context_len=context_len)
        self.max_total_num_tokens = max_total_tokens
        self.max_running_requests = max_running_requests
        self.req_to_token_pool = ReqToTokenPool(max_running_requests + 8, context_len, "cpu")
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(max_total_tokens, page_size, "cpu")

    def forward_batch_generation(self, forward_batch: ForwardBatch):
        ids = torch.full((forward_batch.batch_size,), TOKEN, dtype=torch.int64)
        return SimpleNamespace(next_token_logits=None), SampleOutput(next_token_ids=ids)


def measure(n: int, steps: int, page_size: int) -> tuple[float, float]:
    """(median, mean) microseconds per decode step with n running requests."""
    context_len = PROMPT_LEN + steps + 64
    max_new = steps + 32
    runner = NoOpModelRunner(n * (PROMPT_LEN + max_new + page_size), n, context_len, page_size)
    args = ServerArgs(
        device="cpu",
        max_running_requests=n,
        page_size=page_size,
        max_prefill_tokens=1 << 20,
        log_level="warning",
    ).resolve()
    sched = Scheduler(args, runner)
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    for i in range(n):
        prompt = [(i * 131 + j * 7) % (VOCAB - 10) + 10 for j in range(PROMPT_LEN)]
        sched.handle_message(TokenizedGenerateReqInput(rid=f"r{i}", input_ids=prompt, sampling_params=params))
    while len(sched.running) < n:
        sched.step()
    for _ in range(3):  # warm-up decode steps
        sched.step()
    times: list[float] = []
    for _ in range(steps):
        t0 = time.perf_counter()
        sched.step()
        times.append(time.perf_counter() - t0)
    assert len(sched.running) == n, "every request must still be decoding"
    return statistics.median(times) * 1e6, statistics.fmean(times) * 1e6


def measure_burst(n: int, waiting: int, steps: int, policy: str) -> tuple[float, float, int, int]:
    """(median, mean) microseconds per step of any kind with n request rows and ``waiting`` more
    requests queued, and the queue's length before and after the timed steps."""
    total = n + waiting
    runner = NoOpModelRunner(n * (PROMPT_LEN + 64), n, PROMPT_LEN + 64, 1)
    args = ServerArgs(
        device="cpu", max_running_requests=n, schedule_policy=policy, log_level="warning"
    ).resolve()
    sched = Scheduler(args, runner)
    for i in range(total):
        params = SamplingParams(max_new_tokens=4 + i % 29, temperature=0.0, ignore_eos=True)
        prompt = [(i * 131 + j * 7) % (VOCAB - 10) + 10 for j in range(8 + i % 25)]
        sched.handle_message(TokenizedGenerateReqInput(rid=f"r{i}", input_ids=prompt, sampling_params=params))
    while len(sched.running) < n:
        sched.step()
    before = len(sched.waiting_queue)
    times: list[float] = []
    for _ in range(steps):
        t0 = time.perf_counter()
        sched.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6, statistics.fmean(times) * 1e6, before, len(sched.waiting_queue)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,64,256,1024", help="running-request counts to measure")
    ap.add_argument("--steps", type=int, default=200, help="timed decode steps per size")
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--waiting", default="", help="queue lengths of the burst table (none: no burst)")
    ap.add_argument("--burst-running", type=int, default=256, help="request rows in the burst")
    ap.add_argument("--schedule-policy", default="spf", help="the burst's queue order")
    args = ap.parse_args()
    torch.set_num_threads(1)
    result: dict[str, float] = {}
    print(f"{'running':>8} {'median us/step':>15} {'mean us/step':>13} {'us/req':>8}")
    for n in (int(x) for x in args.sizes.split(",")):
        med, mean = measure(n, args.steps, args.page_size)
        result[str(n)] = round(med, 1)
        print(f"{n:>8} {med:>15.1f} {mean:>13.1f} {med / n:>8.2f}")
    burst: dict[str, float] = {}
    if args.waiting:
        n, pol = args.burst_running, args.schedule_policy
        print(f"\nburst, {n} rows, --schedule-policy {pol}")
        print(f"{'waiting':>8} {'median us/step':>15} {'mean us/step':>13} {'queue after':>12}")
        for w in (int(x) for x in args.waiting.split(",")):
            med, mean, before, after = measure_burst(n, w, args.steps, pol)
            burst[str(w)] = round(med, 1)
            print(f"{before:>8} {med:>15.1f} {mean:>13.1f} {after:>12}")
    if args.json:
        print(json.dumps({"per_step_us": result} | ({"burst_per_step_us": burst} if burst else {})))


if __name__ == "__main__":
    main()

"""Resident memory of srt serving a full KV pool, against its weights plus its pool.

Protocol:
  1. start ``python -m srt.launch_server --model-path M [SERVER FLAGS]`` as compare_servers.py
     does (``running``: a process group of its own, holding every srt process: the HTTP process,
     the scheduler, the detokenizer, multiprocessing's resource tracker), until ``/health`` answers;
  2. read the scheduler's state in ``/get_server_info``: the weights (``weight_bytes``), the KV
     pool (``kv_pool_bytes``, ``max_total_num_tokens``), the vocabulary; and each process's
     resident memory when idle;
  3. fill the pool: ``--num-requests`` concurrent ``/generate`` requests of random token ids
     (fixed seed), each of ``--input-len`` tokens (0: the pool's share, pool / n - output - 16)
     and ``--output-len`` new tokens (``ignore_eos``), while a thread sums VmRSS over the group
     every ``--interval-s`` and keeps the peak;
  4. print per process idle / after / high-water mark (VmHWM), the sampled group peak and
     ``peak / (weights + pool)``, the figure the docs hold to 1.15x; ``--json`` adds one JSON
     line.

    python benchmarks/bench_memory.py --model-path M [--num-requests 8] [--input-len 0]
        [--output-len 16] [--interval-s 0.1] [--json] -- [server flags, e.g. --max-total-tokens 4096]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script
    sys.path.insert(0, str(REPO))

from benchmarks.common import cpu_model  # noqa: E402
from benchmarks.compare_servers import running, srt_spec  # noqa: E402
from benchmarks.server_stats import group_pids  # noqa: E402

MIB = 1 << 20


def fill_input_len(pool_tokens: int, num_requests: int, output_len: int, page: int = 16) -> int:
    """Prompt tokens per request so that the requests together fill the pool (a page of slack each)."""
    return max(1, pool_tokens // num_requests - output_len - page)


def peak_ratio(peak_bytes: int, weight_bytes: int, kv_pool_bytes: int) -> float:
    return round(peak_bytes / (weight_bytes + kv_pool_bytes), 3)


def process_memory(pgid: int) -> dict[int, dict]:
    """pid -> {"cmd", "rss_mib", "hwm_mib"} for every process of the group."""
    out = {}
    for pid in group_pids(pgid):
        try:
            with open(f"/proc/{pid}/status") as f:
                st = dict(line.split(":", 1) for line in f if ":" in line)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:70]
        except OSError:
            continue
        kib = {k: int(st[k].split()[0]) for k in ("VmRSS", "VmHWM")}
        out[pid] = {"cmd": cmd, "rss_mib": kib["VmRSS"] // 1024, "hwm_mib": kib["VmHWM"] // 1024}
    return out


def _get(port: int, path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return json.loads(r.read() or b"{}")


def _generate(port: int, ids: list[int], output_len: int) -> None:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": output_len, "ignore_eos": True}}
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=7200) as r:
        r.read()


def run(args: argparse.Namespace) -> dict:
    spec = srt_spec(args.model_path, args.port, "", args.server_flags)
    with running(spec, args.port, Path(args.log), args.interval_s) as (_, rss):
        info = _get(args.port, "/get_server_info")
        state = info["internal_states"][0]  # the scheduler's (one data-parallel rank)
        pool_tokens = int(state["max_total_num_tokens"])
        input_len = args.input_len or fill_input_len(pool_tokens, args.num_requests, args.output_len)
        vocab = int(state["vocab_size"])
        time.sleep(2)
        idle = process_memory(rss.pgid)
        rng = random.Random(args.seed)
        prompts = [[rng.randrange(100, vocab) for _ in range(input_len)] for _ in range(args.num_requests)]
        rss.peak = rss.sample()  # the fill's peak, not the start-up's
        t0 = time.perf_counter()
        threads = [threading.Thread(target=_generate, args=(args.port, p, args.output_len)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - t0
        rss.sample()
        after = process_memory(rss.pgid)
    weights, pool = int(state["weight_bytes"]), int(state["kv_pool_bytes"])
    return {
        "cpu": cpu_model(),
        "model_path": args.model_path,
        "server_flags": args.server_flags,
        "pool_tokens": pool_tokens,
        "requests": args.num_requests,
        "input_len": input_len,
        "output_len": args.output_len,
        "seconds": round(seconds, 1),
        "weight_mib": weights // MIB,
        "kv_pool_mib": pool // MIB,
        "processes": {pid: {**after.get(pid, {}), "idle_mib": idle[pid]["rss_mib"]} for pid in idle},
        "group_peak_mib": rss.peak // MIB,
        "peak_over_weights_plus_pool": peak_ratio(rss.peak, weights, pool),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--input-len", type=int, default=0, help="0: the pool's share per request")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--interval-s", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--port", type=int, default=31877)
    p.add_argument("--log", default="/tmp/srt_bench_memory.log")
    p.add_argument("--json", action="store_true")
    p.add_argument("server_flags", nargs="*", help="after --: flags for srt.launch_server")
    args = p.parse_args()
    r = run(args)
    print(
        f"# {r['cpu']}; {r['requests']} requests of {r['input_len']} + {r['output_len']} tokens in {r['seconds']} s"
    )
    print(f"weights {r['weight_mib']} MiB, KV pool {r['kv_pool_mib']} MiB ({r['pool_tokens']} tokens)")
    print("  pid  idle MiB  after MiB  peak (VmHWM) MiB  command")
    for pid, m in r["processes"].items():
        print(
            f"{pid:>6} {m['idle_mib']:>9} {m.get('rss_mib', 0):>10} {m.get('hwm_mib', 0):>17}  {m.get('cmd', '')}"
        )
    print(f"group peak {r['group_peak_mib']} MiB = {r['peak_over_weights_plus_pool']}x (weights + pool)")
    if args.json:
        print(json.dumps(r))


if __name__ == "__main__":
    main()

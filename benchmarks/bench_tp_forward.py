"""Decode step time with tensor parallelism: ``--tp-size`` ranks of ``--threads-per-rank``
threads each (gloo on 127.0.0.1, one spawned process per rank) against the same model on one
rank; bench_forward's protocol (random KV of ``--context`` tokens, one DECODE forward per step,
median of ``--repeats`` after a warm-up; timed = ``ModelRunner.forward``, no sampling).

The tp=1 figures come twice: as configured (the native decode-layer call where it applies) and
layer by layer (``--disable-native-decode-layers``, which TP forces). Also times the collectives alone: one gloo all_reduce of a decode step's ``[bs, hidden]``
activations, and the number of collectives a decode step makes (2 per layer, 1 for the
embedding, 1 gather of the logits), which is what TP adds to a step on one host.

    python benchmarks/bench_tp_forward.py [--tp-size 2] [--threads-per-rank 1] [--batch-sizes 1,32]
        [--quantization auto|gguf|none] [--json]

Why TP=2 is slower than TP=1 on one 2-core host with gloo (measured: a decode step spends most of its
time inside the collectives): a decode step makes 62 blocking collectives on the default model
(30 layers x 2 all_reduces, the embedding's, the logits gather), each a gloo round trip over TCP
loopback plus a wait for the slower rank (the ranks are uneven: 2 and 1 of the 3 KV heads);
the native one-call decode path is off under TP; and splitting the matmuls across processes
adds no memory bandwidth over splitting them across 2 threads of one process, while each rank
still pays the full per-op Python/dispatch cost. TP pays off when one device cannot hold or
feed the model, not for a small model on a few cores.

Output: one line per (configuration, batch size); ``--json`` adds one JSON object as the last
line (``tp1_ms``, ``tpN_ms``, ``allreduce_us`` per batch size).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_forward import _decode_batch, _fill_context, _median_ms  # noqa: E402

from srt.model_executor.model_runner import ModelRunner  # noqa: E402
from srt.server_args import ServerArgs  # noqa: E402


def _server_args(
    a: argparse.Namespace, tp_size: int, threads: int, native_off: bool = False, gloo: bool = False
) -> ServerArgs:
    bs = max(int(x) for x in a.batch_sizes.split(","))
    args = ServerArgs(
        model_path=a.model_path,
        max_total_tokens=bs * (a.context + 1) + 64,
        max_running_requests=bs,
        num_threads=threads,
        quantization=a.quantization,
        disable_native_decode_layers=native_off,
        disable_custom_all_reduce=gloo,
    ).resolve()
    return dataclasses.replace(args, tp_size=tp_size)  # ServerArgs refuses tp > 1 until launch supports it


def decode_times(
    a: argparse.Namespace,
    tp_size: int,
    threads: int,
    tp_rank: int = 0,
    native_off: bool = False,
    gloo: bool = False,
) -> dict[str, float]:
    """Median decode step (ms) per batch size on this rank (``gloo``: TP collectives over gloo,
    not shared memory)."""
    runner = ModelRunner(_server_args(a, tp_size, threads, native_off, gloo), tp_rank=tp_rank)
    sizes = [int(x) for x in a.batch_sizes.split(",")]
    rows = _fill_context(runner, max(sizes), a.context, 0)
    out = {}
    for bs in sizes:
        fb = _decode_batch(runner, rows[:bs], a.context)
        out[str(bs)] = _median_ms(lambda fb=fb: runner.forward(fb), a.repeats)
        runner.token_to_kv_pool_allocator.free(fb.out_cache_loc)
    return out


def allreduce_us(sizes: list[int], hidden: int, reduce, repeats: int = 200) -> dict[str, float]:
    """Median microseconds of ``reduce(x)`` for x ``[bs, hidden]`` per batch size."""
    out = {}
    for bs in sizes:
        x = torch.randn(bs, hidden)
        reduce(x)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            reduce(x)
            times.append(time.perf_counter() - t)
        out[str(bs)] = statistics.median(times) * 1e6
    return out


def _rank(rank: int, a: argparse.Namespace, port: int, queue) -> None:
    from srt.distributed import TPInfo

    torch.set_num_threads(a.threads_per_rank)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=a.tp_size)
    try:
        times = decode_times(a, a.tp_size, a.threads_per_rank, rank)
        times_gloo = decode_times(a, a.tp_size, a.threads_per_rank, rank, gloo=True)
        sizes = [int(x) for x in a.batch_sizes.split(",")]
        shm = TPInfo(rank, a.tp_size).with_shared_memory("cpu")
        comm = allreduce_us(sizes, a.hidden, dist.all_reduce)
        comm_shm = allreduce_us(sizes, a.hidden, shm.all_reduce)
        if rank == 0:
            queue.put((times, times_gloo, comm, comm_shm))
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--quantization", default="auto", choices=["auto", "gguf", "none"])
    ap.add_argument("--tp-size", type=int, default=2)
    ap.add_argument("--threads-per-rank", type=int, default=1)
    ap.add_argument(
        "--tp-threads", type=int, default=0, help="threads of the tp=1 runs (default: all ranks' threads)"
    )
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    threads_tp1 = a.tp_threads if a.tp_threads else a.tp_size * a.threads_per_rank
    tp1 = decode_times(a, 1, threads_tp1)
    tp1_layers = decode_times(a, 1, threads_tp1, native_off=True)
    a.hidden = _hidden(a)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, a, port, queue)) for r in range(a.tp_size)]
    for p in procs:
        p.start()
    tpn, tpn_gloo, comm, comm_shm = queue.get(timeout=1800)
    for p in procs:
        p.join()
    for bs in tp1:
        print(
            f"decode bs={bs:>3} ctx={a.context}: tp=1 x {threads_tp1} threads {tp1[bs]:7.1f} ms "
            f"(layer by layer {tp1_layers[bs]:7.1f} ms) | tp={a.tp_size} x {a.threads_per_rank} thread(s) "
            f"{tpn[bs]:7.1f} ms shared memory, {tpn_gloo[bs]:7.1f} ms gloo (one all_reduce of "
            f"[{bs}, {a.hidden}]: {comm_shm[bs]:.0f} us shared memory, {comm[bs]:.0f} us gloo)"
        )
    if a.json:
        result = {
            "tp1_ms": tp1,
            "tp1_layer_by_layer_ms": tp1_layers,
            f"tp{a.tp_size}_ms": tpn,
            f"tp{a.tp_size}_gloo_ms": tpn_gloo,
            "allreduce_us": comm_shm,
            "allreduce_gloo_us": comm,
        }
        print(json.dumps(result))


def _hidden(a: argparse.Namespace) -> int:
    from srt.configs.model_config import ModelConfig

    return ModelConfig.from_server_args(_server_args(a, 1, 1)).hidden_size


if __name__ == "__main__":
    main()

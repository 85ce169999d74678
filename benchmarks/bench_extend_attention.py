"""Extend (prefill) attention alone on bf16 activations: the native kernel as srt runs it, the same
kernel on the values widened to float32, and torch's bf16 SDPA.

Protocol (fixed seeds; ``--shape`` picks the attention as in bench_decode_attention.py: the
default ``qwen2.5-1.5b`` 12 query heads, 2 KV heads, head dim 128):
  * ``--batches``: comma-separated batches of new sequences without a cached prefix, ``N`` one
    sequence of N tokens, ``NxB`` B sequences of N tokens each (one call for all of them, as
    ``fused_cpu`` makes it); random bf16 q [T, H, D] and K / V [T, H_kv, D];
  * (a) ``native``: ``torch.ops.srt_cpu.extend_attention`` on the bf16 tensors, ``isa=""``: the
        AVX512-BF16 kernel (both products on vdpbf16ps) where the CPU's vdpbf16ps is fast, the
        widened float32 kernel elsewhere (the ``kernel`` column says which);
    (b) ``widened``: the same op on ``.float()`` copies (the copies timed too: the float32 kernel
        as srt ran bf16 before the AVX512-BF16 kernel);
    (c) ``sdpa``: ``F.scaled_dot_product_attention(is_causal=True)`` per sequence in bf16, K / V
        repeated over each GQA group (``--no-sdpa`` skips it);
  * one call per layer's worth; median of ``--repeats`` calls after one warm-up;
  * FLOPs: 4 x H x D x (keys each query sees, summed) (causal: N (N + 1) / 2 a sequence), and,
    for scale, the bf16 matmul rate measured in the same run (a [512, 2048] @ [2048, 2048] bf16
    matmul: srt's bf16 linear or torch's, the best).

    python benchmarks/bench_extend_attention.py [--shape NAME] [--batches 512,2048,256x8,64x32]
        [--repeats 7] [--no-sdpa] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from bench_decode_attention import SHAPES
from common import _time_matmul, cpu_model

from srt.kernels.cpu import kernel_status, load


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def parse_batch(spec: str) -> list[int]:
    n, _, b = spec.partition("x")
    return [int(n)] * int(b or 1)


def kernel_name(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, desc: list[torch.Tensor], scale: float
) -> str:
    """Which kernel ``isa=""`` ran: the AVX512-BF16 one gives the same bits as asking for it."""
    op = torch.ops.srt_cpu.extend_attention
    try:
        dot = op(q, k, v, *desc, scale, "avx512_bf16")
    except RuntimeError:
        return "float32"
    return "avx512_bf16" if torch.equal(op(q, k, v, *desc, scale, ""), dot) else "float32"


def bench_batch(
    spec: str, h: int, hkv: int, d: int, g: torch.Generator, repeats: int, with_sdpa: bool, rate: float
) -> str:
    """One row of the table: the batch ``spec`` (``N`` or ``NxB``) through the three paths."""
    lens = parse_batch(spec)
    t = sum(lens)
    q = torch.randn(t, h, d, generator=g).bfloat16()
    k = torch.randn(t, hkv, d, generator=g).bfloat16()
    v = torch.randn(t, hkv, d, generator=g).bfloat16()
    starts = torch.tensor([sum(lens[:i]) for i in range(len(lens))], dtype=torch.int64)
    n = torch.tensor(lens, dtype=torch.int64)
    desc = [starts, starts, n, n]
    flops = sum(4.0 * h * d * x * (x + 1) / 2 for x in lens)
    scale = d**-0.5
    op = torch.ops.srt_cpu.extend_attention

    def sdpa() -> None:
        for s0, x in zip(starts.tolist(), lens, strict=True):
            qq = q[s0 : s0 + x].transpose(0, 1)
            kk = k[s0 : s0 + x].transpose(0, 1).repeat_interleave(h // hkv, 0)
            vv = v[s0 : s0 + x].transpose(0, 1).repeat_interleave(h // hkv, 0)
            F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale)

    nat = median_ms(lambda: op(q, k, v, *desc, scale, ""), repeats)
    wid = median_ms(lambda: op(q.float(), k.float(), v.float(), *desc, scale, ""), repeats)
    sd = median_ms(sdpa, repeats) if with_sdpa else float("nan")

    def cell(ms: float) -> str:
        return f"{ms:8.2f} ({flops / ms / 1e6:5.0f})"

    return (
        f"{spec:>8} {kernel_name(q, k, v, desc, scale):>12} {cell(nat):>16} {cell(wid):>16} {cell(sd):>16}"
        f" {wid / nat:>8.2f} {flops / nat / 1e6 / (rate / 1e9):>8.2f}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=list(SHAPES), default="qwen2.5-1.5b", help="the model whose attention")
    p.add_argument("--batches", default="512,2048,256x8,64x32")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--no-sdpa", action="store_true", help="skip torch's SDPA")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not load(build_if_missing=True) or not hasattr(torch.ops.srt_cpu, "extend_attention"):
        raise SystemExit(f"the native kernels are unavailable: {kernel_status()}")
    shape = SHAPES[args.shape]
    h, hkv, d = shape.heads, shape.kv_heads, shape.head_dim
    print(f"cpu: {cpu_model()}; torch {torch.__version__}; threads {torch.get_num_threads()}")
    print(f"kernel: {kernel_status()}")
    rate = _time_matmul(512, 2048, 2048, 0.3, torch.bfloat16)
    print(f"bf16 matmul rate ([512, 2048] @ [2048, 2048]): {rate / 1e9:.1f} GFLOP/s")
    print(f"shape {args.shape}: H={h} H_kv={hkv} D={d}; ms per call (one layer), GFLOP/s in brackets")
    print(
        f"{'batch':>8} {'kernel':>12} {'native':>16} {'widened':>16} {'sdpa':>16} {'wid/nat':>8} {'nat/rate':>8}"
    )
    g = torch.Generator().manual_seed(0)
    for spec in args.batches.split(","):
        print(bench_batch(spec, h, hkv, d, g, args.repeats, not args.no_sdpa, rate))


if __name__ == "__main__":
    main()

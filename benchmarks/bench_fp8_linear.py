"""FP8 matmuls alone: srt's fp8 linear (``fp8_linear`` on ``pack_fp8_weight``'s one-byte codes,
widened to bf16 in cache) against the same codes in bf16 panels (``bf16_linear``, two bytes a
weight: what FP8 layers hold on a CPU without AVX512-VBMI), with a scale a row (outside the op) and
with a scale a block of 128 x 128 (applied as the codes widen), on a Llama-3.1-8B layer's shapes,
bf16 activations.

Protocol (fixed seeds, random finite e4m3 codes): the shapes and the weight cycling of
benchmarks/bench_w8a8_linear.py (enough copies to exceed ``--cycle-mib``, so weights come from
DRAM); the best of ``--repeats`` passes; ``GB/s``: the one-byte codes over the time (M = 1: of the
read bandwidth measured in the same run); ``bf16/fp8``: the bf16 panels' time over the fp8 op's.

    python benchmarks/bench_fp8_linear.py [--ms 1,8,64,256] [--repeats 3] [--cycle-mib 256]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO_ROOT = str(Path(__file__).resolve().parents[1])
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from benchmarks.bench_w8a8_linear import SHAPES, best_time  # noqa: E402
from benchmarks.common import format_table, memory_read_bandwidth  # noqa: E402

BLOCK = 128


def fp8_codes(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", default="1,8,64,256")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cycle-mib", type=float, default=256.0)
    args = ap.parse_args()
    from srt.kernels.cpu import native_available

    ops = torch.ops.srt_cpu
    if not (native_available() and ops.fp8_fast_blocks()):
        raise SystemExit(
            "the fp8 linear's vector widening needs the native kernels, AVX512-VBMI and AVX512-BF16"
        )
    gen = torch.Generator().manual_seed(0)
    bw = memory_read_bandwidth()["bandwidth_gbs"]
    rows = []
    for name, (n, k) in SHAPES.items():
        count = max(2, int(args.cycle_mib * 2**20 // (n * k)))
        codes = [fp8_codes(n, k, gen) for _ in range(count)]
        plain = [ops.pack_fp8_weight(c) for c in codes]
        grid = (-(-n // BLOCK), -(-k // BLOCK))
        blocks = [ops.pack_fp8_weight(c, torch.rand(grid, generator=gen) * 1e-3, BLOCK, BLOCK) for c in codes]
        bf16 = [ops.pack_bf16_weight(c.to(torch.bfloat16)) for c in codes[: max(2, count // 2)]]
        del codes
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, generator=gen).bfloat16()
            t_fp8 = best_time(lambda w, x=x, n=n: ops.fp8_linear(x, w, n, None, ""), plain, args.repeats)
            t_blk = best_time(lambda w, x=x, n=n: ops.fp8_linear(x, w, n, None, ""), blocks, args.repeats)
            t_bf16 = best_time(lambda w, x=x, n=n: ops.bf16_linear(x, w, n, None, ""), bf16, args.repeats)
            gbs, gbs_blk = n * k / t_fp8 / 1e9, n * k / t_blk / 1e9
            of = (lambda g: f" ({g / bw:.2f})") if m == 1 else (lambda g: "")
            rows.append([name, f"{n}x{k}", m, f"{t_fp8 * 1e3:.2f}", f"{gbs:.1f}{of(gbs)}", f"{t_blk * 1e3:.2f}",
                         f"{gbs_blk:.1f}{of(gbs_blk)}", f"{t_bf16 * 1e3:.2f}", f"{t_bf16 / t_fp8:.2f}"])  # fmt: skip
    print(f"read bandwidth {bw:.1f} GB/s, {torch.get_num_threads()} threads")
    header = [
        "layer",
        "N x K",
        "M",
        "fp8 ms",
        "GB/s (of bw)",
        "blocks ms",
        "GB/s (of bw)",
        "bf16 ms",
        "bf16/fp8",
    ]
    print(format_table(header, rows))


if __name__ == "__main__":
    main()

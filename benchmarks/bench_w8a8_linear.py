"""W8A8 matmuls alone: srt's int8 kernel (``gguf_linear_w8a8`` on ``gguf_pack_w8a8``'s groups:
activations quantized per token inside it, integer dot products) against the float32 path those
layers take without it (``gguf_linear`` on Q8_0 blocks of the same codes, after per-token fake
quantization), on a Llama-3.1-8B layer's shapes.

Protocol (fixed seeds, random int8 codes, one scale a row):
  * shapes [N, K]: qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336; M rows of x;
  * each implementation cycles over enough copies of its weight to exceed ``--cycle-mib``
    (default 256 MiB, beyond the last-level cache), so weights come from DRAM as in serving;
    the best of ``--repeats`` passes;
  * ``GB/s``: the int8 weight's bytes over its time (M = 1: against the read bandwidth measured in
    the same run, ``torch.sum`` of 1 GiB); ``GOP/s``: 2 M N K over the time; ``int8/float``: the
    float path's time over the int8 kernel's.

    python benchmarks/bench_w8a8_linear.py [--ms 1,8,64,256] [--repeats 3] [--cycle-mib 256]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = str(Path(__file__).resolve().parents[1])
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from benchmarks.common import format_table, memory_read_bandwidth  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def q8_0_rows(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Q8_0 bytes of random int8 codes with one float16 scale a row (every block carries it)."""
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    scale = (torch.rand(n, 1, generator=gen) * 0.01 + 1e-3).half().expand(n, k // 32).contiguous()
    blocks = [scale.view(torch.uint8).view(n, k // 32, 2), codes.view(torch.uint8).view(n, k // 32, 32)]
    return torch.cat(blocks, 2).reshape(n, -1).contiguous()


def best_time(fn, copies: list, repeats: int) -> float:
    fn(copies[0])
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for c in copies:
            fn(c)
        best = min(best, (time.perf_counter() - t0) / len(copies))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", default="1,8,64,256")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cycle-mib", type=float, default=256.0)
    args = ap.parse_args()
    from srt.kernels.cpu import gguf, native_available
    from srt.layers.linear import fake_quant_rows

    if not (native_available() and gguf.w8a8_fast()):
        raise SystemExit("the int8 kernel's vector path needs the native kernels and AVX-512 VNNI")
    ops = torch.ops.srt_cpu
    gen = torch.Generator().manual_seed(0)
    bw = memory_read_bandwidth()["bandwidth_gbs"]
    rows = []
    for name, (n, k) in SHAPES.items():
        count = max(2, int(args.cycle_mib * 2**20 // (n * k)))
        q8 = [q8_0_rows(n, k, gen) for _ in range(count)]
        packed = [ops.gguf_pack_w8a8(d) for d in q8]
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, generator=gen)
            t_int8 = best_time(
                lambda w, x=x, n=n: ops.gguf_linear_w8a8(x, w, n, None, ""), packed, args.repeats
            )
            t_float = best_time(
                lambda w, x=x: ops.gguf_linear(fake_quant_rows(x, "int8"), w, 8, None), q8, args.repeats
            )
            gbs = n * k / t_int8 / 1e9
            rows.append([name, f"{n}x{k}", m, f"{t_int8 * 1e3:.2f}", f"{gbs:.1f}" + (f" ({gbs / bw:.2f})" if m == 1 else ""),
                         f"{2 * m * n * k / t_int8 / 1e9:.0f}", f"{t_float * 1e3:.2f}", f"{t_float / t_int8:.2f}"])  # fmt: skip
    print(f"read bandwidth {bw:.1f} GB/s, {torch.get_num_threads()} threads")
    header = ["layer", "N x K", "M", "int8 ms", "GB/s (of bw)", "GOP/s", "float ms", "int8/float"]
    print(format_table(header, rows))


if __name__ == "__main__":
    main()

"""W8A8 matmuls alone: srt's int8 kernel (``gguf_linear_w8a8``: activations quantized per token
inside it, integer dot products) in each weight layout of ``gguf_pack_w8a8`` (``groups``: the AVX-512
VNNI kernel's; ``amx``: panels for brgemm on AMX-INT8 tiles, with a VNNI loop below
``SRT_W8A8_AMX_M`` rows), against the float32 path those layers take without it (``gguf_linear`` on
Q8_0 blocks of the same codes, after per-token fake quantization; ``--float``), on a Llama-3.1-8B
layer's shapes.

Protocol (fixed seeds, random int8 codes, one scale a row):
  * shapes [N, K]: qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336; M rows of x;
  * each implementation cycles over enough copies of its weight to exceed ``--cycle-mib``
    (default 256 MiB, beyond the last-level cache), so weights come from DRAM as in serving;
    the best of ``--repeats`` passes;
  * per layout: ms, ``GB/s`` the int8 weight's bytes over its time (M = 1: against the read
    bandwidth measured in the same run, ``torch.sum`` of 1 GiB), ``GOP/s`` 2 M N K over the time;
    the first layout's time over each other's; ``float/int8``: the float path's time over the
    first layout's.

    python benchmarks/bench_w8a8_linear.py [--ms 1,8,64,256] [--layouts groups,amx] [--float]
        [--repeats 3] [--cycle-mib 256]
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
    ap.add_argument("--layouts", default="", help="default: groups, and amx where the CPU has AMX-INT8")
    ap.add_argument("--float", action="store_true", help="also time the float32 path")
    args = ap.parse_args()
    from srt.kernels.cpu import native_available, w8a8
    from srt.layers.linear import fake_quant_rows

    if not (native_available() and w8a8.w8a8_fast()):
        raise SystemExit("the int8 kernel's vector path needs the native kernels and AVX-512 VNNI")
    ops = torch.ops.srt_cpu
    gen = torch.Generator().manual_seed(0)
    layouts = args.layouts.split(",") if args.layouts else ["groups"] + (["amx"] if w8a8.w8a8_amx() else [])
    bw = memory_read_bandwidth()["bandwidth_gbs"]
    rows = []
    for name, (n, k) in SHAPES.items():
        count = max(2, int(args.cycle_mib * 2**20 // (n * k)))
        q8 = [q8_0_rows(n, k, gen) for _ in range(count)]
        packed = {lay: [ops.gguf_pack_w8a8(d, lay) for d in q8] for lay in layouts}
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, generator=gen)
            row: list = [name, f"{n}x{k}", m]
            times = []
            for lay in layouts:
                t = best_time(
                    lambda w, x=x, n=n: ops.gguf_linear_w8a8(x, w, n, None, ""), packed[lay], args.repeats
                )
                gbs = n * k / t / 1e9
                row += [f"{t * 1e3:.2f}", f"{gbs:.1f}" + (f" ({gbs / bw:.2f})" if m == 1 else ""), f"{2 * m * n * k / t / 1e9:.0f}"]  # fmt: skip
                times.append(t)
            row += [f"{times[0] / t:.2f}" for t in times[1:]]
            if args.float:
                t_float = best_time(
                    lambda w, x=x: ops.gguf_linear(fake_quant_rows(x, "int8"), w, 8, None), q8, args.repeats
                )
                row += [f"{t_float * 1e3:.2f}", f"{t_float / times[0]:.2f}"]
            rows.append(row)
        del packed
    print(f"read bandwidth {bw:.1f} GB/s, {torch.get_num_threads()} threads")
    header = ["layer", "N x K", "M"]
    for lay in layouts:
        header += [f"{lay} ms", "GB/s (of bw)", "GOP/s"]
    header += [f"{layouts[0]}/{lay}" for lay in layouts[1:]]
    header += ["float ms", f"float/{layouts[0]}"] if args.float else []
    print(format_table(header, rows))


if __name__ == "__main__":
    main()

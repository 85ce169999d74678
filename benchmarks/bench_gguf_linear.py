"""Quantized linear layers alone: ``torch.ops.srt_cpu.gguf_linear`` against float32.

Protocol (fixed seeds, random GGUF blocks with finite scales):
  * shapes [N, K] of the default model (SmolLM2-135M: qkv 960x576, o 576x576, gate_up 3072x576,
    down 576x1536 as Q4_1; the tied LM head 49152x576 as Q8_0) and of a 7B Llama (4096x4096,
    11008x4096; Q4_1 and, when the K-quant kernels are built, Q4_K / Q6_K), M rows of x;
  * every implementation cycles over enough copies of its weight to exceed ``--cycle-mib``
    (default 96 MiB, beyond the last-level cache), so weights come from DRAM as in serving;
  * (a) ``q``: ``gguf_linear`` on the GGUF rows; (b) ``f32 small``: ``srt_cpu.small_batch_linear``
    on the dequantized float32 weight (M <= 16 only); (c) ``f32 onednn``: oneDNN's prepacked
    float32 linear (``mkldnn._linear_pointwise`` on ``_reorder_linear_weight``);
    the fastest of repeated calls after a warm-up (on a shared machine the median catches other
    processes' time slices; the weight copies keep every call reading from DRAM);
  * bound (M = 1): quantized weight bytes / the read bandwidth measured in this run (``torch.sum``
    of a 1 GiB float32 tensor, best of 5); ``GB/s`` is the weight bytes over q's time;
  * ``--packed``: also (e) ``f32 packed``: srt's own float32 kernel (``packed_linear`` on
    ``pack_linear_weight`` of the dequantized weight: the float32 copies ``--gguf-float32-rows``
    keeps), against ``q model``, the kernel the model runs on the blocks (``gguf_linear_x8`` on
    the x8 layout for Q4_0 / Q4_1 / Q8_0, ``gguf_linear`` otherwise); ``q/packed`` above 1 means
    the copy is faster (where it crosses 1 sets ``--gguf-float32-rows``);
  * ``--q8a``: also (d) ``q8a``: ``gguf_linear_q8a`` (activations quantized to int8 blocks, integer
    dot products) on the same weight copies, and ``q/q8a``, gguf_linear's time over q8a's
    (``--no-f32`` skips (b) and (c));
  * ``--x8-a24``: for Q4_0 / Q4_1 (the 7B shapes in Q4_0 too), (f) the x8 layout's two decode
    paths at every M: ``gguf_linear_x8`` on float32 lanes (the process runs with
    ``SRT_GGUF_X8_A24_M=0``, so it never switches) and ``gguf_linear_x8_a24`` (24-bit activations,
    integer dot products), and ``f32/a24``, the first's time over the second's. A small
    ``--cycle-mib`` (8) keeps the weights in the last-level cache: the kernels' compute speed.

    python benchmarks/bench_gguf_linear.py [--ms 1,4,8,16,32,64,300] [--shapes default,7b]
        [--threads N] [--cycle-mib 96] [--q8a] [--packed] [--no-f32] [--x8-a24]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

REPO_ROOT = str(Path(__file__).resolve().parents[1])
if REPO_ROOT not in sys.path:  # run as a script: make `tests` importable
    sys.path.insert(0, REPO_ROOT)

from benchmarks.common import cpu_model, read_bandwidth_gbs  # noqa: E402
from srt.kernels.cpu import kernel_status, load  # noqa: E402
from srt.kernels.cpu.gguf import (  # noqa: E402
    QTYPE_NAMES,
    dequantize,
    native_qtypes,
    pack_x8,
    q8a_qtypes,
    x8_a24_qtypes,
    x8_qtypes,
)
from tests.helpers.gguf_models import random_code_blocks as random_blocks  # noqa: E402

DEFAULT_SHAPES = [("qkv", 960, 576, 3), ("o", 576, 576, 3), ("gate_up", 3072, 576, 3), ("down", 576, 1536, 3)]
DEFAULT_SHAPES += [("lm_head", 49152, 576, 8)]
SEVEN_B = [("7b_q", 4096, 4096), ("7b_up", 11008, 4096)]


def timeit(fns: list[Callable[[], object]], min_time: float = 0.3, max_reps: int = 200) -> float:
    """Fastest seconds per call, cycling through ``fns`` (one per weight copy)."""
    for f in fns[:2]:
        f()
    times: list[float] = []
    total, i = 0.0, 0
    while (total < min_time or len(times) < 5) and len(times) < max_reps:
        f = fns[i % len(fns)]
        start = time.perf_counter()
        f()
        dt = time.perf_counter() - start
        times.append(dt)
        total += dt
        i += 1
    return min(times)


def copies(nbytes: int, cycle_bytes: int) -> int:
    return max(1, min(64, -(-cycle_bytes // max(nbytes, 1))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,4,8,16,32,64,300")
    ap.add_argument("--shapes", default="default,7b")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--cycle-mib", type=int, default=96)
    ap.add_argument("--q8a", action="store_true", help="also time gguf_linear_q8a (int8 activations)")
    ap.add_argument("--no-f32", action="store_true", help="skip the float32 baselines (b) and (c)")
    ap.add_argument("--packed", action="store_true", help="also time srt's packed float32 kernel (e)")
    ap.add_argument(
        "--x8-a24", action="store_true", help="also time the x8 layout's float and 24-bit paths (f)"
    )
    args = ap.parse_args()
    if args.x8_a24:  # read once by the kernels: gguf_linear_x8 stays on its float32 lanes at every M
        os.environ["SRT_GGUF_X8_A24_M"] = "0"
    if args.threads:
        torch.set_num_threads(args.threads)
    load()
    if not {2, 3, 8} <= native_qtypes():
        raise SystemExit(f"native gguf ops unavailable: {kernel_status()}")
    if args.q8a and not q8a_qtypes():
        raise SystemExit(f"gguf_linear_q8a unavailable: {kernel_status()}")
    ms = [int(m) for m in args.ms.split(",")]
    shapes = []
    if "default" in args.shapes:
        shapes += DEFAULT_SHAPES
    if "7b" in args.shapes:
        qs = ([2] if args.x8_a24 else []) + [3] + [q for q in (12, 14) if q in native_qtypes()]
        shapes += [(name, n, k, q) for name, n, k in SEVEN_B for q in qs]
    cycle = args.cycle_mib << 20
    bw = read_bandwidth_gbs() * 1e9
    print(f"# {cpu_model()}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"# {kernel_status()}")
    print(f"# read bandwidth (torch.sum of 1 GiB f32): {bw / 1e9:.1f} GB/s")
    hdr = f"{'shape':>8} {'N x K':>12} {'type':>5} {'M':>4} {'q ms':>8} {'f32 small':>9} {'f32 onednn':>10}"
    hdr += f" {'q/onednn':>8} {'GB/s':>6} {'bound ms':>8}"
    hdr += f" {'q8a ms':>8} {'q/q8a':>6} {'q8a GB/s':>8}" if args.q8a else ""
    hdr += f" {'q model':>8} {'f32 packed':>10} {'q/packed':>8}" if args.packed else ""
    print(hdr + (f" {'x8 f32':>8} {'x8 a24':>8} {'f32/a24':>7} {'a24 GB/s':>8}" if args.x8_a24 else ""))
    for name, n, k, q in shapes:
        data = random_blocks(n, k, q)
        w = dequantize(data, q, k)
        qcopies = [data.clone() for _ in range(copies(data.numel(), cycle))]
        packed = []
        if not args.no_f32:
            fcopies = [w.clone() for _ in range(copies(w.numel() * 4, cycle))]
            packed = [torch.ops.mkldnn._reorder_linear_weight(c, 32) for c in fcopies]
            del fcopies
        versus = packed_weights(data, w, q, cycle) if args.packed else None
        x8 = _clones(pack_x8(data, q), cycle) if args.x8_a24 and q in x8_a24_qtypes() else None
        for m in ms:
            x = torch.randn(m, k)
            tq = timeit([partial(torch.ops.srt_cpu.gguf_linear, x, d, q, None) for d in qcopies])
            ts = to = float("nan")
            if m <= 16 and packed:
                fc = [w.clone() for _ in range(len(packed))]
                ts = timeit([partial(torch.ops.srt_cpu.small_batch_linear, x, c, None) for c in fc])
                del fc
            if packed:
                to = timeit(
                    [partial(torch.ops.mkldnn._linear_pointwise, x, p, None, "none", [], "") for p in packed]
                )
            gbs = data.numel() / tq / 1e9
            bound = data.numel() / bw * 1e3
            line = (
                f"{name:>8} {f'{n}x{k}':>12} {QTYPE_NAMES[q]:>5} {m:>4} {tq * 1e3:8.3f} {ts * 1e3:9.3f}"
                f" {to * 1e3:10.3f} {tq / to:8.2f} {gbs:6.1f} {bound:8.3f}"
            )
            if args.q8a:
                t8 = timeit([partial(torch.ops.srt_cpu.gguf_linear_q8a, x, d, q, None) for d in qcopies])
                line += f" {t8 * 1e3:8.3f} {tq / t8:6.2f} {data.numel() / t8 / 1e9:8.1f}"
            if versus is not None:
                line += packed_columns(x, q, n, *versus)
            if x8 is not None:
                tf = timeit([partial(torch.ops.srt_cpu.gguf_linear_x8, x, c, q, n, None) for c in x8])
                ta = timeit([partial(torch.ops.srt_cpu.gguf_linear_x8_a24, x, c, q, n, None) for c in x8])
                line += f" {tf * 1e3:8.3f} {ta * 1e3:8.3f} {tf / ta:7.2f} {x8[0].numel() / ta / 1e9:8.1f}"
            print(line)


def packed_weights(
    data: torch.Tensor, w: torch.Tensor, q: int, cycle: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(e)'s weight copies, made once per shape: the blocks in the layout the model runs them in
    (x8 for Q4_0 / Q4_1 / Q8_0) and the float32 copy in the packed kernel's panels."""
    blocks = pack_x8(data, q) if q in x8_qtypes() else data
    return _clones(blocks, cycle), _clones(torch.ops.srt_cpu.pack_linear_weight(w, 0), cycle)


def packed_columns(
    x: torch.Tensor, q: int, n: int, blocks: list[torch.Tensor], panels: list[torch.Tensor]
) -> str:
    """(e): the model's kernel on the blocks, srt's packed float32 kernel on the float32 copy."""
    if q in x8_qtypes():
        model = [partial(torch.ops.srt_cpu.gguf_linear_x8, x, c, q, n, None) for c in blocks]
    else:
        model = [partial(torch.ops.srt_cpu.gguf_linear, x, c, q, None) for c in blocks]
    f32 = [partial(torch.ops.srt_cpu.packed_linear, x, c, n, None, "") for c in panels]
    tm, tp = timeit(model), timeit(f32)
    return f" {tm * 1e3:8.3f} {tp * 1e3:10.3f} {tm / tp:8.2f}"


def _clones(t: torch.Tensor, cycle: int) -> list[torch.Tensor]:
    return [t.clone() for _ in range(copies(t.numel() * t.element_size(), cycle))]


if __name__ == "__main__":
    main()

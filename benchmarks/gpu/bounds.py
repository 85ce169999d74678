"""The two physical bounds of the GPU at hand, measured in the same run as the figures compared
with them: HBM bandwidth (a device-to-device copy, counting bytes read plus bytes written) and
the bf16 matmul rate (an N x N x N product on random data).

Protocol: CUDA events around each call, after warm-ups; the median of ``--repeats`` calls. The
copy moves ``--copy-gib`` GiB (far past the L2 cache); the matmul is 8192^3 by default (fills an
H100/H200). Never on zeros (a product of zeros runs faster than real data).

    python -m benchmarks.gpu.bounds [--copy-gib 2] [--matmul-n 8192] [--repeats 20] [--json]

With ``--json`` the last output line is one JSON object: ``copy_gbs`` (GB/s, read + write),
``matmul_tflops`` (bf16), ``device``, and the sizes used.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def _median_event_ms(fn, repeats: int, warmup: int = 3) -> float:
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth_gbs(gib: float = 2.0, repeats: int = 20) -> float:
    """GB/s of ``dst.copy_(src)`` on the GPU, bytes read plus bytes written."""
    import torch

    n = int(gib * 2**30) // 2
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = _median_event_ms(lambda: dst.copy_(src), repeats)
    return 2 * src.numel() * src.element_size() / (ms / 1e3) / 1e9


def bf16_matmul_tflops(n: int = 8192, repeats: int = 20) -> float:
    """TFLOP/s of an ``n x n x n`` bf16 matmul (2 n^3 FLOPs) on random data."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    ms = _median_event_ms(lambda: torch.matmul(a, b, out=out), repeats)
    return 2.0 * n**3 / (ms / 1e3) / 1e12


def measure(copy_gib: float = 2.0, matmul_n: int = 8192, repeats: int = 20) -> dict:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu.bounds needs a CUDA device (torch.cuda.is_available() is False)")
    result = {
        "device": torch.cuda.get_device_name(),
        "copy_gib": copy_gib,
        "copy_gbs": round(copy_bandwidth_gbs(copy_gib, repeats), 1),
        "matmul_n": matmul_n,
        "matmul_tflops": round(bf16_matmul_tflops(matmul_n, repeats), 1),
        "repeats": repeats,
    }
    torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--copy-gib", type=float, default=2.0)
    ap.add_argument("--matmul-n", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    r = measure(args.copy_gib, args.matmul_n, args.repeats)
    print(
        f"{r['device']}: copy {r['copy_gbs']:.0f} GB/s (read + write), bf16 matmul {r['matmul_tflops']:.0f} TFLOP/s"
    )
    if args.json:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())

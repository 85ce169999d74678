"""Float32 linear layers alone: srt's linear backends over one decode step's or prefill's weights.

Protocol (fixed seeds; the default model's linear shapes: q/k/v 960 x 576, o 576 x 576, gate/up
3072 x 576, down 576 x 1536, over 30 distinct layers, so that the weights, 0.4 GB, stream from
memory as in a real forward; the LM head is left out):
  * each backend packs the weights once (``LinearBackend.pack_weight``), as at load;
  * for each row count M, one "pass" = the four linear layers of all 30 layers on an input of M
    rows; the backends alternate pass by pass (``--repeats`` rounds, after one warm-up round), so
    a slow spell of the machine hits them alike; the median is reported, with GFLOP/s and each
    backend's speed against the first one (its time over theirs: above 1 is faster).

    python benchmarks/bench_linear.py [--rows 1,4,8,16,32,64,128,512,2048]
        [--backends onednn,native,torch] [--repeats 7] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import cpu_model

from srt.kernels.cpu import kernel_status, load
from srt.layers.linear_backend import create_linear_backend

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) per layer
LAYERS = 30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,4,8,16,32,64,128,512,2048")
    p.add_argument("--backends", default="onednn,native,torch")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load(build_if_missing=True)
    print(f"cpu: {cpu_model()}; torch {torch.__version__}; threads {torch.get_num_threads()}")
    print(f"kernels: {kernel_status()}")
    gen = torch.Generator().manual_seed(0)
    weights = [[torch.randn(o, i, generator=gen) * 0.05 for o, i in SHAPES] for _ in range(LAYERS)]
    names = args.backends.split(",")
    backends = {n: create_linear_backend(n) for n in names}
    packed = {n: [[b.pack_weight(w) for w in layer] for layer in weights] for n, b in backends.items()}
    flops_per_row = 2 * sum(o * i for o, i in SHAPES) * LAYERS
    print(
        f"{'rows':>5} "
        + " ".join(f"{n + ' ms':>11} {'GF/s':>6}" for n in names)
        + "  "
        + " ".join(f"{n + '/' + names[0]:>14}" for n in names[1:])
    )
    for m in [int(r) for r in args.rows.split(",")]:
        xs = {i: torch.randn(m, i, generator=gen) for _, i in SHAPES}

        def one_pass(name: str, xs: dict[int, torch.Tensor] = xs) -> float:
            b, pk = backends[name], packed[name]
            t = time.perf_counter()
            with torch.inference_mode():
                for layer in range(LAYERS):
                    for (_, i), w, wp in zip(SHAPES, weights[layer], pk[layer]):
                        b.apply(xs[i], w, None, wp)
            return time.perf_counter() - t

        times: dict[str, list[float]] = {n: [] for n in names}
        for n in names:
            one_pass(n)
        for _ in range(args.repeats):
            for n in names:
                times[n].append(one_pass(n))
        med = {n: statistics.median(v) for n, v in times.items()}
        cells = " ".join(f"{med[n] * 1e3:>11.1f} {flops_per_row * m / med[n] / 1e9:>6.0f}" for n in names)
        ratios = " ".join(f"{med[names[0]] / med[n]:>13.2f}x" for n in names[1:])
        print(f"{m:>5} {cells}  {ratios}")


if __name__ == "__main__":
    main()

"""Linear layers alone: srt's linear backends over one decode step's or prefill's weights, in
float32 or (``--dtype bfloat16``) bf16.

Protocol (fixed seeds; the default model's linear shapes: q/k/v 960 x 576, o 576 x 576, gate/up
3072 x 576, down 576 x 1536, over 30 distinct layers, so that the weights, 0.4 GB, stream from
memory as in a real forward; the LM head is left out):
  * each backend packs the weights once (``LinearBackend.pack_weight``), as at load;
  * for each row count M, one "pass" = the four linear layers of all 30 layers on an input of M
    rows; the backends alternate pass by pass (``--repeats`` rounds, after one warm-up round), so
    a slow spell of the machine hits them alike; the median is reported, with GFLOP/s and each
    backend's speed against the first one (its time over theirs: above 1 is faster).

In bf16 (weights and activations; ``--shape qwen2.5-1.5b`` for that model's layers, 28 of them,
2.6 GB) the backends are ``native`` (srt's bf16 linear, the path it picks for the row count),
``native:PATH`` (one path forced: ``avx512_bf16``, ``brgemm``, ``avx512``, ``avx2``, ``scalar``; a
path this CPU lacks is left out, saying so), ``native+onednn`` (srt's bf16 linear with the oneDNN
copies of ``--bf16-prefill-copy on``: oneDNN's matmul on them from 64 rows; a CPU without AMX tiles
makes none) and ``torch`` (``F.linear`` in bf16: oneDNN). The
crossover of ``native``'s paths (``SRT_BF16_BRGEMM_M``) is the row count from which ``brgemm`` wins.

    python benchmarks/bench_linear.py [--rows 1,4,8,16,32,64,128,512,2048]
        [--backends onednn,native,torch] [--repeats 7] [--threads N]
    python benchmarks/bench_linear.py --dtype bfloat16 --shape qwen2.5-1.5b
        --backends native:avx512_bf16,native:brgemm,native:avx512,torch --rows 1,4,8,16,32,64,256

In float32, ``native-bf16w`` is srt's native backend with bf16 storage (``--weight-dtype
bfloat16``: what a bf16 checkpoint gets on a CPU without bf16 arithmetic): the float32 weights
rounded to bf16 and packed in bf16 pairs, widened to float32 in registers against float32 rows.

    python benchmarks/bench_linear.py --shape qwen2.5-1.5b --backends native,native-bf16w,onednn
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import cpu_model

from srt.kernels.cpu import kernel_status, load
from srt.layers.linear_backend import create_linear_backend

# (out, in) per layer, layers: the default model's (q/k/v, o, gate/up, down)
MODEL_SHAPES = {
    "smollm2-135m": ([(960, 576), (576, 576), (3072, 576), (576, 1536)], 30),
    "qwen2.5-1.5b": ([(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)], 28),
}


class ForcedPath:
    """srt's bf16 linear on one path (``torch.ops.srt_cpu.bf16_linear(..., isa=path)``)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.native = create_linear_backend("native")

    def pack_weight(self, weight: torch.Tensor, prefill: bool = True) -> torch.Tensor | None:
        return self.native.pack_weight(weight, prefill)

    def apply(self, x, weight, bias=None, packed=None):
        return torch.ops.srt_cpu.bf16_linear(x, packed, weight.shape[0], bias, self.path)


def make_backend(name: str, dtype: torch.dtype):
    """A backend by name (``native:PATH``: one bf16 path), or None with the reason it cannot run here."""
    if name == "native-bf16w":  # bf16 storage, float32 activations (--weight-dtype bfloat16)
        if dtype != torch.float32:
            raise SystemExit("native-bf16w: bf16 storage under float32 activations (--dtype float32)")
        return create_linear_backend("native", weight_dtype=torch.bfloat16)
    if name == "native+onednn":  # the bf16 weights' oneDNN copies from 64 rows (--bf16-prefill-copy on)
        return create_linear_backend("native", prefill_copy="on")
    if not name.startswith("native:"):
        return create_linear_backend(name)
    if dtype != torch.bfloat16:
        raise SystemExit(f"{name}: forced paths are bf16 ones (--dtype bfloat16)")
    b = ForcedPath(name.split(":", 1)[1])
    try:
        b.apply(
            torch.zeros(1, 64, dtype=dtype),
            torch.empty(32, 64, device="meta"),
            None,
            b.pack_weight(torch.zeros(32, 64, dtype=dtype)),
        )
    except RuntimeError as e:
        print(f"{name}: left out ({str(e).splitlines()[0]})")
        return None
    return b


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,4,8,16,32,64,128,512,2048")
    p.add_argument("--backends", default="onednn,native,torch")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--shape", default="smollm2-135m", choices=sorted(MODEL_SHAPES))
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    shapes, layers = MODEL_SHAPES[args.shape]
    if args.threads:
        torch.set_num_threads(args.threads)
    load(build_if_missing=True)
    print(f"cpu: {cpu_model()}; torch {torch.__version__}; threads {torch.get_num_threads()}")
    print(f"kernels: {kernel_status()}")
    gen = torch.Generator().manual_seed(0)
    print(f"{args.shape}: {layers} layers of {shapes}, {args.dtype}")
    weights = [
        [(torch.randn(o, i, generator=gen) * 0.05).to(dtype) for o, i in shapes] for _ in range(layers)
    ]
    backends = {n: b for n in args.backends.split(",") if (b := make_backend(n, dtype)) is not None}
    names = list(backends)
    # one packed copy per kind of packing (the forced bf16 paths share native's)
    packs: dict[str, list] = {}
    packed = {}
    for n, b in backends.items():
        key = "native" if n == "native" or n.startswith("native:") else n
        if key not in packs:
            packs[key] = [[b.pack_weight(w) for w in layer] for layer in weights]
        packed[n] = packs[key]
    flops_per_row = 2 * sum(o * i for o, i in shapes) * layers
    print(
        f"{'rows':>5} "
        + " ".join(f"{n + ' ms':>11} {'GF/s':>6}" for n in names)
        + "  "
        + " ".join(f"{n + '/' + names[0]:>14}" for n in names[1:])
    )
    for m in [int(r) for r in args.rows.split(",")]:
        xs = {i: torch.randn(m, i, generator=gen).to(dtype) for _, i in shapes}

        def one_pass(name: str, xs: dict[int, torch.Tensor] = xs) -> float:
            b, pk = backends[name], packed[name]
            t = time.perf_counter()
            with torch.inference_mode():
                for layer in range(layers):
                    for (_, i), w, wp in zip(shapes, weights[layer], pk[layer]):
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

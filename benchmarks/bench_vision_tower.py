"""A vision tower alone: transformers' module as it ships against the same module as srt runs it
(srt/models/vision_common.py ``srt_tower``: srt's linear backend, patch convolution as a matmul,
quick-GELU in one pass, Qwen2-VL's rope attention), same random weights, same pixels.

``python benchmarks/bench_vision_tower.py [--model DIR] [--dtype bfloat16] [--images 1] [--side 448] [--repeats 5]``

Protocol: the checkpoint's ``vision_config`` (default: make_vlm_checkpoint.py's Qwen2-VL-2B shape,
cached) builds both towers (Qwen2-VL / Qwen2.5-VL), weights drawn once with a fixed seed and
loaded into both; ``--images`` images of ``--side`` x ``--side`` pixels as the image processor
would cut them (``(side / 14)^2`` patches each, one tower call). One untimed call each, then
``--repeats`` rounds alternating the two; the median of each and their ratio are printed, with the
largest difference of the merged outputs (relative to the largest output) and, with ``--profile``,
the share of each op in one call of srt's tower (torch's profiler).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from srt.kernels import cpu as cpu_kernels  # noqa: E402
from srt.layers.linear import Linear  # noqa: E402
from srt.layers.linear_backend import create_linear_backend  # noqa: E402
from srt.models import qwen2_vl  # noqa: E402
from srt.models.vision_common import srt_tower  # noqa: E402


def _default_model() -> str:
    from benchmarks.make_vlm_checkpoint import cached_checkpoint

    return str(cached_checkpoint())


def _towers(model: str, dtype: torch.dtype):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    vc = config.vision_config
    torch.manual_seed(0)
    hf = qwen2_vl.transformers_tower(vc, config.model_type).to(dtype).eval()
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.02)
    ours = srt_tower(
        qwen2_vl._tower(vc, config.model_type).to(dtype), dtype, create_linear_backend("native", dtype)
    )
    ours.load_state_dict(hf.state_dict(), strict=True)
    for m in ours.modules():
        if isinstance(m, Linear):
            m.prepare_weights()
    return hf, ours, vc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="A Qwen2-VL / Qwen2.5-VL folder (config only).")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--images", type=int, default=1)
    ap.add_argument("--side", type=int, default=448, help="Pixels a side (a multiple of 28).")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not cpu_kernels.load(build_if_missing=True):
        raise SystemExit(f"native CPU kernels unavailable: {cpu_kernels.kernel_status()}")
    dtype = getattr(torch, args.dtype)
    hf, ours, vc = _towers(args.model or _default_model(), dtype)
    side = args.side // vc.patch_size
    grid = torch.tensor([[1, side, side]] * args.images)
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * vc.temporal_patch_size * vc.patch_size**2).to(dtype)
    times: dict[str, list[float]] = {"transformers": [], "srt": []}
    outs = {}
    with torch.no_grad():
        for name, tower in (("transformers", hf), ("srt", ours)):
            outs[name] = tower(pixels, grid_thw=grid).pooler_output.float()
        for _ in range(args.repeats):
            for name, tower in (("transformers", hf), ("srt", ours)):
                t0 = time.perf_counter()
                tower(pixels, grid_thw=grid)
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    diff = float((outs["srt"] - outs["transformers"]).abs().max() / outs["transformers"].abs().max())
    from benchmarks.common import cpu_model

    cpu = cpu_model()
    print(f"cpu: {cpu}; {args.dtype}; {args.images} x {args.side}x{args.side} ({pixels.shape[0]} patches)")
    for k, v in times.items():
        print(f"  {k:>12}: median {med[k] * 1e3:8.1f} ms  (runs {', '.join(f'{x * 1e3:.0f}' for x in v)})")
    print(
        f"  transformers / srt: {med['transformers'] / med['srt']:.2f}x; largest output difference {diff:.2e} of the largest output"
    )
    result = {
        "dtype": args.dtype,
        "patches": int(pixels.shape[0]),
        "median_s": med,
        "ratio": med["transformers"] / med["srt"],
        "max_rel_diff": diff,
    }
    if args.profile:
        from torch.profiler import profile

        with torch.no_grad(), profile() as prof:
            ours(pixels, grid_thw=grid)
        total = sum(e.self_cpu_time_total for e in prof.key_averages())
        top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]
        print(
            "  srt's tower, self time by op: "
            + ", ".join(f"{e.key} {e.self_cpu_time_total / total:.0%}" for e in top)
        )
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()

"""Kernels per decode layer on the GPU, counted by the CUDA profiler, beside the CPU census.

    python -m benchmarks.gpu.profile_layers --model-path DIR --load-format dummy --json-out FILE
        [--layers 2,4] [--work-dir DIR] [--context 512] [--attention-backend flashinfer]

``DIR/config.json`` gives the shapes. For each layer count of ``--layers`` a copy of that config
with ``num_hidden_layers`` set is written under ``--work-dir`` and loaded as a ModelRunner the way
``benchmarks/bench_forward.py`` builds one (bf16, dummy weights, FlashInfer attention, the default
server arguments otherwise, a KV pool of one ``--context``-token sequence), with CUDA graphs off so
that every kernel is launched, and seen, on its own. After ``--warmup`` eager decode steps at
batch 1, one more step (``ModelRunner.forward``: attention metadata, the layers, final norm, LM
head; no sampling) runs under ``torch.profiler`` and its device events are counted: kernels,
and memory copies and sets apart.

Kernels per layer = (kernels of the deeper model - kernels of the shallower) / (difference in
layers): whatever the step does once (embedding, FlashInfer's plan, the final norm, the LM head)
and whatever the first and the last layer do differently cancel out, so the figure is a middle
layer's, which is what most of a 32-layer model is. ``profiler_step_kernels`` is the rest of the
shallower model's step. Then ``benchmarks.gpu.census`` counts the same decode step of the
deeper config on the CPU (same process), and both go into one JSON object:

    profiler_kernels_per_layer   CUDA kernels per decoder layer (from the difference)
    profiler_memops_per_layer    memory copies and sets per layer
    profiler_step_kernels        kernels outside the layers
    profiler_kernels_by_layers   {"2": kernels of the 2-layer step, "4": ...}
    profiler_layer_kernels       [[kernel name, launches per layer], ...], most first
    profiler_top_kernels         [[kernel name, launches], ...] of the deeper model's whole step
    census_kernels_per_layer, census_kernels_per_layer_range, census_layer_ops,
    census_step_kernels, census_host_syncs       the census's summary

The file is rewritten after the profile and after the census, so a step stopped part-way keeps
what it measured. Nothing here imports torch or srt until a measurement runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import sys
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from benchmarks.gpu import report

DEFAULT_LAYERS = (2, 4)
# (budget s, min s) per model in ``make gpu-check``: Python and torch start, two small CUDA runners
# (dummy weights drawn on the GPU; FlashInfer's kernels compiled by the earlier steps), a profiled
# step each, then the census on the CPU (about 20 s for the 8B shape's 4 layers)
CHECK_BUDGETS = {"smollm2-135m": (90.0, 30.0), "llama-3.1-8b": (120.0, 45.0)}
TOP_KERNELS = 15
NAME_CHARS = 90
KERNEL, MEMOP, OTHER = "kernel", "memop", "other"
# the profiler's device events that are not kernels, when it gives no activity type
_MEMOP_PREFIXES = ("Memcpy", "Memset")
_SYNC_NAMES = re.compile(r"^(Context|Stream|Event|Device) (Sync|Synchronize|Wait)", re.I)


def classify(name: str, category: str | None) -> str:
    """``kernel``, ``memop`` (a copy or set) or ``other`` (a sync, an annotation) for one device
    event: by its activity type (``kernel``, ``gpu_memcpy``, ``gpu_memset``: the Chrome trace's
    ``cat``) when known, else by its name."""
    if category:
        if category == "kernel":
            return KERNEL
        return MEMOP if category in ("gpu_memcpy", "gpu_memset") else OTHER
    if name.startswith(_MEMOP_PREFIXES):
        return MEMOP
    return OTHER if _SYNC_NAMES.match(name) else KERNEL


def _on_device(event: Any) -> bool:
    kind = getattr(event, "device_type", None)
    return getattr(kind, "name", str(kind)).rsplit(".", 1)[-1] == "CUDA"


def count_device_events(events: Iterable[Any]) -> dict[str, Counter]:
    """Launches per name of the CUDA events among ``events``: ``torch.profiler``'s
    ``FunctionEvent`` objects (``name``, ``device_type``, ``activity_type``) or a Chrome trace's
    event dicts (``cat``, ``name``; only those of category kernel, gpu_memcpy or gpu_memset)."""
    out = {KERNEL: Counter(), MEMOP: Counter()}
    for ev in events:
        if isinstance(ev, dict):
            if ev.get("ph", "X") != "X" or ev.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
                continue
            name, category = str(ev.get("name", "")), ev["cat"]
        elif _on_device(ev) and not getattr(ev, "is_user_annotation", False):  # a range, not a launch
            name, category = str(ev.name), getattr(ev, "activity_type", None)
        else:
            continue
        kind = classify(name, category)
        if kind != OTHER:
            out[kind][short_name(name)] += 1
    return out


def short_name(name: str) -> str:
    """A kernel's name without its return type, template arguments and parameters
    (``void flashinfer::Foo<128, ...>(...)`` -> ``flashinfer::Foo``), at most NAME_CHARS."""
    s = re.sub(r"^(void|static|__global__)\s+", "", name.strip()).replace("(anonymous namespace)::", "")
    cut = min((i for i in (s.find("<", 1), s.find("(", 1)) if i > 0), default=len(s))
    return s[:cut].strip()[:NAME_CHARS] or name[:NAME_CHARS]


def per_layer(by_layers: dict[int, dict[str, Counter]]) -> dict[str, Any]:
    """Per-layer figures from the counts of two (or more) depths: the difference between the
    deepest and the shallowest divided by their difference in layers."""
    lo, hi = min(by_layers), max(by_layers)
    if lo == hi:
        raise ValueError("per-layer counts need two different layer counts")
    span = hi - lo
    k_lo, k_hi = by_layers[lo][KERNEL], by_layers[hi][KERNEL]
    kernels = (sum(k_hi.values()) - sum(k_lo.values())) / span
    memops = (sum(by_layers[hi][MEMOP].values()) - sum(by_layers[lo][MEMOP].values())) / span
    names = {n: (k_hi[n] - k_lo[n]) / span for n in set(k_hi) | set(k_lo)}
    layer_kernels = sorted(((n, _num(c)) for n, c in names.items() if c), key=lambda x: (-x[1], x[0]))
    return {
        "profiler_kernels_per_layer": _num(kernels),
        "profiler_memops_per_layer": _num(memops),
        "profiler_step_kernels": _num(sum(k_lo.values()) - lo * kernels),
        "profiler_kernels_by_layers": {str(n): sum(c[KERNEL].values()) for n, c in sorted(by_layers.items())},
        "profiler_layer_kernels": [list(x) for x in layer_kernels],
        "profiler_top_kernels": [[n, c] for n, c in k_hi.most_common(TOP_KERNELS)],
    }


def _num(x: float) -> float | int:
    return int(x) if float(x).is_integer() else round(x, 2)


def census_fields(summary: dict) -> dict:
    """The census summary (``benchmarks.gpu.census.summary``) under the JSON's ``census_`` names."""
    keys = ("kernels_per_layer", "kernels_per_layer_range", "layer_ops", "step_kernels", "host_syncs")
    return {f"census_{k}": summary[k] for k in keys if k in summary}


def check_steps(py: str, run_dir: Path) -> list[tuple]:
    """``make gpu-check``'s profile steps, one per model of ``report.MODELS`` (dummy weights):
    ``(name, argv, budget_s, min_s, result file, extra)`` each."""
    models = run_dir / "models"
    steps = []
    for model, (budget, min_s) in CHECK_BUDGETS.items():
        folder = report.write_model_config(models / model, report.MODELS[model])
        out = run_dir / f"profile_{model}.json"
        argv = [py, "-m", "benchmarks.gpu.profile_layers", "--model-path", str(folder), "--load-format"]
        argv += ["dummy", "--work-dir", str(models / "profile"), "--json-out", str(out)]
        steps.append((f"profile:{model}", argv, budget, min_s, out, {"model": model}))
    return steps


def layer_configs(model_path: Path, work_dir: Path, layers: Iterable[int]) -> dict[int, Path]:
    """A model folder per layer count: ``model_path``'s config.json with ``num_hidden_layers`` set."""
    config = json.loads((model_path / "config.json").read_text())
    out = {}
    for n in layers:
        folder = work_dir / f"{model_path.name}-{n}-layers"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=n), indent=1))
        out[n] = folder
    return out


def profile_decode_step(folder: Path, args: argparse.Namespace) -> dict[str, Counter]:
    """Device events of one eager batch-1 decode step of the model in ``folder`` (see the module
    docstring), the runner freed afterwards."""
    import torch

    from benchmarks import bench_forward as bf

    argv = ["--model-path", str(folder), "--load-format", args.load_format, "--device", args.device]
    argv += ["--dtype", args.dtype, "--attention-backend", args.attention_backend, "--disable-cuda-graph"]
    argv += ["--batch-sizes", "1", "--context", str(args.context), "--prefill-len", "16"]
    runner, _ = bf.build_runner(bf.parse_args(argv), [1])
    try:
        return _profiled_step(runner, args.context, args.warmup)
    finally:
        del runner
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _profiled_step(runner: Any, context: int, warmup: int) -> dict[str, Counter]:
    from torch.profiler import ProfilerActivity, profile

    from benchmarks import bench_forward as bf

    fb = bf._decode_batch(runner, bf._fill_context(runner, 1, context, seed=0), context)
    sync = bf.device_sync(runner.device)
    for _ in range(warmup):
        runner.forward(fb)
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runner.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        runner.forward(fb)
        sync()
    return count_device_events(prof.events())


def run_census(folder: Path, load_format: str) -> dict:
    """The CPU census of one decode step at batch 1 of the model in ``folder``."""
    from benchmarks.gpu import census

    runner = census.census_runner(str(folder), "bfloat16", load_format=load_format)
    return census.summary(census.census_decode_step(runner, 1))


def write_json(path: str | None, data: dict) -> None:
    if path:
        tmp = Path(path + ".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", required=True, help="a folder holding config.json")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--attention-backend", default="flashinfer")
    ap.add_argument("--layers", default=",".join(map(str, DEFAULT_LAYERS)), help="two layer counts")
    ap.add_argument("--context", type=int, default=512, help="cached tokens of the decoded sequence")
    ap.add_argument("--warmup", type=int, default=3, help="eager decode steps before the profiled one")
    ap.add_argument("--work-dir", default=None, help="where the configs per layer count go")
    ap.add_argument("--no-census", action="store_true", help="the profiler's count only")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    args.layers = sorted({int(x) for x in args.layers.split(",") if x})
    if len(args.layers) < 2 or args.layers[0] < 1:
        ap.error("--layers needs two different positive layer counts")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = Path(args.model_path)
    folders = layer_configs(model, Path(args.work_dir or model.parent / "profile"), args.layers)
    result: dict[str, Any] = {"model_path": str(model), "device": args.device, "batch_size": 1}
    result.update(attention_backend=args.attention_backend, context=args.context, layers_profiled=args.layers)
    t0 = time.perf_counter()
    counts = {n: profile_decode_step(folder, args) for n, folder in folders.items()}
    result.update(per_layer(counts), profile_s=round(time.perf_counter() - t0, 1))
    if args.device == "cuda" and not any(sum(c[KERNEL].values()) for c in counts.values()):
        result["error"] = "the profiler saw no CUDA kernel (is CUPTI available?)"
    write_json(args.json_out, result)
    print(
        f"profiler: {result['profiler_kernels_per_layer']} kernels per layer, {result['profiler_step_kernels']} outside"
    )
    if not args.no_census:
        t0 = time.perf_counter()
        result.update(census_fields(run_census(folders[args.layers[-1]], args.load_format)))
        result["census_s"] = round(time.perf_counter() - t0, 1)
        write_json(args.json_out, result)
        print(
            f"census: {result['census_kernels_per_layer']} kernels per layer ({' '.join(result['census_layer_ops'])})"
        )
    print(json.dumps(result))
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())

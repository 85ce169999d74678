"""Image serving: srt and vLLM-CPU on a Qwen2-VL-2B-shaped checkpoint with random weights, side by side.

``python benchmarks/bench_vision.py [--servers srt,vllm] [--concurrency 1,8] [--layers N] [--vision-depth N]``

Checkpoint. ``benchmarks/make_vlm_checkpoint.py``'s folder (Qwen2-VL-2B-Instruct's shapes, no
weights; ``--layers`` / ``--vision-depth`` shrink the text model / the vision tower), served by both
with ``--load-format dummy`` and ``--dtype`` (float32 by default: the same numerics on both).

Workload. For concurrency ``c`` (``--concurrency``, ``--num-prompts`` requests each), drawn with seed
``--seed + c`` (distinct images and text per run, so no run hits another's prefix or image cache):
``srt.bench_serving``'s image dataset, ``--image-count`` images of ``--image-resolution``
(``--image-format``, ``--image-content``) and ``--input-len`` text tokens per request, outputs of
``[max(1, int(L * --output-range-ratio)), L]`` tokens for ``L = --output-len``. Each request is one
OpenAI chat message (``POST /v1/chat/completions``: the images as ``image_url`` parts with data URIs,
then the text), streamed, greedy, ``ignore_eos``; one uncounted warm-up request (an altered image)
first; all sent at once, at most ``c`` in flight. Then the text-only run: the same texts and output
lengths without the images, on the same server. The client is ``srt.bench_serving.benchmark``;
TTFT and TPOT as it computes them (output counts from the servers' usage).

Servers, one at a time, each started fresh, polled on ``/health``, stopped after its runs::

    srt   .venv/bin/python -m srt.launch_server --model-path DIR --port P --load-format dummy
          --dtype D --enable-cache-report  [--srt-args]
    vLLM  PYTHONPATH=DIR/vllm_cpu_shim VLLM_CPU_OMP_THREADS_BIND=0-<N-1> .venv-vllm/bin/python -m
          vllm.entrypoints.openai.api_server --model DIR --load-format dummy --dtype D
          --gpu-memory-utilization U --max-model-len 2048 --max-num-seqs <max(32, max c)>
          --served-model-name qwen2-vl --limit-mm-per-prompt '{"image": {"count": K, "width": W,
          "height": H}, "video": 0}' --host 127.0.0.1 --port P  [--vllm-args]

vLLM's flags are compare_servers' (``U`` from the weights: ``vllm_memory_utilization``) plus
``--limit-mm-per-prompt``, which sizes the image vLLM profiles its encoder with at start-up (by
default the largest the processor allows, 16,384 merged tokens, which takes far too long on 2 cores)
and turns video off; ``vllm_cpu_shim`` lets it build Qwen2-VL's processor without torchvision (see
make_vlm_checkpoint.py).

Cost on 2 cores. The full shape is 2.2B parameters (8.2 GiB in float32); its tower spends about
1.3 TFLOP on each 448x448 image, seconds of TTFT per image on 2 cores, so the default run takes
tens of minutes; ``--layers 2 --vision-depth 2 --num-prompts 2,8 --output-len 16`` checks the set-up
in a few.

Output: a Markdown table (per server, concurrency and input: output tok/s, TTFT p50, TPOT p50, and
srt / vLLM of each), the CPU's model name, ``benchmarks/results/bench_vision-<timestamp>.json``
(settings, commands, all metrics) and the server logs in ``benchmarks/results/bench_vision-<timestamp>/``.
A server that does not start, or a run whose every request fails, gets a failed row and its log tail;
the other runs go on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import statistics
import sys
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(REPO))

from benchmarks import compare_servers as cs  # noqa: E402
from benchmarks import make_vlm_checkpoint as mvc  # noqa: E402
from benchmarks.bench_lora import log_errors  # noqa: E402
from benchmarks.common import format_table  # noqa: E402
from benchmarks.server_health import free_port  # noqa: E402

SERVERS = ("srt", "vllm")
INPUTS = ("images", "text")
METRICS = ("output_throughput", "median_ttft_ms", "median_tpot_ms")
NAMES = {"output_throughput": "tok/s", "median_ttft_ms": "TTFT", "median_tpot_ms": "TPOT"}
BACKEND = "openai-chat"  # POST /v1/chat/completions on both servers
SERVED_NAME = "qwen2-vl"


# ---------------------------------------------------------------- workload
def make_workloads(tokenizer, conc: int, n: int, args: argparse.Namespace) -> dict[str, list]:
    """``{"images": rows with images, "text": the same texts and output lengths without them}`` of
    the run at concurrency ``conc`` (seed ``--seed + conc``)."""
    import numpy as np

    from srt.bench_serving_images import sample_image_requests
    from srt.benchmark.datasets import DatasetRow, sample_lengths

    rng = np.random.default_rng(args.seed + conc)
    rows = sample_image_requests(
        tokenizer,
        rng,
        n,
        args.image_count,
        args.input_len,
        args.input_len,  # replaced below: the output lengths have their own range
        1.0,
        resolution=args.image_resolution,
        image_format=args.image_format,
        image_content=args.image_content,
    )
    out_lens = sample_lengths(rng, n, args.output_len, args.output_range_ratio)
    for row, out_len in zip(rows, out_lens):
        row.output_len = out_len
    text = [DatasetRow(r.text, r.prompt_len, r.output_len) for r in rows]
    return {"images": rows, "text": text}


async def _client(base_url: str, rows: list, conc: int):
    from srt.bench_serving import benchmark

    return await benchmark(
        rows, backend=BACKEND, base_url=base_url, max_concurrency=conc, warmup_requests=1, seed=0
    )


# ---------------------------------------------------------------- servers
def weight_bytes(cfg: dict, bytes_per_param: int) -> int:
    """Bytes of the checkpoint's weights (text model, vision tower and merger; tied embeddings)."""
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * inter
    v = cfg["vision_config"]
    e, depth, patch = v["embed_dim"], v["depth"], v["patch_size"]
    block = 4 * e * e + 2 * e * e * v["mlp_ratio"]
    merged = e * v["spatial_merge_size"] ** 2
    vision = depth * block + 3 * v["temporal_patch_size"] * patch * patch * e + merged * merged + merged * h
    return (vocab * h + cfg["num_hidden_layers"] * layer + vision) * bytes_per_param


def server_spec(server: str, ckpt: Path, port: int, args: argparse.Namespace) -> cs.ServerSpec:
    flags = ["--load-format", "dummy", "--dtype", args.dtype]
    if server == "srt":
        return cs.srt_spec(str(ckpt), port, args.srt_args, flags)
    cfg = json.loads((ckpt / "config.json").read_text())
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    util = cs.vllm_memory_utilization(weight_bytes(cfg, 4 if args.dtype == "float32" else 2), total)
    width, height = _resolution(args.image_resolution)
    limit = {"image": {"count": args.image_count, "width": width, "height": height}, "video": 0}
    spec = cs.vllm_spec(
        args.vllm_python,
        str(ckpt),
        port,
        max(32, *args.concurrency),
        f"--limit-mm-per-prompt {shlex.quote(json.dumps(limit))} {args.vllm_args}",
        name=SERVED_NAME,
        dummy=True,
        memory_utilization=util,
        dtype=args.dtype,
    )
    shim = str(ckpt / mvc.SHIM_DIR)
    spec.env["PYTHONPATH"] = os.pathsep.join(p for p in (shim, os.environ.get("PYTHONPATH")) if p)
    return spec


def _resolution(resolution: str) -> tuple[int, int]:
    from srt.bench_serving_images import parse_image_resolution

    return parse_image_resolution(resolution)


def bench_server(server: str, workloads: dict, args: argparse.Namespace, run_dir: Path) -> list[dict]:
    """Start ``server``, run every concurrency (images, then text), stop it; its result rows (each
    with ``error`` and ``log_tail`` when the server did not start or every request failed)."""
    port = free_port()
    spec = server_spec(server, args.checkpoint, port, args)
    log = run_dir / f"{server}-{len(list(run_dir.glob(f'{server}*.log')))}.log"
    base = {"server": server, "command": spec.argv, "env": spec.env}
    runs = [(c, kind) for c in args.concurrency for kind in INPUTS]
    rows: list[dict] = []
    try:
        with cs.running(spec, port, log) as (ready_s, rss):
            base["startup_s"] = round(ready_s, 1)
            for conc, kind in runs:
                rows.append(_one_run(server, f"http://127.0.0.1:{port}", workloads[conc][kind], conc, kind))
                rows[-1].update(base, rss_gib=round(rss.sample() / 2**30, 3))
                if rows[-1].get("error"):
                    rows[-1].update(log_errors(log))
            for r in rows:
                r["peak_rss_gib"] = round(rss.peak / 2**30, 3)
    except RuntimeError as e:  # did not start
        print(f"[{server}] FAILED: {e}", file=sys.stderr, flush=True)
        done = {(r["concurrency"], r["input"]) for r in rows}
        err = {"error": str(e).split("\n")[0], **log_errors(log)}
        rows += [{**base, "concurrency": c, "input": k, **err} for c, k in runs if (c, k) not in done]
    return rows


def _one_run(server: str, base_url: str, rows: list, conc: int, kind: str) -> dict:
    """One run's result row; a failed warm-up fails the run (the next runs go on)."""
    row: dict = {"concurrency": conc, "input": kind, "num_prompts": len(rows)}
    try:
        res = asyncio.run(_client(base_url, rows, conc))
    except RuntimeError as e:
        print(f"[{server}] c={conc} {kind}: FAILED: {e}", file=sys.stderr, flush=True)
        return {**row, "error": str(e).split("\n")[0]}
    m = res.metrics
    row.update({k: getattr(m, k) for k in METRICS}, completed=m.completed, failed=m.failed)
    row.update(errors=res.errors, all_metrics=m.to_dict())
    if m.completed == 0:
        row["error"] = f"every request failed: {res.errors[:1]}"
    print(
        f"[{server}] c={conc} {kind}: {m.output_throughput:.1f} tok/s, TTFT p50 {m.median_ttft_ms:.0f} ms, "
        f"TPOT p50 {m.median_tpot_ms:.1f} ms" + (f", {m.failed} failed: {res.errors}" if m.failed else ""),
        flush=True,
    )
    return row


# ---------------------------------------------------------------- report
def add_ratios(rows: list[dict]) -> None:
    """On srt's rows, ``srt_over_vllm``: each metric over vLLM's at the same concurrency and input
    in the same round (the servers take turns, so a ratio pairs runs minutes apart)."""
    by = {(r["server"], r["concurrency"], r["input"], r["round"]): r for r in rows}
    for r in rows:
        other = by.get(("vllm", r["concurrency"], r["input"], r["round"]))
        if r["server"] != "srt" or other is None:
            continue
        ok = not r.get("error") and not other.get("error")
        r["srt_over_vllm"] = {k: r[k] / other[k] if ok and other.get(k) else None for k in METRICS}


def table(rows: list[dict]) -> str:
    header = ["round", "server", "c", "input", "status", "out tok/s", "TTFT p50 ms", "TPOT p50 ms"]
    with_ratios = any("srt_over_vllm" in r for r in rows)
    header += ["srt/vLLM tok/s", "srt/vLLM TTFT", "srt/vLLM TPOT"] if with_ratios else []
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    lines = []
    for r in sorted(
        rows, key=lambda r: (r["concurrency"], INPUTS.index(r["input"]), r["round"], r["server"])
    ):
        status = (
            f"FAILED: {r['error'][:50]}"
            if r.get("error")
            else f"{r['failed']} failed"
            if r["failed"]
            else "ok"
        )
        vals = ["-"] * 3 if r.get("error") else [f"{r[k]:.1f}" for k in METRICS]
        line = [r["round"], r["server"], r["concurrency"], r["input"], status, *vals]
        if with_ratios:
            line += [fmt(v) for v in (r.get("srt_over_vllm") or dict.fromkeys(METRICS)).values()]
        lines.append(line)
    return format_table(header, lines)


def print_report(rows: list[dict], cpu: dict, args: argparse.Namespace) -> None:
    print(f"CPU: {cpu.get('Model name')} ({os.cpu_count()} CPUs)")
    print(
        f"checkpoint: {args.checkpoint} ({args.dtype}); {args.image_count} x {args.image_resolution} "
        f"{args.image_format} ({args.image_content}) per request, {args.input_len} text tokens in, "
        f"{max(1, int(args.output_len * args.output_range_ratio))}-{args.output_len} out"
    )
    print(table(rows))
    medians = median_ratios(rows)
    if medians:
        print("srt/vLLM, median over rounds: " + "; ".join(medians))
    for r in rows:
        if r.get("error") and r.get("log_tail"):
            print(f"\n[{r['server']}, c={r['concurrency']}, {r['input']}] {r['error']}")
            print(f"first error in the log: {r['log_error']}\nlog tail:\n{r['log_tail']}")


def median_ratios(rows: list[dict]) -> list[str]:
    """One "c=8 images: tok/s 1.02x, TTFT 0.95x, TPOT 0.97x" per workload with paired rounds."""
    out = []
    for c in sorted({r["concurrency"] for r in rows}):
        for kind in INPUTS:
            pairs = [r.get("srt_over_vllm") for r in rows if r["concurrency"] == c and r["input"] == kind]
            pairs = [p for p in pairs if p and all(v is not None for v in p.values())]
            if pairs:
                med = {k: statistics.median(p[k] for p in pairs) for k in METRICS}
                out.append(
                    f"c={c} {kind} ({len(pairs)} rounds): "
                    + ", ".join(f"{NAMES[k]} {v:.2f}x" for k, v in med.items())
                )
    return out


# ---------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--servers", default="srt,vllm", help=f"Comma list of {', '.join(SERVERS)} (default: both).")
    a(
        "--rounds",
        type=int,
        default=2,
        help="The servers take turns this many times (ratios pair each round).",
    )
    a("--concurrency", default="1,8", help="Comma list of concurrencies.")
    a("--num-prompts", default="4,16", help="Requests per concurrency (comma list, or one number for all).")
    a("--image-count", type=int, default=1, help="Images per request.")
    a(
        "--image-resolution",
        default="448x448",
        help="As srt.bench_serving takes it (HEIGHTxWIDTH or 720p...).",
    )
    a("--image-format", default="jpeg", choices=("jpeg", "png"))
    a("--image-content", default="random", choices=("random", "blank"))
    a("--input-len", type=int, default=64, help="Text tokens of every request.")
    a("--output-len", type=int, default=64, help="Longest output.")
    a("--output-range-ratio", type=float, default=0.5, help="Outputs uniform in [L * ratio, L].")
    a("--seed", type=int, default=1)
    a(
        "--dtype",
        default="bfloat16",
        choices=("float32", "bfloat16"),
        help="Weights and activations, both servers (default: the checkpoint's).",
    )
    a("--model", default=None, help="A checkpoint folder (default: make_vlm_checkpoint.py's, cached).")
    a("--layers", type=int, default=mvc.TEXT_LAYERS, help="Text decoder layers of the checkpoint.")
    a("--vision-depth", type=int, default=mvc.VISION_DEPTH, help="Vision tower blocks of the checkpoint.")
    a("--srt-args", default="", help="Extra srt.launch_server flags (one string).")
    a("--vllm-args", default="", help="Extra vLLM api_server flags (one string).")
    args = p.parse_args(argv)
    args.servers = [s for s in SERVERS if s in args.servers.split(",")]
    if not args.servers:
        p.error(f"--servers: choose from {SERVERS}")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    prompts = [int(n) for n in args.num_prompts.split(",")]
    if len(prompts) not in (1, len(args.concurrency)):
        p.error("--num-prompts: one number, or one per --concurrency")
    args.num_prompts = prompts * len(args.concurrency) if len(prompts) == 1 else prompts
    return args


def prepare(args: argparse.Namespace) -> dict:
    """The checkpoint and vLLM's venv; returns the versions."""
    args.checkpoint = (
        Path(args.model) if args.model else mvc.cached_checkpoint(args.layers, args.vision_depth)
    )
    versions, args.vllm_python = cs.versions_and_vllm(args.servers)
    return versions


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, cs._raise_on_sigterm)  # stop the running server on SIGTERM / SIGHUP
    signal.signal(signal.SIGHUP, cs._raise_on_sigterm)
    versions = prepare(args)
    from srt.benchmark.tokenizer import load_tokenizer

    tok = load_tokenizer(str(args.checkpoint))
    workloads = {c: make_workloads(tok, c, n, args) for c, n in zip(args.concurrency, args.num_prompts)}
    run_dir = REPO / "benchmarks" / "results" / f"bench_vision-{datetime.now():%Y%m%d-%H%M%S}"
    run_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for rnd in range(1, args.rounds + 1):
        for s in args.servers:
            for row in bench_server(s, workloads, args, run_dir):
                results.append({**row, "round": rnd})
    add_ratios(results)
    cpu = cs.cpu_info()
    print_report(results, cpu, args)
    settings = {k: v for k, v in vars(args).items() if k not in ("vllm_python",)}
    summary = {
        "date": datetime.now().isoformat(timespec="seconds"),
        "cpu": cpu,
        "versions": versions,
        "settings": settings,
        "runs": results,
    }
    out = run_dir.with_suffix(".json")
    out.write_text(json.dumps(summary, indent=2, default=str))
    print(f"summary: {out.relative_to(REPO)}; logs: {run_dir.relative_to(REPO)}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())

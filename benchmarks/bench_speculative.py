"""Speculative decoding (``--speculative-algorithm NGRAM``) against none, side by side, and against
llama.cpp's server at concurrency 1, on the two workloads of benchmarks/data/ (spec_workloads.py):

- copy: chat prompts whose answer repeats most of the prompt (rename in code, edit a JSON
  document, fix typos);
- free: stories, explanations and poems, nothing to copy.

``python benchmarks/bench_speculative.py [--concurrency 1,8,32] [--rounds 2] [--srt-args ...]``

Protocol. srt serves the default model twice per round, without and with speculation (the order
reversed every other round), each in turn started, benchmarked and stopped. Every run is
``srt.bench_serving --backend openai-chat --dataset-name jsonl``: chat completions, streamed,
greedy, stopping at EOS or the row's max tokens (the outputs of both srt servers are the same
tokens). Per run: output tok/s, TPOT p50, and with speculation the accept-length histogram of the
run (tokens per request decode step, from the server's ``srt:spec_accept_length`` metric).
llama.cpp's server (``.venv-llamacpp``, the same Q4_1 GGUF, one slot) serves the copy workload at
concurrency 1 without and with its own draft-free n-gram speculation
(``COMMON_SPECULATIVE_TYPE_NGRAM_SIMPLE``), unless ``--no-llamacpp``.

Output: a table per round, the medians of the ratios over the rounds, and
``benchmarks/results/bench_speculative-<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import urllib.request
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import compare_servers as cs  # noqa: E402
from benchmarks.common import default_model_dir_and_file, format_table  # noqa: E402
from benchmarks.common import versions as local_versions  # noqa: E402

DATA = REPO / "benchmarks" / "data"
WORKLOADS = {"copy": DATA / "spec_copy.jsonl", "free": DATA / "spec_free.jsonl"}
DEFAULT_PROMPTS = {1: 8, 8: 24, 32: 64}
SPEC_FLAGS = ["--speculative-algorithm", "NGRAM"]

# run in .venv-llamacpp: argv = gguf, port, threads, context, speculative type name (or NONE)
LLAMACPP_MAIN = """
import signal, sys, xllamacpp as xlc
path, port, threads, ctx, spec = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
p = xlc.CommonParams()
p.model.path, p.port, p.n_parallel, p.n_ctx = path, port, 1, ctx
p.cpuparams.n_threads = p.cpuparams_batch.n_threads = threads
if spec != "NONE":
    p.speculative.types = [getattr(xlc.common_speculative_type, "COMMON_SPECULATIVE_TYPE_" + spec)]
server = xlc.Server(p)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
signal.pause()
"""


def accept_histogram(port: int) -> dict[str, float]:
    """The server's ``srt:spec_accept_length`` histogram: cumulative bucket counts and the sum."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"srt:spec_accept_length_(bucket|sum|count)\{([^}]*)\} ([0-9.e+-]+)", line)
        if m:
            le = re.search(r'le="([^"]+)"', m.group(2))
            out[f"le={le.group(1)}" if le else m.group(1)] = float(m.group(3))
    return out


def histogram_delta(before: dict[str, float], after: dict[str, float]) -> dict:
    """Steps of one run per accept length bucket, its step count and mean accept length."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    steps = d.get("count", 0.0)
    per_bucket: dict[str, int] = {}
    prev = 0.0
    for k in sorted((k for k in d if k.startswith("le=")), key=lambda k: float(k[3:])):
        per_bucket[k[3:]] = int(d[k] - prev)
        prev = d[k]
    mean = d.get("sum", 0.0) / steps if steps else None
    return {"steps": int(steps), "mean_accept_length": mean, "per_bucket": per_bucket}


def run_workload(port: int, workload: str, conc: int, prompts: int, out: Path) -> dict:
    argv = [sys.executable, "-m", "srt.bench_serving", "--backend", "openai-chat", "--port", str(port)]
    argv += ["--dataset-name", "jsonl", "--dataset-path", str(WORKLOADS[workload]), "--disable-ignore-eos"]
    argv += ["--num-prompts", str(prompts), "--max-concurrency", str(conc), "--output-file", str(out)]
    argv += ["--disable-tqdm"]
    if out.exists():
        out.unlink()
    res = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    if res.returncode != 0 or not out.exists():
        raise RuntimeError(f"bench_serving failed ({res.returncode}):\n{(res.stdout + res.stderr)[-3000:]}")
    rec = json.loads(out.read_text().splitlines()[-1])
    keep = (
        "output_throughput",
        "median_tpot_ms",
        "median_ttft_ms",
        "total_output_tokens",
        "completed",
        "failed",
    )
    return {k: rec.get(k) for k in keep}


def bench_srt(name: str, flags: list[str], args: argparse.Namespace, gguf: str, run_dir: Path) -> dict:
    port = cs.free_port()
    spec = cs.srt_spec(gguf, port, args.srt_args, flags)
    runs = []
    with cs.running(spec, port, run_dir / f"{name}.log"):
        for workload in args.workloads:
            for conc, prompts in zip(args.concurrency, args.num_prompts):
                before = accept_histogram(port)
                row = run_workload(
                    port, workload, conc, prompts, run_dir / f"{name}-{workload}-c{conc}.jsonl"
                )
                row.update(
                    workload=workload,
                    concurrency=conc,
                    accept=histogram_delta(before, accept_histogram(port)),
                )
                runs.append(row)
                acc = row["accept"]["mean_accept_length"]
                print(
                    f"[{name}] {workload} c={conc}: {row['output_throughput']:.1f} tok/s, TPOT p50 "
                    f"{row['median_tpot_ms']:.1f} ms" + (f", accept length {acc:.2f}" if acc else ""),
                    flush=True,
                )
    return {"command": spec.argv, "runs": runs}


def bench_llamacpp(python: Path, gguf: str, spec_type: str, run_dir: Path) -> dict:
    port = cs.free_port()
    argv = [str(python), "-c", LLAMACPP_MAIN, gguf, str(port), str(os.cpu_count() or 1), "4096", spec_type]
    label = f"llamacpp-{spec_type.lower()}"
    with cs.running(cs.ServerSpec("llamacpp", argv), port, run_dir / f"{label}.log"):
        row = run_workload(port, "copy", 1, 8, run_dir / f"{label}-copy-c1.jsonl")
    print(
        f"[{label}] copy c=1: {row['output_throughput']:.1f} tok/s, TPOT p50 {row['median_tpot_ms']:.1f} ms"
    )
    return {"speculative": spec_type, **row}


def round_table(res: dict) -> tuple[str, dict]:
    """The table of one round and its ratios (spec on / off) per (workload, concurrency)."""
    rows, ratios = [], {}
    for off, on in zip(res["srt-off"]["runs"], res["srt-ngram"]["runs"]):
        key = f"{off['workload']} c={off['concurrency']}"
        r = on["output_throughput"] / off["output_throughput"]
        ratios[key] = r
        acc = on["accept"]["mean_accept_length"]
        rows.append(
            [
                key,
                f"{off['output_throughput']:.1f}",
                f"{on['output_throughput']:.1f}",
                f"{r:.2f}x",
                f"{off['median_tpot_ms']:.1f}",
                f"{on['median_tpot_ms']:.1f}",
                f"{acc:.2f}" if acc else "-",
            ]
        )
    header = ["workload", "off tok/s", "NGRAM tok/s", "ratio", "off TPOT p50", "NGRAM TPOT p50", "accept len"]
    text = format_table(header, rows)
    if "llamacpp" in res:
        lc = res["llamacpp"]
        srt_on = next(
            r for r in res["srt-ngram"]["runs"] if r["workload"] == "copy" and r["concurrency"] == 1
        )
        text += "\n" + format_table(
            ["copy c=1", "tok/s", "TPOT p50", "srt NGRAM / this"],
            [
                [
                    f"llama.cpp {x['speculative']}",
                    f"{x['output_throughput']:.1f}",
                    f"{x['median_tpot_ms']:.1f}",
                    f"{srt_on['output_throughput'] / x['output_throughput']:.2f}x",
                ]
                for x in lc
            ],
        )
    return text, ratios


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument(
        "--num-prompts", default=None, help="Comma list, one per concurrency (default 8, 24, 64)."
    )
    ap.add_argument("--workloads", default="copy,free")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--srt-args", default="", help="Extra flags for both srt servers (one string).")
    ap.add_argument("--spec-args", default="", help="Extra flags for the speculative srt server only.")
    ap.add_argument("--llamacpp", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.workloads = args.workloads.split(",")
    if args.num_prompts is None:
        args.num_prompts = [DEFAULT_PROMPTS.get(c, 2 * c) for c in args.concurrency]
    else:
        args.num_prompts = [int(n) for n in args.num_prompts.split(",")]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir, gguf_name = default_model_dir_and_file()
    gguf = os.path.join(model_dir, gguf_name)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = REPO / "benchmarks" / "results" / f"bench_speculative-{stamp}"
    run_dir.mkdir(parents=True, exist_ok=True)
    llama_py = None
    if args.llamacpp:
        llama_py = cs.ensure_venv(REPO / ".venv-llamacpp", cs.LLAMACPP_REQUIREMENT, "import xllamacpp")
    configs = [("srt-off", []), ("srt-ngram", SPEC_FLAGS + args.spec_args.split())]
    rounds, all_ratios = [], []
    summary = {"cpu": cs.cpu_info(), "versions": local_versions(), "args": vars(args), "rounds": rounds}
    path = REPO / "benchmarks" / "results" / f"bench_speculative-{stamp}.json"
    for rnd in range(args.rounds):
        res: dict = {}
        rounds.append(res)
        for name, flags in configs if rnd % 2 == 0 else configs[::-1]:
            res[name] = bench_srt(name, flags, args, gguf, run_dir)
            path.write_text(json.dumps(summary, indent=1, default=str))  # what is done so far
        if llama_py is not None and "copy" in args.workloads and 1 in args.concurrency:
            res["llamacpp"] = [bench_llamacpp(llama_py, gguf, t, run_dir) for t in ("NONE", "NGRAM_SIMPLE")]
        text, ratios = round_table(res)
        print(f"\nround {rnd + 1}\n{text}", flush=True)
        all_ratios.append(ratios)
    if args.rounds > 1:
        keys = list(all_ratios[0])
        rows = [
            [k, *(f"{r[k]:.2f}" for r in all_ratios), f"{statistics.median(r[k] for r in all_ratios):.2f}x"]
            for k in keys
        ]
        print(
            "\n"
            + format_table(["NGRAM / off", *(f"round {i + 1}" for i in range(args.rounds)), "median"], rows)
        )
    path.write_text(json.dumps(summary, indent=1, default=str))
    print(f"summary: {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

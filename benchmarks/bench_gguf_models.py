"""Big-model shapes without downloads: load and single-stream decode of random-weight Llama GGUFs.

For each shape (``--shapes``; ``tests/helpers/gguf_models.SHAPES``: 1b = 2048/8192 x 16 layers,
32/8 heads; 7b = 4096/11008 x 32 layers, 32/32 heads; vocabulary = the default model's 49152-token
tokenizer, copied into the file):

  1. write a random-weight Llama GGUF (``--scheme``, default the Q4_K_M mix; random blocks
     drawn directly, ``fast_random``) into a fresh temporary directory (``--tmp-dir``); the
     directory and the tokenizer cache entry srt makes for the file are removed afterwards,
     also on error or Ctrl-C;
  2. convert its tokenizer once (srt caches the conversion) so the load below is the model's;
  3. ``load_s``: wall time of ``Engine(file, quantization=--quantization, ...)`` until ready
     (scheduler process start and imports, config, weights, a small KV pool: 2 x (prompt +
     decode + 8) tokens, at least 256); ``model_load_s``: the scheduler's own "Model loaded in"
     figure (config + weights), read from the engine's log (captured to a file; printed on
     error or with ``--show-log``);
  4. one warm-up request, then one greedy stream of ``--decode-tokens`` new tokens after a
     ``--prompt-tokens`` random prompt (``ignore_eos``): ``ttft_s`` = prompt sent -> first
     token; ``decode_ms_per_token`` = (last chunk - first chunk) / tokens between them: the
     prefill is excluded, the scheduler loop and IPC of a real server step are included;
  5. memory of the scheduler process (the one holding the model): ``rss_after_load_gib``
     (VmRSS when ready), ``peak_rss_gib`` (VmHWM after the run: the high-water mark of
     loading and decoding), from /proc/<pid>/status; the weight bytes the scheduler reports
     (``weight_bytes``) and the file's.

The bound: every decode step reads each weight of the decoder layers and the LM head once
(``bytes_per_token``: the stored blocks when the server kept them quantized, float32 when it
dequantized them (``--quantization none``, or a fallback: told apart by the ``weight_bytes`` it
reports); the one embedding row read is negligible). ``bandwidth_gbs`` is the memory read
bandwidth measured in this process while no engine runs, before and after the runs: the best
time of ``torch.sum`` over a ``--bandwidth-gib`` float32 tensor at one thread and at all threads,
the fastest of those. ``bound_ms_per_token = bytes_per_token / bandwidth``, ``efficiency =
bound / measured``.

    python benchmarks/bench_gguf_models.py [--shapes 1b,7b] [--quantization gguf|none]
        [--decode-tokens 16] [--prompt-tokens 32] [--scheme Q4_K_M] [--json]

A table goes to stdout and a JSON record to ``benchmarks/results/bench_gguf_models-<time>.json``
(``--out`` to change, ``--no-save`` for none). ``--quantization none`` dequantizes to float32:
the 7b shape (~27 GB) does not fit in 24 GB and is refused unless ``--force``. With ``gguf`` the run
stops first when srt's native kernels (which the server needs to keep the blocks) are not built
for the file's types, and any child process past ``--max-rss-gib`` (16) is killed, so a float32
fallback fails the run instead of the machine. The ``tiny``
shape (512/1536 x 2 layers) is for trying the script quickly.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # run as a script: make `benchmarks` and `tests` importable
    sys.path.insert(0, REPO_ROOT)

from benchmarks.common import cpu_model, default_model_dir_and_file, memory_read_bandwidth  # noqa: E402
from tests.helpers.gguf_models import SHAPES, decode_read_tensors, tensor_plan, write_llama_gguf  # noqa: E402

BENCH_SHAPES: dict[str, dict[str, int]] = {
    **SHAPES,
    "tiny": dict(hidden=512, intermediate=1536, layers=2, heads=8, kv_heads=4),
}
GIB = 1 << 30


# ------------------------------------------------------------------------ measurements
@contextlib.contextmanager
def stderr_to(path: str) -> Iterator[None]:
    """File descriptor 2 (this process's and the children it spawns meanwhile) to ``path``."""
    sys.stderr.flush()
    saved = os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


class RssGuard:
    """Kills (SIGKILL, by pid) any child process of this one whose RSS passes ``limit_bytes``, so
    a load that goes wrong (weights dequantized to float32 by a fallback) fails the run instead of
    pushing the shared machine into the OOM killer. ``tripped`` names what it killed."""

    def __init__(self, limit_bytes: int, interval_s: float = 0.2) -> None:
        import threading

        self.limit = limit_bytes
        self.interval = interval_s
        self.tripped: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="rss-guard", daemon=True)

    def _watch(self) -> None:
        import psutil

        me = psutil.Process()
        while not self._stop.wait(self.interval):
            for child in me.children(recursive=True):
                try:
                    rss = child.memory_info().rss
                    if rss > self.limit:
                        child.kill()
                        self.tripped = (
                            f"pid {child.pid} at {rss / GIB:.1f} GiB RSS (limit {self.limit / GIB:.1f})"
                        )
                except psutil.Error:
                    continue

    def __enter__(self) -> RssGuard:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def proc_status_bytes(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of ``pid`` in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def bytes_per_token(shape: dict[str, int], vocab: int, scheme: str, quantized: bool) -> int:
    """Weight bytes one decode step reads: every matrix and norm of the decoder layers and the
    LM head (``output.weight``), as stored (``quantized``) or as float32."""
    read = decode_read_tensors(tensor_plan(**shape, vocab=vocab, qtype_scheme=scheme))
    if quantized:
        return sum(p.nbytes for p in read)
    return sum(4 * math.prod(p.shape) for p in read)


def native_qtype_names() -> set[str]:
    """Names of the GGUF types srt's native kernels keep quantized in this process (empty when
    the library is not built for the current sources)."""
    try:
        from gguf import GGMLQuantizationType

        from srt.kernels.cpu import gguf as gguf_kernels

        return {GGMLQuantizationType(t).name for t in gguf_kernels.native_qtypes()}
    except Exception:  # noqa: BLE001 - an srt without the GGUF kernels
        return set()


# ------------------------------------------------------------------------------ one run
def _stream_decode(engine, prompt: list[int], n: int) -> dict[str, float]:
    params = {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}
    t0 = time.perf_counter()
    marks: list[tuple[float, int]] = []
    for chunk in engine.generate(input_ids=prompt, sampling_params=params, stream=True):
        marks.append((time.perf_counter(), int(chunk["meta_info"]["completion_tokens"])))
    marks = [m for m in marks if m[1] > 0]
    if not marks or marks[-1][1] != n:
        raise RuntimeError(f"expected {n} tokens, the stream gave {marks[-1][1] if marks else 0}")
    (t_first, c_first), (t_last, c_last) = marks[0], marks[-1]
    out = {"ttft_s": t_first - t0, "total_s": t_last - t0, "completion_tokens": c_last}
    out["decode_ms_per_token"] = (
        (t_last - t_first) * 1e3 / (c_last - c_first) if c_last > c_first else math.nan
    )
    out["decode_tokens_timed"] = c_last - c_first
    return out


def _run_engine(path: str, kwargs: dict[str, Any], result: dict[str, Any], args: argparse.Namespace) -> None:
    """Start an Engine on ``path``, measure (module docstring, steps 3-5) into ``result``, stop it."""
    from srt.entrypoints.engine import Engine

    name, vocab = result["shape"], result["vocab"]
    t0 = time.perf_counter()
    engine = Engine(path, **kwargs)
    result["load_s"] = time.perf_counter() - t0
    try:
        pid = engine.child_pids["scheduler"]
        st = proc_status_bytes(pid)
        result["rss_after_load_bytes"] = st["VmRSS"]
        state = engine.get_server_info()["internal_states"][0]
        for key in ("weight_bytes", "quantization", "max_total_num_tokens"):
            if state.get(key) is not None:
                result[f"server_{key}"] = state[key]
        print(
            f"[{name}] loaded in {result['load_s']:.1f} s, scheduler RSS {st['VmRSS'] / GIB:.2f} GiB "
            f"(peak so far {st['VmHWM'] / GIB:.2f})",
            flush=True,
        )
        rng = np.random.default_rng(args.seed)
        low = min(1000, vocab // 2)  # stay clear of the special tokens at the start

        def prompt() -> list[int]:
            return [int(t) for t in rng.integers(low, vocab, size=args.prompt_tokens)]

        t0 = time.perf_counter()
        _stream_decode(engine, prompt(), 3)  # warm-up (first-call set-up of every kernel)
        result["warmup_s"] = time.perf_counter() - t0
        result.update(_stream_decode(engine, prompt(), args.decode_tokens))
        st = proc_status_bytes(pid)
        result["rss_end_bytes"] = st["VmRSS"]
        result["peak_rss_bytes"] = st["VmHWM"]
    finally:
        engine.shutdown()


def run_shape(name: str, args: argparse.Namespace, bandwidth: dict[str, float]) -> dict[str, Any]:
    from srt.server_args import ServerArgs
    from srt.utils import hf_tokenizer

    shape = BENCH_SHAPES[name]
    model_dir, model_file = default_model_dir_and_file()
    tok_src = os.path.join(model_dir, model_file)
    result: dict[str, Any] = {
        "shape": name,
        **shape,
        "scheme": args.scheme,
        "quantization": args.quantization,
    }
    tmp = tempfile.mkdtemp(prefix=f"srt-bench-gguf-{name}-", dir=args.tmp_dir)
    tok_cache = None
    try:
        path = os.path.join(tmp, f"random-llama-{name}-{args.scheme}.gguf")
        t0 = time.perf_counter()
        info = write_llama_gguf(
            path, **shape, qtype_scheme=args.scheme, seed=args.seed, tokenizer_from=tok_src, fast_random=True
        )
        result["write_s"] = time.perf_counter() - t0
        vocab = info["vocab"]
        result.update(
            vocab=vocab,
            params=info["params"],
            file_bytes=info["file_bytes"],
            file_weight_bytes=info["weight_bytes"],
            qtypes=info["qtypes"],
        )
        print(
            f"[{name}] wrote {info['file_bytes'] / GIB:.2f} GiB ({info['qtypes']}) in {result['write_s']:.1f} s",
            flush=True,
        )
        tok_cache = hf_tokenizer._cache_dir(path)
        t0 = time.perf_counter()
        hf_tokenizer.load_tokenizer(path)  # converted once and cached, so the load below is the model's
        result["tokenizer_convert_s"] = time.perf_counter() - t0

        context = args.prompt_tokens + args.decode_tokens + 8
        kwargs: dict[str, Any] = dict(
            max_total_tokens=max(2 * context, 256),
            context_length=max(context, 128),
            max_running_requests=2,
            log_level=args.log_level,
        )
        if args.quantization == "gguf":
            missing = sorted(set(info["qtypes"]) - {"F32"} - native_qtype_names())
            if missing:
                raise SystemExit(
                    f"--quantization gguf: srt's native kernels do not cover {missing} here (not built for "
                    "the current sources? `python -m srt.kernels.cpu.build`); the server would dequantize "
                    "them to float32"
                )
        if "quantization" in ServerArgs.field_names():
            kwargs["quantization"] = args.quantization
        elif args.quantization != "none":
            raise SystemExit("this srt has no --quantization flag yet: run with --quantization none")
        log_path = os.path.join(tmp, "engine.log")
        ok = False
        try:
            with RssGuard(int(args.max_rss_gib * GIB)) as guard, stderr_to(log_path):
                # the children inherit fd 2: their log lands in the file
                try:
                    _run_engine(path, kwargs, result, args)
                except Exception as e:
                    if guard.tripped:
                        raise RuntimeError(f"[{name}] RSS guard killed {guard.tripped}") from e
                    raise
            ok = True
        finally:
            with open(log_path, errors="replace") as f:
                log = f.read()
            m = re.search(r"Model loaded in ([\d.]+) s", log)
            if m:
                result["model_load_s"] = float(m.group(1))
            if args.show_log or not ok:
                lines = log.splitlines()
                print("\n".join(lines if args.show_log else lines[-40:]), file=sys.stderr)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if tok_cache:
            shutil.rmtree(tok_cache, ignore_errors=True)
    # the weights as the server holds them: quantized blocks, or float32 when it dequantized
    # (--quantization none, or a fallback it logged); its weight_bytes tells them apart
    server_bytes = result.get("server_weight_bytes")
    if server_bytes is not None:
        quantized = server_bytes < 2 * result["file_weight_bytes"]
    else:
        quantized = args.quantization != "none"
    result["weights_kept_quantized"] = quantized
    result["bytes_per_token"] = bytes_per_token(shape, result["vocab"], args.scheme, quantized)
    bw = bandwidth["bandwidth_gbs"] * 1e9
    result["bound_ms_per_token"] = result["bytes_per_token"] / bw * 1e3
    result["efficiency"] = result["bound_ms_per_token"] / result["decode_ms_per_token"]
    return result


# ------------------------------------------------------------------------------- report
def print_table(rows: list[dict[str, Any]], bandwidth: dict[str, float]) -> None:
    print(
        f"\nmemory read bandwidth {bandwidth['bandwidth_gbs']:.1f} GB/s (torch.sum of "
        f"{bandwidth['bandwidth_tensor_gib']:.1f} GiB float32, best of 1 and all threads: "
        f"{ {n: round(v, 1) for n, v in bandwidth['bandwidth_gbs_by_threads'].items()} })"
    )
    head = (
        f"{'shape':<6} {'scheme':<7} {'quant':<5} {'file GB':>8} {'B/token GB':>10} {'load s':>7} {'model s':>7} "
        f"{'RSS GiB':>7} {'peak GiB':>8} {'TTFT s':>7} {'ms/token':>9} {'bound ms':>8} {'eff':>5}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['shape']:<6} {r['scheme']:<7} {r['quantization'] if r['weights_kept_quantized'] else 'f32':<5} "
            f"{r['file_bytes'] / 1e9:>8.2f} "
            f"{r['bytes_per_token'] / 1e9:>10.2f} {r['load_s']:>7.1f} "
            f"{r.get('model_load_s', math.nan):>7.1f} {r['rss_after_load_bytes'] / GIB:>7.2f} "
            f"{r['peak_rss_bytes'] / GIB:>8.2f} {r['ttft_s']:>7.2f} {r['decode_ms_per_token']:>9.1f} "
            f"{r['bound_ms_per_token']:>8.1f} {r['efficiency']:>5.0%}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="1b,7b", help=f"comma-separated, of {', '.join(BENCH_SHAPES)}")
    p.add_argument("--quantization", default="gguf", choices=["gguf", "none"])
    p.add_argument(
        "--scheme", default="Q4_K_M", help="Q4_K_M or one type (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K)"
    )
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bandwidth-gib", type=float, default=1.0)
    p.add_argument(
        "--tmp-dir", default=None, help="where the model files are written (default: the system's)"
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--show-log", action="store_true", help="print the engine's log (else only on error)")
    p.add_argument("--force", action="store_true", help="run 7b with --quantization none anyway")
    p.add_argument(
        "--max-rss-gib",
        type=float,
        default=16.0,
        help="kill the engine's processes past this RSS (a float32 fallback of 7b would OOM the machine)",
    )
    p.add_argument(
        "--out", default=None, help="JSON path (default benchmarks/results/bench_gguf_models-<time>.json)"
    )
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--json", action="store_true", help="also print the JSON record as the last line")
    args = p.parse_args(argv)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    for s in shapes:
        if s not in BENCH_SHAPES:
            p.error(f"unknown shape {s!r}; use {', '.join(BENCH_SHAPES)}")
    if args.decode_tokens < 2:
        p.error("--decode-tokens must be at least 2 (the first token comes from the prefill)")
    if args.quantization == "none" and "7b" in shapes and not args.force:
        p.error("7b in float32 needs ~27 GB of weights: run it with --quantization gguf (or --force)")

    bandwidth = memory_read_bandwidth(args.bandwidth_gib)
    print(f"memory read bandwidth {bandwidth['bandwidth_gbs']:.1f} GB/s", flush=True)
    rows = [run_shape(s, args, bandwidth) for s in shapes]
    # measured again after the runs (the machine may be shared): the best of both is the bound's
    after = memory_read_bandwidth(args.bandwidth_gib)
    bandwidth["bandwidth_gbs_before_after"] = [bandwidth["bandwidth_gbs"], after["bandwidth_gbs"]]
    if after["bandwidth_gbs"] > bandwidth["bandwidth_gbs"]:
        bandwidth.update(after, bandwidth_gbs_before_after=bandwidth["bandwidth_gbs_before_after"])
        bw = bandwidth["bandwidth_gbs"] * 1e9
        for r in rows:
            r["bound_ms_per_token"] = r["bytes_per_token"] / bw * 1e3
            r["efficiency"] = r["bound_ms_per_token"] / r["decode_ms_per_token"]
    print_table(rows, bandwidth)
    record = {
        "benchmark": "bench_gguf_models",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "args": vars(args),
        **bandwidth,
        "runs": rows,
    }
    if not args.no_save:
        out = args.out or os.path.join(
            REPO_ROOT, "benchmarks", "results", f"bench_gguf_models-{time.strftime('%Y%m%d-%H%M%S')}.json"
        )
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:
            json.dump(record, f, indent=2)
        print(f"wrote {out}")
    if args.json:
        print(json.dumps(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

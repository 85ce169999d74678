"""Model forward cost through the ModelRunner: load, decode at several batch sizes, a prefill.

Protocol (default model unless ``--model-path``; float32 on CPU; fixed seeds):
  1. load: wall time of ``ModelRunner(server_args)`` with ``--max-total-tokens`` set (weights +
     pools, no KV profiling); peak resident memory is read at the end (``ru_maxrss``) and
     after the load.
  2. decode: ``max(batch sizes)`` sequences of ``--context`` tokens get KV slots from the real
     allocator; their K/V are filled with seeded random values (decode cost does not depend on
     the values, and prefilling 256 x 256 tokens just to bench would take minutes). For each
     batch size B the first B sequences run one DECODE forward (the token at position
     ``context``) ``--repeats`` times after one warm-up; the median is reported.
     ``decode_attn_ms`` is the attention backend alone over all layers for the same batch
     (``init_forward_metadata`` + ``forward_decode`` per layer with random q/k/v).
  3. prefill: one EXTEND forward of a 512-token sequence, median of ``--repeats``.
Timed region = ``ModelRunner.forward`` (metadata, model, logits; no sampling).

Per-op profile (``--profile``; one extra run of each measured forward after the timed ones):
the wall time inside each kind of module, through forward hooks (one thread of control, so
wall time is the op's time): ``attention`` (RadixAttention: KV write + attention backend),
``linear`` (every ``Linear``: q/k/v, o, gate/up, down), ``lm_head`` (the LogitsProcessor: last-row
gather + LM head matmul), ``other`` = the forward minus those (embedding, norms, rope,
activation, metadata, Python).

    python benchmarks/bench_forward.py [--batch-sizes 1,16,64,256] [--context 256] [--json]
        [--attention-backend torch_native|fused_cpu] [--kv-cache-dtype float16]
        [--quantization gguf|none] [--profile]

With ``--json`` the last output line is one JSON object: ``load_s``, ``peak_rss_gib``,
``decode_ms`` ({"1": .., "16": .., ...}), ``prefill512_ms`` and the extras ``load_rss_gib``,
``decode_attn_ms``, ``threads``, ``linear_backend``, and with ``--profile`` ``profile`` ({"prefill512":
{op: ms}, "decode_1": {op: ms}, ...}).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import torch
from torch import nn

from srt.configs.backends import LINEAR_BACKENDS
from srt.layers.forward_batch import ForwardBatch, ForwardMode
from srt.layers.linear import Linear
from srt.layers.logits_processor import LogitsProcessor
from srt.layers.radix_attention import RadixAttention
from srt.model_executor.model_runner import ModelRunner
from srt.server_args import ServerArgs
from srt.utils.pages import page_ceil

PREFILL_LEN = 512


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / (1 << 30)  # Linux: KiB


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


PROFILED_KINDS: tuple[tuple[str, type[nn.Module]], ...] = (
    ("attention", RadixAttention),
    ("linear", Linear),
    ("lm_head", LogitsProcessor),
)


def profile_ops(model: nn.Module, fn, runs: int = 3) -> dict[str, float]:
    """Median over ``runs`` calls of ``fn()`` with hooks on the modules of PROFILED_KINDS: ms
    per kind, ``other`` (the rest of the call) and ``total``."""
    samples = [_profile_once(model, fn) for _ in range(runs)]
    return {k: statistics.median(s[k] for s in samples) for k in samples[0]}


def _profile_once(model: nn.Module, fn) -> dict[str, float]:
    spent = {kind: 0.0 for kind, _ in PROFILED_KINDS}
    starts: dict[int, float] = {}
    handles = []
    for module in model.modules():
        kind = next((k for k, cls in PROFILED_KINDS if isinstance(module, cls)), None)
        if kind is None:
            continue

        def pre(mod, _args, _key=id(module)):
            starts[_key] = time.perf_counter()

        def post(mod, _args, _out, _key=id(module), _kind=kind):
            spent[_kind] += time.perf_counter() - starts.pop(_key)

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        t0 = time.perf_counter()
        fn()
        total = time.perf_counter() - t0
    finally:
        for h in handles:
            h.remove()
    out = {kind: v * 1e3 for kind, v in spent.items()}
    out["other"] = max(0.0, total * 1e3 - sum(out.values()))
    out["total"] = total * 1e3
    return out


def format_profile(name: str, prof: dict[str, float]) -> str:
    total = prof["total"] or 1.0
    parts = "  ".join(f"{k} {v:7.1f} ms ({100 * v / total:4.1f}%)" for k, v in prof.items() if k != "total")
    return f"  profile {name:>12}: {parts}"


def _fill_context(runner: ModelRunner, num_seqs: int, context: int, seed: int) -> list[int]:
    """Rows of ``num_seqs`` sequences with ``context`` tokens of random KV; returns the rows."""
    rows = runner.req_to_token_pool.alloc(num_seqs)
    assert rows is not None
    slots = runner.token_to_kv_pool_allocator.alloc_extend(
        [0] * num_seqs, [context] * num_seqs, [-1] * num_seqs
    )
    assert slots is not None
    runner.req_to_token_pool.req_to_token[rows, :context] = slots.view(num_seqs, context)
    gen = torch.Generator().manual_seed(seed)
    pool = runner.token_to_kv_pool
    values = torch.randn(slots.numel(), pool.head_num, pool.head_dim, generator=gen).to(pool.dtype)
    for buf in pool.k_buffer + pool.v_buffer:  # the same values everywhere: only the cost matters
        buf[slots] = values
    return rows


def _decode_batch(runner: ModelRunner, rows: list[int], context: int) -> ForwardBatch:
    """DECODE batch adding the token at position ``context`` to each row (slots allocated once)."""
    bs = len(rows)
    req_to_token = runner.req_to_token_pool.req_to_token
    last_loc = req_to_token[rows, context - 1].tolist()
    loc = runner.token_to_kv_pool_allocator.alloc_decode([context + 1] * bs, last_loc)
    assert loc is not None
    req_to_token[rows, context] = loc
    input_ids = [(31 * r + 7) % runner.model_config.vocab_size for r in rows]
    return ForwardBatch.build(
        ForwardMode.DECODE, input_ids, rows, [context] * bs, [1] * bs, loc, runner.device
    )


def _attention_only_ms(runner: ModelRunner, fb: ForwardBatch, repeats: int) -> float:
    cfg = runner.model_config
    layers = [m for m in runner.model.modules() if type(m).__name__ == "RadixAttention"]
    assert len(layers) == cfg.num_hidden_layers
    gen = torch.Generator().manual_seed(1)
    bs = fb.batch_size
    q = torch.randn(bs, cfg.num_attention_heads * cfg.head_dim, generator=gen).to(runner.dtype)
    k = torch.randn(bs, cfg.num_key_value_heads * cfg.head_dim, generator=gen).to(runner.dtype)
    v = torch.randn_like(k)
    backend = runner.attn_backend
    fb.req_to_token_pool, fb.token_to_kv_pool, fb.attn_backend = (
        runner.req_to_token_pool,
        runner.token_to_kv_pool,
        backend,
    )

    def run() -> None:
        backend.init_forward_metadata(fb)
        with torch.inference_mode():
            for layer in layers:
                backend.forward_decode(q, k, v, layer, fb)

    return _median_ms(run, repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--linear-backend", default="auto", choices=list(LINEAR_BACKENDS))
    ap.add_argument("--attention-backend", default=None, help="e.g. torch_native, fused_cpu (default: auto)")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--quantization", default="auto", choices=["auto", "gguf", "none"])
    ap.add_argument("--batch-sizes", default="1,16,64,256")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--profile", action="store_true", help="per-op time (attention, linear, lm_head, other)")
    args = ap.parse_args()
    batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    max_bs = max(batch_sizes)
    ctx = args.context
    page = args.page_size
    per_seq = page_ceil(ctx + 1, page)
    pool_tokens = max(max_bs * per_seq, page_ceil(PREFILL_LEN, page)) + 4 * page

    server_args = ServerArgs(
        model_path=args.model_path,
        dtype=args.dtype,
        page_size=page,
        max_total_tokens=pool_tokens,
        max_running_requests=max_bs,
        num_threads=args.num_threads,
        linear_backend=args.linear_backend,
        attention_backend=args.attention_backend,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        random_seed=args.seed,
    ).resolve()
    t0 = time.perf_counter()
    runner = ModelRunner(server_args)
    load_s = time.perf_counter() - t0
    load_rss = _peak_rss_gib()
    print(f"load: {load_s:.2f} s, peak RSS {load_rss:.2f} GiB, threads {torch.get_num_threads()}")

    # prefill first, while the pool is empty
    prefill_rows = runner.req_to_token_pool.alloc(1)
    prefill_loc = runner.token_to_kv_pool_allocator.alloc_extend([0], [PREFILL_LEN], [-1])
    runner.req_to_token_pool.req_to_token[prefill_rows[0], :PREFILL_LEN] = prefill_loc
    prefill_ids = [(13 * i + 5) % runner.model_config.vocab_size for i in range(PREFILL_LEN)]

    def prefill() -> None:
        fb = ForwardBatch.build(
            ForwardMode.EXTEND, prefill_ids, prefill_rows, [0], [PREFILL_LEN], prefill_loc, runner.device
        )
        runner.forward(fb)

    prefill_ms = _median_ms(prefill, max(1, args.repeats // 2))
    print(f"prefill {PREFILL_LEN}: {prefill_ms:.1f} ms")
    profiles: dict[str, dict[str, float]] = {}
    if args.profile:
        profiles[f"prefill{PREFILL_LEN}"] = profile_ops(runner.model, prefill)
        print(format_profile(f"prefill{PREFILL_LEN}", profiles[f"prefill{PREFILL_LEN}"]))
    runner.token_to_kv_pool_allocator.free(prefill_loc)
    runner.req_to_token_pool.free(prefill_rows)

    rows = _fill_context(runner, max_bs, ctx, args.seed)
    decode_ms: dict[str, float] = {}
    attn_ms: dict[str, float] = {}
    for bs in batch_sizes:
        fb = _decode_batch(runner, rows[:bs], ctx)
        decode_ms[str(bs)] = _median_ms(lambda fb=fb: runner.forward(fb), args.repeats)
        attn_ms[str(bs)] = _attention_only_ms(runner, fb, args.repeats)
        print(
            f"decode bs={bs:4d} ctx={ctx}: {decode_ms[str(bs)]:8.1f} ms/step "
            f"(attention {attn_ms[str(bs)]:7.1f} ms, {1e3 * bs / decode_ms[str(bs)]:8.1f} tok/s)"
        )
        if args.profile:
            profiles[f"decode_{bs}"] = profile_ops(runner.model, lambda fb=fb: runner.forward(fb))
            print(format_profile(f"decode_{bs}", profiles[f"decode_{bs}"]))
        runner.token_to_kv_pool_allocator.free(fb.out_cache_loc)

    result = {
        "load_s": round(load_s, 3),
        "peak_rss_gib": round(_peak_rss_gib(), 3),
        "decode_ms": {k: round(v, 3) for k, v in decode_ms.items()},
        "prefill512_ms": round(prefill_ms, 3),
        "load_rss_gib": round(load_rss, 3),
        "decode_attn_ms": {k: round(v, 3) for k, v in attn_ms.items()},
        "threads": torch.get_num_threads(),
        "linear_backend": runner.linear_backend.name,
        "quantization": server_args.quantization,
        "weight_mib": runner.weight_bytes / 2**20,
    }
    if profiles:
        result["profile"] = {name: {k: round(v, 3) for k, v in p.items()} for name, p in profiles.items()}
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()

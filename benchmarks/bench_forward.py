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
  3. prefill: one EXTEND forward of a ``--prefill-len``-token sequence (512), median of
     ``--repeats`` // 2.
Timed region = ``ModelRunner.forward`` (metadata, model, logits; no sampling); on CUDA the
device is synchronized before the clock is read. On CUDA, a DECODE batch replays the runner's
CUDA graph where the attention backend has graph hooks (flashinfer; up to ``--cuda-graph-max-bs``,
``--disable-cuda-graph`` to time eager launches) and runs eagerly otherwise (torch_native):
``decode_cuda_graph`` records which, per batch size, and ``decode_host_ms`` how long the host
takes to return from a step with the device idle (its own share of the step's time).

On a GPU (``--device cuda``; bfloat16 weights, GGUF weights dequantized at load): the KV pool
holds ``max(batch sizes) x (context + 1)`` tokens, so a Llama-3.1-8B shape at batch 256 and
context 512 needs about 16 GiB of KV beside 15 GiB of weights. Each figure comes with the
least work it must do, for comparing with the device's bounds: ``decode_min_bytes`` (one pass
over the dense weights in ``--dtype``: the decoder layers' linear maps and the LM head, plus the
K/V of every sequence's context) and ``prefill_flops`` (2 x weights x tokens, the LM head for the
last row, 4 x layers x heads x head_dim x tokens(tokens+1)/2 for causal attention).

Per-op profile (``--profile``; one extra run of each measured forward after the timed ones):
the wall time inside each kind of module, through forward hooks (one thread of control, so
wall time is the op's time): ``attention`` (RadixAttention: KV write + attention backend),
``linear`` (every ``Linear``: q/k/v, o, gate/up, down), ``lm_head`` (the LogitsProcessor: last-row
gather + LM head matmul), ``other`` = the forward minus those (embedding, norms, rope,
activation, metadata, Python).

    python benchmarks/bench_forward.py [--batch-sizes 1,16,64,256] [--context 256] [--json]
        [--attention-backend torch_native|fused_cpu|flashinfer] [--kv-cache-dtype float16]
        [--quantization gguf|none] [--profile] [--device cpu|cuda] [--prefill-len 512]
        [--model-path DIR --load-format dummy] [--json-out FILE]

With ``--json`` the last output line is one JSON object: ``load_s``, ``peak_rss_gib``,
``decode_ms`` ({"1": .., "16": .., ...}), ``prefill512_ms`` (``prefill{N}_ms`` for
``--prefill-len N``; also ``prefill_ms``) and the extras ``load_rss_gib``, ``decode_attn_ms``,
``threads``, ``linear_backend``, ``device``, ``dtype``, ``attention_backend``, ``context``,
``prefill_len``, ``decode_min_bytes``, ``prefill_flops``, ``gpu_peak_gib`` (CUDA), and with
``--profile`` ``profile`` ({"prefill512": {op: ms}, "decode_1": {op: ms}, ...}). ``--json-out
FILE`` writes the same object after the prefill and after each batch size, so a run stopped
part-way leaves what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import ModelShape, workload_flops  # noqa: E402

from srt.configs.backends import LINEAR_BACKENDS  # noqa: E402
from srt.layers.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from srt.layers.linear import Linear  # noqa: E402
from srt.layers.logits_processor import LogitsProcessor  # noqa: E402
from srt.layers.radix_attention import RadixAttention  # noqa: E402
from srt.model_executor.model_runner import ModelRunner  # noqa: E402
from srt.server_args import ServerArgs  # noqa: E402
from srt.utils.pages import page_ceil  # noqa: E402

PREFILL_LEN = 512


def _no_sync() -> None:
    pass


def device_sync(device: torch.device) -> Callable[[], None]:
    """What to call before reading a clock: the device's synchronize (CUDA work is asynchronous)."""
    return torch.cuda.synchronize if device.type == "cuda" else _no_sync


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / (1 << 30)  # Linux: KiB


def _median_ms(fn, repeats: int, sync: Callable[[], None] = _no_sync) -> float:
    fn()  # warm-up
    sync()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def _host_ms(fn, repeats: int, sync: Callable[[], None]) -> float:
    """Median time until ``fn()`` returns, the device idle before each call: on CUDA the host's
    own part of a step (inputs, metadata, plan, launches or graph replay), not the kernels'."""
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
        sync()
    return statistics.median(times) * 1e3


PROFILED_KINDS: tuple[tuple[str, type[nn.Module]], ...] = (
    ("attention", RadixAttention),
    ("linear", Linear),
    ("lm_head", LogitsProcessor),
)


def profile_ops(model: nn.Module, fn, runs: int = 3, sync: Callable[[], None] = _no_sync) -> dict[str, float]:
    """Median over ``runs`` calls of ``fn()`` with hooks on the modules of PROFILED_KINDS: ms
    per kind, ``other`` (the rest of the call) and ``total`` (``sync`` runs at each hook)."""
    samples = [_profile_once(model, fn, sync) for _ in range(runs)]
    return {k: statistics.median(s[k] for s in samples) for k in samples[0]}


def _profile_once(model: nn.Module, fn, sync: Callable[[], None] = _no_sync) -> dict[str, float]:
    spent = {kind: 0.0 for kind, _ in PROFILED_KINDS}
    starts: dict[int, float] = {}
    handles = []
    for module in model.modules():
        kind = next((k for k, cls in PROFILED_KINDS if isinstance(module, cls)), None)
        if kind is None:
            continue

        def pre(mod, _args, _key=id(module)):
            sync()
            starts[_key] = time.perf_counter()

        def post(mod, _args, _out, _key=id(module), _kind=kind):
            sync()
            spent[_kind] += time.perf_counter() - starts.pop(_key)

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        t0 = time.perf_counter()
        fn()
        sync()
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
    values = torch.randn(slots.numel(), pool.head_num, pool.head_dim, generator=gen)
    values = values.to(device=pool.k_buffer[0].device, dtype=pool.dtype)
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
    put = lambda t: t.to(device=runner.device, dtype=runner.dtype)  # noqa: E731
    q = put(torch.randn(bs, cfg.num_attention_heads * cfg.head_dim, generator=gen))
    k = put(torch.randn(bs, cfg.num_key_value_heads * cfg.head_dim, generator=gen))
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

    return _median_ms(run, repeats, device_sync(runner.device))


def min_work(runner: ModelRunner, context: int, batch_sizes: list[int], prefill_len: int) -> dict:
    """The least work of each measured forward (see the module docstring): ``decode_min_bytes``
    per batch size and ``prefill_flops``."""
    shape = ModelShape.from_hf_config(runner.model_config.hf_config)
    itemsize = runner.dtype.itemsize
    weights = (shape.layer_weight_params + shape.hidden * shape.vocab) * itemsize
    kv = runner.bytes_per_token * (context + 1)
    return {
        "decode_min_bytes": {str(bs): weights + bs * kv for bs in batch_sizes},
        "prefill_flops": sum(workload_flops(shape, [prefill_len], [1]).values()),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"])
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--linear-backend", default="auto", choices=list(LINEAR_BACKENDS))
    ap.add_argument(
        "--attention-backend", default=None, help="e.g. torch_native, fused_cpu, flashinfer (default: auto)"
    )
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--disable-cuda-graph", action="store_true", help="CUDA: decode with eager launches")
    ap.add_argument(
        "--enable-int8-activations", action="store_true", help="GGUF: int8 activations (<= 8 rows)"
    )
    ap.add_argument("--quantization", default="auto", choices=["auto", "gguf", "none"])
    ap.add_argument(
        "--gguf-float32-rows", type=int, default=None, help="as the server flag (0: no float32 copies)"
    )
    ap.add_argument("--batch-sizes", default="1,16,64,256")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--prefill-len", type=int, default=PREFILL_LEN)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--json-out", default=None, help="rewrite the JSON result here after each measurement")
    ap.add_argument("--profile", action="store_true", help="per-op time (attention, linear, lm_head, other)")
    return ap.parse_args(argv)


def build_runner(args: argparse.Namespace, batch_sizes: list[int]) -> tuple[ModelRunner, ServerArgs]:
    page = args.page_size
    per_seq = page_ceil(args.context + 1, page)
    pool_tokens = max(max(batch_sizes) * per_seq, page_ceil(args.prefill_len, page)) + 4 * page
    server_args = ServerArgs(
        model_path=args.model_path,
        load_format=args.load_format,
        device=args.device,
        dtype=args.dtype,
        page_size=page,
        max_total_tokens=pool_tokens,
        max_running_requests=max(batch_sizes),
        num_threads=args.num_threads,
        linear_backend=args.linear_backend,
        attention_backend=args.attention_backend,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        random_seed=args.seed,
        disable_cuda_graph=args.disable_cuda_graph,
        enable_int8_activations=args.enable_int8_activations,
        gguf_float32_rows=args.gguf_float32_rows,
    ).resolve()
    return ModelRunner(server_args), server_args


class Result:
    """The JSON result, rewritten to ``--json-out`` after each measurement."""

    def __init__(self, path: str | None, fields: dict) -> None:
        self.path, self.data = path, dict(fields)

    def update(self, **fields) -> None:
        self.data.update(fields)
        if self.path:
            tmp = Path(self.path + ".tmp")
            tmp.write_text(json.dumps(self.data, indent=1))
            tmp.replace(self.path)


def bench_prefill(runner: ModelRunner, args: argparse.Namespace, result: Result, profiles: dict) -> None:
    """The prefill of ``--prefill-len`` tokens, while the pool is empty."""
    n, sync = args.prefill_len, device_sync(runner.device)
    rows = runner.req_to_token_pool.alloc(1)
    loc = runner.token_to_kv_pool_allocator.alloc_extend([0], [n], [-1])
    runner.req_to_token_pool.req_to_token[rows[0], :n] = loc
    ids = [(13 * i + 5) % runner.model_config.vocab_size for i in range(n)]

    def prefill() -> None:
        runner.forward(ForwardBatch.build(ForwardMode.EXTEND, ids, rows, [0], [n], loc, runner.device))

    ms = _median_ms(prefill, max(1, args.repeats // 2), sync)
    print(f"prefill {n}: {ms:.1f} ms")
    result.update(**{f"prefill{n}_ms": round(ms, 3), "prefill_ms": round(ms, 3)})
    if args.profile:
        profiles[f"prefill{n}"] = profile_ops(runner.model, prefill, sync=sync)
        print(format_profile(f"prefill{n}", profiles[f"prefill{n}"]))
    runner.token_to_kv_pool_allocator.free(loc)
    runner.req_to_token_pool.free(rows)


def bench_decode(
    runner: ModelRunner, args: argparse.Namespace, batch_sizes: list[int], result: Result, profiles: dict
) -> None:
    ctx, sync = args.context, device_sync(runner.device)
    rows = _fill_context(runner, max(batch_sizes), ctx, args.seed)
    decode_ms: dict[str, float] = {}
    attn_ms: dict[str, float] = {}
    graphs: dict[str, bool] = {}
    host_ms: dict[str, float] = {}
    for bs in batch_sizes:
        fb = _decode_batch(runner, rows[:bs], ctx)
        graphs[str(bs)] = runner.cuda_graph_runner is not None and runner.cuda_graph_runner.can_run(fb)
        decode_ms[str(bs)] = _median_ms(lambda fb=fb: runner.forward(fb), args.repeats, sync)
        attn_ms[str(bs)] = _attention_only_ms(runner, fb, args.repeats)
        if runner.device.type == "cuda":
            host_ms[str(bs)] = round(_host_ms(lambda fb=fb: runner.forward(fb), args.repeats, sync), 3)
        print(
            f"decode bs={bs:4d} ctx={ctx}: {decode_ms[str(bs)]:8.1f} ms/step "
            f"(attention {attn_ms[str(bs)]:7.1f} ms, {1e3 * bs / decode_ms[str(bs)]:8.1f} tok/s)"
        )
        if args.profile:
            profiles[f"decode_{bs}"] = profile_ops(runner.model, lambda fb=fb: runner.forward(fb), sync=sync)
            print(format_profile(f"decode_{bs}", profiles[f"decode_{bs}"]))
        runner.token_to_kv_pool_allocator.free(fb.out_cache_loc)
        result.update(
            decode_ms={k: round(v, 3) for k, v in decode_ms.items()},
            decode_attn_ms={k: round(v, 3) for k, v in attn_ms.items()},
            decode_cuda_graph=dict(graphs),
            **({"decode_host_ms": dict(host_ms)} if host_ms else {}),
        )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    t0 = time.perf_counter()
    runner, server_args = build_runner(args, batch_sizes)
    load_s = time.perf_counter() - t0
    load_rss = _peak_rss_gib()
    print(f"load: {load_s:.2f} s, peak RSS {load_rss:.2f} GiB, threads {torch.get_num_threads()}")
    result = Result(
        args.json_out,
        {
            "load_s": round(load_s, 3),
            "load_rss_gib": round(load_rss, 3),
            "device": runner.device.type,
            "dtype": str(runner.dtype).removeprefix("torch."),
            "attention_backend": server_args.attention_backend,
            "linear_backend": runner.linear_backend.name,
            "quantization": server_args.quantization,
            "weight_mib": runner.weight_bytes / 2**20,
            "threads": torch.get_num_threads(),
            "context": args.context,
            "prefill_len": args.prefill_len,
            **min_work(runner, args.context, batch_sizes, args.prefill_len),
        },
    )
    profiles: dict[str, dict[str, float]] = {}
    bench_prefill(runner, args, result, profiles)
    bench_decode(runner, args, batch_sizes, result, profiles)
    final = {"peak_rss_gib": round(_peak_rss_gib(), 3)}
    if runner.device.type == "cuda":
        final["gpu_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    if profiles:
        final["profile"] = {name: {k: round(v, 3) for k, v in p.items()} for name, p in profiles.items()}
    result.update(**final)
    if args.json:
        print(json.dumps(result.data))


if __name__ == "__main__":
    main()

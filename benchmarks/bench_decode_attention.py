"""Decode attention alone: the pure-torch reference, srt's torch-native backend, the native kernel.

Protocol (fixed seeds; ``--shape`` picks the attention: the default model's, SmolLM2-135M, 9
query heads, 3 KV heads, head dim 64, 30 layers, or ``qwen2.5-1.5b`` 12 / 2 / 128 / 28 layers, or
``llama-3.1-8b`` 32 / 8 / 128 / 32 layers):
  * one KV pool (srt's ``MHATokenToKVPool``) per KV dtype and batch size, B sequences of
    ``--context`` tokens each on randomly permuted pages of ``--page-size`` tokens (a pool after
    some serving; ``--contiguous`` lays each sequence out in order instead), random K/V; the
    queries random float32 values, rounded to bf16 over a bf16 KV (a bf16 model's, which on an
    AVX512-BF16 CPU take both products on bf16 dot products);
  * one step = attention for one decode token per sequence in each layer; layers cycle over
    ``distinct`` K/V buffers (one a layer, or fewer past ``--max-pool-gib``; the reuse
    distance then still exceeds the last-level cache), so every layer reads K/V from DRAM;
  * before each timed step a 256 MiB buffer is read to push the KV out of the CPU caches (in
    serving, the weights pass through them between two steps); median of ``--repeats`` steps;
  * (a) ``reference``: ``srt.kernels.cpu.reference.paged_decode_attention_ref``, per layer
        (a Python loop over sequences: skipped above ``--ref-max-batch``);
    (b) ``torch_native``: ``TorchNativeAttnBackend``: ``init_forward_metadata`` once per step,
        then ``forward_decode(save_kv_cache=False)`` per layer;
    (c) ``native``: ``torch.ops.srt_cpu.paged_decode_attention`` per layer (built if missing);
  * bound: the K/V bytes one step must read (sum of context x H_kv x D x 2 x itemsize x layers)
    over the read bandwidth measured in this run (``torch.sum`` of a 1 GiB float32 tensor on
    torch's threads, best of 5).

    python benchmarks/bench_decode_attention.py [--shape NAME] [--batch-sizes 1,16,64,256] [--context 256]
        [--kv-dtypes float32,float16] [--page-size 1] [--threads N]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from common import cpu_model, read_bandwidth_gbs

from srt.kernels.cpu import kernel_status, load
from srt.kernels.cpu.reference import paged_decode_attention_ref

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class AttnShape:
    heads: int
    kv_heads: int
    head_dim: int
    layers: int


# --shape: the attention of the default model and of the bf16 shapes compare_servers serves
SHAPES = {
    "smollm2-135m": AttnShape(9, 3, 64, 30),
    "qwen2.5-1.5b": AttnShape(12, 2, 128, 28),
    "llama-3.1-8b": AttnShape(32, 8, 128, 32),
}


@dataclass
class FakeLayer:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    layer_id: int


@dataclass
class Setup:
    shape: AttnShape
    pool: object  # MHATokenToKVPool
    distinct: int
    req_to_token: torch.Tensor
    rows: torch.Tensor
    seq_lens: torch.Tensor
    q: torch.Tensor  # [bs, H, D]
    kv_bytes: int  # per step


_FLUSH = torch.ones(64 << 20, dtype=torch.float32)  # 256 MiB


def median_step_ms(step: Callable[[], None], repeats: int) -> float:
    step()  # warm-up
    times = []
    for _ in range(repeats):
        _FLUSH.sum()
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def make_setup(
    shape: AttnShape,
    bs: int,
    ctx: int,
    page_size: int,
    dtype: torch.dtype,
    max_pool_gib: float,
    contiguous: bool,
):
    from srt.mem_cache.memory_pool import MHATokenToKVPool

    hkv, d = shape.kv_heads, shape.head_dim
    g = torch.Generator().manual_seed(bs * 1000 + ctx)
    pages_per_seq = math.ceil(ctx / page_size)
    num_pages = bs * pages_per_seq
    layer_bytes = (num_pages + 1) * page_size * hkv * d * 2 * dtype.itemsize
    distinct = max(1, min(shape.layers, int(max_pool_gib * (1 << 30) // layer_bytes)))
    pool = MHATokenToKVPool(num_pages * page_size, page_size, dtype, hkv, d, distinct, "cpu")
    for buf in pool.k_buffer + pool.v_buffer:
        buf.copy_(torch.randn(buf.shape, generator=g))
    order = torch.arange(1, num_pages + 1) if contiguous else torch.randperm(num_pages, generator=g) + 1
    pages = order.view(bs, pages_per_seq)
    slots = (pages[:, :, None] * page_size + torch.arange(page_size)).reshape(bs, -1)[:, :ctx]
    req_to_token = torch.zeros(bs + 1, ctx + 8, dtype=torch.int64)
    rows = torch.arange(1, bs + 1)
    req_to_token[rows, :ctx] = slots
    q = torch.randn(bs, shape.heads, d, generator=g)
    if dtype == torch.bfloat16:
        q = q.to(dtype).float()
    seq_lens = torch.full((bs,), ctx, dtype=torch.int64)
    kv_bytes = bs * ctx * hkv * d * 2 * dtype.itemsize * shape.layers
    return Setup(shape, pool, distinct, req_to_token, rows, seq_lens, q, kv_bytes)


def step_reference(s: Setup, scale: float) -> Callable[[], None]:
    def step() -> None:
        for layer in range(s.shape.layers):
            k, v = s.pool.get_kv_buffer(layer % s.distinct)
            paged_decode_attention_ref(s.q, k, v, s.req_to_token, s.rows, s.seq_lens, scale)

    return step


def step_native(s: Setup, scale: float) -> Callable[[], None]:
    op = torch.ops.srt_cpu.paged_decode_attention

    def step() -> None:
        for layer in range(s.shape.layers):
            k, v = s.pool.get_kv_buffer(layer % s.distinct)
            op(s.q, k, v, s.req_to_token, s.rows, s.seq_lens, scale)

    return step


def step_torch_native(s: Setup, scale: float, ctx: int) -> Callable[[], None]:
    from srt.layers.attention.torch_native import TorchNativeAttnBackend
    from srt.layers.forward_batch import ForwardBatch, ForwardMode
    from srt.mem_cache.memory_pool import ReqToTokenPool

    bs = s.q.shape[0]
    req_pool = ReqToTokenPool(s.req_to_token.shape[0], s.req_to_token.shape[1], "cpu")
    req_pool.req_to_token.copy_(s.req_to_token)
    rows = s.rows.tolist()
    out_loc = s.req_to_token[s.rows, ctx - 1]
    fb = ForwardBatch.build(ForwardMode.DECODE, [0] * bs, rows, [ctx - 1] * bs, [1] * bs, out_loc)
    fb.req_to_token_pool, fb.token_to_kv_pool = req_pool, s.pool
    backend = TorchNativeAttnBackend(None)
    fb.attn_backend = backend
    sh = s.shape
    layers = [FakeLayer(sh.heads, sh.kv_heads, sh.head_dim, scale, i) for i in range(s.distinct)]
    q2 = s.q.reshape(bs, sh.heads * sh.head_dim)
    kv = torch.zeros(bs, sh.kv_heads * sh.head_dim)

    def step() -> None:
        backend.init_forward_metadata(fb)
        for layer in range(sh.layers):
            backend.forward_decode(q2, kv, kv, layers[layer % s.distinct], fb, save_kv_cache=False)

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=list(SHAPES), default="smollm2-135m", help="the model whose attention")
    p.add_argument("--batch-sizes", default="1,16,64,256")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--kv-dtypes", default="float32,float16")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--contiguous", action="store_true", help="sequences' pages in order, not permuted")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--ref-repeats", type=int, default=1)
    p.add_argument("--ref-max-batch", type=int, default=16, help="skip the (slow) reference above this batch")
    p.add_argument("--max-pool-gib", type=float, default=1.5)
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    load(build_if_missing=True)
    print(f"cpu: {cpu_model()}; torch {torch.__version__}; threads {torch.get_num_threads()}")
    print(f"kernel: {kernel_status()}")
    native = torch.ops.srt_cpu.cpu_isa() if "native" in kernel_status().split(":")[0] else None
    bw = read_bandwidth_gbs()
    print(f"read bandwidth (torch.sum, 1 GiB float32): {bw:.1f} GB/s")
    shape = SHAPES[args.shape]
    print(
        f"shape {args.shape}: H={shape.heads} H_kv={shape.kv_heads} D={shape.head_dim} layers={shape.layers} "
        f"context={args.context} "
        f"page_size={args.page_size} ({'contiguous' if args.contiguous else 'permuted pages'})"
    )
    scale = shape.head_dim**-0.5
    hdr = (
        f"{'kv':>8} {'bs':>4} {'MB/step':>8} {'bound':>7} {'ref':>8} {'torch_nat':>9} {'native':>7}"
        f" {'nat/bound':>9} {'tn/nat':>7} {'ref/nat':>7}"
    )
    print(f"ms per step ({shape.layers} layers):")
    print(hdr)
    for name in args.kv_dtypes.split(","):
        dtype = DTYPES[name]
        for bs in [int(b) for b in args.batch_sizes.split(",")]:
            s = make_setup(shape, bs, args.context, args.page_size, dtype, args.max_pool_gib, args.contiguous)
            bound = s.kv_bytes / (bw * 1e9) * 1e3
            ref = math.nan
            if bs <= args.ref_max_batch:
                ref = median_step_ms(step_reference(s, scale), args.ref_repeats)
            try:
                tn = median_step_ms(step_torch_native(s, scale, args.context), args.repeats)
            except Exception as e:  # noqa: BLE001 - the backend's API may move; report, go on
                print(f"torch_native backend failed: {type(e).__name__}: {e}")
                tn = math.nan
            nat = median_step_ms(step_native(s, scale), args.repeats) if native else math.nan
            print(
                f"{name:>8} {bs:>4} {s.kv_bytes / 1e6:>8.1f} {bound:>7.2f} {ref:>8.2f} {tn:>9.2f} {nat:>7.2f}"
                f" {nat / bound:>9.2f} {tn / nat:>7.2f} {ref / nat:>7.1f}"
            )
            del s


if __name__ == "__main__":
    main()

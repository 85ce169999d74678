"""The activation peak that KV pool sizing sets aside: the memory growth of one dummy extend of
the largest prefill the scheduler may form.

On CUDA the whole model runs and the allocator's peak is read. On the CPU only the first decoder
layer runs, over every token of the extend: a layer's activations replace the previous layer's,
so the peak of one layer (with the embedding, the residual stream and the LM head's last rows)
is the model's, at a fraction of the cost (the full 2,048-token forward of an 8B model takes
minutes on 2 cores; one layer of 32 takes seconds). A model without a ``model.layers`` list runs
whole. The pools are throw-away, committed before measuring, so only activations and one-time
kernel workspaces count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from srt.layers.forward_batch import ForwardBatch, ForwardMode
from srt.mem_cache import pool_size
from srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from srt.utils.cpu_memory import release_free_memory
from srt.utils.pages import page_ceil


@contextmanager
def first_layer_only(model: nn.Module) -> Iterator[bool]:
    """``model.model.layers`` cut to its first layer for the duration (yields whether it was)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) < 2:
        yield False
        return
    native = getattr(inner, "native_decode", None)
    inner.layers, inner.native_decode = nn.ModuleList([layers[0]]), None
    try:
        yield True
    finally:
        inner.layers = layers
        if native is not None:
            inner.native_decode = native


def profile_activation_peak(
    model: nn.Module,
    run_model: Callable[[ForwardBatch], Any],
    new_kv_pool: Callable[[int], MHATokenToKVPool],
    attn_backend: Any,
    num_tokens: int,
    context_len: int,
    page_size: int,
    vocab_size: int,
    device: torch.device,
) -> int:
    """Peak memory growth (bytes) of one dummy extend of ``num_tokens`` tokens (module docstring)."""
    seq_lens = pool_size.split_into_sequences(num_tokens, context_len)
    req_pool = ReqToTokenPool(len(seq_lens), max(seq_lens), device)
    kv_pool = new_kv_pool(page_ceil(num_tokens, page_size))
    slots = torch.arange(page_size, page_size + num_tokens, dtype=torch.int64, device=device)
    start = 0
    for row, n in enumerate(seq_lens):
        req_pool.req_to_token[row, :n] = slots[start : start + n]
        start += n
    input_ids = [(7 * i + 11) % vocab_size for i in range(num_tokens)]
    rows = list(range(len(seq_lens)))
    fb = ForwardBatch.build(ForwardMode.EXTEND, input_ids, rows, [0] * len(seq_lens), seq_lens, slots, device)
    fb.req_to_token_pool, fb.token_to_kv_pool, fb.attn_backend = req_pool, kv_pool, attn_backend

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        run_model(fb)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        del fb, kv_pool, req_pool
        torch.cuda.empty_cache()
        return max(0, peak)
    with first_layer_only(model) as one_layer:
        # commit the buffers the forward writes (only those: 1 GiB for 4,096 tokens of an 8B)
        used = 1 if one_layer else len(kv_pool.k_buffer)
        for buf in kv_pool.k_buffer[:used] + kv_pool.v_buffer[:used]:
            buf.zero_()
        meter = pool_size.PeakRSSMeter()
        meter.start()
        run_model(fb)
        peak = meter.peak_growth()
    del fb, kv_pool, req_pool
    release_free_memory()  # the throw-away pools and the activations, back to the OS
    return peak

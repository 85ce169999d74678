"""Images attended both ways (Gemma 3, srt/layers/attention/image_blocks.py) on the CPU backends,
and the prefill chunks that never cut such an image (srt/utils/pages.py's ``uncut_chunk``).

The oracle loops over every query in float64: the keys it sees are its causal ones, plus the
other tokens of the image block it sits in, minus those before its sliding window (transformers'
Gemma 3 mask: AND(window, OR(causal, same image))). torch_native and fused_cpu (native extend
kernel and its fallback) are checked against it on EXTEND and MIXED batches, with cached
prefixes, blocks at the start / middle / end of a sequence, several blocks in a sequence,
windows shorter than a block, and GQA; causal images (Qwen, LLaVA) keep the causal result.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from srt.layers.attention.fused_cpu import FusedCPUAttnBackend
from srt.layers.attention.image_blocks import block_visible, image_blocks
from srt.layers.forward_batch import ForwardMode
from srt.managers.scheduler.schedule_policy import AddResult, PrefillAdder
from srt.utils.pages import uncut_chunk
from tests.unit.test_attention_window_cap import WindowCapLayer, run_fused
from tests.unit.test_torch_native_attention import Case, make_case, run_backend

# batch -> (mode, prefix lens, extend lens, blocks as (sequence, lo, hi) local query indices)
BATCHES = {
    "one": (ForwardMode.EXTEND, [0], [40], [(0, 5, 21)]),
    "prefix": (ForwardMode.EXTEND, [0, 13, 7], [9, 30, 20], [(1, 0, 12), (1, 20, 30), (2, 3, 19)]),
    "mixed": (ForwardMode.MIXED, [4, 0, 30, 9], [25, 16, 1, 1], [(0, 10, 25), (1, 0, 16)]),
}


def _spans(extend_lens, blocks, bidirectional=True):
    starts = [sum(extend_lens[:i]) for i in range(len(extend_lens))]
    image = SimpleNamespace(bidirectional=bidirectional)
    return [SimpleNamespace(row=starts[i] + lo, n=hi - lo, image=image, src=0) for i, lo, hi in blocks]


def make(batch: str, window: int = -1, bidirectional: bool = True, head_dim: int = 64) -> Case:
    mode, prefixes, extends, blocks = BATCHES[batch]
    case = make_case(mode, prefixes, extends, 16, heads=4, kv_heads=2, head_dim=head_dim, seed=3)
    case.layer = WindowCapLayer(**dataclasses.asdict(case.layer), sliding_window_size=window)
    case.fb.image_spans = _spans(extends, blocks, bidirectional)[::-1]  # any order
    return case


def naive(case: Case, blocks) -> torch.Tensor:
    fb, layer = case.fb, case.layer
    h, h_kv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    window = layer.sliding_window_size
    rows = []
    for i in range(fb.batch_size):
        e, s = fb.extend_seq_lens_cpu[i], fb.seq_lens_cpu[i]
        start, p = int(fb.extend_start_loc[i]), s - e
        for j in range(e):
            seen = set(range(p + j + 1))
            for b, lo, hi in blocks:
                if b == i and lo <= j < hi:
                    seen |= set(range(p + lo, p + hi))
            if window >= 0:
                seen = {t for t in seen if t >= p + j - window}
            keys = sorted(seen)
            k = case.full_k[i][keys].double().repeat_interleave(h // h_kv, dim=1)
            v = case.full_v[i][keys].double().repeat_interleave(h // h_kv, dim=1)
            scores = torch.einsum("hd,khd->hk", case.q[start + j].view(h, d).double(), k) * layer.scaling
            rows.append(torch.einsum("hk,khd->hd", scores.softmax(-1), v).reshape(h * d))
    return torch.stack(rows).float()


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("window", [-1, 6, 100])
@pytest.mark.parametrize("run", [run_backend, run_fused], ids=["torch_native", "fused_cpu"])
def test_blocks_match_the_oracle(batch, window, run):
    blocks = BATCHES[batch][3]
    case = make(batch, window)
    torch.testing.assert_close(run(case), naive(case, blocks), rtol=1e-4, atol=1e-5)


def test_fused_fallback_head_dim_honours_blocks():
    case = make("prefix", head_dim=24)  # not a multiple of 64: fused_cpu's SDPA fallback
    torch.testing.assert_close(run_fused(case), naive(case, BATCHES["prefix"][3]), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("run", [run_backend, run_fused], ids=["torch_native", "fused_cpu"])
def test_causal_images_stay_causal(run):
    case = make("prefix", bidirectional=False)
    torch.testing.assert_close(run(case), naive(case, []), rtol=1e-4, atol=1e-5)
    assert image_blocks(case.fb.image_spans, case.fb.extend_seq_lens_cpu) == {}


def test_blocks_per_sequence_and_visibility():
    extend_lens = [9, 30, 20]
    spans = _spans(extend_lens, [(1, 0, 12), (2, 3, 19), (1, 20, 30), (0, 4, 5)])
    # a one-token image needs no block
    assert image_blocks(spans, extend_lens) == {1: [(0, 12), (20, 30)], 2: [(3, 19)]}
    vis = block_visible(4, 6, [(1, 3)], -1, "cpu")  # prefix 2, block = keys 3, 4
    expect = torch.tensor(
        [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool
    )
    assert torch.equal(vis, expect)
    # window 0: a query sees itself and, inside its block, the later tokens only
    vis0 = block_visible(4, 6, [(1, 3)], 0, "cpu")
    assert vis0[1].tolist() == [False, False, False, True, True, False]


# ---------------------------------------------------------------- chunks
@pytest.mark.parametrize(
    "start, chunk, spans, page, expect",
    [
        (0, 10, [(5, 20)], 1, 5),  # ends before the image
        (0, 10, [(12, 20)], 1, 10),  # the image is after the chunk
        (5, 10, [(5, 20)], 1, 15),  # the image starts the chunk: all of it
        (0, 10, [(2, 6), (8, 30)], 1, 8),
        (0, 16, [(5, 20)], 4, 4),  # page-aligned before the image
        (4, 8, [(5, 20)], 4, 16),  # before it leaves nothing: past it, rounded to a page
        (0, 10, [(3, 9), (9, 40)], 4, 40),  # back into the first image's page: past both
        (0, 0, [(0, 5)], 1, 0),
        (0, 10, [], 1, 10),
    ],
)
def test_uncut_chunk(start, chunk, spans, page, expect):
    got = uncut_chunk(start, chunk, spans, page)
    assert got == expect
    for lo, hi in spans:
        assert not lo < start + got < hi or got <= 0


def _adder(chunk: int) -> PrefillAdder:
    return PrefillAdder(
        page_size=1,
        rem_total_tokens=10_000,
        rem_input_tokens=10_000,
        rem_chunk_tokens=chunk,
        max_new_reqs=8,
        new_token_ratio=0.5,
    )


def test_prefill_adder_keeps_images_whole():
    d = _adder(32).add(prefix_len=0, input_len=100, max_new_left=4, whole_spans=[(20, 60)])
    assert (d.result, d.extend_len) == (AddResult.CHUNKED, 20)
    d = _adder(32).add(prefix_len=20, input_len=100, max_new_left=4, whole_spans=[(20, 60)])
    assert (d.result, d.extend_len) == (AddResult.CHUNKED, 40)  # longer than the chunk budget
    d = _adder(32).add(prefix_len=20, input_len=62, max_new_left=4, whole_spans=[(20, 60)])
    assert (d.result, d.extend_len) == (AddResult.CHUNKED, 40)
    d = _adder(32).add(prefix_len=20, input_len=60, max_new_left=4, whole_spans=[(20, 60)])
    assert (d.result, d.extend_len) == (AddResult.ADMITTED, 40)
    d = _adder(32).add(prefix_len=0, input_len=100, max_new_left=4)
    assert (d.result, d.extend_len) == (AddResult.CHUNKED, 32)


def test_a_backend_without_image_blocks_is_refused_for_gemma3():
    from srt.layers.attention.registry import check_backend_serves
    from srt.layers.attention.torch_native import TorchNativeAttnBackend
    from srt.utils.errors import ConfigError

    class NoBlocks(TorchNativeAttnBackend):
        supports_image_blocks = False

    gemma3 = SimpleNamespace(bidirectional_images=True)
    with pytest.raises(ConfigError, match="both ways.*flashinfer.*torch_native"):
        check_backend_serves(gemma3, NoBlocks(None), "flashinfer")
    check_backend_serves(gemma3, TorchNativeAttnBackend(None), "torch_native")
    check_backend_serves(gemma3, FusedCPUAttnBackend(None), "fused_cpu")
    check_backend_serves(SimpleNamespace(), NoBlocks(None), "flashinfer")  # a causal model

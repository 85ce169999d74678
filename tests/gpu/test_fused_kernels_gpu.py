"""FlashInfer's fused kernels on a CUDA device, as srt binds them (``srt/layers/fused_kernels.py``):

* each kernel against its torch reference (``srt/layers/fused_reference.py``, float32 inside,
  one rounding), over the shapes srt passes: 2-D rows, heads of a strided qkv view normalised in
  place, partial rotary, positions past the original context;
* greedy tokens of the default model (or a model of its shapes with seeded random weights) with
  the fused kernels equal those with ``--disable-fused-kernels`` except at a near-tie of the
  unfused run's logprobs (bf16 rounds at different points on the two paths).

Skipped without CUDA or flashinfer.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from srt.layers.fused_kernels import FLASHINFER_OPS, FusedKernels, flashinfer_ops
from srt.layers.fused_reference import reference_ops
from srt.managers.io_struct import TokenizedGenerateReqInput
from srt.managers.scheduler import Scheduler
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs
from tests.gpu.test_serving_modes_gpu import MAX_NEW, model_kw, prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer-python"),
]
BF16 = torch.bfloat16
NEAR_TIE = 0.1  # logprob gap: bf16 rounds at different points with and without the fused kernels


def _both() -> tuple[FusedKernels, FusedKernels]:
    return FusedKernels(flashinfer_ops()), FusedKernels(reference_ops())


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a.float(), b.float(), rtol=1.6e-2, atol=1.6e-2)


@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("rows,hidden", [(1, 576), (7, 4096), (64, 2304)])
def test_norms_match_the_reference(gemma, rows, hidden):
    real, ref = _both()
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, hidden, device="cuda", generator=gen).to(BF16)
    res = torch.randn(rows, hidden, device="cuda", generator=gen).to(BF16)
    w = (torch.rand(hidden, device="cuda", generator=gen) + 0.5).to(BF16)
    _close(real.norm(x, w, 1e-5, gemma), ref.norm(x, w, 1e-5, gemma))
    xa, ra, xb, rb = x.clone(), res.clone(), x.clone(), res.clone()
    real.add_norm_(xa, ra, w, 1e-5, gemma)
    ref.add_norm_(xb, rb, w, 1e-5, gemma)
    _close(ra, rb)
    _close(xa, xb)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_head_norms_in_place_on_a_qkv_view(head_dim):
    real, ref = _both()
    heads, kv_heads, t = 8, 2, 5
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, device="cuda").to(BF16)
    w = (torch.rand(head_dim, device="cuda") + 0.5).to(BF16)
    a, b = qkv.clone(), qkv.clone()
    for buf, k in ((a, real), (b, ref)):
        q = buf[:, : heads * head_dim].view(t, heads, head_dim)
        assert k.norm(q, w, 1e-6, in_place=True) is not None
    _close(a, b)  # q normalised, k and v untouched


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("rows,width", [(1, 3072), (33, 28672)])
def test_activations_match_the_reference(act, rows, width):
    real, ref = _both()
    x = torch.randn(rows, width, device="cuda").to(BF16)
    _close(real.act_and_mul(x, act), ref.act_and_mul(x, act))


@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (128, 128), (128, 96), (256, 256)])
def test_rope_matches_the_reference_on_qkv_views(head_dim, rotary_dim):
    real, ref = _both()
    heads, kv_heads, t = 8, 2, 9
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, device="cuda").to(BF16)
    table = torch.randn(4096, rotary_dim, device="cuda")
    positions = torch.tensor([0, 1, 2, 100, 511, 512, 2047, 4000, 4095], device="cuda")
    a, b = qkv.clone(), qkv.clone()
    for buf, k in ((a, real), (b, ref)):
        q, kk = buf[:, : heads * head_dim], buf[:, heads * head_dim : (heads + kv_heads) * head_dim]
        assert k.rope_(positions, q, kk, head_dim, table) is not None
    _close(a, b)


def _greedy(fused: bool, model: dict) -> list[tuple[list[int], list[dict[int, float]]]]:
    args = ServerArgs(
        device="cuda",
        attention_backend="flashinfer",
        max_total_tokens=4096,
        max_running_requests=8,
        cuda_graph_max_bs=8,
        grammar_backend="none",
        disable_fused_kernels=not fused,
        **model,
    ).resolve()
    sched = Scheduler(args)
    out = []
    for i, prompt in enumerate(prompts()):
        params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
        req = TokenizedGenerateReqInput(
            rid=f"p{i}", input_ids=prompt, sampling_params=params, return_logprob=True, top_logprobs_num=5
        )
        sched.handle_message(req)
        ids: list[int] = []
        tops: list[dict[int, float]] = []
        for batch in sched.run_until_idle():
            for j, rid in enumerate(batch.rids):
                assert rid == f"p{i}"
                ids.extend(batch.output_ids[j])
                tops.extend(dict(step) for step in batch.output_top_logprobs[j])
        out.append((ids, tops))
    sched.worker.shutdown()
    del sched
    torch.cuda.empty_cache()
    return out


def test_greedy_tokens_with_and_without_fused_kernels(tmp_path):
    from tests.helpers.hf_reference import assert_tokens_match

    assert set(FLASHINFER_OPS) == set(flashinfer_ops())
    model = model_kw(tmp_path / "smollm2-shapes")
    plain, fused = _greedy(False, model), _greedy(True, model)
    ties = 0
    for (ids, _), (ref_ids, ref_tops) in zip(fused, plain):
        ties += assert_tokens_match(ids, ref_ids, ref_tops, near_tie=NEAR_TIE)
    assert ties <= 1, f"{ties} near-ties in {len(plain)} prompts"
